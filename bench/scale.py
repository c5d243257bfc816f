"""Scale: one aggregator with 16 synthetic learners of a ~50M-parameter model, then the fragments
split over 2 aggregator processes: versions per second, merge latency, peak RSS of every role.

Model d_model 512, 16 layers, d_ff 2048, seq 128 (50.5M parameters, P=8 fragments of ~6.3M);
``--quick`` uses d_model 256, 6 layers (4.9M). Learners: ``DILOCO_COMPUTE=synthetic`` (no JAX:
each step sleeps 0.1 s and moves the real 50M-value fragment vectors), H=24, int8 outer gradients
without error feedback (one model copy less per learner: 16 learners must fit in RAM next to
other jobs), heartbeats every 1 s; a monitor; a quantised downlink (``DILOCO_DOWNLINK_QUANTISER=int8``:
int8 deltas against fp32 keyframes, ``bus.downlink``). Aggregator defaults otherwise (K=1).

Measured over a window of ``window`` seconds once every learner stepped: versions per second
(sum over fragments and aggregators), the aggregators' merge_latency_p50/max (first arrival ->
published, last 200 merges), peak RSS: learners from their metrics (VmHWM), aggregators and the
monitor from /proc/<pid>/status VmHWM. ``skipped_syncs`` show learners whose previous outer
gradient was still being published when the next one was due (the broker or the aggregator was
the bottleneck).

    python -m bench.scale --quick --out scale.json
    python -m bench.scale --out scale.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import time

from bench.common import finish, parser, progress
from bench.runs import Cluster, model_config
from learner.spec import count_params

M = 16
FULL = {"DILOCO_D_MODEL": "512", "DILOCO_N_LAYERS": "16", "DILOCO_N_HEADS": "8", "DILOCO_D_FF": "2048",
        "DILOCO_SEQ_LEN": "128", "DILOCO_NUM_FRAGMENTS": "8"}
QUICK = {"DILOCO_D_MODEL": "256", "DILOCO_N_LAYERS": "6", "DILOCO_N_HEADS": "8", "DILOCO_D_FF": "1024",
         "DILOCO_SEQ_LEN": "128", "DILOCO_NUM_FRAGMENTS": "8"}
LEARNER = {"DILOCO_COMPUTE": "synthetic", "DILOCO_STEP_TIME": "0.1", "DILOCO_SYNC_EVERY": "24",
           "DILOCO_TOTAL_STEPS": "100000000", "DILOCO_WARMUP_STEPS": "0", "DILOCO_QUANTISER": "int8",
           "DILOCO_ERROR_FEEDBACK": "false", "DILOCO_DOWNLINK_QUANTISER": "int8", "DILOCO_MANIFEST_TIMEOUT": "600"}


def mem_available_mib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def run_config(model: dict, aggs: list[str], window: float) -> dict:
    names = [f"learner-{i}" for i in range(M)]
    agg_ids = [f"agg-{i}" for i in range(len(aggs))]
    async with Cluster(f"scale{len(aggs)}", {**model, **LEARNER}, metrics_interval=1.0) as c:
        c.start("monitor", "monitor")
        for a, frags in zip(agg_ids, aggs):
            c.start(a, "aggregator", DILOCO_AGGREGATOR_ID=a, DILOCO_AGG_FRAGMENTS=frags)
        t_start = time.monotonic()
        for n in names:
            c.start(n, "learner", DILOCO_LEARNER_ID=n, DILOCO_NUM_LEARNERS=str(M))
            await asyncio.sleep(0.2)

        def versions() -> int:
            return sum(sum((c.metrics("aggregator", a).get("versions") or {}).values()) for a in agg_ids)

        ok = await c.wait_for(lambda: all((c.metrics("learner", n).get("step") or 0) > 0 for n in names), 600, 0.5)
        if not ok:
            raise RuntimeError("learners did not start:\n" + c.log_tail(names[0]))
        startup = time.monotonic() - t_start
        progress(f"{len(aggs)} aggregator(s): all {M} learners stepping after {startup:.1f} s; "
                 f"MemAvailable {mem_available_mib():.0f} MiB")
        await asyncio.sleep(2.0)
        v0, t0 = versions(), time.monotonic()
        s0 = {n: c.metrics("learner", n).get("step", 0) for n in names}
        while time.monotonic() - t0 < window:
            await asyncio.sleep(5.0)
            progress(f"  versions {versions() - v0} in {time.monotonic() - t0:.0f} s; "
                     f"MemAvailable {mem_available_mib():.0f} MiB")
        await asyncio.sleep(1.1)  # one more metrics message
        v1, t1 = versions(), time.monotonic()
        lm = [c.metrics("learner", n) for n in names]
        am = [c.metrics("aggregator", a) for a in agg_ids]
        out = {
            "aggregators": len(aggs), "fragments": aggs, "startup_s": round(startup, 1),
            "versions_per_s": round((v1 - v0) / (t1 - t0), 3),
            "merge_latency_p50": max((a.get("merge_latency_p50") or 0) for a in am),
            "merge_latency_max": max((a.get("merge_latency_max") or 0) for a in am),
            "per_aggregator": [{"id": a, "merges": m.get("merges"), "merge_latency_p50": m.get("merge_latency_p50"),
                                "merge_latency_max": m.get("merge_latency_max"), "rejected": m.get("rejected"),
                                "peak_rss_mib": c.pid_hwm_mib(a)} for a, m in zip(agg_ids, am)],
            "aggregator_peak_rss_mib": max((c.pid_hwm_mib(a) or 0) for a in agg_ids),
            "monitor_peak_rss_mib": c.pid_hwm_mib("monitor"),
            "learner_peak_rss_mib_max": max((m.get("rss_mib") or 0) for m in lm),
            "learner_peak_rss_mib_mean": round(sum((m.get("rss_mib") or 0) for m in lm) / M, 1),
            "learner_state_mib": lm[0].get("state_mib"),
            "learner_steps_per_s": round(sum(m.get("step", 0) - s0[n] for m, n in zip(lm, names)) / M / (t1 - t0), 3),
            "learner_skipped_syncs": sum(m.get("skipped_syncs") or 0 for m in lm),
            "learner_contributions": sum(m.get("contributions") or 0 for m in lm),
            "learner_bytes_sent_mib": round(sum(m.get("bytes_sent") or 0 for m in lm) / 2**20, 1),
            "learner_bytes_received_mib": round(sum(m.get("bytes_received") or 0 for m in lm) / 2**20, 1),
        }
    progress(f"{len(aggs)} aggregator(s): {out['versions_per_s']} versions/s, merge latency p50 "
             f"{out['merge_latency_p50']} max {out['merge_latency_max']}, RSS agg {out['aggregator_peak_rss_mib']} "
             f"monitor {out['monitor_peak_rss_mib']} learner max {out['learner_peak_rss_mib_max']} MiB")
    return out


async def main_async(quick: bool, window: float) -> dict:
    model = QUICK if quick else FULL
    n = count_params(model_config(model).spec())
    progress(f"model {n / 1e6:.1f}M parameters, {M} synthetic learners; MemAvailable {mem_available_mib():.0f} MiB")
    one = await run_config(model, ["all"], window)
    two = await run_config(model, ["0-3", "4-7"], window)
    return {"M": M, "params": n, "model": model, "learner": LEARNER, "window_s": window,
            "one_aggregator": one, "two_aggregators": two,
            "versions_per_s": {"one": one["versions_per_s"], "two": two["versions_per_s"]},
            "merge_latency_p50": {"one": one["merge_latency_p50"], "two": two["merge_latency_p50"]},
            "merge_latency_max": {"one": one["merge_latency_max"], "two": two["merge_latency_max"]}}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=None)
    a = p.parse_args()
    r = asyncio.run(main_async(a.quick, a.window or (10.0 if a.quick else 60.0)))
    finish({"bench": "scale", "quick": a.quick, **r}, a.out)


if __name__ == "__main__":
    main()
