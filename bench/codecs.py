"""Codec speed: encode and decode of every outer-gradient codec, GB/s of float32 input, on this machine.

Dense quantisers (``bus.quant``) and the sparse top-k codecs (``bus.sparse``): ``encode_array`` and
``decode_array`` of a vector of 16 Mi values (4 Mi with ``--quick``), best of a few repetitions, and
for the sparse codecs the learner's own path too, ``encode_with_feedback`` with a residual (the
residual added, top-k, the blob, the new residual: ``feedback``). Target (issue 27): >= 1 GB/s for
the new codecs, so they never limit a learner or the aggregator.

    python -m bench.codecs --quick --out codecs.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import time

import numpy as np

from bench.common import finish, parser, progress
from bus import codec, sparse

MiB = 1 << 20


def codec_speed(quick: bool) -> dict:
    n = (4 if quick else 16) * MiB
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    res = (rng.standard_normal(n) * 0.1).astype(np.float32)
    reps = 3 if quick else 5
    out = {}
    for q in codec.CODECS:
        enc, dec, fb = [], [], []
        buf = np.empty(n, np.float32)
        for _ in range(reps):
            t0 = time.perf_counter()
            blob = codec.encode_array(x, q)
            t1 = time.perf_counter()
            codec.decode_array(blob, lambda m: buf)
            t2 = time.perf_counter()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
            if q in sparse.SPARSE:
                d, r = x.copy(), res.copy()
                t3 = time.perf_counter()
                codec.encode_with_feedback(d, r, q, keep_residual=True, want_sent=False)
                fb.append(time.perf_counter() - t3)
        gb = x.nbytes / 1e9
        out[q] = {"encode": round(gb / min(enc), 3), "decode": round(gb / min(dec), 3)}
        if fb:
            out[q]["feedback"] = round(gb / min(fb), 3)
        progress(f"codec {q}: {out[q]} GB/s")
    return out


def main() -> None:
    a = parser(__doc__.splitlines()[0]).parse_args()
    speeds = codec_speed(a.quick)
    sp = [v for q, row in speeds.items() if q in sparse.SPARSE for v in row.values()]
    finish({"bench": "codecs", "quick": a.quick, "values": (4 if a.quick else 16) * MiB, "codec_gbps": speeds,
            "slowest_sparse_gbps": min(sp)}, a.out)


if __name__ == "__main__":
    main()
