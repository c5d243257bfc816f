"""The learner's side of its progress record (``bus.progress``): read at start, written while training.

``ProgressKeeper`` is an object with its own state (the bucket, the revision it last wrote, what
it wrote, whether another process took the id over). It writes with a compare-and-set on the
revision it last saw, so of two processes with the same learner id (an old one cut off by a
partition while its replacement runs elsewhere) only the newest keeps the record: the other is
told once (``progress_superseded``) and stops writing.

A run created by an older version has no progress bucket until its aggregator restarts (which
creates missing buckets): the learner then says so once (``progress_unavailable``) and trains
from step 0 as before.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from bus.progress import KIND, BadProgress, Progress, Resume, progress_from_dict
from bus.subjects import Subjects


class ProgressKeeper:
    """Reads and writes one learner id's progress record."""

    def __init__(self, js, run: str, learner: str, incarnation: str, budget: int | None, log):
        self.js, self.learner, self.incarnation, self.budget, self.log = js, learner, incarnation, budget, log
        self.bucket = Subjects(run).bucket(KIND)
        self.kv: Any = None
        self.rev = 0  # the revision of the record we last read or wrote (0: none)
        self.available = True  # false: no bucket, or another process took the id over
        self.superseded = False
        self.restarts = 0
        self.lost = 0
        self.written: tuple | None = None  # (step, trained, done) last written
        self.writes = 0
        self.failures = 0

    async def load(self) -> Progress | None:
        """This id's record (None: none, or none readable: said once why)."""
        try:
            self.kv = await self.js.key_value(self.bucket)
        except BucketNotFoundError:
            self._unavailable("the run has no progress bucket (created by an older version: restart its aggregator, "
                              "which creates it)")
            return None
        except Exception as e:  # no right to read it, a server blip: train without resuming
            self._unavailable(f"the progress bucket could not be opened: {e!r}")
            return None
        try:
            entry = await self.kv.get(self.learner)
        except KeyNotFoundError:
            return None
        except Exception as e:
            self._unavailable(f"the progress record could not be read: {e!r}")
            return None
        self.rev = entry.revision or 0
        try:
            return progress_from_dict(orjson.loads(entry.value or b"null"))
        except (BadProgress, ValueError) as e:
            self.log.warning("progress_unreadable", error=str(e), hint="starting from step 0; the record is replaced")
            return None

    def _unavailable(self, why: str) -> None:
        self.available = False
        self.log.warning("progress_unavailable", reason=why,
                         message="this learner's progress is not kept: a restart will start its step, schedule, "
                                 "budget and data over")

    def adopt(self, resume: Resume) -> None:
        """The resume decision of this process: its restarts and lost steps go into every write."""
        self.restarts, self.lost = resume.restarts, resume.lost_total

    def record(self, step: int, trained: int, done: bool = False) -> Progress:
        return Progress(learner=self.learner, incarnation=self.incarnation, step=int(step),
                        trained=max(int(trained), int(step)), budget=self.budget, restarts=self.restarts,
                        lost=self.lost, done=bool(done), at=time.time())

    async def write(self, step: int, trained: int, done: bool = False, force: bool = False) -> bool:
        """Write the record if it changed (or ``force``); False if not written (unavailable,
        superseded, or the write failed: the next one tries again)."""
        if not self.available or self.kv is None:
            return False
        key = (int(step), int(trained), bool(done))
        if key == self.written and not force:
            return True
        value = orjson.dumps(self.record(step, trained, done).to_dict())
        for _ in range(2):
            try:
                self.rev = await (self.kv.create(self.learner, value) if self.rev == 0
                                  else self.kv.update(self.learner, value, last=self.rev))
                self.written = key
                self.writes += 1
                return True
            except KeyWrongLastSequenceError:
                if not await self._reread():
                    return False
            except Exception as e:
                self.failures += 1
                self.log.debug("progress_write_failed", error=repr(e))
                return False
        return False

    async def _reread(self) -> bool:
        """Our compare-and-set failed: if the record is still ours (a write whose reply was lost),
        take its revision and retry; if another process wrote it, stop writing (said once)."""
        try:
            entry = await self.kv.get(self.learner)
            rec = progress_from_dict(orjson.loads(entry.value or b"null"))
        except KeyNotFoundError:
            self.rev = 0
            return True
        except Exception as e:
            self.failures += 1
            self.log.debug("progress_write_failed", error=repr(e))
            return False
        if rec.incarnation == self.incarnation:
            self.rev = entry.revision or 0
            return True
        self.available, self.superseded = False, True
        self.log.warning("progress_superseded", by=rec.incarnation, their_step=rec.step,
                         message=f"another process with learner id {self.learner} (incarnation {rec.incarnation}) "
                                 "writes this id's progress now: this one stops writing it. Two processes with one "
                                 "id train twice on the same data shard: stop one of them")
        return False
