"""The merge-log stage of a fragment's pipeline: the write-ahead record of each merge, checkpoints,
and recovery by replay (:class:`MergeLog`). The pure parts (records, replay, the checkpoint
policy) are ``aggregator.mlog``.

* **Write-ahead**: a merge of fragment p into version v+1 is committed by its
  :class:`~aggregator.mlog.MergeRecord` on ``state.<p>.log.<slot>`` (STATE stream, message id
  ``<run>.mlog.<p>.<v+1>``), before its contributions are acknowledged. A record whose publish
  fails is retried as it is (never re-merged: a lost ack may hide a stored record), and the
  fragment merges nothing else meanwhile.
* **Checkpoints**: the whole :class:`~aggregator.step.FragmentState` as a versioned object on
  ``state.<p>`` (as every version was before), when :class:`~aggregator.mlog.CheckpointPolicy`
  says so, when the process stops, and never more than ``2 x DILOCO_CHECKPOINT_EVERY`` versions
  behind (the fragment waits for its checkpoint).
* **Recovery**: the newest checkpoint, then every record newer than it, each contribution read
  back from the GRAD stream by its stream sequences and merged again with ``merge_step``: the state
  the crashed process had, bit for bit. A contribution the GRAD stream no longer holds (older than
  ``DILOCO_STREAM_MAX_AGE``, or evicted at its byte limit) cannot be replayed: its version is
  taken as applied without its effect, logged as an error, counted (``replay_lost``) and recorded in
  an ``events.recovered`` event.

The stage's own state: per fragment its log position (the newest checkpoint, what the log holds
beyond it, the GRAD sequences it points to), the merge waiting for its record (the merge stage's
queue into this stage: one per fragment, the fragment merges nothing else meanwhile), the
checkpoints being stored, and what it last saw of the GRAD stream. The fragments' states are the
merge stage's (``aggregator.versions``): this stage reads them to checkpoint them, and hands back
a state it read from the store (:class:`Committed`); it never replaces one itself.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from nats.js.errors import NotFoundError

from aggregator.contribution import Contribution, from_grad_message
from aggregator.mlog import (CheckpointPolicy, LogPosition, MergeRecord, applied_without_replay, checkpoint_may_start,
                             early_checkpoint_pays, grad_backlog_behind, log_slots, replay_one, stream_overtaking)
from aggregator.step import FragmentState
from bus import codec
from bus.chunks import Gather
from bus.runs import RunMismatch
from bus.signals import cancel_all
from bus.streams import STATE_ARRAYS
from bus.subjects import Subjects
from bus.transport import TransportError, VersionConflict, fetch_object

#: ``republish(p, state, published)``: a replayed version the global store lacks, published in
#: order while recovering (the merge stage's; False if the server refused)
Republish = Callable[[int, FragmentState, int], Awaitable[bool]]


@dataclass
class Uncommitted:
    """A merge whose record is not stored yet: the fragment's version before it, the record, its
    contributions (acknowledged once the record is stored), their first arrival, why it merged,
    and when the merge began."""

    before: int
    rec: MergeRecord
    items: list
    first: float
    reason: str
    t0: float


@dataclass
class Committed:
    """What :meth:`MergeLog.commit` did with a merge. ``stored``: its record is in the log (False:
    the store was full, and the merge was undone). ``done``: the contributions it applied, to be
    acknowledged; ``back``: those to buffer again, unacknowledged, for a later merge; ``state``: the
    fragment's state read back from the store, which replaces the one in memory (None: the merge's
    own stands)."""

    merge: Uncommitted
    stored: bool
    done: list
    back: list
    state: FragmentState | None = None


class MergeLog:
    """The merge log, checkpoints and replay of an aggregator's fragments."""

    def __init__(self, js: Any, run: str, cfg: Any, plan: Any, model_hash: str, owned: range, momentum_dtype: str,
                 sstore: Any, store_watch: Any, stats: Any, log: Any, states: dict[int, FragmentState]):
        self.js, self.run, self.s, self.cfg = js, run, Subjects(run), cfg
        self.plan, self.model_hash, self.owned, self.momentum_dtype = plan, model_hash, owned, momentum_dtype
        self.sstore, self.store_watch, self.stats, self.log = sstore, store_watch, stats, log
        self.states = states  # the merge stage's, read here (checkpoints), never replaced here
        self.logpos: dict[int, LogPosition] = {}  # per fragment: newest checkpoint, log beyond it
        self.uncommitted: dict[int, Uncommitted] = {}  # fragment -> a merge whose record is not stored yet
        self.ckpt_size: dict[int, int] = {}  # fragment -> bytes of its newest checkpoint
        self.ckpt_tasks: dict[int, asyncio.Task] = {}  # fragment -> its checkpoint being stored
        self.logseqs: dict[int, deque] = {}  # fragment -> (version, oldest GRAD seq, bytes) of records committed
        self.grad_checked = 0.0  # when the GRAD stream's first sequence was last looked at
        self.grad_limit = 0  # ... and its byte limit then
        self.grad_behind = False  # ... and whether it held mostly work not read yet (aggregator.mlog)

    # -- the log ----------------------------------------------------------------------------------

    def slots(self) -> int:
        return log_slots(self.cfg.checkpoint_every)

    def blocks(self, p: int) -> bool:
        """Fragment p may not merge: its last record is not committed yet, its checkpoint is being
        stored from its arrays (``snapshot``), its log since the newest checkpoint fills the slots
        a replay needs (the checkpoint is behind), or the store does not take writes (a full disk:
        ``store_watch``)."""
        pos = self.logpos.get(p)
        return (p in self.uncommitted or self.store_watch.faulted or self.checkpointing(p)
                or (pos is not None and pos.versions_since >= 2 * self.cfg.checkpoint_every))

    def note_restart(self, p: int, norms: list) -> None:
        """An outlier-reference restart of fragment p (``aggregator.validate.OutlierWatch``): logged
        with the fragment's next merge, so a replay makes it at the same point."""
        if p in self.logpos:
            self.logpos[p].restarts.append([float(x) for x in norms])

    def take_restarts(self, p: int) -> tuple:
        """The restarts the next merge of p carries in its record (and forgets them here)."""
        pos = self.logpos[p]
        restarts = tuple(tuple(r) for r in pos.restarts)
        pos.restarts = []
        return restarts

    def started(self, p: int, version: int) -> None:
        """Fragment p starts at ``version`` with a checkpoint of it stored and nothing logged."""
        self.logpos[p] = LogPosition(version, time.monotonic())

    def add(self, p: int, merge: Uncommitted) -> None:
        """A merge of p to commit (:meth:`commit`); p merges nothing else until it is committed."""
        assert p not in self.uncommitted, f"fragment {p} has a merge waiting for its record"
        self.uncommitted[p] = merge

    async def commit(self, p: int) -> Committed | None:
        """Write-ahead: store the record of p's waiting merge. None while it is not stored (retried
        as it is on a later call: a lost ack may hide a stored record); else what was committed, or
        undone when the store is full (the state read back from the store, and every contribution
        to buffer again)."""
        u = self.uncommitted[p]
        if self.store_watch.faulted and not self.store_watch.may_write():
            return None  # the store is full: one write every few seconds
        other = None
        items = u.items
        back: list = []
        state = None
        try:
            other = await self._put(u.rec)
            if other is not None:
                state, items, back = await self._adopt(p, other, u.items)
        except Exception as e:  # not committed: nothing acked; the same record is retried
            if await self.store_watch.failed(e):  # a full store (said once): back to what is stored
                return await self._undo(p, u)
            self.log.error("merge_log_failed", fragment=p, version=u.rec.version, error=repr(e))
            return None
        self.store_watch.stored()
        del self.uncommitted[p]
        pos = self.logpos[p]
        seqs = [q for x in items for q in x.seqs]
        nbytes = sum(x.nbytes for x in items)
        if other is None:  # (an adopted record is in the log position the recovery rebuilt)
            pos.versions_since += 1
            pos.bytes_since += nbytes
        if seqs:
            pos.oldest_seq = min(seqs) if pos.oldest_seq is None else min(pos.oldest_seq, *seqs)
            self.logseqs.setdefault(p, deque()).append((u.rec.version, min(seqs), nbytes))
        return Committed(u, True, items, back, state)

    async def _undo(self, p: int, u: Uncommitted) -> Committed | None:
        """The store is full and merge ``u`` of fragment p could not be stored: go back to what is
        durable (its checkpoint and log, read back as a restart would) and hand every contribution
        back, unacknowledged, for a merge once the store writes again. The state in memory is then
        never ahead of the stored one while merging is paused. None if that cannot be read, or the
        record turns out to be stored: the record is then retried as it is."""
        before = self.logpos.get(p)
        try:
            st = await self.recover_fragment(p, announce=False)
        except Exception as e:  # noqa: BLE001 - reads failing too: keep the record, retried as it is
            self.log.debug("merge_undo_failed", fragment=p, version=u.rec.version, error=repr(e))
            st = None
        if st is None or st.version >= u.rec.version:
            if before is not None:
                self.logpos[p] = before
            return None
        for r in u.rec.restarts:  # the outlier-reference restarts it carried go with the next record
            st.norms.restart(p, list(r))
            self.logpos[p].restarts.append(list(r))
        del self.uncommitted[p]
        self.log.info("merge_undone", fragment=p, version=u.rec.version, durable_version=st.version,
                      contributions=len(u.items), hint="merged again once the store writes")
        return Committed(u, False, [], list(u.items), st)

    async def _put(self, rec: MergeRecord) -> MergeRecord | None:
        """Store ``rec``; returns None when it is stored, or the *other* record the stream already
        held for this version (an earlier attempt whose publish reported a failure although it was
        stored, within the 2-minute dedupe window: that one is the committed merge)."""
        blob = rec.to_bytes()
        ack = await self.js.publish(self.s.merge_log(rec.fragment, rec.version % self.slots()), blob, timeout=5,
                                    headers={"Nats-Msg-Id": f"{self.run}.mlog.{rec.fragment}.{rec.version}"})
        self.stats.log_bytes += len(blob)
        if not getattr(ack, "duplicate", False):
            return None
        stored = await self.js.get_msg(self.s.stream("state"), seq=ack.seq, direct=True)
        if stored.data == blob:
            return None  # our own retry
        return MergeRecord.from_bytes(stored.data)

    async def _adopt(self, p: int, rec: MergeRecord, items: list) -> tuple[FragmentState, list, list]:
        """The stream committed another merge of this version than ours (``rec``): our state was
        advanced in place by a merge that is not the committed one, so fragment p is recovered
        again from its checkpoint and log, which hold that merge. Returns that state, the items it
        applied (to be acknowledged) and the others (to buffer again for the next merge)."""
        st = await self.recover_fragment(p)
        if st is None:
            raise RunMismatch(f"fragment {p}: a merge record of version {rec.version} but no checkpoint")
        done = [x for x in items if st.applied.is_duplicate(x.c)]
        back = [x for x in items if not st.applied.is_duplicate(x.c)]
        self.log.error("merge_log_conflict", fragment=p, version=rec.version, adopted=len(done),
                       kept=len(back), recovered=st.version)
        return st, done, back

    # -- checkpoints -------------------------------------------------------------------------------

    def policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(self.cfg.checkpoint_every, self.cfg.checkpoint_seconds)

    def _snapshot(self, p: int) -> tuple[int, int, Gather, float]:
        """Fragment p's state as checkpoint bytes now: (fragment, version, blob, when). The blob is
        the state's own arrays (``FragmentState.checkpoint``): the fragment does not merge until it
        is stored (:meth:`blocks`)."""
        st = self.states[p]
        blob = st.checkpoint()
        self.ckpt_size[p] = blob.nbytes
        return p, st.version, blob, time.monotonic()

    def checkpointing(self, p: int) -> bool:
        """A checkpoint of fragment p is being stored (from its arrays: they must not change)."""
        task = self.ckpt_tasks.get(p)
        return task is not None and not task.done()

    async def initialise(self, st: FragmentState) -> None:
        """A fragment that starts here (no aggregator state yet): its first checkpoint, no merge."""
        await self.sstore.put(st.fragment, st.version, st.checkpoint(), {"model": self.model_hash})
        self.started(st.fragment, st.version)

    async def checkpoint(self, p: int) -> bool:
        """Checkpoint fragment p now and wait until it is stored (after the one being stored)."""
        task = self.ckpt_tasks.get(p)
        if task is not None and not task.done():
            await asyncio.gather(task, return_exceptions=True)
        return await self._store_checkpoint(self._snapshot(p))

    def checkpoint_if_due(self, p: int) -> None:
        """After a merge of p was committed: its checkpoint, if the policy says so."""
        pos = self.logpos[p]
        if self.policy().due(pos.versions_since, time.monotonic() - pos.checkpoint_time):
            self.start_checkpoint(p)

    def start_checkpoint(self, p: int) -> bool:
        """Checkpoint fragment p without holding the loop: stored from the fragment's own arrays by
        a task while intake and the other fragments' merges go on; this fragment's merges wait
        until it is stored (:meth:`blocks`: no copy of its state is taken). False if one is being
        stored already, or the checkpoints being stored leave no room for it
        (``aggregator.mlog.checkpoint_may_start``), unless this fragment's log is full (its merges
        wait for this checkpoint: it never waits for a slot). At 4 x 100M the loop spent half its
        time waiting for checkpoints to be stored (``loop_s``, bench.scale_synth,
        docs/BENCHMARKS.md)."""
        task = self.ckpt_tasks.get(p)
        if task is not None and not task.done():
            return False
        pos = self.logpos.get(p)
        full = pos is not None and pos.versions_since >= 2 * self.cfg.checkpoint_every  # merges wait for it
        busy = [self.checkpoint_bytes(q) for q, t in self.ckpt_tasks.items() if not t.done()]
        if not full and not checkpoint_may_start(busy, self.checkpoint_bytes(p)):
            return False  # (its turn comes at a later pass: the log holds its merges meanwhile)
        task = self.ckpt_tasks[p] = asyncio.create_task(self._store_checkpoint(self._snapshot(p)))
        task.add_done_callback(self._checkpoint_done)
        return True

    def _checkpoint_done(self, task: asyncio.Task) -> None:
        """A checkpoint task that raised past its own handling (a bug): said, not lost."""
        if not task.cancelled() and task.exception() is not None:
            self.log.error("checkpoint_task_failed", error=repr(task.exception()))

    async def _checkpoints_settled(self) -> None:
        tasks = [t for t in self.ckpt_tasks.values() if not t.done()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _store_checkpoint(self, snap: tuple[int, int, Gather, float]) -> bool:
        p, version, blob, taken = snap
        t0 = time.monotonic()
        try:
            await self.sstore.put(p, version, blob, {"model": self.model_hash})
        except VersionConflict as e:
            if e.committed.version < version:
                self.log.error("checkpoint_conflict", fragment=p, version=version, committed=e.committed.version)
                return False
        except Exception as e:
            if not await self.store_watch.failed(e):  # a full store is said once (store_full)
                self.log.warning("checkpoint_failed", fragment=p, version=version, error=repr(e))
            return False
        else:
            self.stats.checkpoint_bytes += len(blob)
        pos = self.logpos[p]
        if version > pos.checkpoint_version:
            # what the log holds beyond this checkpoint: the merges committed since it was taken
            seqs = self.logseqs.setdefault(p, deque())  # (version, oldest GRAD seq, bytes) per record
            while seqs and seqs[0][0] <= version:
                seqs.popleft()
            # (its time is when it was taken: the log's age bound, DILOCO_CHECKPOINT_SECONDS, counts from
            # there; the outlier-reference restarts not yet logged stay: one made before it was taken is then
            # both in the checkpoint and in the next record, and replays the same, since
            # NormHistory.restart replaces the fragment's norms outright)
            self.logpos[p] = LogPosition(version, taken,
                                         max(0, pos.versions_since - (version - pos.checkpoint_version)),
                                         restarts=pos.restarts, oldest_seq=min((q for _, q, _ in seqs), default=None),
                                         bytes_since=sum(b for _, _, b in seqs))
        self.stats.checkpoints += 1
        self.stats.checkpoint_s += time.monotonic() - t0
        self.log.debug("checkpointed", fragment=p, version=version, log_after=self.logpos[p].versions_since,
                       seconds=round(time.monotonic() - t0, 3))
        return True

    async def checkpoints_due(self, now: float, durable: str) -> None:
        """Checkpoint what the policy says, and at once any fragment whose log points into the part
        of the GRAD stream it is about to drop (looked at every 2 s: one stream-info request, and
        the aggregator's ``durable`` consumer's info when one is)."""
        if self.store_watch.faulted:  # no writes while the store is full (checkpoints are big)
            return
        policy = self.policy()
        overtaken: set[int] = set()
        if now - self.grad_checked > 2.0 and any(pos.oldest_seq is not None for pos in self.logpos.values()):
            self.grad_checked = now
            try:
                info = await self.js.stream_info(self.s.stream("grad"))
                st, limit = info.state, info.config.max_bytes or 0
                self.grad_limit = limit
                overtaken = {p for p, pos in self.logpos.items()
                             if stream_overtaking(pos.oldest_seq, st.first_seq, st.last_seq, st.bytes, limit)}
                if overtaken:
                    ci = await self.js.consumer_info(self.s.stream("grad"), durable)
                    self._note_behind(grad_backlog_behind(ci.num_pending or 0, st.messages, len(self.owned),
                                                          self.plan.num_fragments), ci.num_pending or 0, st.messages)
            except Exception as e:
                self.log.warning("grad_stream_info_failed", error=repr(e))
        # the fragments furthest from their checkpoint first: they start first
        for p, pos in sorted(self.logpos.items(), key=lambda kv: -kv[1].versions_since):
            if p in self.uncommitted:
                continue
            due = policy.due(pos.versions_since, now - pos.checkpoint_time)
            share = self.grad_limit * int(self.plan.sizes[p]) // max(1, sum(int(n) for n in self.plan.sizes))
            if not due and p in overtaken and not early_checkpoint_pays(
                    pos.bytes_since, self.checkpoint_bytes(p), share, self.grad_behind):
                self.stats.checkpoints_early_skipped += 1
                continue
            if (due or p in overtaken) and self.start_checkpoint(p) and not due:
                self.stats.checkpoints_early += 1

    def _note_behind(self, behind: bool, undelivered: int, messages: int) -> None:
        """Say once per change that the GRAD stream holds mostly work not read yet: early checkpoints
        are then bounded (aggregator.mlog.early_checkpoint_pays), and a crash meanwhile loses merges."""
        if behind and not self.grad_behind:
            self.log.warning("grad_stream_behind", undelivered=undelivered, stream_messages=messages,
                             message="the GRAD stream holds mostly contributions not read yet: the oldest are "
                                     "dropped unmerged, early checkpoints are bounded to a quarter of the bytes "
                                     "merged, and a crash now loses the merges the stream no longer holds "
                                     "(replay_lost); give the aggregator more CPU (DILOCO_AGG_SHARDS) or the "
                                     "learners a longer DILOCO_SYNC_EVERY")
        elif not behind and self.grad_behind:
            self.log.info("grad_stream_caught_up", undelivered=undelivered, stream_messages=messages)
        self.grad_behind = behind

    def checkpoint_bytes(self, p: int) -> int:
        """Bytes a checkpoint of fragment p writes: its last one's, or its state's arrays."""
        st = self.states.get(p)
        return self.ckpt_size.get(p) or (st.array_bytes() if st is not None else STATE_ARRAYS * 4 * int(self.plan.sizes[p]))

    async def checkpoint_all(self) -> None:
        """At a clean stop: nothing left to replay."""
        await self._checkpoints_settled()
        for p, pos in list(self.logpos.items()):
            if pos.versions_since > 0 and p not in self.uncommitted:
                await self.checkpoint(p)

    async def close(self) -> None:
        """Cancel the checkpoints being stored (one cut short: the log covers it)."""
        await cancel_all(self.ckpt_tasks.values())

    # -- recovery ---------------------------------------------------------------------------------

    async def _replay_contribution(self, lc) -> Contribution:
        obj = await fetch_object(self.js, self.s.stream("grad"), lc.seqs)
        c = from_grad_message(obj.meta, obj.blob)
        if c.key != lc.key:
            raise NotFoundError  # the sequences hold another object now
        return c

    async def recover_fragment(self, p: int, published: int | None = None, announce: bool = True,
                               republish: Republish | None = None) -> FragmentState | None:
        """The newest checkpoint of p with its log replayed; None when p has no checkpoint yet.

        ``published``: the global head's version. Every replayed version after it is handed to
        ``republish`` as it is reached (the crashed process had them queued: learners follow every
        version's applied keys), and the merge events from it on (deduplicated by their message
        ids). ``announce``: publish an ``events.recovered`` event (not while the store is full)."""
        got = await self.sstore.get(p)
        if got is None:
            return None
        st = FragmentState.from_bytes(got[1])
        ckpt = st.version
        kept = getattr(st.opt, "momentum", None)
        if kept is not None and kept.dtype.name != self.momentum_dtype and announce:
            # the dtype a fragment started with stays (a replay must be bit for bit): said once per fragment
            self.log.warning("momentum_dtype_kept", fragment=p, checkpoint=kept.dtype.name,
                             setting=self.momentum_dtype,
                             hint="DILOCO_OUTER_MOMENTUM_DTYPE takes effect for a fragment that starts after it; "
                                  "this fragment's checkpoint keeps the dtype it was written with")
        records = await read_log(self.js, self.s, p, self.log)
        t0 = time.monotonic()
        replayed = lost = nbytes = 0
        oldest: int | None = None
        v = st.version + 1
        while v in records:
            rec = records[v]
            try:
                contribs = await asyncio.gather(*(self._replay_contribution(lc) for lc in rec.contribs))
                st = replay_one(st, rec, list(contribs), inplace=True)
                replayed += 1
            except (NotFoundError, TransportError, ValueError, codec.CodecError) as e:
                st = applied_without_replay(st, rec)
                lost += 1
                self.log.error("replay_lost", fragment=p, version=v, contributions=len(rec.contribs), error=repr(e),
                               hint="the GRAD stream no longer holds them: its DILOCO_STREAM_MAX_AGE or byte limit "
                                    "is too short for the time the aggregator was down")
            else:
                if (published is not None and republish is not None and st.version >= published
                        and not await republish(p, st, published)):
                    published = None  # the rest waits for the main loop (``unpublished``: the newest version)
            seqs = [q for lc in rec.contribs for q in lc.seqs]
            nbytes += sum(lc.nbytes for lc in rec.contribs)
            if seqs:
                oldest = min(seqs) if oldest is None else min(oldest, *seqs)
            v += 1
        later = sorted(x for x in records if x >= v)
        if later:  # a gap in the log: cannot happen while the slots outnumber the versions a checkpoint lags
            raise RunMismatch(f"fragment {p}: the merge log misses version {v} (checkpoint {ckpt}, records up to "
                              f"{later[-1]}): was DILOCO_CHECKPOINT_EVERY lowered while records were pending?")
        self.logpos[p] = LogPosition(ckpt, time.monotonic(), st.version - ckpt, oldest_seq=oldest, bytes_since=nbytes)
        self.stats.replayed += replayed
        self.stats.replay_lost += lost
        self.stats.recovery_s += time.monotonic() - t0
        if replayed or lost:
            self.log.info("fragment_replayed", fragment=p, checkpoint=ckpt, version=st.version, replayed=replayed,
                          lost=lost, seconds=round(time.monotonic() - t0, 3))
        if not announce:
            return st
        try:
            await self.js.publish(self.s.event("recovered"), orjson.dumps(
                {"fragment": p, "checkpoint": ckpt, "version": st.version, "replayed": replayed, "lost": lost,
                 "aggregator": self.cfg.aggregator_id, "seconds": round(time.monotonic() - t0, 3), "ts": time.time()}),
                timeout=5)
        except Exception as e:
            self.log.warning("recovered_event_failed", fragment=p, error=repr(e))
        return st


async def read_log(js: Any, s: Subjects, p: int, log: Any) -> dict[int, MergeRecord]:
    """Every record of fragment p the STATE stream holds on its log subjects, by version (the
    newest stored copy). The subjects and how many messages each holds come from the server
    (``stream_info`` with a subject filter); a subject holding one is read by its last message,
    one holding more (a slot shared by two versions after ``DILOCO_CHECKPOINT_EVERY`` was
    lowered, with ``DILOCO_GLOBAL_HISTORY`` above 2) message by message on that subject alone.
    Each read finds its message by subject, so the time does not grow with the stream: a scan
    of the stream for the log's wildcard from sequence 1 timed out past the JetStream timeout at
    1B parameters, where STATE holds tens of GB of checkpoint chunks, and the restarted
    aggregator exited."""
    stream = s.stream("state")
    info = await js.stream_info(stream, subjects_filter=s.merge_log_filter(p))
    counts = dict(info.state.subjects or {}) if info.state else {}

    async def read(subject: str, count: int) -> list:
        if count <= 1:
            try:
                return [await js.get_last_msg(stream, subject, direct=True)]
            except NotFoundError:  # purged or replaced between the two requests
                return []
        got: list = []
        seq = 1
        while True:
            try:
                m = await js.get_msg(stream, seq=seq, subject=subject, next=True, direct=True)
            except NotFoundError:
                return got
            got.append(m)
            seq = int(m.seq) + 1

    out: dict[int, MergeRecord] = {}
    for msgs in await asyncio.gather(*(read(x, n) for x, n in sorted(counts.items()))):
        for m in sorted(msgs, key=lambda m: int(m.seq)):  # the newest copy of a version last
            try:
                rec = MergeRecord.from_bytes(m.data)
                out[rec.version] = rec
            except Exception as e:
                log.error("bad_merge_record", fragment=p, seq=m.seq, error=repr(e))
    return out
