"""A lagging aggregator: held-out loss of M real learners as the aggregator is made N times slower.

Issue 37: a run whose aggregator merges slower than its learners send must cost speed, not the model.
Each row runs the roles as ``bench.quality`` does (an embedded server, one aggregator at its
defaults, trust included, M real JAX learner processes of the small model at 20 tokens per parameter)
with the aggregator's ``DILOCO_AGG_SLOWDOWN`` at N: every intake and merge is followed by a blocking
pause of N - 1 times its own duration, as a slower CPU would be. Baselines, same tokens per learner
step, same seed and held-out batches: data-parallel (batch M x b) and **one learner alone** (batch
b, the same number of steps).

Per row: the held-out loss and its gap to the fast aggregator's (lag 1) and to data-parallel, the
staleness the aggregator saw (histogram maximum, in versions), contributions refused (by reason),
the learners' deferred syncs (the sync window, ``DILOCO_SYNC_WINDOW``) and inner steps per
contribution, the aggregator's busy share, and the wall time. Targets (issue 37): at 2x and 4x within
2% of lag 1; at 10x no worse than one learner alone; bounded staleness and nothing refused as
``too_stale`` at every lag.

    python -m bench.lag --out lag.json                        (lags 1,2,4,10; 2,400 steps; ~15 min)
    python -m bench.lag --lags 1,10 --learner-env DILOCO_SYNC_WINDOW=0   (the window off: the failure)
    python -m bench.lag --quick                               (lags 1 and 10, 160 steps, no baselines)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio

from bench.common import finish, parser, progress
from bench.dp import train_dp
from bench.quality import kv, settings
from bench.runs import run_learners


async def one(env: dict, M: int, steps: int, lag: float, agg_env: dict, learner_env: dict,
              final_wait: str = "10") -> dict:
    agg = {**({"DILOCO_AGG_SLOWDOWN": str(lag)} if lag != 1.0 else {}), **agg_env}
    dec = await run_learners(env, M, steps, label=f"lag {lag:g}x", agg=agg,
                             learner={"DILOCO_FINAL_WAIT": final_wait, **learner_env})
    a = dec["aggregator"]
    hist = a.get("staleness_hist") or {}
    ls = list(dec["learners"].values())
    sent = sum(x.get("contributions") or 0 for x in ls)
    return {"lag": lag, "loss": dec["eval"]["eval_loss"], "wall_s": dec["wall_s"],
            "staleness_max": max((int(k) for k in hist), default=0), "staleness_hist": hist,
            "rejected": a.get("rejected") or {}, "too_stale": (a.get("rejected") or {}).get("too_stale", 0),
            "versions": a.get("versions"), "busy": a.get("busy"),
            "deferred_syncs": [x.get("deferred_syncs") for x in ls],
            "contributions": sent, "steps_per_contribution": round(sum(x["step"] or 0 for x in ls) * len(
                (a.get("versions") or {"0": 0})) / max(1, sent), 2)}


async def main_async(quick: bool, steps: int, M: int, lags: list[float], agg_env: dict, learner_env: dict,
                     baselines: bool) -> dict:
    env = settings(True, steps)
    rows = []
    for lag in lags:
        progress(f"lag {lag:g}x: M={M} x {steps} steps")
        r = await one(env, M, steps, lag, agg_env, learner_env, "3" if quick else "10")
        progress(f"lag {lag:g}x: loss {r['loss']:.4f}, staleness <= {r['staleness_max']}, refused {r['rejected']}, "
                 f"deferred {r['deferred_syncs']}, {r['wall_s']} s")
        rows.append(r)
    out: dict = {"M": M, "steps": steps, "settings": env, "agg_env": agg_env, "learner_env": learner_env,
                 "rows": rows}
    fast = next((r["loss"] for r in rows if r["lag"] == 1.0), None)
    if baselines:
        dp = await asyncio.to_thread(train_dp, env, M, steps, progress)
        # one learner alone at a lone learner's own default rate (Muon's x 1; the M learners' rises with M)
        solo = await asyncio.to_thread(train_dp, env, 1, steps, progress)
        out.update(dp_loss=dp["eval_loss"], solo_loss=solo["eval_loss"])
        progress(f"data-parallel {dp['eval_loss']:.4f}, one learner alone {solo['eval_loss']:.4f}")
    for r in rows:
        if fast is not None:
            r["vs_fast"] = round((r["loss"] - fast) / fast, 4)
        if baselines:
            r["vs_dp"] = round((r["loss"] - out["dp_loss"]) / out["dp_loss"], 4)
            r["vs_solo"] = round((r["loss"] - out["solo_loss"]) / out["solo_loss"], 4)
    out["too_stale"] = sum(r["too_stale"] for r in rows)
    out["staleness_max"] = max(r["staleness_max"] for r in rows)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="inner steps per learner (2400: 20 tokens per parameter)")
    p.add_argument("--M", type=int, default=2)
    p.add_argument("--lags", default=None, help="comma-separated aggregator slowdowns (default 1,2,4,10)")
    p.add_argument("--agg-env", default="", help="extra aggregator settings, K=V,K=V")
    p.add_argument("--learner-env", default="", help="extra learner settings, K=V,K=V")
    p.add_argument("--no-baselines", action="store_true", help="skip data-parallel and one learner alone")
    a = p.parse_args()
    steps = a.steps or (160 if a.quick else 2400)
    lags = [float(x) for x in (a.lags or ("1,10" if a.quick else "1,2,4,10")).split(",") if x.strip()]
    r = asyncio.run(main_async(a.quick, steps, a.M, lags, kv(a.agg_env), kv(a.learner_env),
                               not (a.no_baselines or a.quick)))
    finish({"bench": "lag", "quick": a.quick, **r}, a.out)


if __name__ == "__main__":
    main()
