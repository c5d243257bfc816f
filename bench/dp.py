"""Data-parallel baseline in one process: the quality reference of the evidence benchmarks.

M data-parallel workers with batch b each, exactly synchronised every step, are one optimizer on
the concatenation of their M batches (an all-reduced mean gradient is the gradient of the mean
loss). So this trains the run's model from the run's version 0 (``init_params(spec, seed)``, as
the aggregator does) with one AdamW (``learner.inner``, the learners' settings) on batches of M x b
sequences: b from each of the M learner data shards, the shards a run of M learners would use.
The held-out loss is computed exactly as the evaluator does (``Corpus.heldout_batches`` with the
evaluator's batch count and size, ``make_eval_fn``).

    python -m bench.dp --steps 200 --M 4      (prints one JSON line; settings from DILOCO_*)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import argparse
import time

import numpy as np
import orjson


def train_dp(env: dict, M: int, steps: int, progress=None) -> dict:
    """Train ``steps`` steps of batch M x b; ``env`` are DILOCO_* settings (model, learner, eval)."""
    from bench.runs import model_config
    from learner.data import load_corpus
    from learner.inner import make_eval_fn, make_optimizer, make_train_step
    from learner.model import to_jax
    from learner.spec import count_params, init_params

    g = lambda k, d: env.get(k, d)  # noqa: E731
    model = model_config(env)
    spec = model.spec()
    b = int(g("DILOCO_BATCH_SIZE", 16))
    lr, warm = float(g("DILOCO_INNER_LR", 1e-3)), int(g("DILOCO_WARMUP_STEPS", 50))
    total = int(g("DILOCO_TOTAL_STEPS", 1000))
    corpus = load_corpus(g("DILOCO_DATA", "") or None, max_bytes=int(g("DILOCO_DATA_MAX_BYTES", 8 * 1024 * 1024)))
    seed = int(g("DILOCO_DATA_SEED", 0))
    shards = [corpus.shard(i, M, spec.seq_len, seed * 1_000_003 + i) for i in range(M)]
    opt = make_optimizer(lr, warm, total, weight_decay=float(g("DILOCO_WEIGHT_DECAY", 0.1)),
                         clip_norm=float(g("DILOCO_CLIP_NORM", 1.0)) or None)
    step = make_train_step(spec, opt, donate=True)
    params = to_jax(init_params(spec, model.seed))
    state = opt.init(params)
    heldout = corpus.heldout_batches(spec.seq_len, int(g("DILOCO_EVAL_BATCH_SIZE", 16)),
                                     int(g("DILOCO_EVAL_BATCHES", 4)))
    evalf = make_eval_fn(spec)
    t0 = time.monotonic()
    loss = float("nan")
    for t in range(steps):
        batch = np.concatenate([s.batch(b) for s in shards])
        params, state, loss = step(params, state, batch)
        if progress and (t + 1) % 50 == 0:
            progress(f"dp step {t + 1}/{steps} loss {float(loss):.4f}")
    loss = float(loss)
    train_s = time.monotonic() - t0
    ev = float(np.mean([float(evalf(params, hb)) for hb in heldout]))
    return {"eval_loss": ev, "train_loss": loss, "steps": steps, "M": M, "batch": M * b,
            "tokens": steps * M * b * spec.seq_len, "params": count_params(spec), "train_seconds": round(train_s, 2),
            "step_seconds": round(train_s / max(steps, 1), 4)}


def main() -> None:
    import os

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--M", type=int, default=4)
    a = p.parse_args()
    print(orjson.dumps(train_dp(dict(os.environ), a.M, a.steps)).decode())


if __name__ == "__main__":
    main()
