"""Heterogeneous learners: one of four learners 2x slower (DILOCO_SLOWDOWN=2) against an all-fast run.

Two measurements, each as a pair of runs (all fast, then one slow) on fresh embedded servers with
one aggregator (defaults: K=1, adaptive grace) and M=4 learners:

1. **Throughput** (synthetic compute, so that the step time is a fixed sleep and not a share of
   two CPU cores that four JAX processes fight over): every learner steps for a window of
   ``window`` seconds; the fast learners' step rate is (step at the end - step at the start of the
   window) / window, from their metrics. ``fast_throughput_ratio`` = mean fast-learner rate with
   the slow learner / mean rate of the same learners in the all-fast run. Target >= 0.95.
2. **Quality** (the JAX ``SMALL_MODEL``): every learner runs the same number of inner steps (same
   tokens; the slow one simply takes twice as long); ``loss_gap`` = relative held-out loss of the
   heterogeneous run's final global model against the all-fast run's. The fast learners' step
   rate in these runs is reported too (``jax_fast_throughput_ratio``), but there the slow learner's
   sleeping frees CPU for the others, so it overstates.
3. **Dynamic Local Updates** (full runs, or ``--dynamic-h``): the one-slow JAX run twice more,
   with a monitor (DILOCO_DYNAMIC_H reads the learners' paces from the members bucket), with
   ``DILOCO_DYNAMIC_H=false`` and ``true`` (the default since the eighteenth round): the slow learner
   then syncs every ~H/2 steps. Held-out
   loss, merges and the slow learner's period (key ``dynamic_h``).

    python -m bench.hetero --quick --out hetero.json
    python -m bench.hetero --out hetero.json
    python -m bench.hetero --quick --steps 1163 --participation-window 5    (20 tokens per parameter;
        the slow learner alone past the window, as in any run of real length)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import time

from bench.common import finish, parser, progress
from bench.runs import SMALL_MODEL, Cluster, run_learners

M = 4
SLOW = 3  # learner-3 is the slow one
SYNTH = {"DILOCO_COMPUTE": "synthetic", "DILOCO_STEP_TIME": "0.1", "DILOCO_SYNC_EVERY": "10",
         "DILOCO_TOTAL_STEPS": "100000000", "DILOCO_WARMUP_STEPS": "0", "DILOCO_QUANTISER": "int8"}


async def throughput_run(slowdown: float, window: float) -> dict:
    names = [f"learner-{i}" for i in range(M)]
    async with Cluster(f"het{int(slowdown)}", {**SMALL_MODEL, **SYNTH}, metrics_interval=0.25) as c:
        c.start("aggregator", "aggregator", DILOCO_REQUIRE_MEMBERSHIP="false")
        for i, n in enumerate(names):
            c.start(n, "learner", DILOCO_LEARNER_ID=n, DILOCO_NUM_LEARNERS=str(M),
                    DILOCO_SLOWDOWN=str(slowdown if i == SLOW else 1.0))
        await c.wait_for(lambda: all((c.metrics("learner", n).get("step") or 0) >= 5 for n in names), 60)
        s0 = {n: c.metrics("learner", n)["step"] for n in names}
        t0 = time.monotonic()
        await asyncio.sleep(window)
        s1 = {n: c.metrics("learner", n)["step"] for n in names}
        dt = time.monotonic() - t0
        agg = c.metrics("aggregator", "agg-0")
    rates = {n: (s1[n] - s0[n]) / dt for n in names}
    progress(f"synthetic, slowdown {slowdown}: steps/s {rates}, merges {agg.get('merges')}")
    return {"rates": rates, "merges": agg.get("merges"), "staleness_hist": agg.get("staleness_hist"),
            "rejected": agg.get("rejected"), "contributions": agg.get("contributions")}


def fast_rate(learners: dict) -> float:
    """Mean steps/s of the fast learners over their own training time (first step -> exit)."""
    r = []
    for i, (n, x) in enumerate(sorted(learners.items())):
        if i != SLOW and x.get("step_seconds_total"):
            r.append(x["step"] / x["step_seconds_total"])
    return sum(r) / len(r)


async def dynamic_h_pair(env: dict, steps: int, agg: dict | None = None) -> dict:
    slow = {SLOW: {"DILOCO_SLOWDOWN": "2"}}
    runs = {}
    for key, learner in (("without", {"DILOCO_DYNAMIC_H": "false"}), ("with", {"DILOCO_DYNAMIC_H": "true"})):
        q = await run_learners(env, M, steps, label=f"jax one-slow, monitor, dynamic_h {key}", per_learner=slow,
                               monitor=True, learner=learner, agg=agg)
        a = q["aggregator"]
        runs[key] = {"loss": q["eval"]["eval_loss"], "wall_s": q["wall_s"], "merges": a.get("merges"),
                     "staleness_hist": a.get("staleness_hist"), "rejected": a.get("rejected"),
                     "contributions": a.get("contributions"),
                     "slow_period": q["learners"][f"learner-{SLOW}"]["period"],
                     "fast_periods": [q["learners"][f"learner-{i}"]["period"] for i in range(M) if i != SLOW]}
        progress(f"dynamic_h {key}: loss {runs[key]['loss']:.4f}, merges {runs[key]['merges']}, "
                 f"slow period {runs[key]['slow_period']}")
    runs["loss_change"] = (runs["with"]["loss"] - runs["without"]["loss"]) / runs["without"]["loss"]
    return runs


async def main_async(quick: bool, window: float, steps: int, dynamic_h: bool = False,
                     participation_window: float | None = None) -> dict:
    fast = await throughput_run(1.0, window)
    het = await throughput_run(2.0, window)
    fast_names = [f"learner-{i}" for i in range(M) if i != SLOW]
    ratio = sum(het["rates"][n] for n in fast_names) / sum(fast["rates"][n] for n in fast_names)
    slow_ratio = het["rates"][f"learner-{SLOW}"] / fast["rates"][f"learner-{SLOW}"]
    progress(f"fast_throughput_ratio {ratio:.3f} (slow learner at {slow_ratio:.2f} of its all-fast rate)")
    env = dict(SMALL_MODEL, DILOCO_BATCH_SIZE="8", DILOCO_TOTAL_STEPS=str(steps),
               DILOCO_EVAL_BATCHES="8",
               DILOCO_EVAL_BATCH_SIZE="16")
    # a window shorter than the slow learner's time alone stands for a run of real length (its steps
    # take seconds, and it trains alone for hours after the fast ones finished)
    agg = {} if participation_window is None else {"DILOCO_PARTICIPATION_WINDOW": str(participation_window)}
    q_fast = await run_learners(env, M, steps, label="jax all-fast", agg=agg)
    q_het = await run_learners(env, M, steps, label="jax one-slow", per_learner={SLOW: {"DILOCO_SLOWDOWN": "2"}},
                               agg=agg)
    lf, lh = q_fast["eval"]["eval_loss"], q_het["eval"]["eval_loss"]
    progress(f"held-out loss all-fast {lf:.4f}, one slow {lh:.4f}")
    # wall-clock step rate of the fast learners in the JAX runs (CPU shared: see module docstring)
    jr = []
    for q in (q_fast, q_het):
        ls = q["learners"]
        jr.append(sum(ls[n]["step"] / max(q["wall_s"], 1e-9) for n in fast_names))
    dyn = await dynamic_h_pair(env, steps, agg) if dynamic_h else None
    return {"M": M, "slowdown": 2.0, "window_s": window, "synthetic_step_time": float(SYNTH["DILOCO_STEP_TIME"]),
            "fast_throughput_ratio": round(ratio, 4), "slow_learner_rate_ratio": round(slow_ratio, 4),
            "synthetic": {"all_fast": fast, "one_slow": het},
            "jax_steps": steps, "settings": env, "participation_window": participation_window,
            "loss_all_fast": lf, "loss_one_slow": lh,
            "loss_gap": (lh - lf) / lf,
            "jax_fast_step_rate_ratio": round(fast_rate(q_het["learners"]) / fast_rate(q_fast["learners"]), 4),
            "jax_wall_s": {"all_fast": q_fast["wall_s"], "one_slow": q_het["wall_s"]},
            "jax_merges": {"all_fast": q_fast["aggregator"].get("merges"),
                           "one_slow": q_het["aggregator"].get("merges")},
            "jax_staleness_hist": {"all_fast": q_fast["aggregator"].get("staleness_hist"),
                                   "one_slow": q_het["aggregator"].get("staleness_hist")},
            "jax_rejected": {"all_fast": q_fast["aggregator"].get("rejected"),
                             "one_slow": q_het["aggregator"].get("rejected")},
            "dynamic_h": dyn}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--dynamic-h", action="store_true", help="also the Dynamic Local Updates pair (always in full runs)")
    p.add_argument("--participation-window", type=float, default=None,
                   help="the aggregator's DILOCO_PARTICIPATION_WINDOW in the JAX pair (default: its own, 30 s)")
    a = p.parse_args()
    r = asyncio.run(main_async(a.quick, a.window or (3.0 if a.quick else 60.0), a.steps or (40 if a.quick else 400),
                               dynamic_h=a.dynamic_h or not a.quick, participation_window=a.participation_window))
    finish({"bench": "hetero", "quick": a.quick, **r}, a.out)


if __name__ == "__main__":
    main()
