"""Aggregator scale with replaying learners: merges per second with 1, 2 and 4 aggregator
processes, and the model size at which one aggregator falls behind 4, 8 or 16 learners.

The learners are ``bench.replay_learner`` processes: each fragment's int8 outer gradient is
encoded once per process with the real codec and replayed with fresh metadata on a real learner's
schedule (fragment p every H x step_time seconds, staggered by p H / P steps; H=24, step 0.1 s,
P=8), with heartbeats to a monitor. So the learners offer M x P / (H x step_time) contributions
per second (M=8: 26.7/s) at almost no CPU, and the aggregator has the machine to itself but for
the broker. Aggregators: ``diloco aggregator`` with its defaults (the on-time quorum; ``--quorum 1`` for one
merge per arrival) and the int8 keyframe-delta downlink, fragments split into equal ranges
(``DILOCO_AGG_FRAGMENTS``); the run is created by this process before they start.

Each measurement is a window of ``--window`` seconds once every learner of the stage is admitted
and publishing: contributions published / accepted per second, versions per second (sum over
fragments and aggregators), contributions per merge, the backlog in the aggregators' durable
consumers (contributions not yet delivered or not yet acknowledged, start -> end), merge latency
(first arrival -> published), CPU seconds of every aggregator, of the nats-server and of the
replaying learners (/proc/<pid>/stat), and the aggregators' CPU seconds per version and per
contribution per million parameters of the fragment. An aggregator *falls behind* when it accepts
under 90% of what is published, or its backlog grows by more than 10% of the window's arrivals
(plus one contribution per learner: in flight). ``machine_cpu_util`` is every process of the
machine (/proc/stat, in cores), ``others_cpu_util`` what was not ours: other people's jobs.
First, ``merge_cpu_ms_per_mvalue``: the CPU of one merge's parts in this process, no broker.
``loop_share`` (per aggregator): the share of the window's wall time its loop spent in each phase
(``aggregator.load.PhaseClock``: poll, intake, commit, publish, merge, checkpoint, other).
``mvalues_per_agg_cpu_s``: values merged (accepted contributions x fragment size) per aggregator
CPU-second; ``agg_rss_bytes_per_owned_value``: the aggregators' peak RSS over the parameters.

* ``recovery`` (``--recovery``, after the last stage of each sweep model): kill -9 every
  aggregator while the learners publish, start them again, and time until each has recovered every
  fragment (its newest checkpoint, then the merge log replayed from the GRAD stream): the
  ``events.recovered`` records (replayed merges, seconds per fragment) and the wall time from the
  restart to the first merge after it.

* ``aggregators``: model ``--agg-model`` (25M), ``--agg-learners`` (8) learners, 1, 2, 4 aggregators.
* ``sweep``: one aggregator per model size (5M, 12M, 25M, 50M, 100M); learners added in stages of
  4, 8, 16 within one run, stopping after the first stage that falls behind.

    python -m bench.scale_synth --quick --out scale_synth.json
    python -m bench.scale_synth --out scale_synth.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import gc
import math
import os
import time
from pathlib import Path

import orjson

from bench.common import finish, parser, progress
from bench.runs import PY, Cluster, hwm_mib, model_config
from bench.scale import mem_available_mib
from bus.config import CommonConfig
from bus.procs import popen
from monitor.status import fragments_covered
from learner.builtin import create_builtin_run
from learner.spec import count_params, make_plan

ROOT = str(Path(__file__).resolve().parent.parent)
P, H, STEP = 8, 24, 0.1
MODELS = {"5M": (256, 6, 1024), "12M": (384, 7, 1536), "25M": (512, 8, 2048), "50M": (512, 16, 2048),
          "100M": (512, 32, 2048), "1B": (1024, 80, 4096)}
SWEEP = "5M,12M,25M,50M,100M"  # the default sweep; 1B only when asked for (--models 1B: about 20 GB of memory)
AGG = {"DILOCO_DOWNLINK_QUANTISER": "int8"}  # plus DILOCO_QUORUM from --quorum (default: the role's)
MONITOR = {"DILOCO_SUSPECT_AFTER": "5", "DILOCO_EVICT_AFTER": "10"}  # a saturated machine delays heartbeats
TICK = os.sysconf("SC_CLK_TCK")


def model_env(name: str) -> dict:
    d, layers, ff = MODELS[name]
    return {"DILOCO_D_MODEL": str(d), "DILOCO_N_LAYERS": str(layers), "DILOCO_N_HEADS": "8", "DILOCO_D_FF": str(ff),
            "DILOCO_SEQ_LEN": "128", "DILOCO_NUM_FRAGMENTS": str(P)}


def store_for(model: str) -> int:
    """The server's JetStream storage for a run of ``model``: what its streams reserve (``bus.streams``:
    sized for fp32 versions and checkpoints, 66 GiB at 1B), with a margin, at least the default 20
    GiB. Reserved, not written: a 1B run writes far less (int8 contributions and deltas)."""
    from bus.server import DEFAULT_MAX_FILE_STORE
    from bus.streams import sized_bytes

    mc = model_config(model_env(model))
    need = sum(sized_bytes(make_plan(mc.spec(), P, mc.max_imbalance).sizes, 2).values())
    return max(DEFAULT_MAX_FILE_STORE, int(need * 1.1) + 2**30)


def split_fragments(n: int) -> list[str]:
    """``DILOCO_AGG_FRAGMENTS`` of n aggregators over P fragments: equal contiguous ranges."""
    if n == 1:
        return ["all"]
    k = P // n
    return [f"{i * k}-{(i + 1) * k - 1}" for i in range(n)]


def cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process, seconds (None if gone)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return None


def machine_busy_s() -> float:
    """CPU seconds every core of the machine spent busy since boot (/proc/stat: all but idle, iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / TICK


class Run:
    """One cluster: a model, a monitor, ``n_aggs`` aggregator commands, replay processes added in
    stages. Each command may run shard workers (``aggregator.shards``): figures are per process,
    by the ids the aggregators' metrics carry (``agg-0``, or ``agg-0-s0``, ``agg-0-s1``, ...)."""

    def __init__(self, c: Cluster, model: str, n_aggs: int):
        self.c, self.model = c, model
        self.cmds = [f"agg-{i}" for i in range(n_aggs)]
        self.frags = split_fragments(n_aggs)
        self.learners: list[str] = []
        self.replays: list[str] = []
        mc = model_config(model_env(model))
        self.params = count_params(mc.spec())
        self.sizes = make_plan(mc.spec(), P, mc.max_imbalance).sizes
        self.chunks_per_contribution = sum(math.ceil((n + n // 64 + 64) / 2**20) for n in self.sizes) / P

    async def start(self) -> None:
        c = self.c
        t = time.monotonic()
        await create_builtin_run(c.nc.jetstream(timeout=60), CommonConfig(nats_url=c.url, run=c.run),
                                 model_config(model_env(self.model)))
        gc.collect()  # the initial parameters (4 GB at 1B) are not left to a later collection
        progress(f"  run of {self.params / 1e6:.1f}M created in {time.monotonic() - t:.1f} s")
        c.start("monitor", "monitor", **MONITOR)
        self.start_aggregators()
        if not await c.wait_for(lambda: fragments_covered(self.c.role_metrics("aggregator").values()) >= P, 300, 0.5):
            raise RuntimeError("aggregators did not start:\n" + c.log_tail(self.cmds[0]))

    def start_aggregators(self) -> None:
        for a, f in zip(self.cmds, self.frags):
            self.c.start(a, "aggregator", DILOCO_AGGREGATOR_ID=a, DILOCO_AGG_FRAGMENTS=f, **AGG)

    @property
    def aggs(self) -> list[str]:
        """The aggregator processes heard (shard workers included), by id."""
        return sorted(self.c.role_metrics("aggregator"))

    async def add_learners(self, m: int) -> None:
        """Start a replay process for learners ``learner-<len>`` .. ``learner-<m-1>``; wait until
        every learner is admitted and the new ones publish."""
        c, k = self.c, len(self.replays)
        new = [f"learner-{i}" for i in range(len(self.learners), m)]
        name = f"replay-{k}"
        log = open(os.path.join(c.dir, f"{name}.log"), "ab")
        c.procs[name] = popen(
            [PY, "-c", "import sys; from bench.replay_learner import main; sys.exit(main())", "--ids", ",".join(new),
             "--name", name, "--step-time", str(STEP), "--sync-every", str(H), "--seed", str(k)],
            env=c.env(PYTHONPATH=ROOT, DILOCO_REGION="us"), stdout=log, stderr=log)
        log.close()
        self.learners += new
        self.replays.append(name)
        ok = await c.wait_for(lambda: (c.metrics("replay", name).get("published") or 0) > len(new)
                              and all((c.metrics("aggregator", a).get("active") or 0) >= m for a in self.aggs),
                              300, 0.5)
        if not ok:
            raise RuntimeError(f"{name} did not start publishing or its learners were not admitted:\n"
                               + c.log_tail(name) + c.log_tail("monitor"))

    async def snapshot(self) -> dict:
        c = self.c
        js = c.nc.jetstream(timeout=10)
        backlog = 0
        am = {a: dict(c.metrics("aggregator", a)) for a in self.aggs}
        for f in (str(m.get("fragments") or "all") for m in am.values()):
            lo, hi = (0, P - 1) if f == "all" else (int(f.partition("-")[0]), int(f.partition("-")[2] or f))
            try:
                ci = await js.consumer_info(c.s.stream("grad"), f"agg_{lo}_{hi}")
                backlog += (ci.num_pending or 0) + (ci.num_ack_pending or 0)
            except Exception:
                pass
        rm = [dict(c.metrics("replay", r)) for r in self.replays]
        return {"t": time.monotonic(), "busy": machine_busy_s(), "mon_cpu": cpu_s(c.procs["monitor"].pid), "agg": am,
                "agg_cpu": {a: cpu_s(m.get("pid")) for a, m in am.items()},
                "srv_cpu": cpu_s(c.srv.proc.pid), "replay_cpu": sum(m.get("cpu_s") or 0 for m in rm),
                "published": sum(m.get("published") or 0 for m in rm),
                "skipped": sum(m.get("skipped") or 0 for m in rm), "failed": sum(m.get("failed") or 0 for m in rm),
                "backlog_chunks": backlog}

    async def measure(self, window: float, warm: float) -> dict:
        await asyncio.sleep(warm)
        s0 = await self.snapshot()
        while time.monotonic() - s0["t"] < window:
            await asyncio.sleep(max(0.0, min(5.0, window - (time.monotonic() - s0["t"]))))
            v = sum(sum((self.c.metrics("aggregator", a).get("versions") or {}).values()) for a in self.aggs)
            progress(f"    {time.monotonic() - s0['t']:.0f} s: versions {v}, MemAvailable {mem_available_mib():.0f} MiB")
        await asyncio.sleep(1.1)  # one more metrics message of everybody
        s1 = await self.snapshot()
        return self.figures(s0, s1)

    def figures(self, s0: dict, s1: dict) -> dict:
        dt = s1["t"] - s0["t"]
        m = len(self.learners)
        frag_m = self.params / P / 1e6  # mean fragment, millions of values
        per, tot_v = [], 0.0
        tot = {"accepted": 0.0, "cpu": 0.0, "versions": 0, "accepted_n": 0, "rejected": 0}
        for a in sorted(set(s0["agg"]) & set(s1["agg"])):
            a0, a1 = s0["agg"][a], s1["agg"][a]
            dts = max(1e-6, (a1.get("ts") or 0) - (a0.get("ts") or 0))
            dv = sum((a1.get("versions") or {}).values()) - sum((a0.get("versions") or {}).values())
            dacc = (a1.get("accepted") or 0) - (a0.get("accepted") or 0)
            drej = sum((a1.get("rejected") or {}).values()) - sum((a0.get("rejected") or {}).values())
            cpu = (s1["agg_cpu"][a] or 0) - (s0["agg_cpu"][a] or 0)
            l0, l1 = a0.get("loop_s") or {}, a1.get("loop_s") or {}
            loop = {k: round((l1.get(k, 0.0) - l0.get(k, 0.0)) / dts, 3) for k in l1}
            per.append({"id": a, "fragments": a1.get("fragments"), "versions_per_s": round(dv / dts, 3),
                        "loop_share": loop, **{k: round((a1.get(k) or 0) - (a0.get(k) or 0), 3)
                                              for k in ("checkpoints", "checkpoints_early", "checkpoints_early_skipped", "checkpoint_s")},
                        "accepted_per_s": round(dacc / dts, 3), "cpu_util": round(cpu / dt, 3),
                        "merge_latency_p50": a1.get("merge_latency_p50"), "merge_latency_max": a1.get("merge_latency_max"),
                        "rejected": a1.get("rejected"), "transport_dropped": a1.get("transport_dropped"),
                        # versions behind of the contributions merged in the window (their staleness)
                        "staleness_hist": {k: v - (a0.get("staleness_hist") or {}).get(k, 0)
                                           for k, v in (a1.get("staleness_hist") or {}).items()
                                           if v - (a0.get("staleness_hist") or {}).get(k, 0)},
                        "peak_rss_mib": hwm_mib(a1.get("pid"))})
            tot_v += dv / dts
            tot["accepted"] += dacc / dts
            tot["cpu"] += cpu
            tot["versions"] += dv
            tot["accepted_n"] += dacc
            tot["rejected"] += drej
        published = (s1["published"] - s0["published"]) / dt
        growth = (s1["backlog_chunks"] - s0["backlog_chunks"]) / self.chunks_per_contribution
        behind = tot["accepted"] < 0.9 * published or growth > 0.1 * published * dt + m  # m: one in flight each
        out = {
            "model": self.model, "params": self.params, "learners": m, "aggregators": len(per),
            "aggregator_commands": len(self.cmds), "shards": AGG.get("DILOCO_AGG_SHARDS", "auto"),
            "window_s": round(dt, 1), "offered_per_s": round(m * P / (H * STEP), 2),
            "published_per_s": round(published, 2), "accepted_per_s": round(tot["accepted"], 2),
            "versions_per_s": round(tot_v, 2),
            "contributions_per_merge": round(tot["accepted_n"] / tot["versions"], 2) if tot["versions"] else None,
            "rejected": tot["rejected"], "skipped_syncs": s1["skipped"] - s0["skipped"],
            "failed_publishes": s1["failed"] - s0["failed"],
            "backlog_start": round(s0["backlog_chunks"] / self.chunks_per_contribution, 1),
            "backlog_end": round(s1["backlog_chunks"] / self.chunks_per_contribution, 1),
            "merge_latency_p50": max((x["merge_latency_p50"] or 0) for x in per),
            "merge_latency_max": max((x["merge_latency_max"] or 0) for x in per),
            "behind": behind,
            "agg_cpu_util": round(tot["cpu"] / dt, 3),
            "agg_cpu_s_per_version_per_mparam": round(tot["cpu"] / tot["versions"] / frag_m, 4) if tot["versions"] else None,
            "agg_cpu_s_per_contribution_per_mparam": (round(tot["cpu"] / tot["accepted_n"] / frag_m, 4)
                                                      if tot["accepted_n"] else None),
            "mparams_merged_per_s": round(tot["accepted"] * frag_m, 1),
            "mvalues_per_agg_cpu_s": round(tot["accepted"] * frag_m / (tot["cpu"] / dt), 1) if tot["cpu"] else None,
            "agg_rss_bytes_per_owned_value": (round(sum((x["peak_rss_mib"] or 0) for x in per) * 2**20 / self.params, 2)
                                              if all(x["peak_rss_mib"] for x in per) else None),
            "server_cpu_util": round(((s1["srv_cpu"] or 0) - (s0["srv_cpu"] or 0)) / dt, 3),
            "replay_cpu_util": round((s1["replay_cpu"] - s0["replay_cpu"]) / dt, 3),
            "monitor_cpu_util": round(((s1["mon_cpu"] or 0) - (s0["mon_cpu"] or 0)) / dt, 3),
            "machine_cpu_util": round((s1["busy"] - s0["busy"]) / dt, 2),  # all processes, in cores (2 here)
            "replay_peak_rss_mib": max((self.c.pid_hwm_mib(r) or 0) for r in self.replays),
            "monitor_peak_rss_mib": self.c.pid_hwm_mib("monitor"),
            "per_aggregator": per,
        }
        ours = out["agg_cpu_util"] + out["server_cpu_util"] + out["replay_cpu_util"] + out["monitor_cpu_util"]
        out["others_cpu_util"] = round(max(0.0, out["machine_cpu_util"] - ours), 2)  # other people's jobs, the tap
        progress(f"  {self.model} M={m} aggs={len(self.aggs)}: published {out['published_per_s']}/s, accepted "
                 f"{out['accepted_per_s']}/s, {out['versions_per_s']} versions/s ({out['contributions_per_merge']} per "
                 f"merge), backlog {out['backlog_start']} -> {out['backlog_end']}, CPU agg {out['agg_cpu_util']} "
                 f"server {out['server_cpu_util']} replay {out['replay_cpu_util']} others {out['others_cpu_util']}, "
                 f"{out['agg_cpu_s_per_contribution_per_mparam']} s/contribution/M{' BEHIND' if behind else ''}; "
                 f"loop {[x['loop_share'] for x in per]}")
        return out


    async def recover(self, timeout: float = 600.0) -> dict:
        """kill -9 every aggregator, start them again, time their recovery (see the module docstring)."""
        from nats.js.api import DeliverPolicy

        c = self.c
        js = c.nc.jetstream(timeout=10)
        sub = await js.subscribe(c.s.event("recovered"), ordered_consumer=True, deliver_policy=DeliverPolicy.NEW)
        before = {a: sum((c.metrics("aggregator", a).get("versions") or {}).values()) for a in self.aggs}
        for a in self.cmds:  # (shard workers die with their supervisor: bus.procs)
            c.kill(a)
        t0 = time.monotonic()
        self.start_aggregators()
        events = []
        while len(events) < P and time.monotonic() - t0 < timeout:
            try:
                events.append(orjson.loads((await sub.next_msg(timeout=5)).data))
            except Exception:
                pass
        recovered_s = time.monotonic() - t0
        merged = await c.wait_for(lambda: sum(sum((c.metrics("aggregator", a).get("versions") or {}).values())
                                              for a in self.aggs) > sum(before.values())
                                  and all((c.metrics("aggregator", a).get("ts") or 0) > 0 for a in self.aggs),
                                  timeout, 0.2)
        out = {"model": self.model, "params": self.params, "learners": len(self.learners),
               "fragments_recovered": len(events), "replayed": sum(e["replayed"] for e in events),
               "lost": sum(e["lost"] for e in events),
               "replay_s_max": max((e["seconds"] for e in events), default=None),
               "restart_to_recovered_s": round(recovered_s, 2),
               "restart_to_next_merge_s": round(time.monotonic() - t0, 2) if merged else None}
        progress(f"  recovery: {out}")
        return out


async def cluster_run(tag: str, model: str, n_aggs: int, stages: list[int], window: float, warm: float,
                      stop_when_behind: bool, recovery: list | None = None) -> list[dict]:
    out = []
    async with Cluster(f"synth{tag}", {**model_env(model), "DILOCO_MANIFEST_TIMEOUT": "600"}, metrics_interval=1.0,
                       max_file_store=store_for(model)) as c:
        r = Run(c, model, n_aggs)
        progress(f"{model} ({r.params / 1e6:.1f}M), {n_aggs} aggregator(s), learners {stages}; "
                 f"MemAvailable {mem_available_mib():.0f} MiB")
        await r.start()
        for m in stages:
            await r.add_learners(m)
            fig = await r.measure(window, warm)
            out.append(fig)
            if stop_when_behind and fig["behind"]:
                break
        if recovery is not None:
            recovery.append(await r.recover())
    return out


def breakdown(n: int, reps: int = 3) -> dict:
    """CPU milliseconds per million values of one merge of one int8 contribution into a fragment of
    ``n`` values, in this process (no broker): what the aggregator computes per contribution and per
    version, as ``aggregator.service`` does it (the blob's parts read, not decoded: ``unpack``; the
    norm and ``merge_step`` in place, each decoding block by block as it reads; the merge record, a
    checkpoint divided by ``DILOCO_CHECKPOINT_EVERY``, the int8 downlink delta and the crc32 of what
    is sent)."""
    import numpy as np

    from aggregator.config import AggregatorConfig
    from aggregator.contribution import Contribution, from_grad_message
    from aggregator.merge import l2_norm
    from aggregator.mlog import LoggedContribution, MergeRecord, settings_to_dict
    from aggregator.step import FragmentState, MergeSettings, merge_step
    from bus import codec
    from bus.chunks import checksum
    from bus.downlink import Keyframe, encode_version
    from bus.protocol import grad_meta

    every = AggregatorConfig().checkpoint_every
    rng = np.random.default_rng(0)
    blob = bytes(codec.encode_array(rng.standard_normal(n, dtype=np.float32) * np.float32(0.06), "int8"))
    s = MergeSettings(lr=0.7, momentum=0.5, downlink_quantiser="int8", max_inner_lr=0.01,
                      momentum_dtype=AGG.get("DILOCO_OUTER_MOMENTUM_DTYPE", AggregatorConfig().outer_momentum_dtype))
    st = FragmentState.initial(0, 0, rng.standard_normal(n, dtype=np.float32) * np.float32(0.02), s)
    key = Keyframe(0, st.params.copy())
    acc = np.empty(n, np.float32)
    out, got = {}, {}
    rnd = [0]

    def timed(name, f, div=1):
        t = time.process_time()
        for _ in range(reps):
            got[name] = f()
        out[name] = round((time.process_time() - t) / reps * 1e3 / (n / 1e6) / div, 2)

    def step():
        rnd[0] += 1
        c = Contribution("r", "h", "a", "i", 0, rnd[0], 0, H, H * 2048, got["unpack"], H)
        return merge_step(got.get("merge_step", st), [c], s, [got["norm"]], 1 / 8, 8, inplace=True, out=acc)

    meta = grad_meta(run="r", model="h", learner="a", incarnation="i", fragment=0, round_=0, base_version=0,
                     inner_steps=H, tokens=H * 2048, region="x")
    timed("unpack", lambda: from_grad_message(meta, blob).vector)
    timed("norm", lambda: l2_norm(got["unpack"]))
    timed("merge_step", step)
    rec = MergeRecord(0, 1, (LoggedContribution("a", "i", 0, 1, 0, (1,), 1.0, len(blob)),), 0.125, 8, settings_to_dict(s))
    timed("merge_record", rec.to_bytes)
    timed("checkpoint_amortised", lambda: checksum(got["merge_step"].checkpoint()), every)
    timed("downlink_int8", lambda: encode_version(got["merge_step"].params, 1, key, "int8", 64)[0])
    timed("crc32_sent", lambda: checksum(got["downlink_int8"]))
    out["checkpoint_every"] = every
    out["total"] = round(sum(v for k, v in out.items() if k != "checkpoint_every"), 2)
    return out


def first_behind(rows: list[dict]) -> dict:
    """Per learner count m: the smallest model one aggregator fell behind at with m learners or
    fewer (behind at fewer learners is behind at more; None: kept up at every size)."""
    res: dict = {}
    for m in sorted({r["learners"] for r in rows}):
        behind = [r for r in rows if r["behind"] and r["learners"] <= m]
        res[str(m)] = min(behind, key=lambda r: r["params"])["model"] if behind else None
    return res


async def main_async(a) -> dict:
    t0 = time.monotonic()
    mc = model_config(model_env(a.agg_model))
    n = max(make_plan(mc.spec(), P, mc.max_imbalance).sizes)
    cost = breakdown(n)
    progress(f"in-process CPU ms per million values of one merge ({n / 1e6:.2f}M-value fragment): {cost}")
    aggs = []
    for n in a.aggregators:
        aggs += await cluster_run(f"a{n}", a.agg_model, n, [a.agg_learners], a.window, a.warm, False)
    sweep: list = []
    recovery: list | None = [] if a.recovery else None
    for model in a.models:
        sweep += await cluster_run(f"s{model}", model, 1, a.stages, a.window, a.warm, True, recovery)
    return {"P": P, "H": H, "step_time_s": STEP, "quantiser": "int8", "downlink": "int8", "window_s": a.window,
            "merge_cpu_ms_per_mvalue": cost, "aggregators": aggs, "sweep": sweep,
            "versions_per_s": {str(r["aggregators"]): r["versions_per_s"] for r in aggs},
            "accepted_per_s": {str(r["aggregators"]): r["accepted_per_s"] for r in aggs},
            "first_behind": first_behind(sweep), "quorum": a.quorum or "default (auto)",
            "momentum_dtype": a.momentum_dtype or "default (the role's)",
            "mvalues_per_agg_cpu_s": max((r["mvalues_per_agg_cpu_s"] or 0 for r in aggs + sweep), default=None),
            "recovery": recovery, "wall_s": round(time.monotonic() - t0, 1)}


def main() -> None:
    global STEP
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--window", type=float, default=None, help="seconds per measurement (30; quick 6)")
    p.add_argument("--warm", type=float, default=None, help="seconds after a stage starts before measuring")
    p.add_argument("--aggregators", default=None, help="aggregator counts, comma-separated (1,2,4; quick 1,2; none)")
    p.add_argument("--agg-model", default=None, choices=list(MODELS), help="model of the aggregator runs (25M; quick 5M)")
    p.add_argument("--agg-learners", type=int, default=None, help="learners of the aggregator runs (8; quick 4)")
    p.add_argument("--models", default=None, help="sizes of the sweep, comma-separated (all; quick 5M; none)")
    p.add_argument("--stages", default=None, help="learner counts of the sweep (4,8,16; quick 4,8)")
    p.add_argument("--quorum", default=None, help="DILOCO_QUORUM of the aggregators (default: the role's, auto)")
    p.add_argument("--recovery", action="store_true", help="kill -9 and time the recovery after each sweep model")
    p.add_argument("--step-time", type=float, default=None, help="seconds per replayed inner step (0.1)")
    p.add_argument("--shards", default=None, help="DILOCO_AGG_SHARDS of the aggregators (default: the role's, auto; "
                                                  "1: one process, the old shape)")
    p.add_argument("--momentum-dtype", default=None, choices=["float32", "bfloat16"],
                   help="DILOCO_OUTER_MOMENTUM_DTYPE of the aggregators (default: the role's)")
    a = p.parse_args()
    STEP = a.step_time or STEP
    if a.quorum:
        AGG["DILOCO_QUORUM"] = a.quorum
    if a.shards:
        AGG["DILOCO_AGG_SHARDS"] = a.shards
    if a.momentum_dtype:
        AGG["DILOCO_OUTER_MOMENTUM_DTYPE"] = a.momentum_dtype
    q = a.quick
    a.window = a.window or (6.0 if q else 30.0)
    a.warm = a.warm if a.warm is not None else (2.0 if q else 5.0)
    a.aggregators = [int(x) for x in (a.aggregators or ("1,2" if q else "1,2,4")).split(",") if x != "none"]
    a.agg_model = a.agg_model or ("5M" if q else "25M")
    a.agg_learners = a.agg_learners or (4 if q else 8)
    a.models = [x for x in (a.models or ("5M" if q else SWEEP)).split(",") if x != "none"]
    a.stages = [int(x) for x in (a.stages or ("4,8" if q else "4,8,16")).split(",")]
    bad = [x for x in a.models if x not in MODELS]
    if bad or any(P % n for n in a.aggregators):
        p.error(f"unknown model {bad} (choose from {list(MODELS)}) or an aggregator count that does not divide P={P}")
    r = asyncio.run(main_async(a))
    finish({"bench": "scale_synth", "quick": q, **r}, a.out)


if __name__ == "__main__":
    main()
