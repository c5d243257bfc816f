"""The gap to data-parallel against model size (issue 40, part 1): data-parallel, synchronous and
Decoupled DiLoCo at each M on models of several sizes, in the in-process reference
(``simulation.reference``), beside the published fits (DESIGN.md section 9).

Every run trains a built-in transformer of one size (``SIZES``: ``tiny`` ~ the reference's smoke model,
``small`` the reference's default, ``mid`` about twice ``small``) for ``--tokens-per-param`` x its
parameters tokens (20: compute optimal) at the roles' defaults (inner optimizer, rate by the model's
width, H, outer settings, K = M); data-parallel as one optimizer on batches of M x 8 at the same
rate and schedule. The gap of each size and M: (decoupled - data-parallel) / data-parallel, and the same
for synchronous DiLoCo.

Keys: ``params_<size>``; ``gap_<size>_m<M>`` (decoupled), ``sync_gap_<size>_m<M>``,
``async_cost_<size>_m<M>`` = (decoupled - synchronous) / synchronous; ``trend_m<M>`` = the gap at the
largest size run minus the gap at the smallest (negative: the gap falls as models grow, as the
published fits do). ``--plot FILE.png``: the gap against parameters, per M, with the published
points. A figure of one run is one run: ``--seed`` repeats it on other data.

    python -m bench.size_trend --quick --out size_trend.json                        (~1 min)
    python -m bench.size_trend --M 2 4 8 --jobs 2 --out size_trend.json --plot docs/size_trend.png
        (tiny, small, mid: 27 runs, about 30 min on 2 cores; --reuse FILE.json skips the runs a file holds)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import time

from bench.common import fetch_delay_of, finish, parser, period_of, progress, reference_options, reused_rows, run_jobs

#: the model sizes (the reference's model dicts); ``tiny`` and ``small`` are the reference's own
SIZES: dict[str, dict] = {
    "tiny": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "seq_len": 32},
    "small": {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "seq_len": 64},
    "mid": {"d_model": 96, "n_layers": 2, "n_heads": 4, "d_ff": 384, "seq_len": 64},
}
MODES = ("dp", "sync", "decoupled")
#: synchronous DiLoCo against data-parallel at ~20 tokens per parameter, from the scaling-law fits of
#: Charles et al. (DESIGN.md section 9: derived there, not stated by the paper): {M: [(params, gap)]}
PUBLISHED = {4: [(90e6, 0.015), (330e6, 0.010), (1.3e9, 0.004), (2.4e9, 0.002)],
             8: [(90e6, 0.031), (330e6, 0.022), (1.3e9, 0.013), (2.4e9, 0.009)],
             2: [(90e6, 0.005), (2.4e9, 0.0)]}


def params_of(size: str) -> int:
    from simulation.reference import RefConfig, Setup

    probe = Setup(RefConfig(M=1, steps=2, model=SIZES[size]))
    return int(probe.params)


def configs(sizes: list[str], Ms: list[int], modes: list[str], tokens_per_param: float, batch: int, seed: int,
            quick: bool) -> list[tuple[str, object]]:
    from bench.algorithm import budget_steps
    from simulation.reference import RefConfig

    out = []
    for size in sizes:
        n = params_of(size)
        for M in Ms:
            steps = budget_steps(n, tokens_per_param, M, batch, SIZES[size]["seq_len"])
            for mode in modes:
                out.append((size, RefConfig(mode=mode, M=M, steps=steps, batch=batch, model=SIZES[size], data_seed=seed,
                                            eval_points=3 if quick else 8)))
    return out


def one(item: tuple[str, object]) -> dict:
    from simulation.reference import run_reference
    from simulation.reference_setup import inner_rate

    size, cfg = item
    t0 = time.monotonic()
    r = run_reference(cfg)  # type: ignore[arg-type]
    return {"size": size, "M": cfg.M, "mode": cfg.mode, "steps": cfg.steps, "seed": cfg.data_seed,  # type: ignore[attr-defined]
            "inner": cfg.inner_optimizer, "lr": inner_rate(cfg), "eval_loss": float(r["eval_loss"]),  # type: ignore[attr-defined]
            "fetch_delay": fetch_delay_of(cfg), "H": period_of(cfg),  # type: ignore[attr-defined]
            "seconds": round(time.monotonic() - t0, 1)}


def summary(rows: list[dict], params: dict[str, int]) -> dict:
    loss = {(r["size"], r["M"], r["mode"]): r["eval_loss"] for r in rows}
    out: dict = {f"params_{s}": n for s, n in params.items()}
    for (size, M, mode), v in sorted(loss.items()):
        dp = loss.get((size, M, "dp"))
        if mode == "decoupled" and dp:
            out[f"gap_{size}_m{M}"] = round((v - dp) / dp, 4)
        if mode == "sync" and dp:
            out[f"sync_gap_{size}_m{M}"] = round((v - dp) / dp, 4)
        if mode == "decoupled" and (size, M, "sync") in loss:
            s = loss[(size, M, "sync")]
            out[f"async_cost_{size}_m{M}"] = round((v - s) / s, 4)
    for M in sorted({r["M"] for r in rows}):
        have = sorted((params[s], out[f"gap_{s}_m{M}"]) for s in params if f"gap_{s}_m{M}" in out)
        if len(have) >= 2:
            out[f"trend_m{M}"] = round(have[-1][1] - have[0][1], 4)
    return out


def plot(rows: list[dict], params: dict[str, int], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary(rows, params)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, M in enumerate(sorted({r["M"] for r in rows})):
        color = f"C{i}"
        pts = sorted((params[z], 100 * s[f"gap_{z}_m{M}"]) for z in params if f"gap_{z}_m{M}" in s)
        if pts:
            ax.plot(*zip(*pts), "o-", color=color, label=f"decoupled M={M} (this reference)")
        sync = sorted((params[z], 100 * s[f"sync_gap_{z}_m{M}"]) for z in params if f"sync_gap_{z}_m{M}" in s)
        if sync:
            ax.plot(*zip(*sync), "s--", color=color, alpha=0.6, label=f"synchronous M={M}")
        if M in PUBLISHED:
            ax.plot([p for p, _ in PUBLISHED[M]], [100 * g for _, g in PUBLISHED[M]], "^:", color=color,
                    label=f"published fit, synchronous M={M}")
    ax.set_xscale("log")
    ax.axhline(0, color="grey", lw=0.8)
    ax.set_xlabel("parameters")
    ax.set_ylabel("held-out loss over data-parallel's (%)")
    ax.set_title("The gap to data-parallel against model size, 20 tokens per parameter")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from simulation.reference_setup import inner_rate

    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=None, choices=list(SIZES), help="default: all; quick: tiny")
    p.add_argument("--M", type=int, nargs="+", default=None, help="learner counts (default: 2 4 8; quick: 2)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    reference_options(p)
    p.add_argument("--reuse", nargs="+", default=None, help="JSON files of earlier runs: their rows are not run again")
    p.add_argument("--plot", default=None, help="write the gap-against-parameters plot here")
    a = p.parse_args()
    sizes = a.sizes or (["tiny"] if a.quick else list(SIZES))
    Ms = a.M or ([2] if a.quick else [2, 4, 8])
    tpp = a.tokens_per_param or (2.0 if a.quick else 20.0)
    # rows of before the rate was recorded match nothing (the default rate changed with them), and a
    # decoupled row without a fetch delay ran H/4 (the default before the fourteenth round)
    fields = ("size", "M", "mode", "steps", "seed", "lr", "fetch_delay", "H")
    old = {(*k[:-2], fetch_delay_of(r), period_of(r)): r for k, r in reused_rows(a.reuse, fields).items()}
    items = configs(sizes, Ms, a.modes, tpp, a.batch, a.seed, a.quick)

    def key(it: tuple) -> tuple:
        cfg = it[1]
        return (it[0], cfg.M, cfg.mode, cfg.steps, cfg.data_seed, inner_rate(cfg),
                fetch_delay_of(cfg), period_of(cfg))

    todo = [it for it in items if key(it) not in old]
    reused = [old[key(it)] for it in items if key(it) in old]
    progress(f"{len(todo)} runs ({len(reused)} reused): sizes {sizes}, M {Ms}, modes {a.modes}, {tpp} tokens/param")
    rows = reused + run_jobs(one, todo, a.jobs,
                             lambda r: f"{r['size']} M={r['M']} {r['mode']}: {r['eval_loss']:.4f} ({r['seconds']} s)")
    params = {s: params_of(s) for s in sizes}
    if a.plot:
        plot(rows, params, a.plot)
    finish({"tokens_per_param": tpp, "seed": a.seed, "quick": a.quick, "rows": rows, **summary(rows, params)}, a.out)


if __name__ == "__main__":
    main()
