"""The inner optimizer as a lever on DiLoCo's gap (issue 40): data-parallel, synchronous DiLoCo and
Decoupled DiLoCo with AdamW and with Muon (``DILOCO_INNER_OPTIMIZER``, ``learner.inner``), in the
in-process reference (``simulation.reference``).

Every run trains the built-in ``small`` model (119,104 parameters; ``--quick``: the tiny one) for
``--tokens-per-param`` x parameters tokens (20: compute optimal) at the roles' defaults (inner rate by
the model's width, the optimizer and M: ``learner.config.auto_inner_lr``; H, outer settings, K = M),
data-parallel as one optimizer on batches of M x 8 at the same rate, schedule and weight decay.

Keys, per M: ``gap_<kind>_m<M>`` = (decoupled - data-parallel AdamW) / data-parallel AdamW (the
baseline a user has today); ``gap_same_<kind>_m<M>`` against data-parallel with the same inner
optimizer; ``async_cost_<kind>_m<M>`` = (decoupled - synchronous) / synchronous (target <= 1%).
What Muon costs: ``muon_step_cost_<preset>`` = Muon's inner step time over AdamW's (the built-in
model's jitted step, batch 16, the two timed in alternation), ``muon_compile_cost_<preset>`` the same
for the first call (compile); ``--no-speed`` skips it.

    python -m bench.inner_opt --quick --out inner_opt.json            (~1 min)
    python -m bench.inner_opt --M 4 8 --jobs 2 --out inner_opt.json    (~25 min on 2 cores)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import time

from bench.common import finish, parser, progress, reference_options, run_jobs

KINDS = ("adamw", "muon")
MODES = ("dp", "sync", "decoupled")


def configs(Ms: list[int], kinds: list[str], quick: bool, tokens_per_param: float, batch: int, seed: int,
            modes: tuple[str, ...] = MODES, muon_rms: float | None = None) -> list:
    from bench.algorithm import model_budget
    from simulation.reference import TINY_MODEL, RefConfig

    model = TINY_MODEL if quick else RefConfig().model
    out = []
    for M, steps in model_budget(model, tokens_per_param, Ms, batch).items():
        for kind in kinds:
            for mode in modes:
                extra = {} if muon_rms is None else {"muon_rms": muon_rms}
                out.append(RefConfig(mode=mode, M=M, steps=steps, batch=batch, model=model, inner_optimizer=kind,
                                     data_seed=seed, eval_points=3 if quick else 8, **extra))
    return out


def one(cfg) -> dict:
    from simulation.reference import run_reference

    t0 = time.monotonic()
    r = run_reference(cfg)
    return {"M": cfg.M, "mode": cfg.mode, "kind": cfg.inner_optimizer, "muon_rms": cfg.muon_rms, "steps": cfg.steps,
            "eval_loss": float(r["eval_loss"]), "seconds": round(time.monotonic() - t0, 1)}


def step_cost(preset: str, repeats: int = 5, steps: int = 20) -> dict:
    """Muon's jitted inner step (and its compile) against AdamW's on the built-in model ``preset``,
    batch 16, timed in alternation (the median of ``repeats`` blocks of ``steps`` steps each)."""
    import statistics

    import jax
    import numpy as np

    from bus.presets import MODEL_PRESETS
    from bus.config import from_env
    from learner.config import ModelConfig
    from learner.inner import make_optimizer, make_train_step
    from learner.model import to_jax
    from learner.spec import init_params

    spec = from_env(ModelConfig, MODEL_PRESETS[preset]).spec()
    batch = np.random.default_rng(0).integers(0, spec.vocab_size, (16, spec.seq_len + 1)).astype(np.int32)
    state, compile_s, times = {}, {}, {k: [] for k in KINDS}
    for kind in KINDS:
        opt = make_optimizer(1e-3, 10, 1000, kind=kind)
        step = make_train_step(spec, opt)
        params = to_jax(init_params(spec, 0))
        t0 = time.perf_counter()
        params, o, loss = step(params, opt.init(params), batch)
        jax.block_until_ready(loss)
        compile_s[kind] = time.perf_counter() - t0
        state[kind] = (step, params, o)
    for _ in range(repeats):
        for kind in KINDS:
            step, params, o = state[kind]
            t0 = time.perf_counter()
            for _ in range(steps):
                params, o, loss = step(params, o, batch)
            jax.block_until_ready(loss)
            times[kind].append((time.perf_counter() - t0) / steps)
            state[kind] = (step, params, o)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {f"step_ms_{k}_{preset}": round(1e3 * v, 2) for k, v in med.items()} | {
        f"compile_s_{k}_{preset}": round(v, 2) for k, v in compile_s.items()} | {
        f"muon_step_cost_{preset}": round(med["muon"] / med["adamw"], 3),
        f"muon_compile_cost_{preset}": round(compile_s["muon"] / compile_s["adamw"], 3)}


def summary(rows: list[dict]) -> dict:
    loss = {(r["M"], r["kind"], r["mode"]): r["eval_loss"] for r in rows}
    out: dict = {}
    for M in sorted({r["M"] for r in rows}):
        base = loss.get((M, "adamw", "dp"))
        for kind in KINDS:
            dp, sync, dec = (loss.get((M, kind, m)) for m in MODES)
            if dec is None:
                continue
            if base:
                out[f"gap_{kind}_m{M}"] = round((dec - base) / base, 4)
            if dp:
                out[f"gap_same_{kind}_m{M}"] = round((dec - dp) / dp, 4)
            if sync:
                out[f"async_cost_{kind}_m{M}"] = round((dec - sync) / sync, 4)
    return out


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--M", type=int, nargs="+", default=None, help="learner counts (default: 4 8; quick: 2)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    reference_options(p)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--muon-rms", type=float, default=None, help="Muon's update RMS (default: DILOCO_MUON_RMS's)")
    p.add_argument("--no-speed", action="store_true", help="skip what a Muon step costs")
    a = p.parse_args()
    Ms = a.M or ([2] if a.quick else [4, 8])
    tpp = a.tokens_per_param or (2.0 if a.quick else 20.0)
    items = configs(Ms, a.kinds, a.quick, tpp, a.batch, a.seed, tuple(a.modes), a.muon_rms)
    rows = run_jobs(one, items, a.jobs,
                    lambda r: f"M={r['M']} {r['kind']} {r['mode']}: {r['eval_loss']:.4f} ({r['seconds']} s)")
    speed: dict = {}
    if not a.no_speed:
        for preset in (["tiny"] if a.quick else ["small", "default"]):
            speed.update(step_cost(preset, repeats=3 if a.quick else 5))
            progress(f"a Muon step on {preset}: {speed[f'muon_step_cost_{preset}']}x AdamW's")
    finish({"tokens_per_param": tpp, "seed": a.seed, "quick": a.quick, "muon_rms": items[0].muon_rms if items else None,
            "rows": rows, **summary(rows), **speed},
           a.out)


if __name__ == "__main__":
    main()
