"""Data-parallel baseline in one process: the quality reference of the evidence benchmarks.

M data-parallel workers with batch b each, exactly synchronised every step, are one optimizer on
the concatenation of their M batches (an all-reduced mean gradient is the gradient of the mean
loss). So this trains the run's model from the run's version 0 (``init_params(spec, seed)``, as
the aggregator does) with the learners' inner optimizer (``learner.inner``: Muon by default, their
settings) on batches of M x b sequences: b from each of the M learner data shards, the shards a run
of M learners would use.
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


def dp_rate(env: dict, M: int) -> float:
    """The peak rate data-parallel of M learners trains at: the learners' own (``DILOCO_INNER_LR``,
    or the default for the model's width, the inner optimizer and M; Muon's rises with M)."""
    from bench.runs import model_config
    from bus.config import from_env
    from learner.config import LearnerConfig

    lc = from_env(LearnerConfig, {k: v for k, v in env.items() if k.startswith("DILOCO_")})
    return lc.lr_for(model_config(env).spec().d_model, learners=M)


def train_dp(env: dict, M: int, steps: int, progress=None) -> dict:
    """Train ``steps`` steps of batch M x b; ``env`` are DILOCO_* settings (model, learner, eval)."""
    from bench.runs import model_config
    from learner.data import load_corpus
    from learner.inner import make_eval_fn, make_optimizer, make_train_step
    from learner.model import to_jax
    from learner.spec import count_params, init_params

    from bus.config import from_env
    from learner.config import EvalConfig, LearnerConfig

    # the learners' own settings and defaults (never a copy of them)
    diloco = {k: v for k, v in env.items() if k.startswith("DILOCO_")}
    lc, ec = from_env(LearnerConfig, diloco), from_env(EvalConfig, diloco)
    model = model_config(env)
    spec = model.spec()
    b = lc.batch_size
    corpus = load_corpus(lc.data or None, max_bytes=lc.data_max_bytes)
    seed = lc.data_seed
    shards = [corpus.shard(i, M, spec.seq_len, seed * 1_000_003 + i) for i in range(M)]
    lr = dp_rate(env, M)
    opt = make_optimizer(lr, lc.warmup, lc.total_steps, weight_decay=lc.weight_decay,
                         clip_norm=lc.clip_norm or None, kind=lc.inner_optimizer, muon_rms=lc.muon_rms)
    step = make_train_step(spec, opt, donate=True)
    params = to_jax(init_params(spec, model.seed))
    state = opt.init(params)
    heldout = corpus.heldout_batches(spec.seq_len, ec.eval_batch_size, ec.eval_batches)
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
    return {"eval_loss": ev, "train_loss": loss, "steps": steps, "M": M, "batch": M * b, "lr": lr, "inner": lc.inner_optimizer,
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
