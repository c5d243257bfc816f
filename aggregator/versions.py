"""The merge stage of a fragment's pipeline (:class:`VersionMaker`, an object with its own state):
the quorum decision over what the intake buffered, the merge (``aggregator.step``) applied in
place, its record handed to the merge-log stage (``aggregator.durability``: committed before the
contributions are acknowledged), and version v+1 encoded for the downlink
(``aggregator.encoder``) and handed to the publishing stage (``aggregator.publisher``).

State of its own: the fragments' states (which the other stages read), the lock-step fragments
held for the rest of their round, the merge buffer, the operator's trust clears and each learner's
trust verdict said last. At start it recovers each fragment's state through the merge-log stage.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import numpy as np

from aggregator.intake import Intake
from aggregator.membership import Membership
from aggregator.durability import MergeLog, Uncommitted
from aggregator.encoder import DownlinkEncoder
from aggregator.publisher import PUBLISH_QUEUE, Publisher, PublishJob
from aggregator.mlog import LoggedContribution, MergeRecord, settings_to_dict, with_clears
from aggregator.merge import l2_norm
from aggregator.quorum import AUTO, GracePolicy, arrival_leads, decide, round_phases
from aggregator.rounds import held_for_round
from aggregator.step import FragmentState, MergeSettings, fuses, merge_step, participation_scale, round_work
from aggregator.trust import ew_mean
from bus import codec
from bus.runs import RunMismatch
from bus.transport import ack_all


class VersionMaker:
    """Merging buffered contributions into global versions, one fragment at a time."""

    def __init__(self, cfg: Any, run: str, log: Any, stats: Any, store_watch: Any, membership: Membership,
                 intake: Intake, states: dict[int, FragmentState]):
        self.cfg, self.run, self.log, self.stats, self.store_watch = cfg, run, log, stats, store_watch
        self.membership, self.intake = membership, intake
        self.states = states  # fragment -> its state: the parameters, the outer optimizer, what is applied
        self.settings = MergeSettings.from_config(cfg)
        self.settings_dict = settings_to_dict(self.settings)
        self.grace = GracePolicy(mode=cfg.grace, grace=cfg.grace_seconds, max_grace=cfg.grace_seconds,
                                 gamma=cfg.grace_gamma, tau=cfg.tau)
        self.encoder = DownlinkEncoder(cfg, self.settings.downlink_quantiser, log)
        self.held_since: dict[int, float] = {}  # lock-step fragment -> when it was first held
        # the merged outer gradient's buffer, reused, where the merge is not applied block by block
        # (not with the defaults: aggregator.step.fuses); one merge at a time: every fragment merges
        # into its first values (one per fragment size took 4 of 8 fragments' worth at 1B)
        self.accum: np.ndarray | None = None
        self.suspected: dict[str, str] = {}  # learner -> the reason aggregator.trust suspects it ("" : trusted)
        self.trust_clears: dict[str, int] = {}  # learner -> its newest operator clear (bus.trust_clears)
        self.plan: Any = None
        self.owned: range = range(0)
        self.model_hash = ""
        self.merge_log: MergeLog | Any = None
        self.publisher: Publisher | Any = None

    def use(self, plan: Any, owned: range, model_hash: str, max_inner_lr: float | None) -> None:
        """The model whose fragments ``owned`` this stage merges (``max_inner_lr``: the run's
        declared bound, which the merge settings carry into every record)."""
        self.plan, self.owned, self.model_hash = plan, owned, model_hash
        self.settings = dataclasses.replace(self.settings, max_inner_lr=max_inner_lr)
        self.settings_dict = settings_to_dict(self.settings)

    def bind(self, merge_log: MergeLog, publisher: Publisher) -> None:
        """The stages after this one: the merge log (each merge's record) and the publisher."""
        self.merge_log, self.publisher = merge_log, publisher

    # -- merging ----------------------------------------------------------------------------------

    def _blocked(self, p: int) -> bool:
        """Fragment p may not merge now: the merge-log stage holds it (its last record not stored, its
        checkpoint being stored or behind, the store full: ``MergeLog.blocks``), or PUBLISH_QUEUE
        of its versions wait for the publishing stage."""
        return self.merge_log.blocks(p) or self.publisher.waiting(p) >= PUBLISH_QUEUE

    def _decide(self, p: int, now: float, active: set[str]) -> tuple[str | None, float | None, float]:
        """Fragment p by the quorum rule: (why it merges now, or None; when to look again, or None;
        its first buffered arrival)."""
        buf = self.intake.buffers[p]
        if not buf:
            return None, None, now
        contributors: dict[str, float] = {}
        for x in buf:
            contributors[x.c.learner] = min(contributors.get(x.c.learner, x.arrived), x.arrived)
        first = min(x.arrived for x in buf)
        K = self.cfg.quorum
        if K == AUTO and any(x.c.lockstep for x in buf):
            K = 0  # synchronous learners wait for their round's merge: it has every one of them, as all
        d = decide(now, first, contributors, active, K, self.grace, self.intake.arrivals, p)
        if d.merge:
            return d.reason, None, first
        if not active:
            # nobody is active any more (all evicted while their contributions were buffered):
            # merge what we hold after the grace window rather than holding it forever
            if now < first + self.cfg.grace_seconds:
                return None, first + self.cfg.grace_seconds, first
            return "no active learner: merging what is buffered after the grace window", None, first
        return None, d.wait_until, first

    async def merge_due(self, now: float) -> float | None:
        """One look at every owned fragment: decide each against the same membership, hold the
        lock-step fragments whose round is still arriving elsewhere (:mod:`aggregator.rounds`, at
        most the grace window), merge the others. Returns when to look again (or None)."""
        active = self.membership.active()
        buffers = self.intake.buffers
        due: dict[int, tuple[str, float]] = {}
        wake: float | None = None
        for p in self.owned:
            if self._blocked(p):  # its record is not stored yet, its checkpoint is being stored or behind, ...
                continue
            reason, w, first = self._decide(p, now, active)
            if reason is not None:
                due[p] = (reason, first)
            elif w is not None:
                wake = w if wake is None else min(wake, w)
        held: set[int] = set()
        missing: dict[int, set[str]] = {}
        if due:
            missing = {q: active - {x.c.learner for x in buffers[q]}
                       for q in self.owned if q not in due and buffers[q]}
            keys = {q: {(x.c.learner, x.c.incarnation, x.c.round) for x in buffers[q] if x.c.lockstep}
                    for q in self.owned}
            held = held_for_round(set(due), missing, keys,
                                  lambda q, learner, inc: self.states[q].applied.highest_round(learner, inc, q))
        for p in list(self.held_since):
            if p not in held:
                del self.held_since[p]
        for p in sorted(due):
            if self.store_watch.faulted:  # the merge before this one found the store full
                break
            reason, first = due[p]
            if p in held:
                if p not in self.held_since:
                    self.held_since[p] = now
                    self.stats.round_holds += 1
                until = self.held_since[p] + self.cfg.grace_seconds
                if now < until:
                    wake = until if wake is None else min(wake, until)
                    continue
                held_s = now - self.held_since.pop(p)
                self.stats.round_holds_expired += 1
                self.log.warning("round_hold_expired", fragment=p, held_s=round(held_s, 3),
                                 waiting={q: sorted(m) for q, m in missing.items() if m})
                reason = f"{reason}; the rest of its lock-step round did not come in {self.cfg.grace_seconds}s"
            if self._blocked(p):  # (a checkpoint of p started while the merges before it awaited)
                continue
            await self._merge(p, time.monotonic(), first, reason)
        return wake

    async def _merge(self, p: int, now: float, first: float, reason: str) -> None:
        items = self.intake.take(p)
        st = self.states[p]
        t0 = time.monotonic()
        learners = {x.c.learner for x in items}
        participants = self.membership.participants(now) | learners
        scale = (participation_scale(round_work([x.c for x in items]), len(participants))
                 if self.cfg.scale_by_participation else 1.0)
        per_round = max(1, len(participants))
        restarts = self.merge_log.take_restarts(p)
        # operator clears of trust records (diloco trust clear) not yet applied to this fragment:
        # applied before the merge and logged with it, so a replay applies them at the same point
        cleared = tuple(sorted((x, n) for x, n in self.trust_clears.items()
                               if n > st.trust.cleared.get(x, 0) and x in st.trust.learners))
        if cleared:
            st = with_clears(st, cleared)
            self.log.info("trust_cleared", fragment=p, learners=[x for x, _ in cleared], version=st.version + 1)
        # in place: the parameters and optimizer arrays are updated where they are (no copy of the
        # fragment); the record is retried as it is until stored, so the old state is never needed
        n = st.params.size
        acc = None
        if not fuses(self.settings):  # (the defaults apply the merge block by block: no buffer)
            if self.accum is None or self.accum.size < n:
                self.accum = np.empty(max([n] + [self.plan.sizes[q] for q in self.owned]), dtype=np.float32)
            acc = self.accum[:n]
        new = merge_step(st, [x.c for x in items], self.settings, [x.norm for x in items], scale, per_round,
                         inplace=True, out=acc)
        rec = MergeRecord(p, new.version, tuple(
            LoggedContribution(x.c.learner, x.c.incarnation, x.c.fragment, x.c.round, x.c.base_version, x.seqs,
                               float(x.norm), x.nbytes) for x in items),
            float(scale), int(per_round), self.settings_dict, restarts, time.time(), cleared)
        self.states[p] = new
        self.merge_log.add(p, Uncommitted(st.version, rec, items, first, reason, t0))
        await self.commit(p)

    async def commit(self, p: int) -> None:
        """Write-ahead: the merge's record (the merge-log stage), then the contributions' acks, the
        global version handed to the publishing stage, and its checkpoint if due. A record not
        stored is retried as it is on the next pass; a merge undone (the store full) or a committed
        record of another merge adopted puts contributions back in the buffer, unacknowledged."""
        got = await self.merge_log.commit(p)
        if got is None:
            return
        if got.state is not None:  # read back from the store: it replaces the merge's own
            self.states[p] = got.state
        if got.back:
            self.intake.put_back(p, got.back)
        if not got.stored:
            return
        m, items = got.merge, got.done
        before, rec, first, reason, t0 = m.before, m.rec, m.first, m.reason, m.t0
        new = self.states[p]
        for x in items:
            await ack_all(x.tokens)
        merged = {x.c.learner for x in items}
        phases, round_s = round_phases(self.intake.arrivals, p, merged | self.membership.active(),
                                       max((x.arrived for x in items), default=0.0))
        leads = arrival_leads([(x.c.learner, x.c.incarnation, x.arrived) for x in items], phases=phases,
                              round_s=round_s)
        self._queue_publish(p, leads)
        self.merge_log.checkpoint_if_due(p)  # (after the acks: a checkpoint stored meanwhile moved the log)
        self.intake.note_sync(time.monotonic() - t0)
        self.stats.merges += 1
        self.stats.merge_latency.append(time.monotonic() - first)
        firsts = sorted({x.c.learner: x.arrived for x in reversed(items)}.values())
        k = len(firsts) if self.cfg.quorum <= 0 else min(self.cfg.quorum, len(firsts))
        if firsts:  # (none: an adopted record of another merge applied none of ours)
            self.stats.quorum_wait += firsts[k - 1] - first
        self.stats.clipped += new.last_clipped
        self._note_trust(p, new, items)
        for x in items:
            self.stats.staleness[before - x.c.base_version] += 1  # in versions
            self.stats.contributions[x.c.learner] += 1
        self.stats.queue_wait.append(t0 - first)
        self.log.info("merged", fragment=p, version=new.version, n=len(items), reason=reason,
                      wait_s=round(t0 - first, 4), merge_s=round(time.monotonic() - t0, 4),
                      learners=[x.c.learner for x in items], scale=round(rec.scale, 4), clipped=new.last_clipped,
                      stale=[before - x.c.base_version for x in items],
                      lead=[[a, t] for a, _, t in leads],
                      steps=[x.c.inner_steps for x in items], grad_norm=[round(x.norm, 5) for x in items],
                      outer_grad_norm=round(new.last_grad_norm, 5), param_norm=round(l2_norm(new.params), 3),
                      **({"trust": [round(f, 3) for f in new.last_trust]} if min(new.last_trust, default=1.0) < 1.0
                         else {}))
        self.intake.merged(items)  # committed: their decode buffers serve the next contributions

    def _note_trust(self, p: int, new: FragmentState, items: list) -> None:
        """Count the contributions merged at a reduced weight, and say once per change when a learner
        becomes suspected (or trusted again) by ``aggregator.trust``: the reason and its evidence."""
        for x, f in zip(items, new.last_trust):
            if f < 1.0:
                self.stats.downweighted[x.c.learner] += 1
            if f <= 0.0:
                self.stats.distrusted[x.c.learner] += 1
        for learner in sorted({x.c.learner for x in items}):
            # its verdict on the fragment where it is trusted least (one line per change of the
            # reason, not a line per merge where two fragments disagree)
            records = [(q, st.trust) for q, st in self.states.items() if learner in st.trust.learners]
            if not records:
                continue
            q, ts = min(records, key=lambda r: (r[1].learners[learner].trust,
                                                (r[1].learners[learner].evidence or {}).get("median", 1.0)))
            lt = ts.learners[learner]
            if self.suspected.get(learner, "") != lt.reason:
                # where the verdict stands (``on``) and what it rests on: the typical agreement and this
                # learner's pairs there (mean cosine, observations), its own agreement's mean
                detail = {"on": q, "typical": round(ts.typical, 4), "seen": lt.seen,
                          "pair_means": {(b if a == learner else a): [round(ew_mean(r), 4), int(r[4])]
                                         for (a, b), r in sorted(ts.pairs.items()) if learner in (a, b)},
                          "own_mean": round(ew_mean(lt.own), 4) if lt.own else None}
                if lt.reason:
                    self.log.warning("learner_suspected", learner=learner, reason=lt.reason, fragment=p,
                                     weighed=self.settings.trust.mode == "weigh", evidence=lt.evidence,
                                     distrusted=lt.distrusted, replays=lt.replays, **detail)
                else:
                    self.log.info("learner_trusted_again", learner=learner, fragment=p, evidence=lt.evidence, **detail)
                self.suspected[learner] = lt.reason

    # -- publishing -------------------------------------------------------------------------------

    def _publish_job(self, p: int, leads: list | None = None) -> PublishJob:
        """Version ``states[p]`` encoded for the downlink now (the merge updates the parameters in
        place, so the blob is taken before the next merge), to be published in order."""
        st = self.states[p]
        # "merged": the highest round merged so far of every learner taking part (``applied`` lists
        # this merge's only); bounded like ``applied`` by the learners of the run now, not by every
        # id ever seen (the metadata rides in every chunk's header)
        keep = self.membership.participants(time.monotonic()) | self.membership.leavers()
        return self.encoder.encode(st, {"model": self.model_hash, "plan": self.plan.plan_hash(),
                                        "merged": [m for m in st.applied.newest_rounds(p) if m[0] in keep],
                                        **({"lead": leads} if leads else {})})

    def _queue_publish(self, p: int, leads: list | None = None) -> None:
        """Hand version ``states[p]`` to the publishing stage (``aggregator.publisher``): merging goes
        on while its chunks and head are acknowledged (at most PUBLISH_QUEUE versions of a fragment
        wait; then the fragment waits, :meth:`_blocked`)."""
        self.publisher.queue(self._publish_job(p, leads))

    async def publish_global(self, p: int) -> None:
        """After a (re)start: the global version of the state if the global head is behind, and the
        merge event of the newest version (deduplicated by its message id)."""
        st = self.states[p]
        await self.publisher.catch_up(p, st.version, lambda: self._publish_job(p),
                                      ([list(k) for k in st.last_merge], st.last_scale, st.last_per_round))

    # -- start-up and recovery --------------------------------------------------------------------

    async def _republish(self, p: int, st: FragmentState, published: int) -> bool:
        """A replayed version the global store lacks (or holds as its head without, maybe, its
        merge event): publish it now, in order. False if the server refused (then recovery goes on
        without publishing; the main loop publishes the newest version)."""
        try:
            if st.version > published:
                self.states[p] = st
                await self.publisher.send(self._publish_job(p))
            else:
                await self.publisher.send_event(p, st.version, [list(k) for k in st.last_merge], st.last_scale,
                                                st.last_per_round)
            return True
        except Exception as e:
            self.log.warning("recovery_publish_failed", fragment=p, version=st.version, error=repr(e))
            return False

    async def recover(self, gstore: Any, kstore: Any) -> None:
        """Each owned fragment's state at start: its checkpoint with the merge log replayed (the
        versions the global store lacks published again as they are reached), else version 0 from
        the global store (a fragment that starts here); then its keyframe or chained view."""
        for p in self.owned:
            gh = await gstore.head(p)
            if self.cfg.downlink_chain:
                await self.encoder.recover_view(p, int(self.plan.sizes[p]), kstore)
            st = await self.merge_log.recover_fragment(p, -1 if gh is None else gh.version, republish=self._republish)
            if st is None:
                if gh is None:
                    raise RuntimeError(f"fragment {p} has neither state nor global version (the run's creator "
                                       "writes version 0 before the manifest)")
                gh, blob = await gstore.get(p)
                if "ref" in gh.meta or "prev" in gh.meta:
                    raise RunMismatch(f"fragment {p}: no aggregator state, and global version {gh.version} is a "
                                      "delta against a keyframe: the state stream was lost")
                st = FragmentState.initial(p, gh.version, codec.decode_array(blob), self.settings)  # (copied there)
                await self.merge_log.initialise(st)  # its first checkpoint (no merge yet)
                self.log.info("fragment_initialised", fragment=p, version=st.version)
            else:
                if gh is not None and gh.version > st.version:
                    raise RunMismatch(f"fragment {p}: global version {gh.version} is ahead of our state "
                                      f"{st.version}: is another aggregator owning it?")
                # republish what a crash may have cut short: the global version (if behind) and
                # the merge event of the newest version (deduplicated by its message id)
                self.publisher.unpublished.add(p)
                self.log.info("fragment_recovered", fragment=p, version=st.version,
                              global_behind=gh is None or gh.version < st.version)
            self.states[p] = st
            await self.encoder.recover_keyframe(st, kstore, {"model": self.model_hash, "plan": self.plan.plan_hash()})

    async def follow_clears(self, js: Any, stop: asyncio.Event, every: float = 2.0) -> None:
        """The operator's clears of the learners this aggregator holds trust records for, read every
        ``every`` seconds; each fragment applies a new one at its next merge (:meth:`_merge`)."""
        from bus.trust_clears import read_clears

        while not stop.is_set():
            known = {x for st in self.states.values() for x in st.trust.learners}
            try:
                for x, n in (await read_clears(js, self.run, known)).items():
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
