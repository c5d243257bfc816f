"""Chaos harness: a whole run of real processes, faults injected at random, invariants checked.

``ChaosRun`` starts a file-backed nats-server, the aggregator, the monitor, the evaluator and N
learners (tiny JAX model, real loss), each learner behind its own :class:`NetProxy` so its link can
be cut. Faults (seeded): kill -9 of a learner / the aggregator / the monitor / the evaluator and a
restart after a repair time; kill -9 of the nats-server and a restart on the same store; a cut of
one learner's link, healed later. After the trials the learners stop, the aggregator drains, and
the invariants are checked:

* global versions never went back, per fragment (every head publication was recorded live);
* every outer-gradient fragment that JetStream acknowledged was applied exactly once or rejected
  with a counted reason (merge and reject audit events against the GRAD stream's objects);
* training continued: versions advanced in every trial, and the held-out loss at the end is at
  least 20% below the loss of version 0;
* every learner that is alive at the end is active (evicted ones were readmitted);
* no process is left behind.

For runs too long for that end-of-run audit (GRAD and EVENTS are bounded: their oldest messages are
gone by the end), :class:`LiveAudit` keeps the same audit while the run goes (``bench.soak``);
``kill_target`` / ``start_target`` fault one target at once, without a trial's wait for recovery.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field

import orjson
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus.chunks import Assembled, Assembler, Dropped, parse_chunk
from bus.config import CommonConfig
from bus.conn import connect
from bus.procs import popen
from bus.server import EmbeddedServer
from bus.signals import terminate_all
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkConsumer, prompt_fetch
from tests.netproxy import NetProxy
from tests.system import FAST_AGG, FAST_MONITOR, PY, member_states

MODEL = {"DILOCO_D_MODEL": "32", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "2", "DILOCO_D_FF": "64",
         "DILOCO_SEQ_LEN": "32", "DILOCO_NUM_FRAGMENTS": "4", "DILOCO_MAX_INNER_LR": "0.003"}
LEARNER = {"DILOCO_COMPUTE": "model", "DILOCO_BATCH_SIZE": "8", "DILOCO_SYNC_EVERY": "8",
           "DILOCO_INNER_LR": "0.003", "DILOCO_WARMUP_STEPS": "5", "DILOCO_TOTAL_STEPS": "1000000",
           "DILOCO_HEARTBEAT_INTERVAL": "0.2", "DILOCO_DATA_MAX_BYTES": "300000", "DILOCO_QUANTISER": "int8"}
EVAL = {"DILOCO_EVAL_INTERVAL": "1.0", "DILOCO_EVAL_BATCHES": "4", "DILOCO_EVAL_BATCH_SIZE": "8",
        "DILOCO_DATA_MAX_BYTES": "300000"}
LOSS_FALL = 0.8  # loss_fell: the final held-out loss is at least 20% below that of version 0
FAULTS = ("kill_learner", "kill_aggregator", "kill_monitor", "kill_evaluator", "kill_server", "cut_learner")


@dataclass
class Trial:
    fault: str
    target: str
    versions_before: int
    versions_after: int = 0
    ok: bool = False


@dataclass
class Report:
    trials: list[Trial] = field(default_factory=list)
    invariants: dict[str, bool] = field(default_factory=dict)
    details: dict = field(default_factory=dict)


class ChaosRun:
    def __init__(self, workdir: str, learners: int = 3, seed: int = 0, run: str = "chaos",
                 learner_env: dict | None = None, agg_env: dict | None = None, monitor_env: dict | None = None):
        self.workdir, self.n, self.run = workdir, learners, run
        self.monitor_env = {**FAST_MONITOR, **(monitor_env or {})}
        self.learner_env = {**LEARNER, **(learner_env or {})}
        self.agg_env = dict(agg_env or {})
        self.rng = random.Random(seed)
        self.s = Subjects(run)
        self.server = EmbeddedServer(store_dir=os.path.join(workdir, "store"),
                                     log_file=os.path.join(workdir, "nats.log"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.all_pids: set[int] = set()
        self.proxies: dict[str, NetProxy] = {}
        self.heads: list[tuple[int, int]] = []
        self.newest: dict[int, int] = {}  # fragment -> newest version seen (kept as heads arrive)
        self.head_crc: list[tuple[float, int, int, int | None]] = []  # (monotonic, fragment, version, crc of its blob)
        self.evals: list[tuple[float, float, int]] = []
        self.report = Report()

    # -- processes --------------------------------------------------------------------------------

    def _env(self, url: str, **extra: str) -> dict:
        e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
        e.update(MODEL)
        e.update(DILOCO_NATS_URL=url, DILOCO_RUN=self.run, DILOCO_METRICS_INTERVAL="0.5", JAX_PLATFORMS="cpu")
        e.update(extra)
        return e

    def start(self, name: str) -> None:
        if name == "aggregator":
            env = self._env(self.server.url, **{**FAST_AGG, "DILOCO_MAX_STALENESS": "64", "DILOCO_ACK_WAIT": "3",
                                                "DILOCO_CLIP_REFERENCE_STEPS": LEARNER["DILOCO_SYNC_EVERY"],
                                                "DILOCO_EMBEDDED_MONITOR": "false",  # the monitor is killed on its own
                                                **self.agg_env})
        elif name == "monitor":
            env = self._env(self.server.url, **self.monitor_env)
        elif name == "evaluator":
            env = self._env(self.server.url, **EVAL)
        else:
            env = self._env(self.proxies[name].url, **self.learner_env, DILOCO_LEARNER_ID=name,
                            DILOCO_NUM_LEARNERS=str(self.n))
        module = {"aggregator": "aggregator", "monitor": "monitor", "evaluator": "learner.evaluator"}.get(name, "learner")
        args = {"learner.evaluator": [PY, "-m", "diloco.cli", "eval"],
                "aggregator": [PY, "-m", "diloco.cli", "aggregator"]}.get(module, [PY, "-m", module])
        log = open(os.path.join(self.workdir, f"{name}.log"), "ab")
        p = popen(args, env=env, stdout=log, stderr=log)  # dies with us, even if we are SIGKILLed
        log.close()
        self.procs[name] = p
        self.all_pids.add(p.pid)

    def kill(self, name: str) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait(30)

    def pid_of(self, name: str) -> int | None:
        """The pid of ``name`` (a role, or ``server``) if it is running."""
        p = self.server.proc if name == "server" else self.procs.get(name)
        return p.pid if p is not None and p.poll() is None else None

    async def kill_target(self, name: str) -> None:
        """kill -9 of a role or of the nats-server, at once (no restart, no wait for recovery)."""
        if name == "server":
            self.server.kill()
        else:
            self.kill(name)

    async def start_target(self, name: str, server_timeout: float = 90) -> None:
        """Start a role again, or the nats-server on its file store and ports (returns once healthy:
        JetStream recovers the store first, slow on a loaded machine)."""
        if name == "server":
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.server.start(timeout=server_timeout))
        else:
            self.start(name)

    @property
    def learners(self) -> list[str]:
        return [f"l{i}" for i in range(self.n)]

    # -- observation ------------------------------------------------------------------------------

    async def _observe(self) -> None:
        async def on_head(m):
            try:
                h = orjson.loads(m.data)
                f, v = int(h["f"]), int(h["v"])
                self.heads.append((f, v))
                self.newest[f] = max(self.newest.get(f, -1), v)
                self.head_crc.append((time.monotonic(), f, v, h.get("c")))
            except Exception:
                pass

        async def on_metrics(m):
            try:
                d = orjson.loads(m.data)
                if d.get("role") == "evaluator" and d.get("eval_loss") is not None and "evaluated_at" not in d:
                    self.evals.append((time.time(), float(d["eval_loss"]), int(d["version"])))
            except Exception:
                pass

        await self.nc.subscribe(self.s.versioned_heads(GLOBAL), cb=on_head)
        await self.nc.subscribe(f"{self.s.prefix}.metrics.evaluator.*", cb=on_metrics)

    def total_version(self) -> int:
        return sum(self.newest.values())

    def versions_monotonic(self) -> bool:
        """No fragment's version ever went back, over every head publication recorded live."""
        last: dict[int, int] = {}
        mono = True
        for f, v in self.heads:
            mono &= v >= last.get(f, -1)
            last[f] = max(last.get(f, -1), v)
        return mono

    # -- the run ----------------------------------------------------------------------------------

    async def setup(self) -> None:
        self.server.start()
        self.nc = await connect(CommonConfig(nats_url=self.server.url, run=self.run), "chaos-observer")
        self.js = self.nc.jetstream(timeout=10)
        await self._observe()
        for name in self.learners:
            self.proxies[name] = NetProxy("127.0.0.1", self.server.port)
        for name in ("aggregator", "monitor", "evaluator", *self.learners):
            self.start(name)

    async def wait_until(self, pred, timeout: float) -> bool:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if await pred():
                return True
            await asyncio.sleep(0.2)
        return False

    async def all_active(self) -> bool:
        st = await member_states(self.js, self.run)
        return all(st.get(n) == "active" for n in self.learners)

    async def warm_up(self, timeout: float = 120) -> None:
        async def training():
            return self.total_version() >= 2 * len(self.learners) and await self.all_active()
        if not await self.wait_until(training, timeout):
            raise RuntimeError(f"the run did not start: versions {self.total_version()}, "
                               f"members {await member_states(self.js, self.run)}")

    async def trial(self, fault: str | None = None) -> Trial:
        fault = fault or self.rng.choice(FAULTS)
        target = self.rng.choice(self.learners) if fault in ("kill_learner", "cut_learner") else fault.split("_")[1]
        t = Trial(fault, target, self.total_version())
        down = self.rng.uniform(0.5, 2.5)
        if fault == "kill_server":
            self.server.kill()
            await asyncio.sleep(down)
            # JetStream recovers the file store before it is healthy: slow on a loaded machine
            await asyncio.get_running_loop().run_in_executor(None, lambda: self.server.start(timeout=90))
        elif fault == "cut_learner":
            self.proxies[target].cut()
            await asyncio.sleep(down + 1.5)  # past the eviction timeout
            self.proxies[target].heal()
        else:
            self.kill(target)
            await asyncio.sleep(down)
            self.start(target)
        # training continues: versions advance past where they were, and everyone is back
        async def recovered():
            return self.total_version() > t.versions_before + len(self.learners) and await self.all_active()
        t.ok = await self.wait_until(recovered, 90)
        t.versions_after = self.total_version()
        self.report.trials.append(t)
        return t

    async def drain_and_check(self, settle: float = 30.0) -> Report:
        # let the run recover from the last fault before judging the loss (a cut learner's backlog
        # of stale outer gradients, for example, is a transient: it is discounted, not dropped)
        first = min(self.evals, key=lambda e: e[2])[1] if self.evals else float("inf")
        t_end = time.monotonic() + settle
        mark = time.time()
        while time.monotonic() < t_end:
            if any(ts > mark and loss < LOSS_FALL * first for ts, loss, _ in self.evals):
                break
            await asyncio.sleep(0.5)
        self.stop_learners()
        inv = self.report.invariants
        # versions monotonic per fragment, as every head publication was seen live
        inv["versions_monotonic"] = self.versions_monotonic()
        # every acknowledged contribution applied exactly once or rejected with a reason
        published = await self._published_keys()
        applied, rejected = await self._audit(published)
        twice = len(applied) - len(set(applied))
        lost = published - set(applied) - rejected
        inv["none_applied_twice"] = twice == 0
        inv["none_lost"] = not lost
        self.report.details.update(published=len(published), applied=len(applied), rejected=len(rejected),
                                   lost=len(lost), applied_twice=twice)
        # training continued and the loss fell
        inv["versions_advanced_every_trial"] = all(t.ok for t in self.report.trials)
        if self.evals:
            e0 = min(self.evals, key=lambda e: e[2])
            final = max(self.evals, key=lambda e: (e[2], e[0]))
            self.report.details.update(initial_eval_loss=e0[1], final_eval_loss=final[1])
            inv["loss_fell"] = final[1] < LOSS_FALL * e0[1]
        else:
            inv["loss_fell"] = False
        return self.report

    def stop_learners(self, timeout: float = 30) -> None:
        """SIGTERM every learner (each sends what it has not sent yet), kill -9 the ones still there after ``timeout``."""
        for name in self.learners:
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name in self.learners:
            try:
                self.procs[name].wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(name)

    async def _published_keys(self) -> set[tuple]:
        return await published_keys(self.js, self.s)

    async def settle(self, timeout: float) -> bool:
        """Wait until the versions stop advancing and the evaluator has read the newest (the final
        syncs merged and evaluated)."""
        last = self.total_version()

        async def settled():
            nonlocal last
            now, prev = self.total_version(), last
            last = now
            return now == prev and self.evals and self.evals[-1][2] == now

        await asyncio.sleep(2)
        return await self.wait_until(settled, timeout)

    async def _audit(self, published: set[tuple], timeout: float = 60) -> tuple[list, set]:
        """Applied keys (with repeats) from merge events and rejected keys, once they cover ``published``."""
        applied_by_version, rejected = await audit_events(self.js, self.s, published, timeout)
        return [k for keys in applied_by_version.values() for k in keys], rejected

    async def close(self) -> None:
        terminate_all(self.procs.values(), 15)
        for px in self.proxies.values():
            px.close()
        try:
            await self.nc.close()
        except Exception:
            pass
        self.server.close()
        alive = [pid for pid in self.all_pids if _alive(pid)]
        self.report.invariants["no_orphans"] = not alive and self.server.proc is None


def rss_mib(pid: int) -> float | None:
    """Resident set (``VmRSS`` of /proc/PID/status) of process ``pid`` in MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


class StreamTail:
    """Every message of one JetStream stream, in order, through server restarts (for a run too long
    for an audit at the end: GRAD and EVENTS are bounded, so their oldest messages are gone by then).

    An ephemeral pull consumer (no acks) from the next stream sequence not seen yet; whenever it
    fails or falls silent while the stream holds newer messages (a server restart drops ephemeral
    consumers), a new one starts from that sequence. Sequences skipped (discarded by the stream's
    limits before they were read) are counted in ``gaps``: an audit is complete only with none."""

    def __init__(self, js, stream: str, on_msg, batch: int = 256):
        self.js, self.stream, self.on_msg, self.batch = js, stream, on_msg, batch
        self.next_seq = 1
        self.gaps = 0
        self.seen = 0
        self.consumers = 0  # consumers created (one more after every server restart, say)
        self.caught_up = False  # the last fetch said nothing more was pending

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            sub = None
            try:
                info = await self.js.add_consumer(self.stream, ConsumerConfig(
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.next_seq,
                    ack_policy=AckPolicy.NONE, inactive_threshold=60.0, mem_storage=True, num_replicas=1))
                sub = await self.js.pull_subscribe_bind(info.name, self.stream, pending_bytes_limit=256 * 1024 * 1024)
                idle = 0
                while not stop.is_set():
                    try:
                        msgs = await prompt_fetch(sub, self.batch, 1.0)
                    except (asyncio.TimeoutError, TimeoutError):
                        msgs = []
                    if not msgs:
                        idle += 1
                        if idle % 3 == 0:  # silent: is the consumer still there and the stream idle?
                            si = await self.js.stream_info(self.stream)
                            if si.state.last_seq >= self.next_seq:
                                break  # it should have delivered: a new consumer from next_seq
                            self.caught_up = True
                        continue
                    idle = 0
                    for m in msgs:
                        seq = m.metadata.sequence.stream
                        if seq < self.next_seq:
                            continue  # delivered again by a consumer that started earlier
                        self.gaps += seq - self.next_seq
                        self.next_seq = seq + 1
                        self.seen += 1
                        self.on_msg(m)
                    self.caught_up = int(msgs[-1].metadata.num_pending) == 0
            except asyncio.CancelledError:
                raise
            except Exception:  # the server is down or restarting: try again from next_seq
                await asyncio.sleep(0.5)
            finally:
                self.consumers += 1
                if sub is not None:
                    try:
                        await sub.unsubscribe()
                    except Exception:
                        pass

    async def wait_caught_up(self, timeout: float) -> bool:
        """Caught up with the stream's last message as it is now (True), or ``timeout`` passed."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            try:
                last = (await self.js.stream_info(self.stream)).state.last_seq
                if self.next_seq > last:
                    return True
            except Exception:
                pass
            await asyncio.sleep(0.5)
        return False


class LiveAudit:
    """The chaos audit (acknowledged contributions vs merge and reject events) kept live for the
    whole run: GRAD's complete objects and EVENTS' merge and reject events as they are stored, by
    :class:`StreamTail`. Same definitions as :meth:`ChaosRun.drain_and_check`: a contribution is
    acknowledged when every chunk of its object is in GRAD; applied keys come from merge events (a
    version's last event counts: a redone version replaces the first), rejected ones from reject
    events that name a learner and a round."""

    def __init__(self, js, s: Subjects):
        self.s = s
        self.assembler = Assembler(max_age=600.0)
        self.published: set[tuple] = set()
        self.partial = 0  # objects never completed (a learner killed mid-publish, say): not acknowledged
        self.applied_by_version: dict[tuple[int, int], list] = {}
        self.rejected: dict[tuple, str] = {}  # key -> reason of its first reject event
        self.reasons: dict[str, int] = {}  # reject events by reason (keys or not)
        self.merge_events = 0
        self.grad = StreamTail(js, s.stream("grad"), self._on_grad)
        self.events = StreamTail(js, s.stream("events"), self._on_event)
        self._tasks: list[asyncio.Task] = []
        self._stop = asyncio.Event()

    def _on_grad(self, m) -> None:
        try:
            r = self.assembler.add(parse_chunk(m.headers, m.data), time.monotonic())
        except ValueError:
            return
        if isinstance(r, Assembled):
            meta = r.meta
            self.published.add((meta["learner"], meta["inc"], meta["frag"], meta["round"]))
        elif isinstance(r, Dropped) and r.reason != "duplicate":
            self.partial += 1

    def _on_event(self, m) -> None:
        if m.subject not in (self.merge_subject, self.reject_subject):
            return
        try:
            e = orjson.loads(m.data)
        except Exception:
            return
        if m.subject == self.merge_subject:
            self.merge_events += 1
            self.applied_by_version[(e["fragment"], e["version"])] = [tuple(k) for k in e["applied"]]
        else:
            reason = str(e.get("reason"))
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
            if "learner" in e and "round" in e:
                self.rejected.setdefault((e["learner"], e.get("incarnation"), e["fragment"], e["round"]), reason)

    @property
    def merge_subject(self) -> str:
        return self.s.event("merge")

    @property
    def reject_subject(self) -> str:
        return self.s.event("reject")

    def start(self) -> None:
        self._tasks = [asyncio.create_task(t.run(self._stop)) for t in (self.grad, self.events)]

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def applied(self) -> list:
        """Applied keys, with repeats (a key in two versions' events is there twice)."""
        return [k for keys in self.applied_by_version.values() for k in keys]

    def expire_partials(self) -> None:
        """At the end: objects still incomplete will never complete (counted in ``partial``)."""
        self.partial += len(self.assembler.expire(time.monotonic() + 10 * self.assembler.max_age))

    def counts(self) -> dict:
        applied = self.applied()
        uniq = set(applied)
        return {"acknowledged": len(self.published), "applied": len(self.published & uniq),
                "rejected": len({k for k in self.published if k in self.rejected} - uniq),
                "applied_and_a_copy_rejected": len({k for k in self.published if k in self.rejected} & uniq),
                "lost": len(self.published - uniq - set(self.rejected)),
                "applied_twice": len(applied) - len(uniq),
                "applied_not_acknowledged": len(uniq - self.published),
                "rejected_by_reason": dict(sorted(self.reasons.items())), "merge_events": self.merge_events,
                "partial_objects": self.partial,
                "audit_gaps": {"grad": self.grad.gaps, "events": self.events.gaps},
                "audit_consumers": {"grad": self.grad.consumers, "events": self.events.consumers}}

    def lost(self) -> set:
        return self.published - set(self.applied()) - set(self.rejected)

    async def settle(self, timeout: float) -> bool:
        """Wait until every acknowledged contribution is applied or rejected, with both streams read to
        their ends (the aggregator working through its backlog); False after ``timeout``."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            left = t_end - time.monotonic()
            if (await self.grad.wait_caught_up(min(left, 5.0)) and await self.events.wait_caught_up(min(left, 5.0))
                    and not self.lost()):
                return True
            await asyncio.sleep(0.5)
        return False


async def published_keys(js, s: Subjects, poll_timeout: float = 1.0) -> set[tuple]:
    """Every complete outer gradient in the GRAD stream: what JetStream acknowledged."""
    cons = ChunkConsumer(js, s.stream("grad"), f"audit{int(time.time())}", [s.grad_all], batch=64)
    await cons.start()
    keys: set[tuple] = set()
    idle = 0
    while idle < 3:
        got = await cons.poll(timeout=poll_timeout)
        idle = 0 if got else idle + 1
        for r in got:
            if isinstance(r, Assembled):
                m = r.meta
                keys.add((m["learner"], m["inc"], m["frag"], m["round"]))
    await cons.unsubscribe()
    return keys


async def audit_events(js, s: Subjects, published: set[tuple], timeout: float,
                       poll_timeout: float = 0.3) -> tuple[dict, set]:
    """The merge events' applied keys per (fragment, version) and the rejected keys from the reject
    events, read until they cover ``published`` (or ``timeout``: the aggregator may still be working
    through its backlog)."""
    applied_by_version: dict[tuple[int, int], list] = {}
    rejected: set[tuple] = set()
    merges = await js.subscribe(s.event("merge"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    rejects = await js.subscribe(s.event("reject"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    t_end = time.monotonic() + timeout
    try:
        while True:
            for sub in (merges, rejects):
                while True:  # drain what is there now
                    try:
                        m = await sub.next_msg(timeout=poll_timeout)
                    except Exception:
                        break
                    e = orjson.loads(m.data)
                    if sub is merges:
                        applied_by_version[(e["fragment"], e["version"])] = [tuple(k) for k in e["applied"]]
                    elif "learner" in e and "round" in e:
                        rejected.add((e["learner"], e.get("incarnation"), e["fragment"], e["round"]))
            applied = {k for keys in applied_by_version.values() for k in keys}
            if published <= applied | rejected or time.monotonic() > t_end:
                break
            await asyncio.sleep(0.5)
    finally:
        for sub in (merges, rejects):
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass
    return applied_by_version, rejected


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def table(report: Report) -> str:
    lines = ["| # | fault | target | versions before -> after | recovered |", "| --- | --- | --- | --- | --- |"]
    for i, t in enumerate(report.trials, 1):
        lines.append(f"| {i} | {t.fault} | {t.target} | {t.versions_before} -> {t.versions_after} | "
                     f"{'yes' if t.ok else 'NO'} |")
    lines += ["", "| invariant | held |", "| --- | --- |"]
    lines += [f"| {k} | {'yes' if v else 'NO'} |" for k, v in report.invariants.items()]
    return "\n".join(lines)
