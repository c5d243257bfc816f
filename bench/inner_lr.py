"""The inner learning rate, tuned on both sides (issue 40): data-parallel and Decoupled DiLoCo at each
M over a sweep of peak inner rates, in the in-process reference (``simulation.reference``), so the gap
is read against *tuned* data-parallel and DiLoCo's own best rate is found.

Every run trains the built-in ``small`` model (``--quick``: the tiny one) for ``--tokens-per-param`` x
parameters tokens (20: compute optimal), batch 8 per learner step, every other setting the roles'
defaults (Muon inner optimizer, H, outer settings, the on-time quorum); data-parallel is one optimizer
on batches of M x 8 at the same rate and schedule. ``--modes`` may add ``sync`` (synchronous DiLoCo).
``--at-default`` runs each M at its own default rate only; ``--fetch-delay N`` sets the learners'
``DILOCO_FETCH_DELAY`` (-1: the H/4 of the thirteenth round and before); ``--one-slow X`` makes the
last learner X times slower (its step time; the on-time quorum, the role default), ``bench.hetero``'s
speed spread at X = 2; ``--sync-every H ...`` runs DiLoCo at those periods (default: the learner's,
12).

Keys, per M: ``dp_best_lr_m<M>`` / ``dp_best_m<M>`` (the tuned baseline), ``<mode>_best_lr_m<M>`` /
``<mode>_best_m<M>`` (DiLoCo at its own best rate, and period of ``--sync-every``: ``<mode>_best_H_m<M>``),
``gap_tuned_m<M>`` = (decoupled at its best rate and period - tuned data-parallel) / tuned
data-parallel, ``gap_default_m<M>`` = (decoupled at the default rate and period - tuned
data-parallel) / tuned data-parallel (what a user gets against a tuned baseline), and
``default_lr_m<M>`` (``learner.config``'s rate for the model's width, inner optimizer and M learners). A figure of one
run is one run: ``--seed`` repeats the sweep on other data.

    python -m bench.inner_lr --quick --out inner_lr.json                                    (~1 min)
    python -m bench.inner_lr --M 2 4 8 --lrs 0.008 0.016 0.024 0.032 --jobs 2 --out inner_lr.json
        (24 runs, about 20 min on 2 cores; --reuse FILE.json skips the runs a file holds)
    python -m bench.inner_lr --M 4 8 --at-default --modes sync decoupled --one-slow 2 --jobs 2
    python -m bench.inner_lr --M 2 4 8 --at-default --sync-every 6 8 12 --jobs 2   (the period, sixteenth round)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import time

from bench.common import fetch_delay_of, finish, parser, period_of, progress, reference_options, reused_rows, run_jobs

MODES = ("dp", "sync", "decoupled")


def model_of(quick: bool) -> dict:
    from simulation.reference import SMALL_MODEL, TINY_MODEL

    return dict(TINY_MODEL if quick else SMALL_MODEL)


def default_lr(model: dict, M: int) -> float:
    """The rate each of M learners of this model uses when DILOCO_INNER_LR is not set (and
    data-parallel's for M: ``bench.dp``)."""
    from simulation.reference import RefConfig
    from simulation.reference_setup import inner_rate

    return inner_rate(RefConfig(M=M, model=model))


def configs(Ms: list[int], lrs: list[float] | dict[int, list[float]], modes: list[str], model: dict,
            tokens_per_param: float, batch: int, seed: int, quick: bool, fetch_delay: int | None = None,
            one_slow: float = 1.0, periods: list[int] | None = None) -> list:
    """The runs: every M at every rate of ``lrs`` (or of ``lrs[M]``) in every mode, DiLoCo at every
    sync period of ``periods`` (None: the learner's default)."""
    from bench.algorithm import model_budget
    from simulation.reference import RefConfig

    out = []
    for M, steps in model_budget(model, tokens_per_param, Ms, batch).items():
        for lr in (lrs[M] if isinstance(lrs, dict) else lrs):
            for mode in modes:
                for H in ([RefConfig.H] if mode == "dp" or not periods else periods):
                    extra: dict = {}  # (data-parallel and sync fetch nothing late and wait for no one)
                    if mode == "decoupled" and fetch_delay is not None:
                        extra["fetch_delay"] = fetch_delay
                    if mode == "decoupled" and one_slow != 1.0:
                        extra.update(step_times=(1.0,) * (M - 1) + (float(one_slow),), K=-1)
                    out.append(RefConfig(mode=mode, M=M, steps=steps, batch=batch, model=model, lr=lr, data_seed=seed,
                                         H=H, eval_points=3 if quick else 8, **extra))
    return out


def one(cfg) -> dict:
    from simulation.reference import run_reference

    t0 = time.monotonic()
    r = run_reference(cfg)
    slow = max(cfg.step_times) / min(cfg.step_times) if cfg.step_times else 1.0
    return {"M": cfg.M, "mode": cfg.mode, "lr": cfg.lr, "steps": cfg.steps, "seed": cfg.data_seed,
            "inner": cfg.inner_optimizer, "fetch_delay": fetch_delay_of(cfg), "H": period_of(cfg),
            "one_slow": slow, "eval_loss": float(r["eval_loss"]), "seconds": round(time.monotonic() - t0, 1)}


def summary(rows: list[dict], defaults: dict[int, float]) -> dict:
    """The best rate of each mode and M, and the gaps against tuned data-parallel (module docstring)."""
    from learner.config import LearnerConfig

    default_h = LearnerConfig().sync_every
    out: dict = {}
    for M in sorted({r["M"] for r in rows}):
        default = out[f"default_lr_m{M}"] = defaults[M]
        best: dict[str, tuple[float, float, int | None]] = {}
        for r in rows:
            if r["M"] == M and (r["mode"] not in best or r["eval_loss"] < best[r["mode"]][0]):
                best[r["mode"]] = (r["eval_loss"], r["lr"], period_of(r))
        for mode, (loss, lr, h) in best.items():
            out[f"{mode}_best_m{M}"], out[f"{mode}_best_lr_m{M}"] = round(loss, 4), lr
            if h is not None:
                out[f"{mode}_best_H_m{M}"] = h
        if "dp" in best and "decoupled" in best:
            dp = best["dp"][0]
            out[f"gap_tuned_m{M}"] = round((best["decoupled"][0] - dp) / dp, 4)
            at_default = [r["eval_loss"] for r in rows if r["M"] == M and r["mode"] == "decoupled"
                          and abs(r["lr"] - default) < 1e-12 and period_of(r) == default_h]
            if at_default:
                out[f"gap_default_m{M}"] = round((at_default[0] - dp) / dp, 4)
    return out


def main() -> None:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--M", type=int, nargs="+", default=None, help="learner counts (default: 2 4 8; quick: 2)")
    p.add_argument("--lrs", type=float, nargs="+", default=None,
                   help="peak inner rates (default: 0.008 0.016 0.024 0.032; quick: the default rate and twice it)")
    p.add_argument("--modes", nargs="+", default=["dp", "decoupled"], choices=MODES)
    p.add_argument("--at-default", action="store_true", help="each M at its own default rate only (not --lrs)")
    p.add_argument("--fetch-delay", type=int, default=None,
                   help="the learners' DILOCO_FETCH_DELAY (default: the learner's; -1: H/4, the old default)")
    p.add_argument("--one-slow", type=float, default=1.0, help="the last learner this many times slower")
    p.add_argument("--sync-every", type=int, nargs="+", default=None,
                   help="DiLoCo's sync periods H to run (default: the learner's, 12)")
    reference_options(p)
    p.add_argument("--reuse", nargs="+", default=None, help="JSON files of earlier runs: their rows are not run again")
    a = p.parse_args()
    model = model_of(a.quick)
    Ms = a.M or ([2] if a.quick else [2, 4, 8])
    defaults = {M: default_lr(model, M) for M in Ms}
    lrs: list[float] | dict[int, list[float]]
    if a.at_default:
        lrs = {M: [defaults[M]] for M in Ms}
    else:
        lrs = a.lrs or ([defaults[Ms[0]], 2 * defaults[Ms[0]]] if a.quick else [0.008, 0.016, 0.024, 0.032])
        lrs = sorted({*lrs, *defaults.values()})
    tpp = a.tokens_per_param or (2.0 if a.quick else 20.0)
    if a.one_slow < 1.0:
        p.error(f"--one-slow must be >= 1 (how many times slower the last learner is), got {a.one_slow}")
    if a.sync_every and min(a.sync_every) < 1:
        p.error(f"--sync-every takes periods >= 1, got {a.sync_every}")
    # rows of files before the fourteenth round: the learners' H/4 delay, equal speeds; before the
    # sixteenth: H = 12
    old = {(*k[:5], fetch_delay_of(r), r.get("one_slow", 1.0), period_of(r)): r
           for k, r in reused_rows(a.reuse, ("M", "mode", "lr", "steps", "seed", "fetch_delay", "one_slow", "H")).items()}
    items = configs(Ms, lrs, a.modes, model, tpp, a.batch, a.seed, a.quick, a.fetch_delay, a.one_slow, a.sync_every)

    def key(c) -> tuple:
        slow = max(c.step_times) / min(c.step_times) if c.step_times else 1.0
        return (c.M, c.mode, c.lr, c.steps, c.data_seed, fetch_delay_of(c), slow, period_of(c))

    todo = [c for c in items if key(c) not in old]
    reused = [old[key(c)] for c in items if key(c) in old]
    progress(f"{len(todo)} runs ({len(reused)} reused): M {Ms}, rates {lrs}, modes {a.modes}, {tpp} tokens/param, "
             f"fetch delay {a.fetch_delay if a.fetch_delay is not None else 'default'}, one slow x{a.one_slow}, "
             f"H {a.sync_every or 'default'}")
    rows = reused + run_jobs(one, todo, a.jobs, lambda r: f"M={r['M']} lr={r['lr']} {r['mode']} H={r['H']}: "
                                                          f"{r['eval_loss']:.4f} ({r['seconds']} s)")
    finish({"tokens_per_param": tpp, "seed": a.seed, "quick": a.quick, "fetch_delay": a.fetch_delay,
            "one_slow": a.one_slow, "sync_every": a.sync_every, "rows": rows, **summary(rows, defaults)}, a.out)


if __name__ == "__main__":
    main()
