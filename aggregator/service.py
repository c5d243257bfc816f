"""The aggregator service: pull outer gradients, validate, merge on quorum + grace, persist, publish.

Order of a merge of fragment p (what makes a kill -9 at any instant safe):

1. ``merge_step`` (pure) computes state v+1;
2. its merge-log record (contribution keys and GRAD sequences, norms, scale, settings: a few
   hundred bytes) is committed to the STATE stream (write-ahead, ``aggregator.durability``);
3. the contributions' chunk messages are acknowledged;
4. global version v+1 is published (chunks, then head), and a ``merge`` event records which
   contributions it holds;
5. every ``DILOCO_CHECKPOINT_EVERY`` versions (or ``DILOCO_CHECKPOINT_SECONDS``) the whole state
   v+1 (params, optimizer state, applied-set) is checkpointed.

A crash before 2 leaves everything unacked: JetStream redelivers and the merge is redone. A crash
after 2 is finished on restart: the newest checkpoint is loaded and the records after it are
replayed from the contributions the GRAD stream still holds, giving state v+1 bit for bit; it is
ahead of the global head (v), so version v+1 is republished; redelivered contributions are already
in the applied-set and are rejected as ``duplicate``. Nothing acknowledged is lost, nothing is
applied twice.

Several aggregators can share a run, each owning a disjoint fragment range
(``DILOCO_AGG_FRAGMENTS``), each with its own durable consumer.

This module is the process shell (connecting, provisioning, the run's model, metrics, the main
loop, ``main``). The work is a pipeline of objects, each with its own state, one instance each per
aggregator process, joined by per-fragment queues:

* ``aggregator.intake.Intake``: contributions decoded, validated, then buffered per fragment for
  the merge (the buffer is emptied by each merge of its fragment), held until their learner is
  admitted, or rejected (audit events, notices to learners);
* ``aggregator.versions.VersionMaker``: the quorum decision, the merge, the fragments' states;
  recovery at start;
* ``aggregator.durability.MergeLog``: each merge's record committed (one merge per fragment waits
  for it: the fragment merges nothing else meanwhile), checkpoints, replay;
* ``aggregator.encoder.DownlinkEncoder``: each version encoded for the downlink at once (the merge's
  own encoder);
* ``aggregator.publisher.Publisher``: the versions published in order, ``PUBLISH_QUEUE`` per fragment
  at most (beyond it the fragment merges nothing until one is out).

``aggregator.membership.Membership`` says who takes part; intake and merge read it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


from bus.runs import RunMismatch, run_tree
from aggregator.config import AggregatorConfig, parse_fragments
from aggregator.durability import MergeLog
from aggregator.intake import Intake
from aggregator.load import BusyMeter, PhaseClock, saturation_change
from aggregator.publisher import Publisher
from aggregator.membership import Membership
from aggregator.quorum import input_clock
from aggregator.shard_plan import fragments_text
from aggregator.shards import Shards, plan_from_run, wait_for_manifest
from aggregator.store import provision
from aggregator.step import FragmentState
from aggregator.trust import summary as trust_summary
from aggregator.versions import VersionMaker
from bus import codec
from bus.signals import cancel_all, install_stop
from bus.config import CommonConfig, ConfigError, from_env
from bus.conn import ConnectFailed, connect
from bus.log import get_logger, setup
from bus.streams import Limits, LimitsTooSmall, StorageUnavailable, missing_parts
from bus.store_health import StoreWatch, probe_store, write_probe
from bus.subjects import GLOBAL, STATE, Subjects
from bus.transport import ChunkConsumer, ChunkPublisher, VersionedStore


@dataclass
class Stats:
    merges: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    staleness: Counter = field(default_factory=Counter)
    merge_latency: list = field(default_factory=list)  # seconds, first arrival -> published
    queue_wait: list = field(default_factory=list)  # seconds, first arrival -> its merge began
    quorum_wait: float = 0.0
    contributions: Counter = field(default_factory=Counter)  # per learner, applied
    clipped: int = 0  # applied contributions scaled down to their norm cap (bounded influence)
    downweighted: Counter = field(default_factory=Counter)  # per learner, merged below full weight (aggregator.trust)
    distrusted: Counter = field(default_factory=Counter)  # per learner, merged at weight 0
    reference_restarts: int = 0  # norm-outlier references restarted: most learners were refused (OutlierWatch)
    round_holds: int = 0  # lock-step fragments held for the rest of their round (aggregator.rounds)
    round_holds_expired: int = 0  # ... and merged alone after the grace window
    log_bytes: int = 0  # merge-log records written (aggregator.durability)
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    checkpoint_s: float = 0.0
    checkpoints_early: int = 0  # forced: the GRAD stream was about to drop what a replay needs
    checkpoints_early_skipped: int = 0  # ... not written: it would keep fewer bytes replayable than it writes
    replayed: int = 0  # merges replayed from the log at start
    replay_lost: int = 0  # logged merges whose contributions the GRAD stream no longer held
    recovery_s: float = 0.0

    def to_metrics(self) -> dict:
        lat = sorted(self.merge_latency[-200:])
        qw = sorted(self.queue_wait[-200:])
        del self.merge_latency[:-200], self.queue_wait[:-200]
        return {
            "merges": self.merges, "accepted": self.accepted, "rejected": dict(self.rejected),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness.items())},
            "merge_latency_p50": lat[len(lat) // 2] if lat else None,
            "merge_latency_max": lat[-1] if lat else None,
            "queue_wait_p50": round(qw[len(qw) // 2], 4) if qw else None,
            "queue_wait_max": round(qw[-1], 4) if qw else None,
            "quorum_wait_s": round(self.quorum_wait, 3), "contributions": dict(self.contributions),
            "clipped": self.clipped, "reference_restarts": self.reference_restarts,
            "downweighted": dict(self.downweighted), "distrusted": dict(self.distrusted),
            "round_holds": self.round_holds, "round_holds_expired": self.round_holds_expired,
            "log_bytes": self.log_bytes, "checkpoints": self.checkpoints, "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoint_s": round(self.checkpoint_s, 3), "checkpoints_early": self.checkpoints_early,
            "checkpoints_early_skipped": self.checkpoints_early_skipped, "replayed": self.replayed, "replay_lost": self.replay_lost,
            "recovery_s": round(self.recovery_s, 3),
        }

class AggregatorService:
    def __init__(self, common: CommonConfig, cfg: AggregatorConfig):
        """The aggregator knows no model: it merges the tree the run's manifest describes."""
        self.common, self.cfg = common, cfg
        self.s = Subjects(common.run)
        self.plan: Any = None
        self.log = get_logger(role="aggregator", aggregator=cfg.aggregator_id)
        self.states: dict[int, FragmentState] = {}  # the merge stage's; the other stages read them
        self.merge_log: MergeLog | None = None  # the merge-log stage (aggregator.durability), made in run()
        self.publisher: Publisher | None = None  # the publishing stage (aggregator.publisher), made in run()
        self.manifest: Any = None  # the run's manifest: the tree, its plan, the declared geometry
        self.stats = Stats()
        self.load = BusyMeter()  # the share of time spent on intake and merges (aggregator.load)
        self.loop_clock = PhaseClock()  # where the loop's wall time goes, by phase (metrics: loop_s)
        self.saturated = False
        # a full store (bus.store_health): merging pauses, nothing is acked or published meanwhile
        self.store_watch = StoreWatch(self.log, "merging paused: no contribution acknowledged, no version or "
                                                "checkpoint written until the store takes writes again")
        # the pipeline's stages and what they read: who takes part, the intake (a buffer per fragment
        # for the merge), the merge (the fragments' states), the merge log and the publisher (the
        # last two made in run(), once connected)
        self.membership = Membership(cfg, common.run, self.log, self.states)
        self.intake = Intake(cfg, common.run, self.log, self.stats, self.membership, self.states, self.store_watch)
        self.versions = VersionMaker(cfg, common.run, self.log, self.stats, self.store_watch, self.membership,
                                     self.intake, self.states)
        self.nc: Any = None

    @property
    def published(self) -> dict[int, int]:
        """Fragment -> newest version whose head and merge event are out (the publishing stage's)."""
        return self.publisher.published if self.publisher is not None else {}

    def _use(self, model_hash: str, plan) -> None:
        """The model this aggregator merges: its hash and fragment plan (and so the fragments it owns)."""
        self.model_hash, self.plan = model_hash, plan
        self.owned = parse_fragments(self.cfg.agg_fragments, plan.num_fragments)
        self.intake.use(plan, self.owned, model_hash, self.manifest)
        self.versions.use(plan, self.owned, model_hash, self.manifest.max_inner_lr)

    async def _model_from_run(self, js, stop: asyncio.Event) -> None:
        """Wait for the run's manifest (its creator: a learner, an island, ``diloco run create``,
        ``diloco up``) and merge the tree it describes, whatever the model."""
        m = await wait_for_manifest(js, self.common.run, stop, self.log)
        if m is not None:
            tree, plan = run_tree(m)
            self.manifest = m
            self._use(m.model_hash, plan)
            self.log.info("model_from_run", params=tree.num_params, fragments=plan.num_fragments,
                          kind=m.spec.get("kind", "builtin"))

    # -- start-up and recovery --------------------------------------------------------------------

    # -- main loop --------------------------------------------------------------------------------

    def _note_load(self, now: float) -> float:
        """The busy share now; says once per change when the aggregator cannot keep up."""
        share = self.load.share(now)
        full = self.load.start is not None and now - self.load.start >= self.load.window
        change = saturation_change(share, self.saturated, full)
        if change is True:
            self.log.warning("aggregator_saturated", busy=round(share, 3), window_s=self.load.window,
                             message="the aggregator is busy all of the time: it merges slower than the learners "
                             "send, so they defer their syncs (each outer gradient then holds more inner steps); "
                             "give it a faster CPU, or split the fragments over several aggregators "
                             "(DILOCO_AGG_FRAGMENTS)")
        elif change is False:
            self.log.info("aggregator_keeping_up", busy=round(share, 3))
        if change is not None:
            self.saturated = change
        return share

    async def _metrics(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            busy = self._note_load(time.monotonic())
            try:
                msg = {"role": "aggregator", "run": self.common.run, "ts": time.time(),
                       "id": self.cfg.aggregator_id, "fragments": fragments_text(self.owned), "pid": os.getpid(),
                       "versions": {str(p): st.version for p, st in self.states.items()},
                       "buffered": {str(p): len(b) for p, b in self.intake.buffers.items() if b},
                       "held": len(self.intake.hold),
                       "active": len(self.membership.active()), **self.stats.to_metrics(),
                       "busy": round(busy, 3), "saturated": self.saturated, "loop_s": self.loop_clock.rounded(),
                       "trust": trust_summary([st.trust for st in self.states.values()], self.versions.settings.trust),
                       # per fragment: the typical agreement, and whether the check could judge anew
                       # at its newest merge (not with fewer than 4 learners, or agreement at noise level)
                       "trust_typical": {str(p): round(st.trust.typical, 4) for p, st in self.states.items()},
                       "trust_judging": {str(p): st.trust.judging for p, st in self.states.items()},
                       "transport_dropped": dict(self.consumer.stats.dropped or {}), **self.store_watch.metrics()}
                await self.nc.publish(self.s.metrics("aggregator", self.cfg.aggregator_id), codec.dumps_json(msg))
            except Exception as e:
                self.log.warning("metrics_failed", error=repr(e))
            try:
                await asyncio.wait_for(stop.wait(), self.common.metrics_interval)
            except asyncio.TimeoutError:
                pass

    def _busy(self, t0: float) -> None:
        """Count the work since ``t0`` in the busy share; with DILOCO_AGG_SLOWDOWN > 1 (benchmarks and
        tests: an aggregator too slow for its run), block the loop for (slowdown - 1) times it, as a
        slower CPU would (intake and merging both stall)."""
        dt = time.monotonic() - t0
        if self.cfg.agg_slowdown > 1.0 and dt > 0:
            time.sleep((self.cfg.agg_slowdown - 1.0) * dt)
            dt *= self.cfg.agg_slowdown
        self.load.add(time.monotonic(), dt)

    async def _start_consumer(self, stop: asyncio.Event) -> None:
        """Create (or find) the durable GRAD consumer, again while the server is away or its
        JetStream not ready: a server restarted while the aggregator started timed the create
        request out and the aggregator exited (test_aggregator_service, once in a loaded suite)."""
        from nats.errors import ConnectionClosedError, NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.errors import ServiceUnavailableError

        delay = 0.5
        while not stop.is_set():
            try:
                await self.consumer.start()
                return
            except (NatsTimeout, NoRespondersError, ConnectionClosedError, ServiceUnavailableError,
                    asyncio.TimeoutError) as e:
                self.log.warning("consumer_start_retry", error=repr(e), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(5.0, 2 * delay)

    async def run(self, stop: asyncio.Event) -> None:
        async def reconnected() -> None:
            await self.membership.reconnected()
            await self.store_watch.reconnected()

        # (after_reconnect, not reconnected_cb: that one replaced the connection's own logging, so the
        # aggregator never said nats_reconnected, and its later disconnects went unsaid)
        self.nc = await connect(self.common, name=f"aggregator-{self.cfg.aggregator_id}", after_reconnect=reconnected)
        # a short timeout: a request sent while the server restarts can go unanswered, and the
        # merge loop must retry it soon rather than stall (it waited 30 s in the chaos run)
        js = self.js = self.nc.jetstream(timeout=5)
        await self._model_from_run(js, stop)
        if stop.is_set():
            return
        # streams sized from the run's parameters (LimitsTooSmall: an explicit limit cannot hold them)
        limits = Limits.for_run(self.common, self.plan.sizes, self.common.run)
        if self.common.stream_max_age < 4 * self.cfg.checkpoint_seconds:
            raise LimitsTooSmall(
                f"DILOCO_STREAM_MAX_AGE={self.common.stream_max_age:g} is too short for "
                f"DILOCO_CHECKPOINT_SECONDS={self.cfg.checkpoint_seconds:g}: the GRAD stream must keep merged "
                f"contributions for a replay of the merge log; set it to at least {4 * self.cfg.checkpoint_seconds:g}")
        if self.cfg.provision:
            await provision(js, self.common.run, limits, self.store_watch, stop)  # waiting while the store is full
        elif missing := await missing_parts(js, self.common.run):
            raise RunMismatch(f"run {self.common.run!r} is not provisioned (missing {', '.join(missing)}) and "
                              "DILOCO_PROVISION=false: create it first with `diloco run create` (admin credentials)")
        self.store_watch.probe = lambda: js.stream_info(self.s.stream(STATE))
        self.store_watch.write_probe = lambda: write_probe(js, self.s.state_probe)
        pub = ChunkPublisher(js, self.common.max_chunk_bytes, self.common.inflight_chunks, watch=self.store_watch,
                             fail_fast=True)
        self.gstore = VersionedStore(js, self.common.run, GLOBAL, pub)
        self.kstore = VersionedStore(js, self.common.run, GLOBAL, pub, tag="k")
        self.sstore = VersionedStore(js, self.common.run, STATE, pub)
        self.publisher = Publisher(js, self.common.run, self.s.event("merge"), self.gstore, self.kstore,
                                   self.store_watch, self.log)
        self.limits = limits
        self.merge_log = MergeLog(js, self.common.run, self.cfg, self.plan, self.model_hash, self.owned,
                                  self.versions.settings.momentum_dtype, self.sstore, self.store_watch, self.stats,
                                  self.log, self.states)
        self.intake.bind(self.nc, js, self.merge_log)
        self.versions.bind(self.merge_log, self.publisher)
        await self.versions.recover(self.gstore, self.kstore)
        lo, hi = self.owned.start, self.owned.stop - 1
        self.consumer = ChunkConsumer(
            js, self.s.stream("grad"), f"agg_{lo}_{hi}", [self.s.grad_fragment_filter(p) for p in self.owned],
            batch=32, ack_wait=self.cfg.ack_wait,
        )
        self.consumer.assembler.max_age = self.common.partial_timeout
        tasks = [asyncio.create_task(self.membership.follow(js, stop))]
        if self.cfg.require_membership:
            # validate nothing before the membership is known: a restarted aggregator rejected the
            # backlog of every active learner as unknown_learner (their work lost)
            try:
                await asyncio.wait_for(self.membership.loaded.wait(), 10)
            except asyncio.TimeoutError:
                self.log.warning("membership_not_loaded", waited_s=10)
        await self._start_consumer(stop)
        tasks.append(asyncio.create_task(self._metrics(stop)))
        if self.versions.settings.trust.mode != "off":
            tasks.append(asyncio.create_task(self.versions.follow_clears(js, stop)))
        self.log.info("aggregator_started", fragments=f"{lo}-{hi}",
                      versions={p: s.version for p, s in self.states.items()})
        last_keepalive = time.monotonic()
        clock = self.loop_clock
        clock.lap("other", time.monotonic())
        try:
            wake = None
            while not stop.is_set():
                now = time.monotonic()
                timeout = 0.2 if wake is None else max(0.01, min(0.2, wake - now))
                got = await self.consumer.poll(timeout=timeout)
                t_poll = clock.lap("poll", time.monotonic())  # when they reached us: each one's arrival
                for r in got:
                    t_in = time.monotonic()
                    await self.intake.handle(r, t_poll)
                    self._busy(t_in)
                self.intake.release_held(clock.lap("intake", time.monotonic()))
                for p in list(self.merge_log.uncommitted):
                    await self.versions.commit(p)
                clock.lap("commit", time.monotonic())
                for p in self.owned:
                    if p in self.publisher.unpublished:
                        await self.versions.publish_global(p)
                clock.lap("publish", time.monotonic())
                await probe_store(js, self.s.state_probe, self.store_watch)  # a full store is noticed even with nothing to merge
                t_m = clock.lap("other", time.monotonic())
                wake = await self.versions.merge_due(input_clock(t_m, self.consumer.drained_at))
                self._busy(t_m)
                await self.merge_log.checkpoints_due(clock.lap("merge", time.monotonic()), self.consumer.durable)
                clock.lap("checkpoint", time.monotonic())
                if self.intake.audit:
                    await self.intake.publish_audit()
                if len(self.intake.feedback):
                    await self.intake.send_feedback()
                if time.monotonic() - last_keepalive > 5:
                    await self.intake.keep_alive()
                    last_keepalive = time.monotonic()
                clock.lap("other", time.monotonic())
            # a clean stop: the queued versions out, and checkpoints so that nothing is left to
            # replay (bounded: a server that is gone must not hold the stop; a replay covers it)
            await self.publisher.drain(10.0)
            try:
                await asyncio.wait_for(self.merge_log.checkpoint_all(), 20.0)
            except asyncio.TimeoutError:
                self.log.warning("stop_checkpoints_timed_out", hint="the next start replays the merge log")
        finally:
            await cancel_all(tasks)
            await self.merge_log.close()  # (a checkpoint cut short: the log covers it)
            await self.consumer.unsubscribe()
            await self.nc.close()
            self.log.info("aggregator_stopped", versions={p: s.version for p, s in self.states.items()})


def main(argv: list[str] | None = None, companions: Sequence[Callable[..., Awaitable[None]]] = ()) -> int:
    """``python -m aggregator``. ``companions``: ``await c(common, cfg, stop)`` run next to the
    aggregator in its loop until it stops (``diloco aggregator``'s embedded monitor); one that
    fails is logged and the aggregator goes on."""
    try:
        common = from_env(CommonConfig)
        cfg = from_env(AggregatorConfig)
    except ConfigError as e:
        print(f"diloco aggregator: {e}", file=sys.stderr)
        return 2
    setup(common.log_level, run=common.run, role="aggregator", island=common.region)
    svc = AggregatorService(common, cfg)

    async def companion(c, stop: asyncio.Event) -> None:
        try:
            await c(common, cfg, stop)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            svc.log.error("companion_failed", companion=getattr(c, "__name__", repr(c)), error=repr(e))

    async def go() -> int:
        stop = asyncio.Event()
        install_stop(stop)
        extra = [asyncio.create_task(companion(c, stop)) for c in companions]
        try:
            # sized from the run: one process, or shard workers each owning whole fragments (aggregator.shards)
            plan = None
            if cfg.agg_fragments == "all" and cfg.agg_shards != 1:
                plan = await plan_from_run(common, cfg, stop, svc.log)
            if plan is not None and len(plan) > 1:
                return await Shards(cfg, plan, svc.log).run(stop)
            if not stop.is_set():
                await svc.run(stop)
            return 0
        finally:
            stop.set()
            if extra:
                _, pending = await asyncio.wait(extra, timeout=10)
                for t in pending:
                    t.cancel()

    try:
        code = asyncio.run(go())
    except RunMismatch as e:
        print(f"diloco aggregator: {e}", file=sys.stderr)
        return 3
    except (LimitsTooSmall, StorageUnavailable) as e:
        print(f"diloco aggregator: {e}", file=sys.stderr)
        return 2
    except ConnectFailed as e:  # the server not reachable at start
        print(f"diloco aggregator: {e}", file=sys.stderr)
        return 4  # bus.entry.EXIT_UNAVAILABLE, as every command
    return code
