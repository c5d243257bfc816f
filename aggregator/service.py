"""The aggregator service: pull outer gradients, validate, merge on quorum + grace, persist, publish.

Order of a merge of fragment p (what makes a kill -9 at any instant safe):

1. ``merge_step`` (pure) computes state v+1;
2. the state record v+1 is committed to the STATE stream (write-ahead: params, optimizer state,
   applied-set);
3. the contributions' chunk messages are acknowledged;
4. global version v+1 is published (chunks, then head), and a ``merge`` event records which
   contributions it holds.

A crash before 2 leaves everything unacked: JetStream redelivers and the merge is redone. A crash
after 2 is finished on restart: the state (v+1) is ahead of the global head (v), so version v+1 is
republished from the state; redelivered contributions are already in the applied-set and are
rejected as ``duplicate``. Nothing acknowledged is lost, nothing is applied twice.

Several aggregators can share a run, each owning a disjoint fragment range
(``DILOCO_AGG_FRAGMENTS``), each with its own durable consumer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import orjson

from bus.runs import RunMismatch, read_manifest, run_tree
from aggregator.admission import AdmissionHold
from aggregator.config import AggregatorConfig, parse_fragments
from aggregator.contribution import Contribution
from aggregator.merge import l2_norm
from aggregator.quorum import ArrivalStats, GracePolicy, decide
from aggregator.step import FragmentState, MergeSettings, merge_step, participation_scale, round_work
from aggregator.validate import OutlierWatch, Reason, ValidationContext, validate
from bus import codec
from bus.signals import install_stop
from bus.chunks import Assembled, Dropped
from bus.config import CommonConfig, ConfigError, from_env
from bus.conn import connect
from bus.downlink import Keyframe, encode_version
from bus.log import get_logger, setup
from bus.protocol import parse_grad_meta
from bus.streams import Limits, LimitsTooSmall, StorageUnavailable, ensure_run, missing_parts
from bus.subjects import GLOBAL, STATE, Subjects
from bus.transport import ChunkConsumer, ChunkPublisher, VersionConflict, VersionedStore, ack_all, term_all


_AUDIT = ("learner", "incarnation", "fragment", "round", "base", "obj", "subject", "claimed", "detail")


@dataclass
class Pending:
    c: Contribution
    norm: float
    tokens: list
    arrived: float


@dataclass
class Stats:
    merges: int = 0
    accepted: int = 0
    rejected: Counter = field(default_factory=Counter)
    staleness: Counter = field(default_factory=Counter)
    merge_latency: list = field(default_factory=list)  # seconds, first arrival -> published
    quorum_wait: float = 0.0
    contributions: Counter = field(default_factory=Counter)  # per learner, applied
    clipped: int = 0  # applied contributions scaled down to their norm cap (bounded influence)
    reference_restarts: int = 0  # norm-outlier references restarted: most learners were refused (OutlierWatch)

    def to_metrics(self) -> dict:
        lat = sorted(self.merge_latency[-200:])
        return {
            "merges": self.merges, "accepted": self.accepted, "rejected": dict(self.rejected),
            "staleness_hist": {str(k): v for k, v in sorted(self.staleness.items())},
            "merge_latency_p50": lat[len(lat) // 2] if lat else None,
            "merge_latency_max": lat[-1] if lat else None,
            "quorum_wait_s": round(self.quorum_wait, 3), "contributions": dict(self.contributions),
            "clipped": self.clipped, "reference_restarts": self.reference_restarts,
        }


class AggregatorService:
    def __init__(self, common: CommonConfig, cfg: AggregatorConfig):
        """The aggregator knows no model: it merges the tree the run's manifest describes."""
        self.common, self.cfg = common, cfg
        self.s = Subjects(common.run)
        self.plan = None
        self.buffers: dict[int, list[Pending]] = {}
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
        self.unpublished: set[int] = set()
        self.members: dict[str, str] = {}  # learner -> membership state
        self.seen: set[str] = set()
        self.members_loaded = asyncio.Event()  # the members bucket's initial values arrived
        self.recent: dict[str, float] = {}  # learner -> monotonic time of its newest accepted contribution
        self.manifest = None  # the run's manifest: the tree, its plan, the declared geometry
        self.arrivals = ArrivalStats()
        self.stats = Stats()
        self._audit: list[tuple[dict, list]] = []  # (rejection event, its messages): published, then terminated
        self.nc = None

    def _use(self, model_hash: str, plan) -> None:
        """The model this aggregator merges: its hash and fragment plan (and so the fragments it owns)."""
        self.model_hash, self.plan = model_hash, plan
        self.owned = parse_fragments(self.cfg.agg_fragments, plan.num_fragments)
        self.buffers = {p: [] for p in self.owned}

    async def _model_from_run(self, js, stop: asyncio.Event) -> None:
        """Wait for the run's manifest (its creator: a learner, an island, ``diloco run create``,
        ``diloco up``) and merge the tree it describes, whatever the model."""
        logged = False
        while not stop.is_set():
            try:
                m = await read_manifest(js, self.common.run)
            except Exception as e:  # the server restarting: try again
                self.log.warning("manifest_read_failed", error=repr(e))
                m = None
            if m is not None:
                tree, plan = run_tree(m)
                self.manifest = m
                self._use(m.model_hash, plan)
                self.log.info("model_from_run", params=tree.num_params, fragments=plan.num_fragments,
                              kind=m.spec.get("kind", "builtin"))
                return
            if not logged:
                self.log.info("waiting_for_manifest", run=self.common.run,
                              hint="create the run: `diloco run create`, or start a learner or island")
                logged = True
            await asyncio.sleep(0.5)

    # -- membership -------------------------------------------------------------------------------

    def active(self) -> set[str]:
        if not self.cfg.require_membership:
            return set(self.seen)
        return {k for k, st in self.members.items() if st == "active"}

    def leavers(self) -> set[str]:
        """Learners that left (done, not failed): what they sent before leaving is still merged."""
        return {k for k, st in self.members.items() if st == "left"} if self.cfg.require_membership else set()

    def participants(self, now: float) -> set[str]:
        """Learners taking part in the run for the participation scale and the staleness rounds: the
        active ones and those whose contributions arrived within DILOCO_PARTICIPATION_WINDOW seconds.

        The active set alone swings with membership: a server restart or a short cut gets learners
        evicted for a moment, and a merge in that moment would scale its one learner's outer
        gradient as if it were the whole run (the chaos run's divergence; docs/RELIABILITY.md)."""
        window = self.cfg.participation_window
        return self.active() | {k for k, t in self.recent.items() if now - t <= window}

    def known(self) -> set[str]:
        return set(self.seen) if not self.cfg.require_membership else set(self.members)

    async def _follow_membership(self, js, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                kv = await js.key_value(self.s.bucket("members"))
                w = await kv.watchall()
                async for e in w:
                    if stop.is_set():
                        break
                    if e is None:  # the initial values are all in
                        self.members_loaded.set()
                        continue
                    if e.operation in ("DEL", "PURGE") or e.value is None:
                        self.members.pop(e.key, None)
                        continue
                    try:
                        self.members[e.key] = str(orjson.loads(e.value).get("state", ""))
                    except Exception:
                        self.log.warning("bad_member_record", key=e.key)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning("membership_watch_error", error=repr(e))
                await asyncio.sleep(1.0)

    # -- start-up and recovery --------------------------------------------------------------------

    async def _recover(self, js) -> None:
        gstore, sstore = self.gstore, self.sstore
        for p in self.owned:
            got = await sstore.get(p)
            gh = await gstore.head(p)
            if got is None:
                if gh is None:
                    raise RuntimeError(f"fragment {p} has neither state nor global version (the run's creator writes version 0 before the manifest)")
                gh, blob = await gstore.get(p)
                if "ref" in gh.meta:
                    raise RunMismatch(f"fragment {p}: no aggregator state, and global version {gh.version} is a "
                                      "delta against a keyframe: the state stream was lost")
                st = FragmentState.initial(p, gh.version, np.array(codec.decode_array(blob)), self.settings)
                await sstore.put(p, st.version, st.to_bytes(), {"model": self.model_hash})
                self.log.info("fragment_initialised", fragment=p, version=st.version)
            else:
                st = FragmentState.from_bytes(got[1])
                if gh is not None and gh.version > st.version:
                    raise RunMismatch(f"fragment {p}: global version {gh.version} is ahead of our state "
                                      f"{st.version}: is another aggregator owning it?")
                # republish what a crash may have cut short: the global version (if behind) and
                # the merge event of the newest version (deduplicated by its message id)
                self.unpublished.add(p)
                self.log.info("fragment_recovered", fragment=p, version=st.version,
                              global_behind=gh is None or gh.version < st.version)
            self.states[p] = st
            await self._recover_keyframe(p, st)

    async def _recover_keyframe(self, p: int, st: FragmentState) -> None:
        """Quantised downlink: the keyframe deltas refer to after a (re)start. The newest one on the
        keyframe subjects while it is still current; else, for a fresh fragment, version 0 (every
        reader holds it whole, learners build it from the seed), put on the keyframe subjects for
        readers that join later. Otherwise the first version published is a keyframe."""
        if self.settings.downlink_quantiser == "fp32":
            return
        got = await self.kstore.get(p)
        if got is not None:
            head, blob = got
            if head.version <= st.version and st.version - head.version < self.cfg.keyframe_every:
                self.keys[p] = Keyframe(head.version, np.array(codec.decode_array(blob), dtype=np.float32))
                return
        if st.version == 0:
            await self.kstore.put(p, 0, codec.encode_array(st.params),
                                  {"model": self.model_hash, "plan": self.plan.plan_hash(), "key": 0})
            self.keys[p] = Keyframe(0, np.array(st.params, dtype=np.float32, copy=True))

    # -- contributions ----------------------------------------------------------------------------

    def _reject(self, reason: str, tokens=(), **kw) -> None:
        """Count, log and queue the audit event; the rejected messages (``tokens``) are terminated
        only once their event is stored (``_publish_audit``)."""
        self.stats.rejected[reason] += 1
        self.log.warning("contribution_rejected", reason=reason, **kw)
        self._audit.append(({"reason": reason, "ts": time.time(), **{k: v for k, v in kw.items() if k in _AUDIT}},
                            list(tokens)))

    async def _handle(self, r: Assembled | Dropped, now: float) -> None:
        if isinstance(r, Dropped):
            if r.reason == "duplicate":
                return  # a redelivery of something held or done: its original handle settles it
            self._reject(f"transport_{r.reason}", r.tokens, obj=r.obj_id, detail=r.detail)
            return
        try:
            meta = parse_grad_meta(r.meta)
            vec = np.asarray(codec.decode_array(r.blob))  # its shape is checked, never mended
        except (ValueError, codec.CodecError) as e:
            self._reject("malformed", r.tokens, obj=r.obj_id, detail=str(e)[:200])
            return
        subject = getattr(r.tokens[0], "subject", "") if r.tokens else ""
        parts = subject.split(".")
        if len(parts) == 5 and (parts[4] != meta["learner"] or parts[3] != str(meta["frag"])):
            # the subject is what NATS permissions bind to a learner's credentials: metadata that
            # names another learner or fragment than the subject it came on is forged
            self._reject("forged_subject", r.tokens, obj=r.obj_id, subject=subject, claimed=meta["learner"])
            return
        c = Contribution(run=meta["run"], model_hash=meta["model"], learner=meta["learner"],
                         incarnation=meta["inc"], fragment=meta["frag"], round=meta["round"],
                         base_version=meta["base"], inner_steps=meta["steps"], tokens=meta["tokens"], vector=vec,
                         period=meta.get("period", 0))
        if not self.cfg.require_membership and c.run == self.common.run:
            self.seen.add(c.learner)
        norm = l2_norm(vec) if vec.dtype == np.float32 and vec.ndim == 1 else float("nan")
        self._consider(Pending(c, norm, r.tokens, now), now)

    def _consider(self, x: Pending, now: float, since: float | None = None) -> None:
        """Validate a contribution: buffer it for the merge, hold it until its learner is admitted,
        or reject it. ``since``: when it was first held (an item handed back by the hold)."""
        c = x.c
        p = c.fragment
        st = self.states.get(p)
        pending = {b.c.key for b in self.buffers.get(p, [])}
        ctx = ValidationContext(
            run=self.common.run, model_hash=self.model_hash,
            fragment_sizes={q: self.plan.sizes[q] for q in self.owned},
            current_version={q: self.states[q].version for q in self.owned},
            active=self.active() | self.leavers(), known=self.known(),
            applied=st.applied if st else None, pending=pending,
            norms=st.norms if st else None, max_staleness=self.cfg.max_staleness,
            per_round=max(1, len(self.participants(now))),  # as the merge counts rounds
            norm_outlier_factor=self.cfg.norm_outlier_factor, norm_min_history=self.cfg.norm_min_history,
            max_tokens_per_step=self.manifest.max_tokens_per_step, max_inner_lr=self.manifest.max_inner_lr,
        ) if st else None
        reason = "wrong_fragment" if ctx is None else validate(c, ctx, norm=x.norm)
        if (reason in (Reason.unknown_learner, Reason.inactive_learner) and self.cfg.require_membership
                and self.hold.offer(x, c.learner, self.members.get(c.learner), getattr(c.vector, "nbytes", 0),
                                    now, since)):
            if since is None:
                self.log.info("contribution_held", learner=c.learner, state=self.members.get(c.learner),
                              fragment=p, round=c.round, held=len(self.hold))
            return
        if reason == Reason.norm_outlier and st is not None:
            self._watch_outliers(st, c, x.norm)
        if reason is not None:
            self._reject(str(getattr(reason, "value", reason)), x.tokens, learner=c.learner, incarnation=c.incarnation,
                         fragment=p, round=c.round, base=c.base_version, version=st.version if st else None,
                         **({"held_s": round(now - since, 3)} if since is not None else {}))
            return
        if since is not None:
            self.log.info("contribution_admitted", learner=c.learner, fragment=p, round=c.round,
                          held_s=round(now - since, 3))
        self.buffers[p].append(Pending(c, x.norm, x.tokens, now))
        self.recent[c.learner] = now
        self.arrivals = self.arrivals.observe_arrival(c.learner, c.incarnation, now, c.inner_steps)
        self.stats.accepted += 1

    def _watch_outliers(self, st: FragmentState, c: Contribution, norm: float) -> None:
        """Most learners refused as outliers on a fragment: its norm reference is stale (OutlierWatch)."""
        restart = self.outliers.refused(st.fragment, c.learner, norm / max(1, c.inner_steps), self.active())
        if restart is not None:
            st.norms.restart(st.fragment, restart)  # persisted with the fragment's next merge
            self.stats.reference_restarts += 1
            self.log.warning("norm_reference_restarted", fragment=st.fragment, refused_learners=len(restart),
                             norms=[round(x, 6) for x in restart])

    def _release_held(self, now: float) -> None:
        """Decide the held contributions whose learner was admitted, evicted, or waited too long."""
        if len(self.hold):
            for h in self.hold.sweep(self.members.get, now):
                self._consider(h.item, now, since=h.since)

    # -- merging ----------------------------------------------------------------------------------

    async def _maybe_merge(self, p: int, now: float) -> float | None:
        """Merge fragment p if the quorum rule says so; else the time to look again (or None)."""
        buf = self.buffers[p]
        if not buf:
            return None
        contributors: dict[str, float] = {}
        for x in buf:
            contributors[x.c.learner] = min(contributors.get(x.c.learner, x.arrived), x.arrived)
        first = min(x.arrived for x in buf)
        d = decide(now, first, contributors, self.active(), self.cfg.quorum, self.grace, self.arrivals)
        reason = d.reason
        if not d.merge and not self.active():
            # nobody is active any more (all evicted while their contributions were buffered):
            # merge what we hold after the grace window rather than holding it forever
            if now < first + self.cfg.grace_seconds:
                return first + self.cfg.grace_seconds
            reason = "no active learner: merging what is buffered after the grace window"
        elif not d.merge:
            return d.wait_until
        await self._merge(p, now, first, reason)
        return None

    async def _merge(self, p: int, now: float, first: float, reason: str) -> None:
        items = self.buffers[p]
        self.buffers[p] = []
        st = self.states[p]
        t0 = time.monotonic()
        learners = {x.c.learner for x in items}
        participants = self.participants(now) | learners
        scale = (participation_scale(round_work([x.c for x in items]), len(participants))
                 if self.cfg.scale_by_participation else 1.0)
        per_round = max(1, len(participants))
        new = merge_step(st, [x.c for x in items], self.settings, [x.norm for x in items], scale, per_round)
        try:
            await self.sstore.put(p, new.version, new.to_bytes(), {"model": self.model_hash})
        except VersionConflict as e:
            await self._adopt_committed_state(p, items, e)
            return
        except Exception as e:  # state not committed: keep the contributions, try again later
            self.log.error("state_persist_failed", fragment=p, error=repr(e))
            self.buffers[p] = items + self.buffers[p]
            return
        self.states[p] = new
        for x in items:
            await ack_all(x.tokens)
        await self._publish_global(p, fresh=True)
        self.arrivals = self.arrivals.observe_sync(time.monotonic() - t0)
        self.stats.merges += 1
        self.stats.merge_latency.append(time.monotonic() - first)
        firsts = sorted({x.c.learner: x.arrived for x in reversed(items)}.values())
        self.stats.quorum_wait += firsts[min(self.cfg.quorum, len(firsts)) - 1] - first
        self.stats.clipped += new.last_clipped
        for x in items:
            self.stats.staleness[st.version - x.c.base_version] += 1  # in versions
            self.stats.contributions[x.c.learner] += 1
        self.log.info("merged", fragment=p, version=new.version, n=len(items), reason=reason,
                      learners=sorted({x.c.learner for x in items}), scale=round(scale, 4), clipped=new.last_clipped,
                      stale=[st.version - x.c.base_version for x in items],
                      steps=[x.c.inner_steps for x in items], grad_norm=[round(x.norm, 5) for x in items],
                      step_norm=round(l2_norm(new.params - st.params), 5), param_norm=round(l2_norm(new.params), 3))

    async def _adopt_committed_state(self, p: int, items: list[Pending], e: VersionConflict) -> None:
        """The state store already holds version v+1 (or newer) of fragment p: an earlier put whose
        head was stored although it reported a failure, or another writer. Take that state as
        ours; contributions it applied are done (acked), the others wait for the next merge."""
        self.log.error("state_conflict", fragment=p, committed=e.committed.version, error=str(e))
        got = await self.sstore.get(p)
        if got is None:  # cannot happen after a conflict; keep everything and retry later
            self.buffers[p] = items + self.buffers[p]
            return
        st = FragmentState.from_bytes(got[1])
        self.states[p] = st
        self.unpublished.add(p)
        keep = []
        for x in items:
            if st.applied.is_duplicate(x.c):
                await ack_all(x.tokens)
            else:
                keep.append(x)
        self.buffers[p] = keep + self.buffers[p]
        self.log.warning("state_adopted", fragment=p, version=st.version, applied=len(items) - len(keep),
                         kept=len(keep))

    async def _publish_global(self, p: int, fresh: bool = False) -> None:
        """Publish the global version of the state and its merge event. ``fresh``: just merged, so
        not published yet; otherwise (recovery, retry) only if the global head is behind."""
        st = self.states[p]
        applied = [list(k) for k in st.last_merge]
        try:
            head = None if fresh else await self.gstore.head(p)
            if head is None or head.version < st.version:
                meta = {"model": self.model_hash, "plan": self.plan.plan_hash()}
                blob, extra, key = encode_version(st.params, st.version, self.keys.get(p),
                                                  self.settings.downlink_quantiser, self.cfg.keyframe_every)
                if key is not None:  # a keyframe: on its own subjects first, then as the version
                    await self.kstore.put(p, st.version, blob, {**meta, **extra})
                    self.keys[p] = key
                await self.gstore.put(p, st.version, blob, {**meta, **extra, "applied": applied})
            if st.version > 0:
                await self.js.publish(self.s.event("merge"), orjson.dumps(
                    {"fragment": p, "version": st.version, "applied": applied, "scale": st.last_scale,
                     "per_round": st.last_per_round,
                     "ts": time.time()}),
                    headers={"Nats-Msg-Id": f"{self.common.run}.merge.{p}.{st.version}"})
            self.unpublished.discard(p)
        except Exception as e:
            self.log.error("global_publish_failed", fragment=p, version=st.version, error=repr(e))
            self.unpublished.add(p)

    async def _publish_audit(self, limit: int = 256) -> None:
        """Rejections as JetStream events (``events.reject``): an audit trail that survives restarts.

        Each rejected contribution is terminated only after its event is stored. Before, it was
        terminated at once and its event queued: an aggregator killed in between lost the record
        of an acknowledged contribution (the chaos run's ``none_lost``, 2 runs in 12: five
        rejections logged 3 s before the kill, none in the stream). Now a crash in between
        redelivers the contribution, which is judged again. A failed publish keeps the rest queued
        for the next round (it used to drop them)."""
        for _ in range(min(limit, len(self._audit))):
            event, tokens = self._audit[0]
            try:
                await self.js.publish(self.s.event("reject"), orjson.dumps(event), timeout=2)
            except Exception as e:
                self.log.warning("audit_publish_failed", error=repr(e), queued=len(self._audit))
                return
            self._audit.pop(0)
            await term_all(tokens)

    # -- main loop --------------------------------------------------------------------------------

    async def _metrics(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                msg = {"role": "aggregator", "run": self.common.run, "ts": time.time(),
                       "id": self.cfg.aggregator_id,
                       "versions": {str(p): st.version for p, st in self.states.items()},
                       "buffered": {str(p): len(b) for p, b in self.buffers.items() if b},
                       "held": len(self.hold),
                       "active": len(self.active()), **self.stats.to_metrics(),
                       "transport_dropped": dict(self.consumer.stats.dropped or {})}
                await self.nc.publish(self.s.metrics("aggregator", self.cfg.aggregator_id), codec.dumps_json(msg))
            except Exception as e:
                self.log.warning("metrics_failed", error=repr(e))
            try:
                await asyncio.wait_for(stop.wait(), self.common.metrics_interval)
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

    async def run(self, stop: asyncio.Event) -> None:
        self.nc = await connect(self.common, name=f"aggregator-{self.cfg.aggregator_id}")
        # a short timeout: a request sent while the server restarts can go unanswered, and the
        # merge loop must retry it soon rather than stall (it waited 30 s in the chaos run)
        js = self.js = self.nc.jetstream(timeout=5)
        await self._model_from_run(js, stop)
        if stop.is_set():
            return
        # streams sized from the run's parameters (LimitsTooSmall: an explicit limit cannot hold them)
        limits = Limits.for_run(self.common, self.plan.sizes, self.common.run)
        if self.cfg.provision:
            await ensure_run(js, self.common.run, limits, update=True)
        elif missing := await missing_parts(js, self.common.run):
            raise RunMismatch(f"run {self.common.run!r} is not provisioned (missing {', '.join(missing)}) and "
                              "DILOCO_PROVISION=false: create it first with `diloco run create` (admin credentials)")
        pub = ChunkPublisher(js, self.common.max_chunk_bytes, self.common.inflight_chunks)
        self.gstore = VersionedStore(js, self.common.run, GLOBAL, pub)
        self.kstore = VersionedStore(js, self.common.run, GLOBAL, pub, tag="k")
        self.sstore = VersionedStore(js, self.common.run, STATE, pub)
        self.settings = dataclasses.replace(self.settings, max_inner_lr=self.manifest.max_inner_lr)
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
        await self.consumer.start()
        tasks.append(asyncio.create_task(self._metrics(stop)))
        self.log.info("aggregator_started", fragments=f"{lo}-{hi}",
                      versions={p: s.version for p, s in self.states.items()})
        last_keepalive = time.monotonic()
        try:
            wake = None
            while not stop.is_set():
                now = time.monotonic()
                timeout = 0.2 if wake is None else max(0.01, min(0.2, wake - now))
                for r in await self.consumer.poll(timeout=timeout):
                    await self._handle(r, time.monotonic())
                self._release_held(time.monotonic())
                wake = None
                for p in self.owned:
                    if p in self.unpublished:
                        await self._publish_global(p)
                    w = await self._maybe_merge(p, time.monotonic())
                    if w is not None:
                        wake = w if wake is None else min(wake, w)
                if self._audit:
                    await self._publish_audit()
                if time.monotonic() - last_keepalive > 5:
                    await self._keep_alive_held()
                    last_keepalive = time.monotonic()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.consumer.unsubscribe()
            await self.nc.close()
            self.log.info("aggregator_stopped", versions={p: s.version for p, s in self.states.items()})


def main(argv: list[str] | None = None) -> int:
    try:
        common = from_env(CommonConfig)
        cfg = from_env(AggregatorConfig)
    except ConfigError as e:
        print(f"diloco aggregator: {e}", file=sys.stderr)
        return 2
    setup(common.log_level, run=common.run, role="aggregator", island=common.region)
    svc = AggregatorService(common, cfg)

    async def go() -> None:
        stop = asyncio.Event()
        install_stop(stop)
        await svc.run(stop)

    try:
        asyncio.run(go())
    except RunMismatch as e:
        print(f"diloco aggregator: {e}", file=sys.stderr)
        return 3
    except (LimitsTooSmall, StorageUnavailable) as e:
        print(f"diloco aggregator: {e}", file=sys.stderr)
        return 2
    return 0
