"""Quality: held-out loss of Decoupled DiLoCo (M=4 learners through the real bus) against data-parallel.

Decoupled: an embedded server, one aggregator (RDA, outer Nesterov 0.7/0.9, fp32 downlink; variant
``quorum`` by default: K = M with the adaptive grace, as ``diloco up`` runs it; ``--variants``
adds the others of ``bench.runs.AGG_VARIANTS``) and M=4 real JAX learner processes (defaults: H=24, P=8 staggered
fragments, int8 outer gradients with error feedback, rebase on arrival, one download per fragment
and round, a final sync at the step budget), each running ``steps`` inner steps of batch b on its
own data shard; then ``diloco eval --once`` on the final global model.
Data-parallel: one process, the same model, the same version-0 parameters (same seed), the same
AdamW settings and schedule, batches of M x b (b from each of the M shards) for the same number
of steps, so both saw the same number of tokens (``bench/dp.py``); the same held-out batches.

``loss_gap`` = (decoupled - data-parallel) / data-parallel held-out loss. Target <= 1%.

    python -m bench.quality --quick --out quality.json     (small model, ~40 s)
    python -m bench.quality --out quality.json             (default model, ~7 min)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio

from bench.common import finish, parser, progress
from bench.dp import train_dp
from bench.runs import AGG_VARIANTS, SMALL_MODEL, aggregator_settings, run_learners


def settings(quick: bool, steps: int) -> dict:
    env = dict(SMALL_MODEL, DILOCO_BATCH_SIZE="8") if quick else {"DILOCO_BATCH_SIZE": "16"}
    env.update({"DILOCO_TOTAL_STEPS": str(steps), "DILOCO_WARMUP_STEPS": str(max(5, min(50, steps // 10))),
                "DILOCO_EVAL_BATCHES": "8", "DILOCO_EVAL_BATCH_SIZE": "16"})
    return env


def reuse(path: str | None, env: dict, M: int, steps: int) -> dict | None:
    """The data-parallel result of an earlier quality JSON with the same settings (it does not
    depend on the bus or the aggregator, and takes the longest), or None."""
    if not path:
        return None
    import orjson

    with open(path, "rb") as f:
        old = orjson.loads(f.read())
    if old.get("settings") == env and old.get("M") == M and old.get("steps") == steps:
        progress(f"data-parallel: reusing {path} (same settings)")
        return {**old["dp"], "reused_from": path}
    progress(f"data-parallel: {path} has other settings, training again")
    return None


async def main_async(quick: bool, steps: int, M: int, reuse_dp: str | None = None,
                     variants: tuple[str, ...] = ("quorum",)) -> dict:
    env = settings(quick, steps)
    runs = {}
    for v in variants:
        progress(f"decoupled ({v}): M={M} learners x {steps} steps, settings {env}")
        dec = await run_learners(env, M, steps, label=f"decoupled {v}", agg=aggregator_settings(v, M))
        progress(f"decoupled ({v}) eval {dec['eval']['eval_loss']:.4f} ({dec['wall_s']} s)")
        agg = dec["aggregator"]
        runs[v] = {"loss": dec["eval"]["eval_loss"], "aggregator": aggregator_settings(v, M),
                   "wall_s": dec["wall_s"], "merges": agg.get("merges"), "rejected": agg.get("rejected"),
                   "staleness_hist": agg.get("staleness_hist"), "versions": agg.get("versions"),
                   "learner_steps": [x["step"] for x in dec["learners"].values()],
                   "learner_bytes_received": [x["bytes_received"] for x in dec["learners"].values()]}
    progress(f"data-parallel: batch {M} x b, {steps} steps")
    dp = reuse(reuse_dp, env, M, steps) or await asyncio.to_thread(train_dp, env, M, steps, progress)
    progress(f"data-parallel eval {dp['eval_loss']:.4f} ({dp['train_seconds']} s)")
    b = dp["eval_loss"]
    for r in runs.values():
        r["loss_gap"] = (r["loss"] - b) / b
    d = runs[variants[0]]["loss"]
    return {"M": M, "steps": steps, "settings": env, "params": dp["params"], "tokens": dp["tokens"],
            "variant": variants[0], "decoupled_loss": d, "dp_loss": b, "loss_gap": (d - b) / b,
            "decoupled": runs, "dp": dp}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--M", type=int, default=4)
    p.add_argument("--reuse-dp", default=None, help="take the data-parallel result from this earlier quality JSON "
                                                     "if its settings are the same")
    p.add_argument("--variants", default="quorum",
                   help="comma-separated aggregator variants, the first gives loss_gap: " + ",".join(AGG_VARIANTS))
    a = p.parse_args()
    steps = a.steps or (80 if a.quick else 300)
    r = asyncio.run(main_async(a.quick, steps, a.M, a.reuse_dp, tuple(a.variants.split(","))))
    finish({"bench": "quality", "quick": a.quick, **r}, a.out)


if __name__ == "__main__":
    main()
