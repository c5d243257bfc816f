"""Goodput under a seeded failure trace: decoupled vs synchronous DiLoCo vs data-parallel, same trace.

M=8 synthetic-compute learners (``DILOCO_COMPUTE=synthetic``: every inner step sleeps
``STEP_TIME`` in the worker thread and moves real fragment vectors), the real bus, aggregator and
monitor (fast failure detection: heartbeats 0.2 s, suspect 0.6 s, evict 1.0 s). Modes:

* ``decoupled``: ``DILOCO_MODE=async``, K=1 (adaptive grace), H=``H``, staggered fragments;
* ``sync``: synchronous DiLoCo, ``DILOCO_MODE=sync``, quorum K=M (capped by the aggregator at the
  number of *active* learners, so a dead learner is waited for until the monitor marks it
  suspect), H=``H``;
* ``dp``: data-parallel through the same machinery: sync, H=1, K=M;
* ``dp_static`` (full runs): data-parallel *without elasticity*: like ``dp`` but the monitor
  suspects a silent learner only after 30 s, so the survivors wait for the dead learner to be
  repaired and restarted (the paper's data-parallel baseline).

Failure trace (seeded, identical for every mode, times from the start of the measured window):
per learner, up-times drawn from an exponential with mean ``MTBF``; at each failure the learner
process gets SIGKILL, and a new process (new incarnation) is started ``REPAIR`` seconds later.

Accounting (per mode, window of ``T`` seconds that starts once all M learners stepped):
a tap subscribes to the learners' outer-gradient chunks (``diloco.<run>.grad.>``; the first chunk's
header carries ``steps``) and to the aggregator's merge events (``diloco.<run>.events.merge``,
``applied`` = [learner, incarnation, fragment, round]). Every applied contribution of fragment p
credits ``steps x STEP_TIME / P`` seconds (a step advances every fragment; each fragment's share of
it counts once that fragment's outer gradient is in a global version). Goodput = credited seconds
of contributions merged inside the window / (M x T). Dead time (repair, process start, rejoin),
waiting (sync barriers, stalls until a dead learner is suspected), killed unsent work and rejected
or never-merged contributions earn nothing. Edge effects: contributions merged early in the window
carry steps from before it, work of the last round is merged after it; both are < H x STEP_TIME
per learner and roughly cancel.

Timings (``timings`` per mode; bench/goodput_timings.py): the tap also hears heartbeats and the
monitor's membership events, and notes the wall time of every kill, restart, first chunk and
merge; from those, per mode: restart -> first heartbeat (``startup_s``) and -> admission
(``admit_s``), kill -> suspect (``suspect_s``) and -> the survivors' release (``release_s``), and
the failure-free round overhead. They are what ``bench.goodput_sim --measured`` runs the model on;
``--events FILE`` writes the raw records.

``goodput`` = {decoupled, sync, dp}. Target: decoupled >= 0.88 where dp is ~0.27.

    python -m bench.goodput --quick --out goodput.json
    python -m bench.goodput --out goodput.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import random
import time

import orjson

from bench.common import finish, parser, progress
from bench.goodput_timings import mode_timings, round_overhead_samples
from bench.runs import FAST_MONITOR, Cluster

M = 8
STEP_TIME = 0.2
H = 10
P = 2
MODEL = {"DILOCO_D_MODEL": "64", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "4", "DILOCO_D_FF": "256",
         "DILOCO_SEQ_LEN": "64", "DILOCO_NUM_FRAGMENTS": str(P)}
LEARNER = {"DILOCO_COMPUTE": "synthetic", "DILOCO_STEP_TIME": str(STEP_TIME), "DILOCO_TOTAL_STEPS": "100000000",
           "DILOCO_WARMUP_STEPS": "0", "DILOCO_QUANTISER": "int8", "DILOCO_SYNC_TIMEOUT": "60"}

MODES = {
    "decoupled": ({"DILOCO_MODE": "async", "DILOCO_SYNC_EVERY": str(H)}, {"DILOCO_QUORUM": "1"}, {}),
    "sync": ({"DILOCO_MODE": "sync", "DILOCO_SYNC_EVERY": str(H)}, {"DILOCO_QUORUM": str(M)}, {}),
    "dp": ({"DILOCO_MODE": "sync", "DILOCO_SYNC_EVERY": "1"}, {"DILOCO_QUORUM": str(M)}, {}),
    "dp_static": ({"DILOCO_MODE": "sync", "DILOCO_SYNC_EVERY": "1"}, {"DILOCO_QUORUM": str(M)},
                  {"DILOCO_SUSPECT_AFTER": "30", "DILOCO_EVICT_AFTER": "60"}),
}


def failure_trace(seed: int, T: float, mtbf: float, repair: float) -> list[tuple[float, str, int]]:
    """Sorted (time, 'kill'|'start', learner index) events within [0, T)."""
    rng = random.Random(seed)
    ev = []
    for i in range(M):
        t = 0.0
        while True:
            t += rng.expovariate(1.0 / mtbf)
            if t >= T:
                break
            ev.append((t, "kill", i))
            t += repair
            if t < T:
                ev.append((t, "start", i))
    return sorted(ev)


async def run_mode(mode: str, trace, T: float, events: dict | None = None, warm_rounds: int = 0) -> dict:
    """One mode's run: the learners start, then (lock-step modes, ``warm_rounds``) the run trains
    until it has that many failure-free round-overhead samples (at most 120 s), then the trace's
    kills and starts at its times from there (t0), for ``T`` seconds. The warm rounds make the
    sample count independent of the machine's speed: in a fixed first second a loaded machine had
    3-4 rounds where an idle one had 5 or more."""
    lenv, aenv, menv = MODES[mode]
    round_s = int(lenv["DILOCO_SYNC_EVERY"]) * STEP_TIME
    lockstep = lenv["DILOCO_MODE"] == "sync"
    run = f"gp{mode.replace('_', '')}"
    shared = {**MODEL, **FAST_MONITOR, **LEARNER, **lenv}
    names = [f"learner-{i}" for i in range(M)]
    steps_of: dict[tuple, int] = {}  # (learner, inc, frag, round) -> inner steps
    arrived: dict[tuple, float] = {}  # (learner, inc, frag, round) -> wall time its first chunk reached the tap
    merges: list[tuple[float, list]] = []  # (monotonic receive time, applied keys)
    merge_log: list[tuple[float, int, list]] = []  # (aggregator's wall time, fragment, applied keys)
    inc_steps: dict[tuple[str, str], int] = {}  # (learner, incarnation) -> newest step
    first_hb: dict[tuple[str, str], float] = {}  # (learner, incarnation) -> wall time of its first heartbeat
    hb_step0: dict[tuple[str, str], int] = {}  # (learner, incarnation) -> the step its first heartbeat said
    first_step: dict[tuple[str, str], float] = {}  # (learner, incarnation) -> first heartbeat with a new step
    latest_inc: dict[str, str] = {}  # learner -> incarnation of its newest heartbeat
    transitions: list[tuple[float, str, str | None, str]] = []  # membership events (at, learner, old, new)
    async with Cluster(run, shared, metrics_interval=0.5) as c:
        async def on_grad(m):
            try:
                h = orjson.loads(m.headers["Diloco-Chunk"])
                if h["i"] == 0:
                    meta = h["m"]
                    key = (meta["learner"], meta["inc"], meta["frag"], meta["round"])
                    steps_of[key] = meta["steps"]
                    arrived.setdefault(key, time.time())
            except Exception:
                pass

        async def on_merge(m):
            try:
                d = orjson.loads(m.data)
                merges.append((time.monotonic(), d["applied"]))
                merge_log.append((float(d["ts"]), int(d["fragment"]), d["applied"]))
            except Exception:
                pass

        async def on_metrics(m):
            try:
                d = orjson.loads(m.data)
                k = (d["learner"], d["incarnation"])
                inc_steps[k] = max(inc_steps.get(k, 0), int(d["step"]))
            except Exception:
                pass

        async def on_heartbeat(m):
            try:
                d = orjson.loads(m.data)
                k, now = (d["learner"], d["incarnation"]), time.time()
                first_hb.setdefault(k, now)
                if hb_step0.setdefault(k, int(d["step"])) != int(d["step"]):
                    first_step.setdefault(k, now)
                latest_inc[d["learner"]] = d["incarnation"]
            except Exception:
                pass

        async def on_membership(m):
            try:
                d = orjson.loads(m.data)
                transitions.append((float(d["at"]), d["learner"], d["old"], d["new"]))
            except Exception:
                pass

        await c.nc.subscribe(c.s.grad_all, cb=on_grad, pending_bytes_limit=512 * 1024 * 1024)
        await c.nc.subscribe(c.s.event("merge"), cb=on_merge)
        await c.nc.subscribe(f"{c.s.prefix}.metrics.learner.*", cb=on_metrics)
        await c.nc.subscribe(c.s.heartbeat_all, cb=on_heartbeat)
        await c.nc.subscribe(c.s.event("membership"), cb=on_membership)
        c.start("monitor", "monitor", **menv)
        c.start("aggregator", "aggregator", **aenv)
        for n in names:
            c.start(n, "learner", DILOCO_LEARNER_ID=n, DILOCO_NUM_LEARNERS=str(M))
        ok = await c.wait_for(lambda: all((c.metrics("learner", n).get("step") or 0) > 0 for n in names), 120)
        if not ok:
            raise RuntimeError(f"{mode}: learners did not start: " + c.log_tail(names[0]))
        if lockstep and warm_rounds > 0:
            await c.wait_for(lambda: len(round_overhead_samples(merge_log, M, round_s)) >= warm_rounds, 120)
        t0 = time.monotonic()
        at_t0 = dict(inc_steps)
        kills = restarts = 0
        kill_log: list[tuple[float, str, str | None]] = []  # (wall time, learner, its incarnation)
        start_log: list[tuple[float, str]] = []
        for t, what, i in trace:
            delay = t0 + t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            n = names[i]
            if what == "kill":
                c.kill(n)
                kill_log.append((time.time(), n, latest_inc.get(n)))
                kills += 1
            else:
                start_log.append((time.time(), n))
                c.start(n, "learner", DILOCO_LEARNER_ID=n, DILOCO_NUM_LEARNERS=str(M))
                restarts += 1
        rest = t0 + T - time.monotonic()
        while rest > 0:
            await asyncio.sleep(min(rest, 5.0))
            rest = t0 + T - time.monotonic()
        t1 = time.monotonic()
        agg = c.metrics("aggregator", "agg-0")
        mon = c.metrics("monitor", next((i for (r, i) in c.latest if r == "monitor"), ""))
        conn = c.connz()  # the server's byte counters per connection, closed ones (killed learners) too
    credited = 0.0
    applied_n = unknown = 0
    for ts, applied in merges:
        if not t0 <= ts <= t1:
            continue
        for key in applied:
            k = tuple(key)
            s = steps_of.get(k)
            if s is None:
                unknown += 1
                continue
            applied_n += 1
            credited += s * STEP_TIME / P
    computed = sum(s - at_t0.get(k, 0) for k, s in inc_steps.items()) * STEP_TIME
    alloc = M * (t1 - t0)
    sent = sum(1 for _ in steps_of)
    out = {"mode": mode, "window_s": round(t1 - t0, 2), "kills": kills, "restarts": restarts,
           "goodput": round(credited / alloc, 4), "compute_share": round(computed / alloc, 4),
           "credited_s": round(credited, 2), "computed_s": round(computed, 2), "allocated_s": round(alloc, 2),
           "applied_contributions": applied_n, "unmatched_applied": unknown, "contributions_seen": sent,
           "merges": agg.get("merges"), "rejected": agg.get("rejected"), "monitor_counts": mon.get("counts"),
           # the whole run's bytes through the learners' and the aggregator's links (in + out, as the server
           # counted them) and every contribution merged in it, window or not (bench.peers divides the two)
           "learner_link_bytes": sum(i + o for n, (i, o) in conn.items() if n.startswith("learner-")),
           "aggregator_link_bytes": sum(i + o for n, (i, o) in conn.items() if n.startswith("aggregator")),
           "applied_all": sum(len(a) for _, _, a in merge_log),
           "timings": mode_timings(M=M, round_s=round_s, lockstep=lockstep, starts=start_log, kills=kill_log,
                                   first_hb=first_hb, transitions=transitions, merges=merge_log, arrivals=arrived,
                                   first_step=first_step, step_s=STEP_TIME,
                                   heartbeat_s=float(FAST_MONITOR["DILOCO_HEARTBEAT_INTERVAL"]))}
    if events is not None:  # the tap's raw records, for recomputing the timings offline
        events[mode] = {"starts": start_log, "kills": kill_log, "transitions": transitions, "merges": merge_log,
                        "first_hb": [[*k, v] for k, v in first_hb.items()],
                        "first_step": [[*k, v] for k, v in first_step.items()],
                        "arrivals": [[*k, v] for k, v in arrived.items()]}
    progress(f"{mode}: goodput {out['goodput']:.3f} (stepping {out['compute_share']:.3f} of allocated time), "
             f"{kills} kills, {applied_n} applied contributions, rejected {agg.get('rejected')}; timings "
             + ", ".join(f"{k} {v['median']} (n={v['n']})" for k, v in out["timings"].items()))
    return out


async def main_async(quick: bool, T: float, mtbf: float, repair: float, seed: int, modes: list[str],
                     events: dict | None = None) -> dict:
    trace = failure_trace(seed, T, mtbf, repair)
    progress(f"trace: {sum(1 for e in trace if e[1] == 'kill')} failures in {T} s over {M} learners "
             f"(MTBF {mtbf} s per learner, repair {repair} s, seed {seed})")
    rows = {}
    for mode in modes:
        rows[mode] = await run_mode(mode, trace, T, events)
    return {"M": M, "step_time": STEP_TIME, "H": H, "P": P, "window_s": T, "mtbf_s": mtbf, "repair_s": repair,
            "seed": seed, "failures": sum(1 for e in trace if e[1] == "kill"), "trace": trace,
            "modes": rows, "goodput": {m: rows[m]["goodput"] for m in rows}}


def make_plot(r: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(r["modes"])
    fig, ax = plt.subplots(figsize=(5.6, 3.4))
    x = range(len(modes))
    ax.bar([i - 0.2 for i in x], [r["modes"][m]["compute_share"] for m in modes], 0.4, label="stepping", color="C7")
    ax.bar([i + 0.2 for i in x], [r["modes"][m]["goodput"] for m in modes], 0.4, label="goodput", color="C0")
    for i, m in enumerate(modes):
        ax.text(i + 0.2, r["modes"][m]["goodput"] + 0.02, f"{r['modes'][m]['goodput']:.2f}", ha="center", fontsize=8)
    ax.set_xticks(list(x), modes)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("share of allocated learner time")
    ax.set_title(f"M={r['M']}, {r['failures']} kill -9 in {r['window_s']:.0f} s (MTBF {r['mtbf_s']} s, "
                 f"repair {r['repair_s']} s)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=None, help="measured seconds per mode")
    p.add_argument("--mtbf", type=float, default=None, help="mean up-time of a learner, seconds")
    p.add_argument("--repair", type=float, default=3.0, help="seconds before a killed learner is restarted")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--modes", default=None, help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--plot", default=None)
    p.add_argument("--events", default=None, help="write the tap's raw records per mode (JSON) to this file")
    a = p.parse_args()
    T = a.window or (12.0 if a.quick else 100.0)
    mtbf = a.mtbf or 20.0
    modes = a.modes.split(",") if a.modes else (["decoupled", "sync", "dp"] if a.quick else list(MODES))
    events: dict | None = {} if a.events else None
    r = asyncio.run(main_async(a.quick, T, mtbf, a.repair, a.seed, modes, events))
    if a.events:
        with open(a.events, "wb") as f:
            f.write(orjson.dumps(events))
    if a.plot:
        make_plot(r, a.plot)
    finish({"bench": "goodput", "quick": a.quick, **r}, a.out)


if __name__ == "__main__":
    main()
