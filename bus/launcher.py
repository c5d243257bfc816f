"""``diloco up``: a whole run on one machine: broker, aggregator, monitor, evaluator and N learners.

Every role runs as its own OS process (``python -m bus.cli <role>``), configured by ``DILOCO_*``
environment variables exactly as it would be on separate machines; the launcher only chooses the
values, starts the processes, watches the run through the ``metrics`` subjects and stops
everything at the end. Order of a run:

1. generate the run's credentials into ``OUT/auth`` (:func:`bus.auth.init`: one account, one
   least-privilege user per role and per learner; new passwords every time) and start the broker
   (:mod:`bus.topology`: one JetStream server with those accounts, or a hub plus one leaf-node
   server per region, each with the same account and users, the leaf links bound to the account
   with one new password per region: :mod:`bus.auth_leaf`), its JetStream store under
   ``OUT/nats-store`` (wiped at start: every ``diloco up`` is a fresh run). Each role process gets
   its user's env file merged into its environment; the launcher itself connects as ``metrics``
   (read-only). ``--no-auth``: anonymous access as before, on every server of either topology;
2. start the aggregator (it creates version 0), the monitor and the evaluator; wait for the
   evaluator's first held-out loss of version 0 (the *initial* loss);
3. start the learners (``<region>-<i>``, spread round-robin over the regions, each on its own
   data shard), show live progress;
4. when every learner has finished its steps: wait for the last merges and one evaluation of the
   final global versions; on Ctrl-C/SIGTERM: stop at once;
5. stop learners, evaluator and monitor, then the aggregator (SIGTERM, SIGKILL after a timeout;
   the aggregator last so it merges what the learners sent), then the servers; write
   ``OUT/summary.json`` and ``OUT/eval_loss.png``.

Children run in their own process group and get SIGKILL if the launcher dies
(``PR_SET_PDEATHSIG``), so no process outlives the launcher. Every child's stdout and stderr (JSON
log lines) go to ``OUT/logs/<name>.log``; ``OUT/processes.json`` lists pids and exit codes.

Precedence of settings: model preset and launcher defaults < the caller's ``DILOCO_*``
environment < explicit flags (``--steps``, ``--learners``, ...) < per-process identity
(``DILOCO_NATS_URL``, ``DILOCO_REGION``, ``DILOCO_LEARNER_ID``, shard).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from bus.config import CommonConfig, ConfigError, from_env

# -- presets and defaults (pure) --------------------------------------------------------------------

#: Model presets: DILOCO_* values. ``default`` is the configuration's own defaults (836,736 params).
PRESETS: dict[str, dict[str, str]] = {
    "tiny": {"DILOCO_D_MODEL": "32", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "2", "DILOCO_D_FF": "64",
             "DILOCO_SEQ_LEN": "32", "DILOCO_NUM_FRAGMENTS": "4", "DILOCO_BATCH_SIZE": "8",
             "DILOCO_EVAL_BATCH_SIZE": "16", "DILOCO_SYNC_EVERY": "12", "DILOCO_INNER_LR": "0.003"},
    "small": {"DILOCO_D_MODEL": "64", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "4", "DILOCO_D_FF": "256",
              "DILOCO_SEQ_LEN": "64", "DILOCO_NUM_FRAGMENTS": "4", "DILOCO_BATCH_SIZE": "16",
              # inner lr: the best of the data-parallel and DiLoCo sweeps of bench.algorithm at this size
              "DILOCO_SYNC_EVERY": "16", "DILOCO_INNER_LR": "0.008"},
    "default": {},
}

#: Inner steps per learner when neither --steps nor DILOCO_MAX_STEPS/DILOCO_TOTAL_STEPS is given.
DEFAULT_STEPS = {"tiny": 1000, "small": 500, "default": 200}
QUICK_STEPS = 1000

#: Launcher defaults for every process (the caller's environment overrides them).
RUN_DEFAULTS: dict[str, str] = {
    "DILOCO_RUN": "up",
    "DILOCO_METRICS_INTERVAL": "1.0",
    "DILOCO_EVAL_INTERVAL": "4.0",
    # several JAX processes share few cores here: a learner's heartbeats can be late by a step
    "DILOCO_SUSPECT_AFTER": "6.0",
    "DILOCO_EVICT_AFTER": "20.0",
    "DILOCO_MANIFEST_TIMEOUT": "120.0",
    # a fragment's first sync covers only its offset's few warm-up steps, so "10 x the median norm"
    # rejects honest later deltas, and a rejected fragment's base never moves again: see docs/deploy.md
    "DILOCO_NORM_OUTLIER_FACTOR": "1000",
    # int8 deltas against fp32 keyframes: a quarter of the downlink, no measured loss (docs/BENCHMARKS.md)
    "DILOCO_DOWNLINK_QUANTISER": "int8",
    # with every learner in every merge (the quorum below), outer momentum 0.5 at lr 0.7: 4.4% lower
    # held-out loss than momentum 0 and 4.9% lower than 0.9 in the in-process reference (bench.algorithm,
    # small preset, M=2, 20 tokens per parameter; docs/BENCHMARKS.md "Quality of the algorithm")
    "DILOCO_OUTER_MOMENTUM": "0.5",
}

#: DILOCO_REGION of the aggregator, monitor and evaluator (they connect to the hub server).
CENTRAL_REGION = "hub"


@dataclass(frozen=True)
class ProcSpec:
    """One child process: its name (log file stem), role, region (None: central) and environment."""

    name: str
    role: str
    region: str | None
    env: dict[str, str]
    learner_id: str | None = None

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "bus.cli", self.role]


def learner_ids(n: int, regions: list[str]) -> list[tuple[str, str]]:
    """(learner id, region) for n learners spread round-robin: us-0, eu-0, us-1, eu-1, ..."""
    return [(f"{regions[k % len(regions)]}-{k // len(regions)}", regions[k % len(regions)]) for k in range(n)]


def parse_regions(text: str) -> list[str]:
    from bus.subjects import check_token

    regions = [r.strip() for r in text.split(",") if r.strip()]
    if not regions:
        raise ValueError("--regions: expected a comma-separated list like us,eu")
    for r in regions:
        check_token("region", r)
    if len(set(regions)) != len(regions):
        raise ValueError(f"--regions {text!r}: regions must be distinct")
    return regions


#: XLA flags for JAX children when more JAX processes than cores share the machine: one thread each
#: (measured here: 0.34 s per default-model step single-threaded vs 0.40 s with XLA's thread pool, and
#: far less contention with 4 learners and an evaluator on 2 cores).
SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def resolve_steps(environ: dict[str, str], preset: str, steps: int | None, quick: bool) -> int:
    """--steps, else DILOCO_MAX_STEPS, else DILOCO_TOTAL_STEPS, else the preset's default."""
    if steps is not None:
        return steps
    for name in ("DILOCO_MAX_STEPS", "DILOCO_TOTAL_STEPS"):
        given = (environ.get(name) or "").strip()
        if given.isdigit() and int(given) > 0:
            return int(given)
    return QUICK_STEPS if quick else DEFAULT_STEPS[preset]


def base_env(environ: dict[str, str], preset: str, steps: int | None, quick: bool, n_learners: int = 4,
             cpu_count: int | None = None) -> dict[str, str]:
    """Settings shared by every process: preset and launcher defaults, then the caller's DILOCO_* env,
    then the explicit step count. Non-DILOCO variables (PATH, JAX_*, XLA_FLAGS...) pass through."""
    env = dict(environ)
    defaults = dict(RUN_DEFAULTS)
    # every learner in every merge: one merge per round (see docs/deploy.md, "Tuning")
    defaults["DILOCO_QUORUM"] = str(n_learners)
    defaults.update(PRESETS[preset])
    if quick:
        defaults["DILOCO_EVAL_INTERVAL"] = "2.0"
    for k, v in defaults.items():
        env.setdefault(k, v)
    n = resolve_steps(environ, preset, steps, quick)
    env["DILOCO_MAX_STEPS"] = str(n)
    total = (environ.get("DILOCO_TOTAL_STEPS") or "").strip()
    if steps is not None or not (total.isdigit() and int(total) >= n):
        env["DILOCO_TOTAL_STEPS"] = str(n)  # the cosine schedule ends with the run
    if "DILOCO_WARMUP_STEPS" not in environ:
        env["DILOCO_WARMUP_STEPS"] = str(max(0, min(50, int(env["DILOCO_TOTAL_STEPS"]) // 10)))
    # the run declares its peak inner learning rate (it bounds one outer gradient's norm): the
    # learners' own, unless the caller declares a higher one
    lr = env.get("DILOCO_INNER_LR", "0.001")
    try:
        float(lr)
    except ValueError:
        lr = None  # a bad DILOCO_INNER_LR is reported under its own name
    if lr is not None:
        env.setdefault("DILOCO_MAX_INNER_LR", lr)
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    if "XLA_FLAGS" not in environ and n_learners + 1 > cpus:
        env["XLA_FLAGS"] = SINGLE_THREAD_XLA
    return env


def plan_processes(env: dict[str, str], n_learners: int, regions: list[str]) -> list[ProcSpec]:
    """Every child of a run with its environment (NATS URLs are filled in by :func:`with_urls`)."""
    procs = [
        ProcSpec("aggregator", "aggregator", None,
                 {**env, "DILOCO_REGION": CENTRAL_REGION, "DILOCO_AGGREGATOR_ID": env.get("DILOCO_AGGREGATOR_ID", "agg-0")}),
        ProcSpec("monitor", "monitor", None,
                 {**env, "DILOCO_REGION": CENTRAL_REGION, "DILOCO_MONITOR_ID": env.get("DILOCO_MONITOR_ID") or "monitor-0"}),
        ProcSpec("evaluator", "eval", None,
                 {**env, "DILOCO_REGION": CENTRAL_REGION, "DILOCO_EVAL_ID": env.get("DILOCO_EVAL_ID", "eval-0")}),
    ]
    for k, (lid, region) in enumerate(learner_ids(n_learners, regions)):
        procs.append(ProcSpec(f"learner-{lid}", "learner", region, {
            **env, "DILOCO_REGION": region, "DILOCO_LEARNER_ID": lid, "DILOCO_NUM_LEARNERS": str(n_learners),
            "DILOCO_SHARD_INDEX": str(k), "DILOCO_NUM_SHARDS": str(n_learners)}, learner_id=lid))
    return procs


def with_urls(procs: list[ProcSpec], url_for) -> list[ProcSpec]:
    return [ProcSpec(p.name, p.role, p.region, {**p.env, "DILOCO_NATS_URL": url_for(p.region)}, p.learner_id)
            for p in procs]


#: The bus.auth user each role process connects as (learners: ``learner-<id>``).
ROLE_USERS = {"aggregator": "aggregator", "monitor": "monitor", "eval": "evaluator"}


def user_of(spec: ProcSpec) -> str:
    """The NATS user of ``spec`` in the credentials ``bus.auth.init`` generates."""
    if spec.role == "learner":
        return f"learner-{spec.learner_id}"
    return ROLE_USERS[spec.role]


def with_credentials(procs: list[ProcSpec], env_files: dict[str, Any]) -> list[ProcSpec]:
    """Each process with its user's env file (``DILOCO_NATS_USER``/``PASSWORD``, ...) merged into its env."""
    from bus.auth import parse_env_file

    out = []
    for p in procs:
        with open(env_files[user_of(p)]) as f:
            creds = parse_env_file(f.read())
        out.append(ProcSpec(p.name, p.role, p.region, {**p.env, **creds}, p.learner_id))
    return out


def auth_enabled(a: argparse.Namespace) -> bool:
    """Credentials for this launch: on by default (either topology), off with --no-auth."""
    return not a.no_auth


def validate_envs(procs: list[ProcSpec]) -> None:
    """Parse every process's configuration now, so a bad variable stops the launcher, not a child."""
    from bus.cli import load_role_configs

    roles = load_role_configs()
    need = {"aggregator": ("model", "aggregator"), "monitor": ("monitor",), "eval": ("model", "learner", "eval"),
            "learner": ("model", "learner")}
    for p in procs:
        common = from_env(CommonConfig, p.env)
        for r in need[p.role]:
            if r in roles:
                from_env(roles[r], p.env)
        if p.role == "aggregator" and "model" in roles:  # the streams must hold the model's versions
            from learner.spec import make_plan
            from bus.streams import Limits, LimitsTooSmall

            model = from_env(roles["model"], p.env)
            try:
                Limits.for_run(common, make_plan(model.spec(), model.num_fragments, model.max_imbalance).sizes,
                               common.run)
            except LimitsTooSmall as e:
                raise ConfigError(str(e)) from None


def dp_equivalent_bytes(params: int, learners: int, total_inner_steps: int, bytes_per_value: int = 2) -> int:
    """Bytes data-parallel training would move for the same inner steps: a ring all-reduce of every
    gradient in bf16 sends 2 (M-1)/M x params values per worker and step; M workers doing
    ``total/M`` steps each process the same samples as our learners' ``total`` inner steps."""
    if learners < 2:
        return 0
    return int(round(2 * (learners - 1) / learners * params * bytes_per_value * total_inner_steps))


# -- live state from the metrics subjects (pure folding) --------------------------------------------


@dataclass
class RunState:
    """What the launcher learned from metrics and events; folded message by message."""

    run: str
    learners: dict[str, dict] = field(default_factory=dict)  # id -> last learner metrics
    aggregator: dict | None = None
    monitor: dict | None = None
    evals: list[dict] = field(default_factory=list)  # evaluator records, in arrival order
    membership: list[dict] = field(default_factory=list)
    loss_history: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)  # id -> (t, step, loss)
    merge_history: list[tuple[float, int]] = field(default_factory=list)  # (t, merges so far), when it moves
    snapshot: Any = None
    t0: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        from monitor.metrics_view import MetricsSnapshot

        self.snapshot = MetricsSnapshot(run=self.run)

    def on_metrics(self, msg: Any) -> None:
        from monitor.metrics_view import fold

        self.snapshot = fold(self.snapshot, msg)
        if not isinstance(msg, dict) or msg.get("run") != self.run:
            return
        role = msg.get("role")
        if role == "learner" and isinstance(msg.get("learner"), str):
            old = self.learners.get(msg["learner"])
            if old is not None and old.get("incarnation") == msg.get("incarnation") and \
                    float(old.get("ts", 0)) > float(msg.get("ts", 0)):
                return
            self.learners[msg["learner"]] = msg
            loss, step = msg.get("loss"), msg.get("step")
            if isinstance(loss, (int, float)) and isinstance(step, int) and math.isfinite(loss):
                hist = self.loss_history.setdefault(msg["learner"], [])
                if not hist or hist[-1][1] != step:
                    hist.append((float(msg.get("ts", time.time())), step, float(loss)))
        elif role == "aggregator":
            if self.aggregator is None or float(msg.get("ts", 0)) >= float(self.aggregator.get("ts", 0)):
                self.aggregator = msg
                merges = msg.get("merges")
                if isinstance(merges, int) and not isinstance(merges, bool) and \
                        (not self.merge_history or self.merge_history[-1][1] != merges):
                    self.merge_history.append((float(msg.get("ts", time.time())), merges))
        elif role == "monitor":
            self.monitor = msg
        elif (role == "evaluator" and isinstance(msg.get("eval_loss"), (int, float))
              and "evaluated_at" not in msg):  # a repeat of the last evaluation is not a new point
            self.evals.append(msg)

    def on_event(self, msg: Any) -> None:
        """A membership transition; a republished one (same learner, states and time) counts once."""
        if not isinstance(msg, dict):
            return
        key = (msg.get("learner"), msg.get("old"), msg.get("new"), msg.get("at"))
        if any((e.get("learner"), e.get("old"), e.get("new"), e.get("at")) == key for e in self.membership[-64:]):
            return
        self.membership.append(msg)

    @property
    def evictions(self) -> int:
        return sum(1 for e in self.membership if e.get("new") == "evicted")

    def evictions_while_running(self, ended: dict[str, float | None]) -> int:
        """Evictions of learners whose process was still running (a finished learner falls silent too)."""
        n = 0
        for e in self.membership:
            if e.get("new") != "evicted":
                continue
            end = ended.get(str(e.get("learner")))
            at = e.get("at")
            if end is None or not isinstance(at, (int, float)) or at < end:
                n += 1
        return n

    def versions(self) -> dict[str, int]:
        return dict((self.aggregator or {}).get("versions") or {})

    def contributions(self) -> dict[str, int]:
        return dict((self.aggregator or {}).get("contributions") or {})

    def compact_line(self, now: float | None = None) -> str:
        """One status line: elapsed, per learner step and loss, versions, eval loss, evictions."""
        now = time.time() if now is None else now
        parts = [f"[{now - self.t0:6.1f}s]"]
        for lid in sorted(self.learners):
            m = self.learners[lid]
            loss = m.get("loss")
            parts.append(f"{lid} {m.get('step', 0)}" + (f" {loss:.3f}" if isinstance(loss, (int, float)) else ""))
        vs = list(self.versions().values())
        if vs:
            parts.append(f"v{min(vs)}..{max(vs)}" if min(vs) != max(vs) else f"v{vs[0]}")
            parts.append(f"merges {(self.aggregator or {}).get('merges', 0)}")
        if self.evals:
            e = self.evals[-1]
            parts.append(f"eval {e['eval_loss']:.3f}" + (f" (from {self.evals[0]['eval_loss']:.3f})"
                                                         if len(self.evals) > 1 else ""))
        if self.evictions:
            parts.append(f"evictions {self.evictions}")
        return " | ".join(parts)


# -- summary (pure) ---------------------------------------------------------------------------------


def build_summary(*, state: RunState, specs: list[ProcSpec], exit_codes: dict[str, int | None], traffic: dict,
                  params: int, wall_time_s: float, train_time_s: float | None, status: str,
                  settings: dict, learner_ended: dict[str, float | None] | None = None) -> dict:
    contributions = state.contributions()
    learners = {}
    total_steps = 0
    link_by_learner: dict[str, int] = {}
    for c in traffic.get("connections", []):
        name = c.get("name", "")
        if name.startswith("learner-"):
            lid = name[len("learner-"):]
            link_by_learner[lid] = link_by_learner.get(lid, 0) + c["in_bytes"] + c["out_bytes"]
    for p in specs:
        if p.role != "learner":
            continue
        m = state.learners.get(p.learner_id, {})
        steps = int(m.get("step") or 0)
        total_steps += steps
        learners[p.learner_id] = {
            "region": p.region, "steps": steps, "contributions": int(contributions.get(p.learner_id, 0)),
            "contributions_sent": int(m.get("contributions") or 0), "last_train_loss": m.get("loss"),
            "resyncs": m.get("resyncs"), "skipped_syncs": m.get("skipped_syncs"),
            "link_bytes": link_by_learner.get(p.learner_id, 0), "exit_code": exit_codes.get(p.name),
        }
    m_count = len(learners)
    evals = state.evals
    initial = evals[0] if evals else None
    final = evals[-1] if evals else None
    agg = state.aggregator or {}
    broker = int(traffic.get("client_bytes", 0))
    learner_link = sum(link_by_learner.values())
    dp = dp_equivalent_bytes(params, m_count, total_steps)
    return {
        "status": status,
        "run": state.run,
        "settings": settings,
        "params": params,
        "num_learners": m_count,
        "initial_eval_loss": initial["eval_loss"] if initial else None,
        "initial_eval_version": initial.get("version") if initial else None,
        "final_eval_loss": final["eval_loss"] if final else None,
        "final_eval_versions": final.get("versions") if final else None,
        "eval_loss_ratio": (final["eval_loss"] / initial["eval_loss"]) if initial and final else None,
        "eval_history": [{"t": round(float(e.get("ts", 0)) - state.t0, 3), "eval_loss": e["eval_loss"],
                          "version": e.get("version")} for e in evals],
        "merge_history": [{"t": round(t - state.t0, 3), "merges": n} for t, n in state.merge_history],
        "eviction_times": [{"t": round(float(e.get("at", 0)) - state.t0, 3), "learner": e.get("learner")}
                           for e in state.membership if e.get("new") == "evicted"
                           and isinstance(e.get("at"), (int, float))],
        "learners": learners,
        "total_inner_steps": total_steps,
        "versions": agg.get("versions") or {},
        "merges": agg.get("merges"),
        "accepted": agg.get("accepted"),
        "rejected": agg.get("rejected") or {},
        "evictions": state.evictions_while_running(learner_ended or {}),
        "evictions_total": state.evictions,
        "membership_events": len(state.membership),
        "broker_bytes": broker,
        "broker_bytes_source": "sum of in_bytes+out_bytes of every client connection (/connz?state=all)",
        "learner_link_bytes": learner_link,
        "servers": traffic.get("servers", {}),
        "dp_equivalent_bytes": dp,
        "broker_over_dp": (broker / dp) if dp else None,
        "dp_over_broker": (dp / broker) if broker and dp else None,
        "dp_over_learner_link": (dp / learner_link) if learner_link and dp else None,
        "wall_time_s": round(wall_time_s, 2),
        "train_time_s": round(train_time_s, 2) if train_time_s is not None else None,
        "exit_codes": exit_codes,
    }


def render_summary(s: dict) -> str:
    def mib(n: float | None) -> str:
        return "-" if n is None else f"{n / 2**20:.1f} MiB"

    lines = [f"run {s['run']}: {s['status']} in {s['wall_time_s']:.0f}s "
             f"({s['num_learners']} learners, {s['params']:,} params, {s['total_inner_steps']} inner steps)"]
    if s["initial_eval_loss"] is not None:
        lines.append(f"held-out loss  {s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}"
                     f"  (x{s['eval_loss_ratio']:.3f})")
    vs = s["versions"]
    if vs:
        lines.append("versions       " + " ".join(f"f{k}=v{v}" for k, v in sorted(vs.items(), key=lambda kv: int(kv[0])))
                     + f"  ({s['merges']} merges, {sum(s['rejected'].values())} rejected)")
    lines.append("learner        region  steps  contributions(applied/sent)  link")
    for lid, l in sorted(s["learners"].items()):
        lines.append(f"  {lid:<12} {l['region']:<7} {l['steps']:>5}  {l['contributions']:>6} / {l['contributions_sent']:<6}"
                     f"              {mib(l['link_bytes'])}")
    lines.append(f"evictions      {s['evictions']}")
    ratio = s["dp_over_broker"]
    lines.append(f"broker bytes   {mib(s['broker_bytes'])} (learner links {mib(s['learner_link_bytes'])}); "
                 f"data-parallel bf16 would move {mib(s['dp_equivalent_bytes'])}"
                 + (f": {ratio:.1f}x more" if ratio else ""))
    return "\n".join(lines)


def plot_eval(summary: dict, state: RunState, path: str) -> dict | None:
    """Held-out loss over time (bold, each point's version next to it), each learner's training loss
    (thin), the aggregator's merges so far (grey steps, right axis) and evictions (red dotted lines),
    with the final held-out loss written on the plot, as a PNG. Returns what it drew (None: no
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    drawn: dict = {"learners": 0, "eval_points": 0, "merge_steps": 0, "evictions": 0, "final": None}
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for lid, hist in sorted(state.loss_history.items()):
        if hist:
            ax.plot([t - state.t0 for t, _, _ in hist], [l for _, _, l in hist], lw=0.8, alpha=0.5,
                    label=f"train {lid}")
            drawn["learners"] += 1
    ev = summary["eval_history"]
    if ev:
        ax.plot([e["t"] for e in ev], [e["eval_loss"] for e in ev], "o-", color="black", lw=2, ms=3,
                label="held-out (global model)")
        drawn["eval_points"] = len(ev)
        every = max(1, len(ev) // 12)  # at most about a dozen version labels
        for i, e in enumerate(ev):
            if e.get("version") is not None and (i % every == 0 or i == len(ev) - 1):
                ax.annotate(f"v{e['version']}", (e["t"], e["eval_loss"]), textcoords="offset points",
                            xytext=(0, 5), fontsize=6, ha="center", color="black")
        last = ev[-1]
        drawn["final"] = f"final held-out {last['eval_loss']:.4f}" + (
            f" (v{last['version']})" if last.get("version") is not None else "")
        ax.annotate(drawn["final"], (last["t"], last["eval_loss"]), textcoords="offset points", xytext=(-10, 18),
                    ha="right", fontsize=9, fontweight="bold", arrowprops={"arrowstyle": "->", "lw": 0.8})
    for i, e in enumerate(summary.get("eviction_times") or []):
        ax.axvline(e["t"], color="red", ls=":", lw=1, label="eviction" if i == 0 else None)
        drawn["evictions"] += 1
    merges = summary.get("merge_history") or []
    if merges:
        ax2 = ax.twinx()
        ax2.step([m["t"] for m in merges], [m["merges"] for m in merges], where="post", color="grey", lw=1,
                 alpha=0.7)
        ax2.set_ylabel("merges so far (aggregator)", color="grey")
        ax2.tick_params(axis="y", colors="grey")
        drawn["merge_steps"] = len(merges)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"diloco up: run {summary['run']}, {summary['num_learners']} learners")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper center")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn


# -- child processes ----------------------------------------------------------------------------------


def _child_preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()  # own process group: a terminal's Ctrl-C reaches the launcher only, which stops us in order
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    spec: ProcSpec
    log_path: str
    cwd: str
    proc: subprocess.Popen | None = None
    started: float | None = None
    ended: float | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.spec.argv(), env=self.spec.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.cwd, preexec_fn=_child_preexec)
        self.started = time.time()

    def poll(self) -> int | None:
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = time.time()
        return rc

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.poll() is None

    def signal(self, sig: int) -> None:
        if not self.alive:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    @property
    def exit_code(self) -> int | None:
        return self.poll()


def stop_children(groups: list[list[Child]], timeout: float, say=print) -> None:
    """SIGTERM each group in turn, wait up to ``timeout`` for it, SIGKILL its stragglers."""
    asyncio.run(astop_children(groups, timeout, say))


async def astop_children(groups: list[list[Child]], timeout: float, say=print) -> None:
    """:func:`stop_children` without blocking the event loop (a second Ctrl-C is still handled)."""
    for group in groups:
        alive = [c for c in group if c.alive]
        for c in alive:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(c.alive for c in alive) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for c in alive:
            if c.alive:
                say(f"diloco up: {c.spec.name} did not stop within {timeout:.0f}s: SIGKILL")
                c.signal(signal.SIGKILL)
        for c in alive:
            if c.proc is not None:
                with contextlib.suppress(Exception):
                    c.proc.wait(5)


# -- the launcher -------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="diloco up",
        description="Start a whole local run: NATS server(s), aggregator, monitor, evaluator and N learners as "
                    "separate processes; show progress; stop everything at the end or on Ctrl-C; write "
                    "OUT/summary.json and OUT/eval_loss.png. DILOCO_* variables in the environment are honoured "
                    "(see `diloco config ROLE`).")
    p.add_argument("--learners", type=int, default=4, help="number of learners (default 4)")
    p.add_argument("--regions", default="us,eu", help="comma-separated region names the learners are spread over")
    p.add_argument("--steps", type=int, default=None,
                   help="inner steps per learner (default: DILOCO_MAX_STEPS, else 200 for the default model, "
                        f"{QUICK_STEPS} with --quick)")
    p.add_argument("--out", default="./diloco-out", help="output folder: logs, store, summary.json, eval_loss.png")
    p.add_argument("--topology", choices=("single", "leaf"), default="single",
                   help="single: one server; leaf: a hub (JetStream; aggregator, monitor, evaluator) plus one "
                        "leaf-node server per region (its learners), each with the run's account and users, the "
                        "leaf links bound to that account (unless --no-auth)")
    p.add_argument("--no-auth", action="store_true",
                   help="anonymous access to the server(s), as before auth existed. Default (either topology): "
                        "generate one least-privilege user per role and per learner into OUT/auth (bus.auth, "
                        "new passwords every launch), start the server(s) with those accounts only and give each "
                        "process its user's credentials; the launcher reads as the metrics user")
    p.add_argument("--model-preset", choices=sorted(PRESETS), default=None,
                   help="tiny | small | default (default: default, or tiny with --quick); DILOCO_* overrides win")
    p.add_argument("--quick", action="store_true", help="tiny model and few steps: a demo in about 25 s (2 CPU cores)")
    p.add_argument("--run", default=None, help="run id (default: DILOCO_RUN, else 'up')")
    p.add_argument("--progress", choices=("auto", "table", "line", "none"), default="auto",
                   help="live view: a redrawn table (auto on a terminal), one line per interval, or nothing")
    p.add_argument("--progress-interval", type=float, default=None, help="seconds between progress updates")
    p.add_argument("--initial-eval-timeout", type=float, default=180.0,
                   help="seconds to wait for the evaluator's first loss before starting learners")
    p.add_argument("--final-timeout", type=float, default=60.0,
                   help="seconds to wait, after the learners finished, for the last merges and evaluation")
    p.add_argument("--stop-timeout", type=float, default=20.0, help="seconds a process gets after SIGTERM")
    a = p.parse_args(argv)
    if a.learners < 1:
        p.error("--learners must be >= 1")
    if a.steps is not None and a.steps < 1:
        p.error("--steps must be >= 1")
    try:
        a.regions = parse_regions(a.regions)
    except ValueError as e:
        p.error(str(e))
    a.model_preset = a.model_preset or ("tiny" if a.quick else "default")
    return a


class Launcher:
    def __init__(self, a: argparse.Namespace, environ: dict[str, str]):
        self.a = a
        self.out = os.path.abspath(a.out)
        env = base_env(environ, a.model_preset, a.steps, a.quick, a.learners)
        if a.run:
            env["DILOCO_RUN"] = a.run
        env["DILOCO_UP_OUT"] = self.out  # marks every child (and server) of this launch: find them by it
        self.env = env
        self.specs = plan_processes(env, a.learners, a.regions)
        self.auth = auth_enabled(a)
        self.auth_dir = os.path.join(self.out, "auth")
        self.children: list[Child] = []
        self.topology = None
        self.state: RunState | None = None
        self.stop_signal: int | None = None
        self.stop_event: asyncio.Event | None = None
        self.status = "starting"
        self.t_start = time.time()
        self.t_learners: float | None = None
        self.t_learners_done: float | None = None
        self.failure: str | None = None
        tty = sys.stdout.isatty()
        self.progress = a.progress if a.progress != "auto" else ("table" if tty else "line")
        self.progress_interval = a.progress_interval or (1.0 if self.progress == "table" else 2.0)

    # -- helpers ------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(text, flush=True)

    def write_processes(self) -> None:
        data = {"launcher": os.getpid(),
                "servers": self.topology.pids() if self.topology else {},
                "server_urls": {n: s.url for n, s in self.topology.servers.items()} if self.topology else {},
                "auth": self.auth_dir if self.auth else None,  # the folder of the env files (no secrets here)
                "children": [{"name": c.spec.name, "role": c.spec.role, "region": c.spec.region,
                              "pid": c.proc.pid if c.proc else None, "exit_code": c.poll(),
                              "log": os.path.relpath(c.log_path, self.out)} for c in self.children]}
        tmp = os.path.join(self.out, "processes.json.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, os.path.join(self.out, "processes.json"))

    def start_child(self, spec: ProcSpec) -> Child:
        c = Child(spec, os.path.join(self.out, "logs", f"{spec.name}.log"), self.out)
        c.start()
        self.children.append(c)
        self.write_processes()
        return c

    def by_role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.spec.role == role]

    def check_central(self) -> str | None:
        """A reason if a central role exited (fatal for the run)."""
        for c in self.children:
            if c.spec.role != "learner" and c.poll() is not None:
                return f"{c.spec.name} exited with code {c.poll()} (see {os.path.relpath(c.log_path)})"
        return None

    def on_signal(self, sig: int) -> None:
        if self.stop_signal is not None:  # second Ctrl-C: no more patience
            self.say("diloco up: second signal: killing everything")
            for c in self.children:
                c.signal(signal.SIGKILL)
        self.stop_signal = sig
        if self.stop_event is not None:
            self.stop_event.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True if a stop was requested."""
        try:
            await asyncio.wait_for(self.stop_event.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        return self.stop_event.is_set()

    def show(self, force: bool = False) -> None:
        if self.progress == "none" or self.state is None:
            return
        if self.progress == "table":
            from monitor.cli import CLEAR
            from monitor.metrics_view import render_table

            width = shutil.get_terminal_size((100, 24)).columns
            head = f"diloco up | {time.time() - self.t_start:6.1f}s | {self.status} | out {self.out}"
            if self.state.evals:
                head += f" | initial eval {self.state.evals[0]['eval_loss']:.4f}"
            sys.stdout.write(CLEAR + head[:width] + "\n" + render_table(self.state.snapshot, width=width) + "\n")
            sys.stdout.flush()
        else:
            self.say(self.state.compact_line())

    # -- phases -------------------------------------------------------------------------------------

    async def run(self) -> int:
        from bus.codec import loads_json
        from bus.conn import connect
        from bus.subjects import Subjects
        from bus.topology import make_topology

        loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)
        store = os.path.join(self.out, "nats-store")
        if previous := previous_run(self.out):
            self.say(f"diloco up: replacing the previous run's output in {self.out} ({previous}); "
                     "pass --out DIR to keep it")
        shutil.rmtree(store, ignore_errors=True)  # a fresh run every time: our own folders only
        shutil.rmtree(os.path.join(self.out, "logs"), ignore_errors=True)
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        for stale in ("summary.json", "eval_loss.png", WATCH_ENV):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.out, stale))
        run = self.env["DILOCO_RUN"]
        self.state = RunState(run=run, t0=self.t_start)
        nc = None
        rc = 0
        try:
            os.environ["DILOCO_UP_OUT"] = self.out  # the servers inherit the launcher's environment
            auth_conf, leaf_auth, me = "", None, CommonConfig(run=run)
            if self.auth:
                from bus.auth import init as auth_init
                from bus.auth import parse_env_file

                learners = [(p.learner_id, p.region) for p in self.specs if p.role == "learner"]
                # plain passwords in the 0600 config: the env files next to it hold them anyway, and a
                # bcrypt check per connection costs the shared cores seconds while every role starts
                creds = auth_init(self.auth_dir, run, learners, force=True, hash_mode="plain")
                if self.a.topology == "leaf":  # the same account and users on the hub and every leaf
                    from bus.auth_leaf import leaf_auth_from_init

                    leaf_auth = leaf_auth_from_init(creds, run, self.a.regions)
                else:
                    auth_conf = creds.conf.read_text()
                self.specs = with_credentials(self.specs, creds.env_files)
                mine = parse_env_file(creds.env_files["metrics"].read_text())
                me = CommonConfig(run=run, nats_user=mine["DILOCO_NATS_USER"],
                                  nats_password=mine["DILOCO_NATS_PASSWORD"])
            self.topology = make_topology(self.a.topology, self.a.regions, store, os.path.join(self.out, "logs"),
                                          extra_config=auth_conf, leaf_auth=leaf_auth)
            self.topology.start()  # in the main thread: PR_SET_PDEATHSIG follows the spawning thread
            self.specs = with_urls(self.specs, self.topology.url_for)
            self.write_processes()
            urls = {n: s.url for n, s in self.topology.servers.items()}
            access = ("auth: one user per role" + (" on every server" if leaf_auth else "")
                      + f", credentials in {self.auth_dir}" if self.auth else "auth: off (anonymous access, --no-auth)")
            self.say(f"diloco up: {self.a.topology} topology {urls}; run {run!r}; "
                     f"{self.a.learners} learners over {','.join(self.a.regions)}; "
                     f"{self.env['DILOCO_MAX_STEPS']} steps each; model preset {self.a.model_preset}; {access}; "
                     f"out {self.out}")
            write_watch_env(self.out, self.topology.hub_url, run, me if self.auth else None)
            watch = f"diloco metrics --dir {self.out}"
            self.say(f"diloco up: logs in {os.path.join(self.out, 'logs')}; watch from another terminal with {watch}")
            async def quiet(*_: object) -> None:  # the launcher's own connection logs nothing
                return None

            nc = await connect(dataclasses.replace(me, nats_url=self.topology.hub_url), name="launcher",
                               error_cb=quiet, disconnected_cb=quiet, reconnected_cb=quiet)
            s = Subjects(run)

            async def on_metrics(msg) -> None:
                with contextlib.suppress(Exception):
                    self.state.on_metrics(loads_json(msg.data))

            async def on_event(msg) -> None:
                with contextlib.suppress(Exception):
                    self.state.on_event(loads_json(msg.data))

            await nc.subscribe(s.metrics_all, cb=on_metrics)
            await nc.subscribe(s.event("membership"), cb=on_event)
            await nc.flush()

            self.status = "starting aggregator, monitor, evaluator"
            for spec in self.specs:
                if spec.role != "learner":
                    self.start_child(spec)
            rc = await self.wait_initial_eval()
            if rc == 0 and not self.stop_event.is_set():
                self.status = "training"
                self.t_learners = time.time()
                for spec in self.specs:
                    if spec.role == "learner":
                        self.start_child(spec)
                rc = await self.watch_training()
            if rc == 0 and not self.stop_event.is_set():
                rc = await self.wait_final()
        finally:
            self.status = "stopping"
            if self.stop_signal is not None:
                rc = 130 if self.stop_signal == signal.SIGINT else 143
            # the aggregator last: it merges what the learners sent until they stopped
            await astop_children([self.by_role("learner") + self.by_role("eval") + self.by_role("monitor"),
                                  self.by_role("aggregator")], self.a.stop_timeout, self.say)
            self.write_processes() if self.topology else None
            traffic = {}
            if self.topology is not None:
                with contextlib.suppress(Exception):
                    await asyncio.sleep(0.2)  # let the metrics of stopping processes land
                with contextlib.suppress(Exception):
                    traffic = self.topology.traffic()
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()
            if self.topology is not None:
                self.topology.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            status = ("interrupted" if self.stop_signal is not None else
                      "failed" if self.failure else "completed")
            self.finish(traffic, status)
        if self.failure and rc == 0:
            rc = 1
        return rc

    async def wait_initial_eval(self) -> int:
        deadline = time.monotonic() + self.a.initial_eval_timeout
        next_show = 0.0
        while not self.state.evals:
            why = self.check_central()
            if why:
                self.failure = why
                self.say(f"diloco up: {why}")
                return 1
            if time.monotonic() > deadline:
                self.failure = f"no held-out loss from the evaluator within {self.a.initial_eval_timeout:.0f}s"
                self.say(f"diloco up: {self.failure}")
                return 1
            if time.monotonic() >= next_show:
                self.status = "waiting for the initial evaluation"
                next_show = time.monotonic() + max(5.0, self.progress_interval)
                if self.progress == "line":
                    self.say(f"[{time.time() - self.t_start:6.1f}s] waiting for the evaluator's initial held-out loss")
            if await self.sleep(0.1):
                return 0
        e = self.state.evals[0]
        self.say(f"diloco up: initial held-out loss {e['eval_loss']:.4f} (version {e.get('version')})")
        return 0

    async def watch_training(self) -> int:
        next_show = 0.0
        while True:
            why = self.check_central()
            if why:
                self.failure = why
                self.say(f"diloco up: {why}")
                return 1
            learners = self.by_role("learner")
            if all(c.poll() is not None for c in learners):
                self.t_learners_done = time.time()
                bad = {c.spec.name: c.poll() for c in learners if c.poll() != 0}
                if bad:
                    self.failure = f"learners failed: {bad}"
                    self.say(f"diloco up: {self.failure}")
                self.write_processes()
                return 0
            if time.monotonic() >= next_show:
                self.show()
                next_show = time.monotonic() + self.progress_interval
            if await self.sleep(0.2):
                return 0

    async def wait_final(self) -> int:
        """After the learners: wait until nothing is buffered and the evaluator scored the final versions."""
        self.status = "final merges and evaluation"
        self.say(f"diloco up: learners done after {self.t_learners_done - self.t_learners:.1f}s; "
                 "waiting for the last merges and evaluation")
        deadline = time.monotonic() + self.a.final_timeout
        t_done = self.t_learners_done
        while time.monotonic() < deadline:
            why = self.check_central()
            if why:
                self.failure = why
                return 1
            agg = self.state.aggregator or {}
            fresh = float(agg.get("ts", 0)) > t_done + 1.0
            if fresh and not agg.get("buffered"):
                want = {str(k): int(v) for k, v in (agg.get("versions") or {}).items()}
                last = self.state.evals[-1] if self.state.evals else {}
                got = {str(k): int(v) for k, v in (last.get("versions") or {}).items()}
                if got == want:
                    return 0
            if await self.sleep(0.2):
                return 0
        self.say("diloco up: the final evaluation did not catch up with the last versions in time; "
                 "reporting the newest one")
        return 0

    def finish(self, traffic: dict, status: str) -> None:
        from learner.config import ModelConfig
        from learner.spec import count_params

        try:
            params = count_params(from_env(ModelConfig, self.env).spec())
        except Exception:
            params = 0
        exit_codes = {c.spec.name: c.poll() for c in self.children}
        keys = ("DILOCO_D_MODEL", "DILOCO_N_LAYERS", "DILOCO_N_HEADS", "DILOCO_D_FF", "DILOCO_SEQ_LEN",
                "DILOCO_NUM_FRAGMENTS", "DILOCO_BATCH_SIZE", "DILOCO_SYNC_EVERY", "DILOCO_MAX_STEPS",
                "DILOCO_INNER_LR", "DILOCO_QUANTISER", "DILOCO_QUORUM", "DILOCO_MERGE")
        settings = {"topology": self.a.topology, "auth": self.auth, "regions": self.a.regions, "learners": self.a.learners,
                    "model_preset": self.a.model_preset, "quick": self.a.quick,
                    "env": {k: self.env[k] for k in keys if k in self.env}}
        train = None
        if self.t_learners is not None:
            train = (self.t_learners_done or time.time()) - self.t_learners
        summary = build_summary(state=self.state, specs=self.specs, exit_codes=exit_codes, traffic=traffic,
                                params=params, wall_time_s=time.time() - self.t_start, train_time_s=train,
                                status=status, settings=settings,
                                learner_ended={c.spec.learner_id: c.ended for c in self.by_role("learner")})
        if self.failure:
            summary["failure"] = self.failure
        with open(os.path.join(self.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plotted = plot_eval(summary, self.state, os.path.join(self.out, "eval_loss.png"))
        self.say("")
        self.say(render_summary(summary))
        self.say(f"wrote {os.path.join(self.out, 'summary.json')}"
                 + (f" and {os.path.join(self.out, 'eval_loss.png')}" if plotted else ""))


WATCH_ENV = "watch.env"


def previous_run(out: str) -> str | None:
    """What a previous `diloco up` left in ``out`` (None if nothing): it is about to be replaced."""
    found = [name for name in ("summary.json", "logs", "nats-store") if os.path.exists(os.path.join(out, name))]
    return ", ".join(found) or None


def write_watch_env(out: str, url: str, run: str, me: CommonConfig | None) -> str:
    """``<out>/watch.env`` (0600): what `diloco metrics --dir` and `diloco status --dir` need to
    watch this run: the hub's URL, the run id and, with auth, the read-only metrics user."""
    from bus.auth import _env_value

    rows = [("DILOCO_NATS_URL", url), ("DILOCO_RUN", run)]
    if me is not None and me.nats_user:
        rows += [("DILOCO_NATS_USER", me.nats_user), ("DILOCO_NATS_PASSWORD", me.nats_password)]
    path = os.path.join(out, WATCH_ENV)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# written by `diloco up`: watch this run with `diloco metrics --dir DIR` (secret: 0600)\n")
        f.write("".join(f"{k}={_env_value(v)}\n" for k, v in rows))
    return path


def main(argv: list[str] | None = None) -> int:
    from bus.server import ServerError

    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    launcher = Launcher(a, dict(os.environ))
    validate_envs(launcher.specs)  # ConfigError -> one line, exit 2 (bus.cli)
    os.makedirs(launcher.out, exist_ok=True)
    try:
        return asyncio.run(launcher.run())
    except ServerError as e:
        print(f"diloco up: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"diloco up: {e}", file=sys.stderr)
        sys.exit(2)
