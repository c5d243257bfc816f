"""Regions over emulated WAN links: does the inner loop ever wait for the network?

Each region is a network namespace with its own leaf ``nats-server`` and learners, linked to the
hub namespace (hub server with JetStream, aggregator, monitor) by a veth pair limited with
``tc tbf`` and a relay that adds the one-way delay (:mod:`bench.netns`, :mod:`bench.wan_cluster`).
Learners: ``DILOCO_COMPUTE=synthetic`` (every inner step sleeps ``STEP_TIME`` and moves the real
fragment vectors: what is measured is whether publishing and receiving ever hold up the step loop,
not this machine's two shared cores), int8 outer gradients, the ``diloco up`` defaults otherwise
(quorum K = M with the adaptive grace window, int8 downlink deltas), and its auth: the run's account
and one user per role and learner on the hub and every leaf (``--no-auth``: anonymous).

Scenarios, each in its own set of namespaces with its own servers, all four run side by side (so
that the machine's noise falls on each alike), measured over ``window`` seconds once every
learner stepped (steps/s from the learners' own metrics timestamps, so a thin link that delays
their metrics does not bend the figure):

* ``loopback``: the same namespaces, servers and relays with no limit and no delay (the reference);
* ``wan``: every region on ``RATE`` Mbit/s and ``RTT`` ms;
* ``thin``: as ``wan``, but region 0 on ``THIN_RATE`` Mbit/s;
* ``partition``: as ``wan``; region 0 is cut off for ``CUT`` seconds and healed. Reported: when the
  monitor evicted and readmitted its learners, whether they contributed to a merge after the heal,
  and the other regions' steps/s during the cut against before it.

Keys:

* ``wan_throughput_ratio``: mean learner steps/s of ``wan`` over ``loopback`` (goal >= 0.95), and
  ``thin_throughput_ratio`` (the thin region's learners, ``thin`` over ``loopback``);
* ``dp_comm_over_step``: seconds a data-parallel ring all-reduce of the same model's fp32 gradients
  would need per step on the same links (``2 (M-1)/M x 4 x params`` bytes over the slowest link, plus
  ``2 (M-1)`` one-way delays), over the learners' step time; computed for ``wan`` and ``thin``;
* ``bytes_per_learner``: what the broker counted for each learner connection (leaf ``/connz``,
  in + out) per learner-second, and the link's own bytes (``tc -s``) per region;
* ``partition``: ``evicted_after_s``, ``readmitted_after_heal_s``, ``contributed_after_heal``,
  ``others_steps_ratio`` (during the cut over before it).

Needs root and network namespaces (``bench.netns.unavailable()`` says why not, and the benchmark
exits 2 with that line).

    python -m bench.wan --quick --out wan.json
    python -m bench.wan --out wan.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import orjson

from bench.common import finish, parser, progress
from bench.netns import Link, WanNet, unavailable
from bench.runs import FAST_MONITOR, model_config
from bench.wan_cluster import WanCluster, run_in_hub
from learner.spec import count_params

STEP_TIME = 0.1
H = 20
P = 4
RATE, RTT, THIN_RATE, CUT = 20.0, 100.0, 2.0, 30.0
#: ~0.4M parameters: a round of int8 outer gradients is ~0.4 MB per learner, so a 2 Mbit/s link
#: (0.25 MB/s) carries one round every ~3 s up and down, against one round every H x STEP_TIME = 2 s.
MODEL = {"DILOCO_D_MODEL": "128", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "4", "DILOCO_D_FF": "512",
         "DILOCO_SEQ_LEN": "64", "DILOCO_NUM_FRAGMENTS": str(P)}
LEARNER = {"DILOCO_COMPUTE": "synthetic", "DILOCO_STEP_TIME": str(STEP_TIME), "DILOCO_TOTAL_STEPS": "100000000",
           "DILOCO_WARMUP_STEPS": "0", "DILOCO_QUANTISER": "int8", "DILOCO_SYNC_EVERY": str(H),
           "DILOCO_MODE": "async", "DILOCO_SYNC_TIMEOUT": "60"}
AGG = {"DILOCO_DOWNLINK_QUANTISER": "int8"}  # as diloco up runs it


def dp_comm_seconds(params: int, M: int, rate_mbit: float, one_way_ms: float, bytes_per_value: int = 4) -> float:
    """Time of one ring all-reduce of ``params`` values over M regions joined by links of
    ``rate_mbit`` and ``one_way_ms``: each region sends and receives ``2 (M-1)/M`` of the gradient
    in ``2 (M-1)`` steps, each paying the one-way delay (bandwidth-optimal ring; Patarasuk & Yuan)."""
    if M < 2:
        return 0.0
    volume = 2 * (M - 1) / M * params * bytes_per_value
    return volume * 8 / (rate_mbit * 1e6) + 2 * (M - 1) * one_way_ms / 1000


def steps_per_s(series: list[tuple[float, int]], t0: float, t1: float) -> float | None:
    """Steps per second of one learner between ``t0`` and ``t1`` from its (time, step) samples."""
    inside = [(t, s) for t, s in series if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


async def scenario(name: str, net: WanNet, per_region: int, window: float, cut: float | None = None,
                   auth: bool = True) -> dict:
    regions = net.regions
    names = {f"{r}-{j}": r for r in regions for j in range(per_region)}
    M = len(names)
    steps: dict[str, list[tuple[float, int]]] = {n: [] for n in names}
    membership: list[tuple[float, dict]] = []
    merges: list[tuple[float, list]] = []
    env = {**MODEL, **FAST_MONITOR, **LEARNER, "DILOCO_SUSPECT_AFTER": "2.0", "DILOCO_EVICT_AFTER": "4.0"}
    async with WanCluster(net, f"wan{name}", env, metrics_interval=0.25, learners=list(names.items()),
                          auth=auth) as c:
        async def on_metrics(m):
            try:
                d = orjson.loads(m.data)
                if d.get("learner") in steps:
                    steps[d["learner"]].append((float(d["ts"]), int(d["step"])))  # the learner's clock
            except Exception:
                pass

        async def on_member(m):
            try:
                membership.append((time.time(), orjson.loads(m.data)))
            except Exception:
                pass

        async def on_merge(m):
            try:
                merges.append((time.time(), orjson.loads(m.data)["applied"]))
            except Exception:
                pass

        await c.nc.subscribe(f"{c.s.prefix}.metrics.learner.*", cb=on_metrics)
        await c.nc.subscribe(c.s.event("membership"), cb=on_member)
        await c.nc.subscribe(c.s.event("merge"), cb=on_merge)
        c.start("monitor", "monitor")
        c.start("aggregator", "aggregator", DILOCO_QUORUM=str(M), **AGG)
        for n, r in names.items():
            c.start(n, "learner", region=r, DILOCO_LEARNER_ID=n, DILOCO_NUM_LEARNERS=str(M), DILOCO_REGION=r)
        if not await c.wait_for(lambda: all(s and s[-1][1] > 0 for s in steps.values()), 120):
            raise RuntimeError(f"{name}: learners did not start: " + c.log_tail(next(iter(names))))
        await asyncio.sleep(2 * H * STEP_TIME)  # the first rounds: every learner has published once
        c0 = c.connz()
        q0 = [net.qdisc_stats(i) for i in range(len(regions))]
        t0 = time.time()
        out: dict = {"scenario": name, "M": M, "links": [vars(lk) for lk in net.links]}
        if cut is None:
            await asyncio.sleep(window)
            t1 = time.time()
        else:
            before = window / 2
            await asyncio.sleep(before)
            t_cut = time.time()
            net.partition(0)
            progress(f"{name}: region {regions[0]} cut off for {cut:.0f} s")
            await asyncio.sleep(cut)
            net.heal(0)
            t_heal = time.time()
            progress(f"{name}: region {regions[0]} healed")
            cut_names = [n for n, r in names.items() if r == regions[0]]
            ok = await c.wait_for(lambda: all(any(t > t_heal and n in {k[0] for k in applied}
                                                  for t, applied in merges) for n in cut_names), 90)
            t_back = time.time()
            await asyncio.sleep(max(0.0, window / 2 - (t_back - t_heal)))
            t1 = time.time()
            others = [n for n, r in names.items() if r != regions[0]]

            def first(kind: str, after: float) -> float | None:
                ts = [t for t, e in membership if t >= after and e.get("learner") in cut_names and e.get("new") == kind]
                return round(min(ts) - after, 2) if ts else None

            rate_before = [steps_per_s(steps[n], t0, t_cut) for n in others]
            rate_during = [steps_per_s(steps[n], t_cut, t_heal) for n in others]
            ratios = [d / b for b, d in zip(rate_before, rate_during) if b and d is not None]
            out["partition"] = {
                "cut_s": round(t_heal - t_cut, 1), "evicted_after_s": first("evicted", t_cut),
                "readmitted_after_heal_s": (first("rejoining", t_heal) if first("rejoining", t_heal) is not None
                                            else first("active", t_heal)),
                "contributed_after_heal": ok, "contributed_after_heal_s": round(t_back - t_heal, 2) if ok else None,
                "others_steps_ratio": round(min(ratios), 4) if ratios else None,
                "transitions": [{"t": round(t - t_cut, 2), **{k: e.get(k) for k in ("learner", "old", "new", "reason")}}
                                for t, e in membership if t >= t0],
            }
        c1 = c.connz()
        q1 = [net.qdisc_stats(i) for i in range(len(regions))]
        agg = c.metrics("aggregator", "agg-0")
        lm = {n: c.metrics("learner", n) for n in names}
        out["permission_violations"] = sum(c.permission_violations().values())
    span = t1 - t0
    out["window_s"] = round(span, 2)
    out["steps_per_s"] = {n: round(v, 3) if (v := steps_per_s(steps[n], t0, t1)) is not None else None for n in names}
    out["bytes_per_learner_s"] = {}
    for n in names:
        i0, o0 = c0.get(f"learner-{n}", (0, 0))
        i1, o1 = c1.get(f"learner-{n}", (0, 0))
        out["bytes_per_learner_s"][n] = {"up": round((i1 - i0) / span), "down": round((o1 - o0) / span)}
    out["link_bytes_per_s"] = {r: {d: round((q1[i][d].get("bytes", 0) - q0[i][d].get("bytes", 0)) / span)
                                   for d in ("up", "down")} for i, r in enumerate(regions)}
    out["link_drops"] = {r: {d: q1[i][d].get("dropped", 0) for d in ("up", "down")} for i, r in enumerate(regions)}
    out["contributions"] = {n: lm[n].get("contributions") for n in names}
    out["skipped_syncs"] = {n: lm[n].get("skipped_syncs") for n in names}
    out["staleness"] = {n: lm[n].get("staleness") for n in names}
    out["merges"] = agg.get("merges")
    out["rejected"] = agg.get("rejected")
    progress(f"{name}: steps/s {out['steps_per_s']} up/down B/s {out['bytes_per_learner_s']} merges {out['merges']}")
    return out


def run_scenario(name: str, regions: list[str], links: list[Link], per_region: int, window: float,
                 cut: float | None = None, auth: bool = True) -> dict:
    with WanNet(regions, links) as net:
        return run_in_hub(net, scenario, name, net, per_region, window, cut, auth)


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--regions", type=int, default=None, help="regions (default 2 quick, 3 full)")
    p.add_argument("--per-region", type=int, default=1, help="learners per region")
    p.add_argument("--window", type=float, default=None, help="measured seconds per scenario (default 10 quick, 40 full)")
    p.add_argument("--cut", type=float, default=None, help=f"partition length, s (default 8 quick, {CUT:.0f} full)")
    p.add_argument("--scenarios", default="loopback,wan,thin,partition")
    p.add_argument("--no-auth", action="store_true", help="anonymous servers (default: the run's account and "
                   "per-role users on the hub and every leaf, as diloco up --topology leaf)")
    a = p.parse_args()
    why = unavailable()
    if why:
        print(f"bench.wan: {why}", file=sys.stderr)
        sys.exit(2)
    R = a.regions or (2 if a.quick else 3)
    window = a.window or (10.0 if a.quick else 40.0)
    cut = a.cut or (8.0 if a.quick else CUT)
    regions = ["us", "eu", "asia", "au", "sa", "af"][:R]
    wan = Link(RATE, RTT / 2)
    plans = {"loopback": [Link()] * R, "wan": [wan] * R, "thin": [Link(THIN_RATE, RTT / 2)] + [wan] * (R - 1),
             "partition": [wan] * R}
    res: dict = {"regions": regions, "auth": not a.no_auth, "per_region": a.per_region, "step_time": STEP_TIME, "H": H, "P": P,
                 "rate_mbit": RATE, "rtt_ms": RTT, "thin_rate_mbit": THIN_RATE, "scenarios": {}}
    params = count_params(model_config(MODEL).spec())
    names = a.scenarios.split(",")
    progress(f"scenarios {names}, side by side (each in its own namespaces)")
    with ThreadPoolExecutor(len(names)) as ex:
        futs = {s: ex.submit(run_scenario, s, regions, plans[s], a.per_region, window,
                             cut if s == "partition" else None, not a.no_auth) for s in names}
        res["scenarios"] = {s: f.result() for s, f in futs.items()}
    sc = res["scenarios"]
    base = mean(sc["loopback"]["steps_per_s"].values()) if "loopback" in sc else None
    if base and "wan" in sc:
        res["wan_throughput_ratio"] = round(mean(sc["wan"]["steps_per_s"].values()) / base, 4)
    if base and "thin" in sc:
        thin_names = [n for n in sc["thin"]["steps_per_s"] if n.startswith(f"{regions[0]}-")]
        res["thin_throughput_ratio"] = round(mean(sc["thin"]["steps_per_s"][n] for n in thin_names) / base, 4)
    res["params"] = params
    if params:
        M = R * a.per_region
        res["dp_comm_over_step"] = {
            "wan": round(dp_comm_seconds(params, M, RATE, RTT / 2) / STEP_TIME, 2),
            "thin": round(dp_comm_seconds(params, M, THIN_RATE, RTT / 2) / STEP_TIME, 2)}
    res["bytes_per_learner_s"] = {s: v["bytes_per_learner_s"] for s, v in sc.items()}
    if "partition" in sc:
        res["partition"] = {k: v for k, v in sc["partition"]["partition"].items() if k != "transitions"}
    finish(res, a.out)


if __name__ == "__main__":
    main()
