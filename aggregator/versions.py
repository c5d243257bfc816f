"""The aggregator's production of global versions: the quorum decision, the write-ahead merge
(its merge-log record committed before the contributions are acknowledged:
``aggregator.durability``), and version v+1 encoded for the downlink (whole, or a quantised delta
against a keyframe), handed to the publishing stage (``aggregator.publisher``).

A mixin of ``aggregator.service.AggregatorService``; the merge itself is ``aggregator.step``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from aggregator.intake import Pending
from aggregator.publisher import Publisher, PublishJob
from aggregator.mlog import LoggedContribution, MergeRecord, with_clears
from aggregator.merge import l2_norm
from aggregator.quorum import AUTO, ArrivalStats, decide
from aggregator.rounds import held_for_round
from aggregator.step import FragmentState, fuses, merge_step, participation_scale, round_work
from aggregator.trust import ew_mean
from bus import codec, sparse
from bus.downlink import encode_chain, encode_version
from bus.transport import ack_all


class VersionMaker:
    """Merging buffered contributions into global versions for an ``AggregatorService``."""

    if TYPE_CHECKING:  # the state is the AggregatorService's (set in its __init__)
        def __getattr__(self, name: str) -> Any: ...
        arrivals: ArrivalStats
        buffers: dict[int, list[Pending]]
        states: dict[int, FragmentState]
        accum: np.ndarray | None
        publisher: Publisher
        held_since: dict[int, float]

    # -- merging ----------------------------------------------------------------------------------

    def _decide(self, p: int, now: float, active: set[str]) -> tuple[str | None, float | None, float]:
        """Fragment p by the quorum rule: (why it merges now, or None; when to look again, or None;
        its first buffered arrival)."""
        buf = self.buffers[p]
        if not buf:
            return None, None, now
        contributors: dict[str, float] = {}
        for x in buf:
            contributors[x.c.learner] = min(contributors.get(x.c.learner, x.arrived), x.arrived)
        first = min(x.arrived for x in buf)
        K = self.cfg.quorum
        if K == AUTO and any(x.c.lockstep for x in buf):
            K = 0  # synchronous learners wait for their round's merge: it has every one of them, as all
        d = decide(now, first, contributors, active, K, self.grace, self.arrivals, p)
        if d.merge:
            return d.reason, None, first
        if not active:
            # nobody is active any more (all evicted while their contributions were buffered):
            # merge what we hold after the grace window rather than holding it forever
            if now < first + self.cfg.grace_seconds:
                return None, first + self.cfg.grace_seconds, first
            return "no active learner: merging what is buffered after the grace window", None, first
        return None, d.wait_until, first

    async def _merge_due(self, now: float) -> float | None:
        """One look at every owned fragment: decide each against the same membership, hold the
        lock-step fragments whose round is still arriving elsewhere (:mod:`aggregator.rounds`, at
        most the grace window), merge the others. Returns when to look again (or None)."""
        active = set(self.active())
        due: dict[int, tuple[str, float]] = {}
        wake: float | None = None
        for p in self.owned:
            if self._log_blocked(p):  # its record is not stored yet, its checkpoint is being stored or behind
                continue
            reason, w, first = self._decide(p, now, active)
            if reason is not None:
                due[p] = (reason, first)
            elif w is not None:
                wake = w if wake is None else min(wake, w)
        held: set[int] = set()
        missing: dict[int, set[str]] = {}
        if due:
            missing = {q: active - {x.c.learner for x in self.buffers[q]}
                       for q in self.owned if q not in due and self.buffers[q]}
            keys = {q: {(x.c.learner, x.c.incarnation, x.c.round) for x in self.buffers[q] if x.c.lockstep}
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
            if self._log_blocked(p):  # (a checkpoint of p started while the merges before it awaited)
                continue
            await self._merge(p, time.monotonic(), first, reason)
        return wake

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
        pos = self.logpos[p]
        restarts = tuple(tuple(r) for r in pos.restarts)
        pos.restarts = []
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
        self.uncommitted[p] = (st.version, rec, items, first, reason, t0)
        await self._commit(p)

    async def _commit(self, p: int) -> None:
        """Write-ahead: the merge's record, then the contributions' acks, the global version and its
        merge event. A record not stored is retried as it is on the next pass (aggregator.durability)."""
        before, rec, items, first, reason, t0 = self.uncommitted[p]
        if self.store_watch.faulted and not self.store_watch.may_write():
            return  # the store is full: one write every few seconds
        other = None
        try:
            other = await self._log_put(rec)
            if other is not None:
                items = await self._adopt(p, other, items)
        except Exception as e:  # not committed: nothing acked; the same record is retried
            if await self.store_watch.failed(e):  # a full store (said once): back to what is stored
                await self._undo(p, rec, items)
            else:
                self.log.error("merge_log_failed", fragment=p, version=rec.version, error=repr(e))
            return
        self.store_watch.stored()
        del self.uncommitted[p]
        new = self.states[p]
        pos = self.logpos[p]
        seqs = [q for x in items for q in x.seqs]
        nbytes = sum(x.nbytes for x in items)
        if other is None:  # (an adopted record is in the log position the recovery rebuilt)
            pos.versions_since += 1
            pos.bytes_since += nbytes
        if seqs:
            pos.oldest_seq = min(seqs) if pos.oldest_seq is None else min(pos.oldest_seq, *seqs)
            self._logseqs.setdefault(p, deque()).append((rec.version, min(seqs), nbytes))
        for x in items:
            await ack_all(x.tokens)
        self._queue_publish(p)
        pos = self.logpos[p]  # (a checkpoint stored during the acks moved it)
        if self._policy().due(pos.versions_since, time.monotonic() - pos.checkpoint_time):
            self._start_checkpoint(p)
        self.arrivals = self.arrivals.observe_sync(time.monotonic() - t0)
        self.stats.merges += 1
        self.stats.merge_latency.append(time.monotonic() - first)
        firsts = sorted({x.c.learner: x.arrived for x in reversed(items)}.values())
        k = len(firsts) if self.cfg.quorum <= 0 else min(self.cfg.quorum, len(firsts))
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
                      steps=[x.c.inner_steps for x in items], grad_norm=[round(x.norm, 5) for x in items],
                      outer_grad_norm=round(new.last_grad_norm, 5), param_norm=round(l2_norm(new.params), 3),
                      **({"trust": [round(f, 3) for f in new.last_trust]} if min(new.last_trust, default=1.0) < 1.0
                         else {}))
        for x in items:  # merged and committed: their buffers serve the next contributions
            self.pool.give(x.pooled)

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

    def _publish_job(self, p: int) -> PublishJob:
        """Version ``states[p]`` encoded for the downlink now (the merge updates the parameters in
        place, so the blob is taken before the next merge), to be published in order."""
        st = self.states[p]
        # "merged": the highest round merged so far of every learner taking part (``applied`` lists
        # this merge's only); bounded like ``applied`` by the learners of the run now, not by every
        # id ever seen (the metadata rides in every chunk's header)
        keep = self.participants(time.monotonic()) | self.leavers()
        meta = {"model": self.model_hash, "plan": self.plan.plan_hash(),
                "merged": [m for m in st.applied.newest_rounds(p) if m[0] in keep]}
        if self.cfg.downlink_chain:
            # every version against the previous reconstruction; the reconstruction itself, whole,
            # on the keyframe subjects for a reader that lost the chain (bus.downlink.encode_chain)
            q = self.settings.downlink_quantiser
            blob, extra, view = encode_chain(st.params, st.version, self.views.get(p), q,
                                             **codec.codec_args(q, sparse.DEFAULT_CHUNK, self.cfg.downlink_topk_k))
            self.views[p] = view
            whole = blob if "prev" not in extra else codec.encode_array(view.params)
            return PublishJob(p, st.version, blob, {**meta, **extra}, True, [list(k) for k in st.last_merge],
                              st.last_scale, st.last_per_round, key_blob=whole)
        blob, extra, key = encode_version(st.params, st.version, self.keys.get(p),
                                          self.settings.downlink_quantiser, self.cfg.keyframe_every)
        if key is not None:
            self.keys[p] = key
        return PublishJob(p, st.version, blob, {**meta, **extra}, key is not None, [list(k) for k in st.last_merge],
                          st.last_scale, st.last_per_round)

    def _queue_publish(self, p: int) -> None:
        """Hand version ``states[p]`` to the publishing stage (``aggregator.publisher``): merging goes
        on while its chunks and head are acknowledged (at most PUBLISH_QUEUE versions of a fragment
        wait; then the fragment waits, :meth:`_log_blocked`)."""
        self.publisher.queue(self._publish_job(p))

    async def _publish_global(self, p: int) -> None:
        """After a (re)start: the global version of the state if the global head is behind, and the
        merge event of the newest version (deduplicated by its message id)."""
        st = self.states[p]
        await self.publisher.catch_up(p, st.version, lambda: self._publish_job(p),
                                      ([list(k) for k in st.last_merge], st.last_scale, st.last_per_round))
