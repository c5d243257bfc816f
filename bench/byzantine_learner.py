"""A lying learner for ``bench.byzantine``'s system tier: the real ``diloco learner`` process, changed
on its way out as ``simulation.byzantine_attacks`` says (``BYZ_KIND``: sign, random, replay, corrupt).

Not part of the product: a test double of a compromised or buggy host that keeps its identity. It
runs the learner unmodified (same config, heartbeats, counters, codec, error feedback, publish
path) and patches only what it sends or what it trains on:

* ``sign`` / ``random``: the vector handed to the outer-gradient codec (``bus.codec
  .encode_with_feedback``, what a learner quantises and sends) is negated, or replaced by a random
  direction at its own honest norm (all learners train alike, so its norm is a median honest one);
* ``replay``: the blob of one of its own earlier whole rounds of the fragment, sent again as the
  new round (fresh object id, new round number: the learner's own publish path);
* ``corrupt``: every batch of its shard with the tokens of each sequence shuffled.

    BYZ_KIND=sign python -m bench.byzantine_learner       (DILOCO_* as for `diloco learner`)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import os
import sys
import threading

import numpy as np

from simulation.byzantine_attacks import KINDS, keep_for_replay, random_direction, replay_pick, shuffle_tokens


def install(kind: str, seed: int = 0) -> None:
    """Patch this process's learner to lie as ``kind`` (before the learner starts)."""
    if kind not in KINDS:
        raise SystemExit(f"BYZ_KIND must be one of {KINDS}, got {kind!r}")
    rng = np.random.Generator(np.random.PCG64(seed))
    if kind in ("sign", "random"):
        from bus import codec

        encode = codec.encode_with_feedback

        def lying_encode(x, *a, **k):
            if kind == "sign":
                if k.get("in_place"):
                    np.negative(x, out=x)
                else:
                    x = -np.asarray(x, dtype=np.float32)
            else:
                v = random_direction(int(np.asarray(x).size), float(np.linalg.norm(x)), rng)
                if k.get("in_place"):
                    x[...] = v.reshape(np.shape(x))
                else:
                    x = v.reshape(np.shape(x))
            return encode(x, *a, **k)

        codec.encode_with_feedback = lying_encode
    elif kind == "replay":
        from learner import core

        prepare = core.IslandCore._prepare
        kept: dict[int, list] = {}
        lock = threading.Lock()

        def replaying_prepare(self, c):
            blob, meta = prepare(self, c)
            with lock:
                old = replay_pick(kept.get(c.fragment, []), rng)
                if c.steps >= c.period:
                    kept[c.fragment] = keep_for_replay(kept.get(c.fragment, []), np.frombuffer(bytes(blob), np.uint8))
            if old is not None:
                blob = bytearray(old.tobytes())
                self._sent[(c.fragment, c.round)] = blob
            return blob, meta

        core.IslandCore._prepare = replaying_prepare
    else:
        from learner import builtin

        make = builtin.builtin_backend

        def corrupt_backend(spec, plan, cfg, shard):
            batch = shard.batch
            shard.batch = lambda b: shuffle_tokens(batch(b), rng)
            return make(spec, plan, cfg, shard)

        builtin.builtin_backend = corrupt_backend


def main() -> int:
    if {"-h", "--help"} & set(sys.argv[1:]):
        print(__doc__)
        return 0
    install(os.environ.get("BYZ_KIND", ""), int(os.environ.get("BYZ_SEED", "0")))
    from bus.entry import run_command
    from learner.service import main as learner_main

    return run_command("learner", learner_main, sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
