"""Goodput simulator: the paper's Table 1 at 150k-2.4M chips, and the measured bench.goodput.

A discrete-event model (pure part: ``simulation/goodput_model.py``) of N chips in M islands of N/M
chips, each chip failing at a mean time between interruptions (MTBI) of one year, in four modes:

* ``dp``: data-parallel without elasticity. Every failure stalls the whole job for a restart
  (``dp_restart_s``) and the job resumes from its last checkpoint (the work since is recomputed;
  checkpoint at most ``dp_ckpt_s`` old). A lock-step job also loses ``dp_overhead`` of its
  failure-free time to its per-step syncs;
* ``dp_elastic``: the survivors go on after a reconfiguration stall (``elastic_reconfig_s``); the
  failed chip's replica (``replica_chips``) is out until repaired (``repair_s``);
* ``sync``: synchronous DiLoCo, M islands, a barrier every H steps (one sync per round: the
  overhead is dp_overhead / H). A failed island is down for its restart and rejoin and redoes its
  round; everyone waits for it at the barrier (no eviction: classic DiLoCo waits for all M);
* ``decoupled``: an island failure stalls only that island, for ``island_restart_s`` plus the
  rejoin (the global parameters at a 1/M share of the syncer: ``M x rejoin_per_learner_s``), and
  loses the steps of each staggered fragment not yet sent (up to H). Quorum K and the grace
  window delay merges but never block a learner (DESIGN.md 1, 3), so they cost no goodput; the
  share of time with fewer than K islands up is reported (``below_quorum_share``).

Assumptions, and where they come from:

* published (the paper, arXiv 2604.21428, via DESIGN.md 1, 3, 7): 1 year MTBI per chip; chip
  counts 150k-2.4M; M = 4, 8, 16 learners; H = 24 inner steps per fragment and P = 24 staggered
  fragments; Table 1 as DESIGN.md 1 transcribes it (the target; never an output);
* failures: chips fail independently, so the failures of N chips are one Poisson process of rate
  N / MTBI, each hitting a uniformly random island (no chip is simulated); a failure that hits a
  unit already down is absorbed by the restart in progress;
* not found in what we could read of the paper (the stored copies hold its abstract and
  introduction; no restart time, checkpoint interval or step time): the step time (1 s), the DP
  checkpoint age (1 step: in-memory checkpoints), and the dp_elastic constants are chosen; four
  constants are fitted ONCE, as a minimax grid fit to the whole table (``--calibrate`` reruns it):
  ``dp_restart_s`` (62 s) and ``dp_overhead`` (10.25%) on the DP column, ``island_restart_s``
  (2.5 s) and ``rejoin_per_learner_s`` (1.2 s, so 4.8-19 s for M=4-16) on the three island
  columns. Why those two shapes: the DP column falls
  more slowly with N than a pure restart stall allows (1/G - 1 grows as N^0.89, not N), and at
  equal island failure rate the island loss still grows with M (M=4 at 600k: 89%, M=16 at 2.4M:
  86%, both one island failure every 210 s): a constant overhead and a rejoin cost growing with M
  are the simplest mechanisms that produce those two features;
* sync DiLoCo and dp_elastic have no published figures: they use the same constants.

The measured benchmark (``bench.goodput``: 8 synthetic learners, seeded per-learner exponential
up-times, kill -9, restart after ``repair``): :func:`goodput_model.simulate_trace` replays its trace
(``bench.goodput.failure_trace``, so identical) with its STEP_TIME, H, P and window, the monitor's
states (a killed learner stays in the quorum until it is released; a new incarnation counts once
the monitor admits it), the learner's sync schedule (staggered offsets in async mode; all
fragments every H steps and a wait for the merge in sync mode) and the bench's accounting (steps x
STEP_TIME / P per contribution merged inside the window). The speed of the machine under the run
is an input, not a prediction: each mode of a run measures its own timings (bench/goodput_timings.py:
start-up, admission, release after a kill, failure-free round overhead) and the simulator runs each
mode on them (``BenchSystem.measured``). No constant of this part is fitted to a goodput, so
``sim_vs_measured`` checks the failure accounting itself. A file from before the timings existed
gets the defaults, with the start-up inferred from its decoupled stepping share.

Left out: stragglers and slow steps, correlated failures (racks, power domains, a whole island),
failures of the syncer itself, spare pools running dry, repair queues, checkpoint write cost as
its own event, the quality cost of stale or dropped work, and bandwidth.

    python -m bench.goodput_sim --plot docs/goodput_sim.png --out goodput_sim.json
    python -m bench.goodput_sim --quick --measured goodput.json    # the --out of bench.goodput
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import time
from dataclasses import asdict, replace

import orjson

from bench.common import finish, parser, progress
from bench.goodput import failure_trace
from simulation.goodput_model import (
    CHIPS,
    DOCS_FULL_RUN,
    PUBLISHED,
    TRACE_MODES,
    BenchSystem,
    ScaleModel,
    calibrate,
    infer_startup,
    scale_table,
    simulate_trace,
    table_error,
)

#: bench.goodput's own defaults (its main()): window 12 s (--quick) or 100 s, MTBF 20 s, repair
#: 3 s, seed 7, modes decoupled, sync, dp (--quick) or all four.
BENCH_DEFAULTS = {"window_s": (12.0, 100.0), "mtbf_s": 20.0, "repair_s": 3.0, "seed": 7}


def bench_params(r: dict) -> dict:
    return {"M": int(r["M"]), "step": float(r["step_time"]), "H": int(r["H"]), "P": int(r["P"]),
            "window": float(r["window_s"])}


def sim_modes(trace, params: dict, modes, system: BenchSystem, timings: dict | None = None) -> dict:
    """Simulated goodput per mode; with ``timings`` (mode -> a bench.goodput run's measured
    timings) each mode runs on the system those timings describe."""
    timings = timings or {}
    return {m: round(simulate_trace(m, trace, system=system.measured(timings.get(m), m), **params)["goodput"], 4)
            for m in modes}


def compare(sim: dict, measured: dict) -> dict:
    rows = {m: {"sim": sim[m], "measured": measured[m], "diff": round(sim[m] - measured[m], 4)} for m in sim}
    worst = max(abs(v["diff"]) for v in rows.values())
    return {"max_abs_diff": round(worst, 4), "within_0.05": worst <= 0.05, "modes": rows}


def against_file(path: str, system: BenchSystem) -> dict:
    """Simulate the run of a bench.goodput --out file and compare with its measured goodput."""
    with open(path, "rb") as f:
        r = orjson.loads(f.read())
    params = bench_params(r)
    trace = [tuple(e) for e in r["trace"]]
    regenerated = failure_trace(int(r["seed"]), float(r["window_s"]), float(r["mtbf_s"]), float(r["repair_s"]))
    measured = {m: float(g) for m, g in r["goodput"].items() if m in TRACE_MODES}
    rows = r.get("modes", {})
    timings = {m: rows[m]["timings"] for m in measured if (rows.get(m) or {}).get("timings")}
    share = (rows.get("decoupled") or {}).get("compute_share")
    if timings:  # the run measured its own timings: nothing is inferred or fitted
        used, source = system, "measured per mode (bench.goodput timings)"
    elif share is not None:  # an older run: start-up inferred from its decoupled stepping share
        used = replace(system, startup_s=infer_startup(trace, share, system=system, **params))
        source = "start-up inferred from the decoupled stepping share"
    else:
        used, source = system, "defaults"
    out = {"measured_file": path, "params": {**params, "mtbf_s": r["mtbf_s"], "repair_s": r["repair_s"],
                                             "seed": r["seed"], "failures": r.get("failures")},
           "trace_regenerated_identical": [tuple(e) for e in regenerated] == trace,
           "system_from": source, "timings": timings or None,
           "systems": {m: asdict(used.measured(timings.get(m), m)) for m in measured},
           "sim_vs_measured": compare(sim_modes(trace, params, measured, used, timings), measured)}
    out["sim_default_system"] = sim_modes(trace, params, measured, system)
    return out


def default_run(quick: bool, system: BenchSystem) -> dict:
    """bench.goodput's default parameters (no measured file): simulated goodput only."""
    d = BENCH_DEFAULTS
    window = d["window_s"][0 if quick else 1]
    params = {"M": DOCS_FULL_RUN["M"], "step": DOCS_FULL_RUN["step_time"], "H": DOCS_FULL_RUN["H"],
              "P": DOCS_FULL_RUN["P"], "window": window}
    trace = failure_trace(d["seed"], window, d["mtbf_s"], d["repair_s"])
    modes = ("decoupled", "sync", "dp") if quick else TRACE_MODES
    return {"measured_file": None, "measured_note": "no measured file given: pass --measured FILE.json "
            "(the --out JSON of bench.goodput); these are simulated figures for its default parameters",
            "params": {**params, "mtbf_s": d["mtbf_s"], "repair_s": d["repair_s"], "seed": d["seed"],
                       "failures": sum(1 for e in trace if e[1] == "kill")},
            "sim": sim_modes(trace, params, modes, system), "sim_vs_measured": None}


def docs_run(system: BenchSystem) -> dict:
    """The docs' full run (MTBF 30 s, 100 s), simulated with the timings it measured."""
    d = DOCS_FULL_RUN
    trace = failure_trace(d["seed"], d["window_s"], d["mtbf_s"], d["repair_s"])
    sim = sim_modes(trace, bench_params(d), TRACE_MODES, system, d["timings"])
    return {"params": {k: d[k] for k in ("window_s", "mtbf_s", "repair_s", "seed")},
            "note": "simulated with the timings that run measured; no constant is fitted to its goodput",
            **compare(sim, d["goodput"])}


def table_text(rows: dict) -> str:
    head = f"{'goodput %':<16}" + "".join(f"{c // 1000:>7}k" for c in CHIPS)
    lines = [head]
    for key, vals in rows.items():
        lines.append(f"{key:<16}" + "".join(f"{100 * v:8.1f}" for v in vals))
        pub = PUBLISHED.get("dp" if key == "dp" else int(key[len("decoupled_M"):]) if key.startswith("decoupled_M") else None)
        if pub:
            lines.append(f"{'  published':<16}" + "".join(f"{p:8.0f}" for p in pub))
    return "\n".join(lines)


def make_plot(rows: dict, path: str, err: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    style = {"dp": ("C3", "-"), "dp_elastic": ("C4", ":")}
    for i, M in enumerate((4, 8, 16)):
        style[f"decoupled_M{M}"] = (f"C{i}", "-")
        style[f"sync_M{M}"] = (f"C{i}", "--")
    for key, vals in rows.items():
        color, ls = style[key]
        ax.plot(CHIPS, [100 * v for v in vals], ls, color=color, label=key.replace("_M", " M="))
        pub = PUBLISHED.get("dp" if key == "dp" else int(key[11:]) if key.startswith("decoupled_M") else None)
        if pub:
            ax.plot(CHIPS, pub, "o", color=color, mfc="none")
    ax.plot([], [], "o", color="k", mfc="none", label="published (Table 1)")
    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(CHIPS, [f"{c / 1e6:g}M" if c >= 1e6 else f"{c // 1000}k" for c in CHIPS])
    ax.set_ylim(0, 100)
    ax.set_xlabel("chips (1 year MTBI per chip)")
    ax.set_ylabel("goodput %")
    ax.set_title(f"simulated (lines) vs published (circles); max error {err:.1f} points", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--measured", default=None, help="the --out JSON of bench.goodput, to compare with")
    p.add_argument("--plot", default=None, help="goodput against chips, simulated and published (PNG)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--failures", type=int, default=None,
                   help="chip failures simulated per island-mode cell (10x for dp): 100000, --quick 20000")
    p.add_argument("--calibrate", action="store_true", help="rerun the scale model's one-off calibration on Table 1 (about a minute)")
    a = p.parse_args()
    t0 = time.monotonic()
    model, system = ScaleModel(), BenchSystem()
    if a.calibrate:
        progress("calibrating the scale model on Table 1")
        model = calibrate(model, seed=a.seed)
    failures = a.failures or (20_000 if a.quick else 100_000)
    rows = scale_table(model, failures=failures, seed=a.seed)
    err, errs = table_error(rows)
    print(table_text(rows), flush=True)
    progress(f"table1_max_error {err:.2f} points ({failures} failures per cell)")
    run = against_file(a.measured, system) if a.measured else default_run(a.quick, system)
    docs = docs_run(system)
    progress(f"docs' full run: max |sim - measured| {docs['max_abs_diff']}")
    if run["sim_vs_measured"] is not None:
        progress(f"{a.measured}: max |sim - measured| {run['sim_vs_measured']['max_abs_diff']} "
                 f"(system: {run['system_from']})")
    if a.plot:
        make_plot(rows, a.plot, err)
    finish({"bench": "goodput_sim", "quick": a.quick, "table1_max_error": round(err, 2),
            "sim_vs_measured": run.pop("sim_vs_measured"), **run, "docs_full_run": docs,
            "table1_errors": errs, "table": {k: [round(100 * v, 2) for v in vals] for k, vals in rows.items()},
            "chips": list(CHIPS), "published": {str(k): v for k, v in PUBLISHED.items()},
            "failures_per_cell": failures, "seed": a.seed, "calibrated_now": a.calibrate,
            "scale_model": asdict(model), "bench_system": asdict(system),
            "runtime_s": round(time.monotonic() - t0, 2)}, a.out)


if __name__ == "__main__":
    main()
