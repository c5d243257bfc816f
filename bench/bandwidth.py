"""Bandwidth: bytes through the broker per learner (the server's own /connz counters) against
data-parallel ring all-reduce in bf16, for outer-gradient precisions x H, each with its held-out loss.

Every configuration is a fresh run: embedded server, one aggregator (its defaults, as ``diloco up``
runs it: K = every active learner, mean merge, outer Nesterov 0.7/0.5 once per round;
``DILOCO_DOWNLINK_QUANTISER`` int8, i.e. int8 deltas against fp32 keyframes, or fp32 whole
versions; the ``lean`` rows: ``diloco up --preset lean``), M=4 real JAX learners
(defaults: one download per fragment and own sync, rebase on arrival, final sync) of a small model (``SMALL_MODEL``: d_model 64,
2 layers, seq 64, ~0.12M parameters; batch 8) that run ``steps`` inner steps with P=8 staggered
fragments and exit, then ``diloco eval --once``. A learner's traffic is what the server counts for
its connection ``learner-<id>`` in ``/connz`` (``state=all``): ``in_bytes`` (uplink: outer
gradients, heartbeats, metrics, JetStream API and acks) + ``out_bytes`` (downlink: global versions,
head/KV watches, API replies), from start-up (initial download of every fragment) to exit.
Peak: the largest increase over any 1 s window of /connz samples taken every 0.25 s.

Data-parallel: ring all-reduce of bf16 gradients, per worker and step 2 (M-1)/M x N x 2 bytes,
for the same number of steps; its loss is ``bench/dp.py`` (one process, batch M x b, same model,
seed, schedule and steps). Its peak rate is its per-step bytes over the learners' mean step time
(it sends every step).

``reduction_vs_dp`` = DP bytes / learner bytes of the best configuration whose held-out loss is
within 1% of data-parallel's (``loss_gap`` its relative gap); if none is, both are reported for
the configuration with the smallest gap and ``within_1pct`` is false.

    python -m bench.bandwidth --quick --out bandwidth.json
    python -m bench.bandwidth --out bandwidth.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio

from bench.common import finish, parser, progress
from bench.dp import train_dp
from bench.runs import SMALL_MODEL, aggregator_settings, learner_settings, model_config, run_learners
from learner.spec import count_params

M = 4


def configs(quick: bool) -> list[tuple[str, int, str, str]]:
    """(uplink quantiser, H, downlink quantiser, aggregator variant)."""
    if quick:
        return [("int8", 25, "int8", "defaults"), ("topk2", 25, "topk4", "lean")]
    out = [(q, h, "int8", "defaults") for h in (25, 100, 250) for q in ("fp32", "bf16", "int8", "e3m0")]
    out += [("e3m0", 100, "fp32", "defaults")]  # the same with whole fp32 versions on the downlink
    # the lean preset (diloco up --preset lean): sparse 2-bit up, chained sparse 4-bit down, outer SGD
    out += [("topk2", h, "topk4", "lean") for h in (12, 25, 100)]
    return out


async def main_async(quick: bool, steps: int, plot: str | None) -> dict:
    env = dict(SMALL_MODEL, DILOCO_BATCH_SIZE="8", DILOCO_METRICS_INTERVAL="1.0", DILOCO_TOTAL_STEPS=str(steps),
               DILOCO_EVAL_BATCHES="8",
               DILOCO_EVAL_BATCH_SIZE="16")
    n = count_params(model_config(env).spec())
    dp_step_bytes = 2 * (M - 1) / M * n * 2
    progress(f"model {n} params; data-parallel ring all-reduce bf16: {dp_step_bytes:.0f} B per worker and step")
    dp = await asyncio.to_thread(train_dp, env, M, steps, progress)
    progress(f"data-parallel held-out loss {dp['eval_loss']:.4f}")
    rows = []
    for up, H, down, variant in configs(quick):
        label = f"{up}/H{H}/down-{down}/{variant}"
        r = await run_learners(env, M, steps, label=label, sample_connz=True,
                               learner={**learner_settings(variant), "DILOCO_QUANTISER": up, "DILOCO_SYNC_EVERY": str(H)},
                               agg={**aggregator_settings(variant, M), "DILOCO_DOWNLINK_QUANTISER": down})
        ls = list(r["learners"].values())
        steps_done = sum(x["step"] or 0 for x in ls) / len(ls)
        up_b = sum(x["connz_in"] for x in ls) / len(ls)
        down_b = sum(x["connz_out"] for x in ls) / len(ls)
        total = up_b + down_b
        # steady state: bytes after the first inner step (leaves out the start-up download of
        # every fragment in fp32, version 0, and the JetStream/KV set-up), over the remaining steps
        at = [x["connz_at_first_step"] for x in ls]
        steady = (sum(x["connz_in"] + x["connz_out"] - sum(a) for x, a in zip(ls, at) if a) / len(ls)
                  if all(at) else None)
        step_s = sum((x["step_seconds_total"] or 0) / max(x["step"] or 1, 1) for x in ls) / len(ls)
        peak = max(x["peak_Bps"] or 0 for x in ls)
        dp_total = dp_step_bytes * steps_done
        loss = r["eval"]["eval_loss"]
        row = {"uplink": up, "H": H, "downlink": down, "aggregator": variant, "steps": steps_done,
               "bytes_per_learner": round(total), "uplink_bytes": round(up_b), "downlink_bytes": round(down_b),
               "bytes_per_step": round(total / max(steps_done, 1), 1), "dp_bytes": round(dp_total),
               "reduction_vs_dp": round(dp_total / total, 2),
               "steady_bytes": round(steady) if steady else None,
               "steady_reduction_vs_dp": round(dp_step_bytes * (steps_done - 1) / steady, 2) if steady else None,
               "peak_Bps": round(peak), "dp_rate_Bps": round(dp_step_bytes / step_s) if step_s else None,
               "peak_reduction_vs_dp": round(dp_step_bytes / step_s / peak, 2) if step_s and peak else None,
               "versions": sum((r["aggregator"].get("versions") or {}).values()),
               "rejected": r["aggregator"].get("rejected"), "eval_loss": loss,
               "loss_gap": (loss - dp["eval_loss"]) / dp["eval_loss"], "wall_s": r["wall_s"]}
        rows.append(row)
        progress(f"{label}: {total / 1e6:.2f} MB/learner ({up_b / 1e6:.2f} up, {down_b / 1e6:.2f} down), "
                 f"{row['reduction_vs_dp']}x less than DP (steady {row['steady_reduction_vs_dp']}x), peak {peak / 1e6:.2f} MB/s, loss {loss:.4f} "
                 f"gap {row['loss_gap']:+.2%}")
    ok = [r for r in rows if r["loss_gap"] <= 0.01]
    ok_steady = [r for r in ok if r["steady_reduction_vs_dp"]]
    best = max(ok, key=lambda r: r["reduction_vs_dp"]) if ok else min(rows, key=lambda r: r["loss_gap"])
    by_down = {}
    for d in sorted({r["downlink"] for r in rows}):
        cand = [r for r in rows if r["downlink"] == d and r["loss_gap"] <= 0.01]
        b = max(cand, key=lambda r: r["reduction_vs_dp"]) if cand else None
        by_down[d] = {k: b[k] for k in ("uplink", "H", "reduction_vs_dp", "loss_gap")} if b else None
    if plot:
        make_plot(rows, plot)
    return {"M": M, "steps": steps, "params": n, "settings": env, "dp_loss": dp["eval_loss"],
            "dp_bytes_per_step": dp_step_bytes, "rows": rows,
            "best": {k: best[k] for k in ("uplink", "H", "downlink")}, "within_1pct": bool(ok),
            "reduction_vs_dp": best["reduction_vs_dp"], "loss_gap": best["loss_gap"],
            "peak_reduction_vs_dp": best["peak_reduction_vs_dp"], "best_by_downlink": by_down,
            "steady_reduction_vs_dp": max((r["steady_reduction_vs_dp"] for r in ok_steady), default=None)}


def make_plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    marks = {"fp32": "o", "bf16": "s", "int8": "^", "e3m0": "v", "int4": "D", "topk2": "*"}
    for r in rows:
        color = {"fp32": "C0", "int8": "C1", "topk4": "C3"}.get(r["downlink"], "C2")
        ax.scatter(r["reduction_vs_dp"], 100 * r["loss_gap"], marker=marks.get(r["uplink"], "x"), color=color, s=40)
        ax.annotate(f"H{r['H']}", (r["reduction_vs_dp"], 100 * r["loss_gap"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes reduction vs data-parallel bf16 ring all-reduce (x)")
    ax.set_ylabel("held-out loss gap vs data-parallel (%)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], marker=m, ls="", color="k", label=f"uplink {q}") for q, m in marks.items()
               if any(r["uplink"] == q for r in rows)]
    handles += [Line2D([], [], marker="o", ls="", color=c, label=f"downlink {d}")
                for d, c in (("fp32", "C0"), ("int8", "C1"), ("bf16", "C2"), ("topk4", "C3"))
                if any(r["downlink"] == d for r in rows)]
    ax.legend(handles=handles, fontsize=7)
    ax.set_title("Bandwidth vs quality (M=4, small model, /connz bytes)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--plot", default=None, help="write a PNG of reduction vs loss gap")
    a = p.parse_args()
    steps = a.steps or (60 if a.quick else 300)
    r = asyncio.run(main_async(a.quick, steps, a.plot))
    finish({"bench": "bandwidth", "quick": a.quick, **r}, a.out)


if __name__ == "__main__":
    main()
