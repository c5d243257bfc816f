"""The aggregator's durability: the merge log, checkpoints, and recovery by replay.

A mixin of ``aggregator.service.AggregatorService``; the pure parts (records, replay, the
checkpoint policy) are ``aggregator.mlog``.

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
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from nats.js.errors import NotFoundError

from aggregator.contribution import from_grad_message
from aggregator.mlog import (CheckpointPolicy, LogPosition, MergeRecord, applied_without_replay, log_slots,
                             replay_one, stream_overtaking)
from aggregator.step import FragmentState
from bus import codec
from bus.runs import RunMismatch
from bus.transport import TransportError, VersionConflict, fetch_object

#: versions of one fragment encoded and waiting for their publisher (aggregator.versions): beyond
#: it the fragment merges nothing until one is out
PUBLISH_QUEUE = 2


class Durability:
    """Merge log, checkpoints and replay for an ``AggregatorService``."""

    if TYPE_CHECKING:
        def __getattr__(self, name: str) -> Any: ...
        states: dict[int, FragmentState]
        logpos: dict[int, LogPosition]
        _grad_checked: float

    # -- the log ----------------------------------------------------------------------------------

    def _slots(self) -> int:
        return log_slots(self.cfg.checkpoint_every)

    def _log_blocked(self, p: int) -> bool:
        """Fragment p may not merge: its last record is not committed yet, or its log since the
        newest checkpoint fills the slots a replay needs (the checkpoint is behind)."""
        pos = self.logpos.get(p)
        return (p in self.uncommitted or len(self.pubq.get(p, ())) >= PUBLISH_QUEUE
                or (pos is not None and pos.versions_since >= 2 * self.cfg.checkpoint_every))

    async def _log_put(self, rec: MergeRecord) -> MergeRecord | None:
        """Store ``rec``; returns None when it is stored, or the *other* record the stream already
        held for this version (an earlier attempt whose publish reported a failure although it was
        stored, within the 2-minute dedupe window: that one is the committed merge)."""
        blob = rec.to_bytes()
        ack = await self.js.publish(self.s.merge_log(rec.fragment, rec.version % self._slots()), blob, timeout=5,
                                    headers={"Nats-Msg-Id": f"{self.common.run}.mlog.{rec.fragment}.{rec.version}"})
        self.stats.log_bytes += len(blob)
        if not getattr(ack, "duplicate", False):
            return None
        stored = await self.js.get_msg(self.s.stream("state"), seq=ack.seq, direct=True)
        if stored.data == blob:
            return None  # our own retry
        return MergeRecord.from_bytes(stored.data)

    async def _adopt(self, p: int, rec: MergeRecord, items: list) -> list:
        """The stream committed another merge of this version than ours (``rec``): our state was
        advanced in place by a merge that is not the committed one, so fragment p is recovered
        again from its checkpoint and log, which hold that merge. Returns the items it applied (to
        be acknowledged); the others go back to the buffer for the next merge."""
        st = await self._recover_fragment(p)
        if st is None:
            raise RunMismatch(f"fragment {p}: a merge record of version {rec.version} but no checkpoint")
        self.states[p] = st
        done = [x for x in items if st.applied.is_duplicate(x.c)]
        self.buffers[p] = [x for x in items if not st.applied.is_duplicate(x.c)] + self.buffers[p]
        self.log.error("merge_log_conflict", fragment=p, version=rec.version, adopted=len(done),
                       kept=len(items) - len(done), recovered=st.version)
        return done

    async def _read_log(self, p: int) -> dict[int, MergeRecord]:
        """Every record of fragment p the STATE stream holds, by version (the newest stored copy)."""
        out: dict[int, MergeRecord] = {}
        seq = 1
        stream = self.s.stream("state")
        while True:
            try:
                m = await self.js.get_msg(stream, seq=seq, subject=self.s.merge_log_filter(p), next=True, direct=True)
            except NotFoundError:
                return out
            try:
                rec = MergeRecord.from_bytes(m.data)
                out[rec.version] = rec
            except Exception as e:
                self.log.error("bad_merge_record", fragment=p, seq=m.seq, error=repr(e))
            seq = int(m.seq) + 1

    # -- checkpoints -------------------------------------------------------------------------------

    def _policy(self) -> CheckpointPolicy:
        return CheckpointPolicy(self.cfg.checkpoint_every, self.cfg.checkpoint_seconds)

    async def _checkpoint(self, p: int) -> bool:
        st = self.states[p]
        pos = self.logpos[p]
        t0 = time.monotonic()
        try:
            blob = st.to_bytes(self._ckpt_buf.get(p))
            # reused by the next checkpoint (fresh pages cost more than the copy)
            self._ckpt_buf[p] = blob.obj if isinstance(blob, memoryview) else blob  # type: ignore[assignment]
            await self.sstore.put(p, st.version, blob, {"model": self.model_hash})
        except VersionConflict as e:
            if e.committed.version < st.version:
                self.log.error("checkpoint_conflict", fragment=p, version=st.version, committed=e.committed.version)
                return False
        except Exception as e:
            self.log.warning("checkpoint_failed", fragment=p, version=st.version, error=repr(e))
            return False
        else:
            self.stats.checkpoint_bytes += len(blob)
        self.logpos[p] = LogPosition(st.version, time.monotonic())
        self.stats.checkpoints += 1
        self.stats.checkpoint_s += time.monotonic() - t0
        self.log.debug("checkpointed", fragment=p, version=st.version, after=pos.versions_since,
                       seconds=round(time.monotonic() - t0, 3))
        return True

    async def _checkpoints_due(self, now: float) -> None:
        """Checkpoint what the policy says, and at once any fragment whose log points into the part
        of the GRAD stream it is about to drop (looked at every 2 s: one stream-info request)."""
        policy = self._policy()
        overtaken: set[int] = set()
        if now - self._grad_checked > 2.0 and any(pos.oldest_seq is not None for pos in self.logpos.values()):
            self._grad_checked = now
            try:
                info = await self.js.stream_info(self.s.stream("grad"))
                st, limit = info.state, info.config.max_bytes or 0
                overtaken = {p for p, pos in self.logpos.items()
                             if stream_overtaking(pos.oldest_seq, st.first_seq, st.last_seq, st.bytes, limit)}
            except Exception as e:
                self.log.warning("grad_stream_info_failed", error=repr(e))
        for p, pos in list(self.logpos.items()):
            if p not in self.uncommitted and (p in overtaken or policy.due(pos.versions_since, now - pos.checkpoint_time)):
                if p in overtaken:
                    self.stats.checkpoints_early += 1
                await self._checkpoint(p)

    async def _checkpoint_all(self) -> None:
        """At a clean stop: nothing left to replay."""
        for p, pos in list(self.logpos.items()):
            if pos.versions_since > 0 and p not in self.uncommitted:
                await self._checkpoint(p)

    # -- recovery ---------------------------------------------------------------------------------

    async def _replay_contribution(self, lc) -> Any:
        obj = await fetch_object(self.js, self.s.stream("grad"), lc.seqs)
        c = from_grad_message(obj.meta, obj.blob)
        if c.key != lc.key:
            raise NotFoundError  # the sequences hold another object now
        return c

    async def _recover_fragment(self, p: int, published: int | None = None) -> FragmentState | None:
        """The newest checkpoint of p with its log replayed; None when p has no checkpoint yet.

        ``published``: the global head's version. Every replayed version after it is published as
        it is reached (the crashed process had them queued: learners follow every version's
        applied keys), and the merge events from it on (deduplicated by their message ids)."""
        got = await self.sstore.get(p)
        if got is None:
            return None
        st = FragmentState.from_bytes(got[1])
        ckpt = st.version
        records = await self._read_log(p)
        t0 = time.monotonic()
        replayed = lost = 0
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
                if published is not None and st.version >= published and not await self._republish(p, st, published):
                    published = None  # the rest waits for the main loop (``unpublished``: the newest version)
            seqs = [q for lc in rec.contribs for q in lc.seqs]
            if seqs:
                oldest = min(seqs) if oldest is None else min(oldest, *seqs)
            v += 1
        later = sorted(x for x in records if x >= v)
        if later:  # a gap in the log: cannot happen while the slots outnumber the versions a checkpoint lags
            raise RunMismatch(f"fragment {p}: the merge log misses version {v} (checkpoint {ckpt}, records up to "
                              f"{later[-1]}): was DILOCO_CHECKPOINT_EVERY lowered while records were pending?")
        self.logpos[p] = LogPosition(ckpt, time.monotonic(), st.version - ckpt, oldest_seq=oldest)
        self.stats.replayed += replayed
        self.stats.replay_lost += lost
        self.stats.recovery_s += time.monotonic() - t0
        if replayed or lost:
            self.log.info("fragment_replayed", fragment=p, checkpoint=ckpt, version=st.version, replayed=replayed,
                          lost=lost, seconds=round(time.monotonic() - t0, 3))
        try:
            await self.js.publish(self.s.event("recovered"), orjson.dumps(
                {"fragment": p, "checkpoint": ckpt, "version": st.version, "replayed": replayed, "lost": lost,
                 "aggregator": self.cfg.aggregator_id, "seconds": round(time.monotonic() - t0, 3), "ts": time.time()}),
                timeout=5)
        except Exception as e:
            self.log.warning("recovered_event_failed", fragment=p, error=repr(e))
        return st

    async def _republish(self, p: int, st: FragmentState, published: int) -> bool:
        """A replayed version the global store lacks (or holds as its head without, maybe, its
        merge event): publish it now, in order. False if the server refused (then recovery goes on
        without publishing; the main loop publishes the newest version)."""
        try:
            if st.version > published:
                self.states[p] = st
                await self._send(self._publish_job(p))
            else:
                await self._send_event(p, st.version, [list(k) for k in st.last_merge], st.last_scale,
                                       st.last_per_round)
            return True
        except Exception as e:
            self.log.warning("recovery_publish_failed", fragment=p, version=st.version, error=repr(e))
            return False

    async def _recover(self, js) -> None:
        gstore, sstore = self.gstore, self.sstore
        for p in self.owned:
            gh = await gstore.head(p)
            if self.cfg.downlink_chain:
                await self._recover_view(p)
            st = await self._recover_fragment(p, -1 if gh is None else gh.version)
            if st is None:
                if gh is None:
                    raise RuntimeError(f"fragment {p} has neither state nor global version (the run's creator writes version 0 before the manifest)")
                gh, blob = await gstore.get(p)
                if "ref" in gh.meta or "prev" in gh.meta:
                    raise RunMismatch(f"fragment {p}: no aggregator state, and global version {gh.version} is a "
                                      "delta against a keyframe: the state stream was lost")
                st = FragmentState.initial(p, gh.version, np.array(codec.decode_array(blob)), self.settings)
                await sstore.put(p, st.version, st.to_bytes(), {"model": self.model_hash})
                self.logpos[p] = LogPosition(st.version, time.monotonic())
                self.log.info("fragment_initialised", fragment=p, version=st.version)
            else:
                if gh is not None and gh.version > st.version:
                    raise RunMismatch(f"fragment {p}: global version {gh.version} is ahead of our state "
                                      f"{st.version}: is another aggregator owning it?")
                # republish what a crash may have cut short: the global version (if behind) and
                # the merge event of the newest version (deduplicated by its message id)
                self.unpublished.add(p)
                self.log.info("fragment_recovered", fragment=p, version=st.version,
                              global_behind=gh is None or gh.version < st.version)
            self.states[p] = st
            if p not in self.keys:  # (a replay that published versions started from a keyframe)
                await self._recover_keyframe(p, st)
