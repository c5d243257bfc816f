"""The last stage of a fragment's pipeline: publishing the global versions a merge made.

The merge stage (``aggregator.versions``) encodes each new version for the downlink at once (the
merge updates the parameters in place, so the blob is taken before the next merge) and hands it
here as a :class:`PublishJob`. Each fragment has its own queue, bounded at ``PUBLISH_QUEUE``
(beyond it the fragment merges nothing until one is out), drained in
order by its own task: the keyframe if the version is one, the version's chunks and head, then its
``merge`` event. A failed publish is retried, never skipped: learners follow every version's
applied keys. Merging goes on while a fragment's versions are being acknowledged.

State of its own: the queues and their tasks, the newest version out per fragment, and the
fragments whose newest version must be published again after a restart or a refused write.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from bus.transport import VersionConflict


#: versions of one fragment encoded and waiting for their publisher: beyond it the fragment merges
#: nothing until one is out (``aggregator.versions``)
PUBLISH_QUEUE = 2


@dataclass(frozen=True)
class PublishJob:
    """A global version ready to publish: its downlink blob and metadata, and its merge event."""

    fragment: int
    version: int
    blob: bytearray
    meta: dict
    keyframe: bool
    applied: list
    scale: float
    per_round: int
    key_blob: bytearray | bytes | None = None  # a chained downlink: the whole reconstruction


class Publisher:
    """Publishes the versions of an aggregator's fragments, one ordered queue per fragment."""

    def __init__(self, js: Any, run: str, event_subject: str, gstore: Any, kstore: Any, store_watch: Any,
                 log: Any):
        self.js, self.run, self.event_subject = js, run, event_subject
        self.gstore, self.kstore = gstore, kstore
        self.store_watch, self.log = store_watch, log
        self.queues: dict[int, deque[PublishJob]] = {}  # fragment -> versions encoded, in order
        self.tasks: dict[int, asyncio.Task] = {}  # fragment -> the task draining its queue
        self.published: dict[int, int] = {}  # fragment -> newest version whose head and merge event are out
        self.unpublished: set[int] = set()  # fragments whose newest version is to be published again

    def waiting(self, p: int) -> int:
        """Versions of fragment p queued and not out yet."""
        return len(self.queues.get(p, ()))

    def queue(self, job: PublishJob) -> None:
        """Hand a version to its fragment's queue (started if idle)."""
        p = job.fragment
        self.queues.setdefault(p, deque()).append(job)
        t = self.tasks.get(p)
        if t is None or t.done():
            self.tasks[p] = asyncio.create_task(self._drain_queue(p))

    async def _drain_queue(self, p: int) -> None:
        """Publish fragment p's queued versions in order; a failed one is retried (never skipped)."""
        q = self.queues[p]
        delay = 0.1
        while q:
            job = q[0]
            try:
                await self.send(job)
            except Exception as e:
                if not await self.store_watch.failed(e):  # a full store is said once (store_full)
                    self.log.error("global_publish_failed", fragment=p, version=job.version, error=repr(e),
                                   retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
                continue
            q.popleft()
            delay = 0.1

    async def send(self, job: PublishJob) -> None:
        """One version: its keyframe (if it is one), its chunks and head, then its merge event."""
        p = job.fragment
        try:
            if job.keyframe:  # a keyframe: on its own subjects first, then as the version
                if job.key_blob is None:
                    await self.kstore.put(p, job.version, job.blob, job.meta)
                else:  # a chained version: the whole reconstruction (a keyframe of the view)
                    await self.kstore.put(p, job.version, job.key_blob,
                                          {**{k: v for k, v in job.meta.items() if k != "prev"}, "key": job.version})
            await self.gstore.put(p, job.version, job.blob, {**job.meta, "applied": job.applied})
        except VersionConflict as e:  # a newer version is out already (a recovery republished it)
            if e.committed.version < job.version:
                raise
            self.log.warning("global_version_superseded", fragment=p, version=job.version,
                             committed=e.committed.version)
        await self.send_event(p, job.version, job.applied, job.scale, job.per_round)
        self.published[p] = max(self.published.get(p, -1), job.version)

    async def send_event(self, p: int, version: int, applied: list, scale: float, per_round: int) -> None:
        """The ``merge`` event of version ``version`` of p (deduplicated by its message id)."""
        if version > 0:
            await self.js.publish(self.event_subject, orjson.dumps(
                {"fragment": p, "version": version, "applied": applied, "scale": scale, "per_round": per_round,
                 "ts": time.time()}), headers={"Nats-Msg-Id": f"{self.run}.merge.{p}.{version}"})

    async def catch_up(self, p: int, version: int, job: Callable[[], PublishJob], event: tuple) -> None:
        """After a (re)start or a refused write: version ``version`` of p if the global head is behind
        it (``job()`` encodes it), else the merge event of the head (``event``: applied, scale,
        per_round). Said and kept in ``unpublished`` for the next pass if the server refuses."""
        if self.store_watch.faulted and not self.store_watch.may_write():
            return  # the store is full: one write every few seconds
        try:
            head = await self.gstore.head(p)
            if head is None or head.version < version:
                await self.send(job())
            else:
                await self.send_event(p, version, *event)
            self.published[p] = max(self.published.get(p, -1), version)
            self.unpublished.discard(p)
        except Exception as e:
            if not await self.store_watch.failed(e):
                self.log.error("global_publish_failed", fragment=p, version=version, error=repr(e))
            self.unpublished.add(p)

    async def drain(self, timeout: float = 30.0) -> None:
        """Wait for the queued versions to go out, ``timeout`` seconds at most (then cancelled)."""
        tasks = [t for t in self.tasks.values() if not t.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for t in pending:
                t.cancel()
