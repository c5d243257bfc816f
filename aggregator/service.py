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

This module is the process shell (start-up, recovery, membership, metrics, the main loop,
``main``); ``aggregator.intake`` takes contributions in, ``aggregator.versions`` merges and encodes
each version, and ``aggregator.publisher`` (an object with its own queues) publishes them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import orjson

from bus.runs import RunMismatch, run_tree
from aggregator.admission import AdmissionHold
from aggregator.config import AggregatorConfig, parse_fragments
from aggregator.durability import Durability
from aggregator.feedback import FeedbackQueue
from aggregator.intake import Intake, Pending, VectorPool
from aggregator.load import BusyMeter, PhaseClock, saturation_change
from aggregator.mlog import LogPosition, settings_to_dict
from aggregator.publisher import Publisher
from aggregator.quorum import ArrivalStats, GracePolicy, input_clock
from aggregator.shard_plan import fragments_text
from aggregator.shards import Shards, plan_from_run, wait_for_manifest
from aggregator.step import FragmentState, MergeSettings, run_participants
from aggregator.trust import summary as trust_summary
from aggregator.validate import OutlierWatch
from aggregator.versions import VersionMaker
from bus import codec
from bus.signals import install_stop
from bus.config import CommonConfig, ConfigError, from_env
from bus.conn import ConnectFailed, connect
from bus.downlink import Keyframe, View
from bus.log import get_logger, setup
from bus.streams import Limits, LimitsTooSmall, StorageUnavailable, missing_parts
from bus.store_health import StoreWatch
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

class AggregatorService(Intake, VersionMaker, Durability):
    def __init__(self, common: CommonConfig, cfg: AggregatorConfig):
        """The aggregator knows no model: it merges the tree the run's manifest describes."""
        self.common, self.cfg = common, cfg
        self.s = Subjects(common.run)
        self.plan = None
        self.buffers: dict[int, list[Pending]] = {}
        self.held_since: dict[int, float] = {}  # lock-step fragment -> when it was first held
        # contributions whose learner the monitor has not admitted yet (aggregator/admission.py)
        self.hold = AdmissionHold(cfg.admission_wait, int(cfg.admission_hold_mb * 2**20))
        self.outliers = OutlierWatch()
        self.settings = MergeSettings.from_config(cfg)
        self.grace = GracePolicy(mode=cfg.grace, grace=cfg.grace_seconds, max_grace=cfg.grace_seconds,
                                 gamma=cfg.grace_gamma, tau=cfg.tau)
        self.log = get_logger(role="aggregator", aggregator=cfg.aggregator_id)
        self.states: dict[int, FragmentState] = {}
        # newest keyframe per fragment (quantised downlink); after a restart taken back from the
        # keyframe subjects while current (see _recover_keyframe)
        self.keys: dict[int, Keyframe] = {}
        # a chained downlink (DILOCO_DOWNLINK_CHAIN): per fragment, the newest version as readers
        # reconstruct it; after a restart taken back from the keyframe subjects (_recover_view)
        self.views: dict[int, View] = {}
        self.logpos: dict[int, LogPosition] = {}  # per fragment: newest checkpoint, log beyond it
        self.uncommitted: dict[int, tuple] = {}  # fragment -> a merge whose log record is not stored yet
        self.publisher: Publisher | None = None  # the publishing stage (aggregator.publisher), made in run()
        # the merged outer gradient's buffer, reused, where the merge is not applied block by block
        # (not with the defaults: aggregator.step.fuses); one merge at a time: every fragment merges
        # into its first values (one per fragment size took 4 of 8 fragments' worth at 1B)
        self.accum: np.ndarray | None = None
        self.pool = VectorPool()  # decoded contributions' buffers, reused (aggregator.intake)
        self._ckpt_size: dict[int, int] = {}  # fragment -> bytes of its newest checkpoint
        self._ckpt_tasks: dict[int, asyncio.Task] = {}  # fragment -> its checkpoint being stored
        self._logseqs: dict[int, deque] = {}  # fragment -> (version, oldest GRAD seq) of records committed
        self._grad_checked = 0.0  # when the GRAD stream's first sequence was last looked at
        self._grad_limit = 0  # ... and its byte limit then
        self._grad_behind = False  # ... and whether it held mostly work not read yet (aggregator.mlog)
        self.members: dict[str, str] = {}  # learner -> membership state
        self.seen: set[str] = set()
        # without a monitor: learner -> incarnation whose final sync came (it sends nothing more, and
        # rounds stop waiting for it; what it sent is still merged, as a monitor's "left")
        self.finished: dict[str, str] = {}
        self.members_loaded = asyncio.Event()  # the members bucket's initial values arrived
        self.members_rewatch = asyncio.Event()  # the connection came back: watch the bucket anew
        self.recent: dict[str, float] = {}  # learner -> monotonic time of its newest accepted contribution
        self.suspected: dict[str, str] = {}  # learner -> the reason aggregator.trust suspects it ("" : trusted)
        self.trust_clears: dict[str, int] = {}  # learner -> its newest operator clear (bus.trust_clears)
        self.manifest = None  # the run's manifest: the tree, its plan, the declared geometry
        self.arrivals = ArrivalStats()
        self.stats = Stats()
        self.load = BusyMeter()  # the share of time spent on intake and merges (aggregator.load)
        self.loop_clock = PhaseClock()  # where the loop's wall time goes, by phase (metrics: loop_s)
        self.saturated = False
        self._audit: list[tuple[dict, list]] = []  # (rejection event, its messages): published, then terminated
        self.feedback = FeedbackQueue()  # notices to learners of their work rejected or held
        # a full store (bus.store_health): merging pauses, nothing is acked or published meanwhile
        self.store_watch = StoreWatch(self.log, "merging paused: no contribution acknowledged, no version or "
                                                "checkpoint written until the store takes writes again")
        self.nc = None

    @property
    def published(self) -> dict[int, int]:
        """Fragment -> newest version whose head and merge event are out (the publishing stage's)."""
        return self.publisher.published if self.publisher is not None else {}

    def _use(self, model_hash: str, plan) -> None:
        """The model this aggregator merges: its hash and fragment plan (and so the fragments it owns)."""
        self.model_hash, self.plan = model_hash, plan
        self.owned = parse_fragments(self.cfg.agg_fragments, plan.num_fragments)
        self.buffers = {p: [] for p in self.owned}

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

    # -- membership -------------------------------------------------------------------------------

    def active(self) -> set[str]:
        if not self.cfg.require_membership:
            return set(self.seen) - set(self.finished)
        return {k for k, st in self.members.items() if st == "active"}

    def leavers(self) -> set[str]:
        """Learners that left (done, not failed): what they sent before leaving is still merged."""
        return {k for k, st in self.members.items() if st == "left"} if self.cfg.require_membership else set(self.finished)

    def participants(self, now: float) -> set[str]:
        """Learners taking part in the run for the participation scale and the staleness rounds
        (:func:`aggregator.step.run_participants`): the active ones, the leavers with work merged
        here, and those whose contributions arrived within DILOCO_PARTICIPATION_WINDOW seconds.
        Without a monitor the leavers are the final syncs this process has seen: a restart forgets
        them (the monitor's members bucket keeps its ``left``).

        The active set alone swings with membership: a server restart or a short cut gets learners
        evicted for a moment, and a merge in that moment would scale its one learner's outer
        gradient as if it were the whole run (the chaos run's divergence; docs/RELIABILITY.md)."""
        leavers = self.leavers()  # (a few; checked per contribution and per merge)
        merged = {x for x in leavers if any(st.applied.holds(x) for st in self.states.values())}
        return run_participants(self.active(), leavers, self.recent, now, self.cfg.participation_window, merged)

    def known(self) -> set[str]:
        return set(self.seen) if not self.cfg.require_membership else set(self.members)

    async def _follow_membership(self, js, stop: asyncio.Event) -> None:
        """The members bucket, watched; watched anew whenever the connection comes back. A watch
        that outlives a server restart went on silently for 5-14 s (nats-py's ordered consumer
        notices its lost consumer only after two missed heartbeats): learners the monitor had
        readmitted meanwhile still counted as evicted here, and their work was rejected as
        ``inactive_learner`` (bench.soak: 571 contributions in one 6-minute run)."""
        while not stop.is_set():
            reader = w = None
            try:
                self.members_rewatch.clear()  # before the watch: a reconnect during its set-up counts
                kv = await js.key_value(self.s.bucket("members"))
                w = await kv.watchall()
                reader = asyncio.create_task(self._read_members(w, stop))
                rewatch = asyncio.create_task(self.members_rewatch.wait())
                try:
                    await asyncio.wait({reader, rewatch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    rewatch.cancel()
                if reader.done():
                    reader.result()  # what ended the watch (raises its error)
                    continue
                self.log.info("membership_rewatch", members=len(self.members))
                reader.cancel()
                try:
                    await w.stop()
                except Exception:  # noqa: BLE001 - the old consumer may be gone with the old server
                    pass
            except asyncio.CancelledError:
                if reader is not None:
                    reader.cancel()
                raise
            except Exception as e:
                self.log.warning("membership_watch_error", error=repr(e))
                if w is not None:
                    try:
                        await w.stop()
                    except Exception:  # noqa: BLE001
                        pass
                await asyncio.sleep(1.0)

    async def _read_members(self, w, stop: asyncio.Event) -> None:
        fresh: dict[str, str] | None = {}  # the initial values, until they are all in
        async for e in w:
            if stop.is_set():
                break
            if e is None:  # the initial values are all in: they replace what was known
                if fresh is not None:
                    self.members.clear()
                    self.members.update(fresh)
                    fresh = None
                self.members_loaded.set()
                continue
            into = self.members if fresh is None else fresh
            if e.operation in ("DEL", "PURGE") or e.value is None:
                into.pop(e.key, None)
                continue
            try:
                into[e.key] = str(orjson.loads(e.value).get("state", ""))
            except Exception:
                self.log.warning("bad_member_record", key=e.key)

    async def _on_reconnected(self) -> None:
        self.members_rewatch.set()

    # -- start-up and recovery --------------------------------------------------------------------

    async def _recover_view(self, p: int) -> None:
        """A chained downlink after a (re)start: the newest reconstruction on the keyframe subjects
        (the aggregator puts each version's there before its head). The next version published is
        a delta against it if it is the previous version, the view itself whole if it is that
        version, else the exact parameters whole (bus.downlink.encode_chain)."""
        for attempt in range(6):
            try:
                got = await self.kstore.get(p)
                break
            except Exception as e:
                # going on without the view would publish the exact parameters whole at a version
                # the keyframe subjects may hold already (another content): GLOBAL would skip it
                self.log.warning("view_recovery_failed", fragment=p, error=repr(e), attempt=attempt + 1)
                if attempt == 5:
                    raise RuntimeError(f"fragment {p}: the chained downlink's view cannot be read from the "
                                       f"keyframe subjects ({e!r})") from None
                await asyncio.sleep(0.5 * 2**attempt)
        if got is None:
            return
        head, blob = got
        try:
            vec = np.array(codec.decode_array(blob), dtype=np.float32).reshape(-1)
        except codec.CodecError as e:
            self.log.warning("view_recovery_failed", fragment=p, version=head.version, error=str(e))
            return
        if vec.size == self.plan.sizes[p] and np.isfinite(vec).all():
            self.views[p] = View(head.version, vec)

    async def _recover_keyframe(self, p: int, st: FragmentState) -> None:
        """Quantised downlink: the keyframe deltas refer to after a (re)start. The newest one on the
        keyframe subjects while it is still current; else, for a fresh fragment, version 0 (every
        reader holds it whole, learners build it from the seed), put on the keyframe subjects for
        readers that join later. Otherwise the first version published is a keyframe."""
        if self.cfg.downlink_chain:
            if p not in self.views and st.version == 0:  # every reader holds version 0 whole
                self.views[p] = View(0, np.array(st.params, dtype=np.float32, copy=True))
            return
        if self.settings.downlink_quantiser == "fp32":
            return
        got = await self.kstore.get(p)
        if got is not None:
            head, blob = got
            if head.version <= st.version and st.version - head.version < self.cfg.keyframe_every:
                # its values are the blob's (an fp32 blob decodes to a view on it): no second copy
                self.keys[p] = Keyframe(head.version, np.asarray(codec.decode_array(blob), dtype=np.float32).reshape(-1))
                return
        if st.version == 0:
            blob = codec.encode_array(st.params)
            await self.kstore.put(p, 0, blob, {"model": self.model_hash, "plan": self.plan.plan_hash(), "key": 0})
            self.keys[p] = Keyframe(0, codec.decode_array(blob).reshape(-1))  # the blob's values: a copy

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
                       "buffered": {str(p): len(b) for p, b in self.buffers.items() if b},
                       "held": len(self.hold),
                       "active": len(self.active()), **self.stats.to_metrics(),
                       "busy": round(busy, 3), "saturated": self.saturated, "loop_s": self.loop_clock.rounded(),
                       "trust": trust_summary([st.trust for st in self.states.values()], self.settings.trust),
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

    async def _follow_clears(self, js, stop: asyncio.Event, every: float = 2.0) -> None:
        """The operator's clears of the learners this aggregator holds trust records for, read every
        ``every`` seconds; each fragment applies a new one at its next merge (aggregator.versions)."""
        from bus.trust_clears import read_clears

        while not stop.is_set():
            known = {x for st in self.states.values() for x in st.trust.learners}
            try:
                for x, n in (await read_clears(js, self.common.run, known)).items():
                    if n > self.trust_clears.get(x, 0):
                        self.log.warning("trust_clear_received", learner=x, clear=n,
                                         hint="its trust records are forgotten at each fragment's next merge")
                        self.trust_clears[x] = n
                        self.suspected.pop(x, None)
            except Exception as e:  # noqa: BLE001 - a server restart: read again on the next pass
                self.log.debug("trust_clears_unreadable", error=repr(e))
            try:
                await asyncio.wait_for(stop.wait(), every)
            except asyncio.TimeoutError:
                pass

    async def _keep_alive_held(self) -> None:
        """Tell JetStream we still work on held chunks so they are not redelivered while buffered."""
        now = time.monotonic()
        for buf in [*self.buffers.values(), [h.item for h in self.hold.items]]:
            for x in buf:
                if now - x.arrived > self.cfg.ack_wait / 3:
                    for m in x.tokens:
                        try:
                            await m.in_progress()
                        except Exception:
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
        self.nc = await connect(self.common, name=f"aggregator-{self.cfg.aggregator_id}",
                                reconnected_cb=self._on_reconnected)
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
            await self._provision(js, limits, stop)  # ensure_run, waiting while the store is full
        elif missing := await missing_parts(js, self.common.run):
            raise RunMismatch(f"run {self.common.run!r} is not provisioned (missing {', '.join(missing)}) and "
                              "DILOCO_PROVISION=false: create it first with `diloco run create` (admin credentials)")
        self.store_watch.probe = lambda: js.stream_info(self.s.stream(STATE))
        self.store_watch.write_probe = self._write_probe
        pub = ChunkPublisher(js, self.common.max_chunk_bytes, self.common.inflight_chunks, watch=self.store_watch,
                             fail_fast=True)
        self.gstore = VersionedStore(js, self.common.run, GLOBAL, pub)
        self.kstore = VersionedStore(js, self.common.run, GLOBAL, pub, tag="k")
        self.sstore = VersionedStore(js, self.common.run, STATE, pub)
        self.publisher = Publisher(js, self.common.run, self.s.event("merge"), self.gstore, self.kstore,
                                   self.store_watch, self.log)
        self.settings = dataclasses.replace(self.settings, max_inner_lr=self.manifest.max_inner_lr)
        self.settings_dict = settings_to_dict(self.settings)
        self.limits = limits
        await self._recover(js)
        lo, hi = self.owned.start, self.owned.stop - 1
        self.consumer = ChunkConsumer(
            js, self.s.stream("grad"), f"agg_{lo}_{hi}", [self.s.grad_fragment_filter(p) for p in self.owned],
            batch=32, ack_wait=self.cfg.ack_wait,
        )
        self.consumer.assembler.max_age = self.common.partial_timeout
        tasks = [asyncio.create_task(self._follow_membership(js, stop))]
        if self.cfg.require_membership:
            # validate nothing before the membership is known: a restarted aggregator rejected the
            # backlog of every active learner as unknown_learner (their work lost)
            try:
                await asyncio.wait_for(self.members_loaded.wait(), 10)
            except asyncio.TimeoutError:
                self.log.warning("membership_not_loaded", waited_s=10)
        await self._start_consumer(stop)
        tasks.append(asyncio.create_task(self._metrics(stop)))
        if self.settings.trust.mode != "off":
            tasks.append(asyncio.create_task(self._follow_clears(js, stop)))
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
                    await self._handle(r, t_poll)
                    self._busy(t_in)
                self._release_held(clock.lap("intake", time.monotonic()))
                for p in list(self.uncommitted):
                    await self._commit(p)
                clock.lap("commit", time.monotonic())
                for p in self.owned:
                    if p in self.publisher.unpublished:
                        await self._publish_global(p)
                clock.lap("publish", time.monotonic())
                await self._probe_store()  # a full store is noticed even with nothing to merge
                t_m = clock.lap("other", time.monotonic())
                wake = await self._merge_due(input_clock(t_m, self.consumer.drained_at))
                self._busy(t_m)
                await self._checkpoints_due(clock.lap("merge", time.monotonic()))
                clock.lap("checkpoint", time.monotonic())
                if self._audit:
                    await self._publish_audit()
                if len(self.feedback):
                    await self._send_feedback()
                if time.monotonic() - last_keepalive > 5:
                    await self._keep_alive_held()
                    last_keepalive = time.monotonic()
                clock.lap("other", time.monotonic())
            # a clean stop: the queued versions out, and checkpoints so that nothing is left to
            # replay (bounded: a server that is gone must not hold the stop; a replay covers it)
            await self.publisher.drain(10.0)
            try:
                await asyncio.wait_for(self._checkpoint_all(), 20.0)
            except asyncio.TimeoutError:
                self.log.warning("stop_checkpoints_timed_out", hint="the next start replays the merge log")
        finally:
            for t in [*tasks, *self._ckpt_tasks.values()]:  # (a checkpoint cut short: the log covers it)
                t.cancel()
            await asyncio.gather(*tasks, *self._ckpt_tasks.values(), return_exceptions=True)
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
