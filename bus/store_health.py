"""Does the server store what this process writes? A JetStream store that is full (a full disk, or
its ``max_file_store`` used up), told apart from other failures, and the state each role logs once
per change (issue 29; docs/RELIABILITY.md, "Full disk").

What nats-server 2.15 does (measured, docs/RELIABILITY.md):

* **its filesystem full** (ENOSPC): the write that fails gets *no answer* (nats-py: ``TimeoutError``)
  and the stream keeps a write error: every later write to it goes unanswered too, even once space
  is free again, until the server restarts (``bus.server.EmbeddedServer.heal_store`` does it when
  space is back). Its ``/healthz`` then answers 503 "JetStream stream '$G > <stream>' write error:
  ... no space left on device" (``?js-enabled-only=true`` stays 200). Reads (direct get, fetch,
  stream info) and consumer acks go on.
* **its ``max_file_store`` used up** (by storage no stream reserved): every write is refused at
  once, ``ServiceUnavailableError`` code 503, err_code 10023, "insufficient resources"; writes are
  stored again as soon as storage is freed.

:func:`classify` names what an exception shows (pure). A timeout alone could be a server that is
down or restarting, so it counts as a store fault only when the server answers a request about
the stream at once (:func:`store_fault`): it is up, and its store is what stays silent.
:class:`StoreHealth` is the per-process state (pure); :class:`StoreWatch` adds that request and
the one line per change of state (``store_full``, then ``store_writable``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

#: nats-server refusing a write for want of storage: the server's JetStream storage
#: (``max_file_store``) used up (10023 "insufficient resources"), or the account's (10002 "resource
#: limits exceeded for account"). (A stream whose bytes cannot be *reserved*, 10047, is a sizing
#: error, ``bus.streams.StorageUnavailable``, not a full store.)
FULL_ERR_CODES = frozenset({10023, 10002})
#: the text of a write that failed on a full filesystem (what nats-server passes on from the OS)
NO_SPACE = "no space left on device"

FULL = "full"  # the server says its store is full
SILENT = "silent"  # no answer in time: a full disk (nats-server stays silent), or a server down

#: seconds between two writes a role tries while its store is faulted (its probes)
PROBE_EVERY = 5.0
#: seconds without a stored write after which a role with nothing to write (an aggregator with
#: nothing to merge, a learner whose syncs wait for the aggregator) writes a probe: it learns of a
#: full store too, and says so
STORE_IDLE_PROBE = 10.0
#: the longest a waiting learner goes between probes while they are stored (its probes stay in GRAD
#: until the stream's limits drop them: at most about 15 an hour, 1 MiB, for each learner waiting)
STORE_IDLE_PROBE_MAX = 300.0
#: bytes of that probe: as much as a chunk of a small fragment, more than a filesystem block, so
#: that it does not fit in the unused end of a block the stream has already written (a tiny write
#: is stored there on a full disk: measured on tmpfs, docs/RELIABILITY.md)
PROBE_BYTES = 64 * 1024


def _chain(exc: BaseException | None):
    """``exc`` and what it was raised from (``raise ... from None`` ends the chain)."""
    seen = 0
    while exc is not None and seen < 8:
        yield exc
        exc, seen = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__), seen + 1


def classify(exc: BaseException) -> tuple[str, str] | None:
    """(``FULL`` or ``SILENT``, what the server said) for an exception of a write, or None for any
    other failure (pure). Follows ``__cause__`` (a ``TransportError`` raised from the publish's
    own error)."""
    silent = None
    for e in _chain(exc):
        code = getattr(e, "err_code", None)
        desc = str(getattr(e, "description", "") or "")
        text = f"{desc} {e}".lower()
        if code in FULL_ERR_CODES or NO_SPACE in text or "insufficient resources" in text:
            return FULL, (desc or str(e))[:200]
        if silent is None and isinstance(e, TimeoutError):
            silent = (SILENT, "no acknowledgement in time")
    return silent


def store_fault(kind: str | None, server_answers: bool) -> bool:
    """Whether a write's failure of ``kind`` (:func:`classify`) is the store's (pure): the server
    said so, or it stayed silent while it answers requests."""
    return kind == FULL or (kind == SILENT and server_answers)


def describe(kind: str, said: str) -> str:
    """The fault in words, for the one line (pure)."""
    if kind == FULL:
        return f"nats-server refuses writes: {said!r} (its JetStream storage, max_file_store, or the account's is used up, or its disk is full)"
    return ("nats-server does not acknowledge writes while it answers requests: its JetStream store cannot "
            "write (a full disk: the server's log says 'no space left on device')")


HINT = ("free disk space where nats-server keeps its store_dir, or raise its max_file_store; after a full disk "
        "nats-server writes to its streams again only once restarted (`diloco nats` restarts it by itself when "
        "space is back; docs/RELIABILITY.md, 'Full disk')")


@dataclass
class StoreHealth:
    """Whether this process's writes are stored (pure state; the caller logs the transitions)."""

    probe_every: float = PROBE_EVERY
    reason: str | None = None  # the fault now (None: writes are stored)
    since: float = 0.0
    episodes: int = 0  # times the store went faulted
    refused: int = 0  # writes refused or unanswered while faulted
    seconds: float = 0.0  # seconds faulted over the finished episodes
    next_probe: float = 0.0
    last_stored: float = 0.0  # when a write was last stored

    @property
    def faulted(self) -> bool:
        return self.reason is not None

    def fault(self, reason: str, now: float, tried_at: float | None = None) -> bool:
        """A write failed for want of storage; True if this starts an episode. ``tried_at``: when
        that write was sent (a probe): the next probe is due ``probe_every`` after it, not after its
        failure (a silent store fails a probe only at its timeout, which doubled the wait)."""
        self.refused += 1
        self.next_probe = (now if tried_at is None else min(now, tried_at)) + self.probe_every
        if self.reason is not None:
            return False
        self.reason, self.since = reason, now
        self.episodes += 1
        return True

    def stored(self, now: float) -> float | None:
        """A write was stored: the seconds of the episode this ends, or None if there was none."""
        self.last_stored = now
        if self.reason is None:
            return None
        down = now - self.since
        self.seconds += down
        self.reason = None
        return down

    def may_write(self, now: float) -> bool:
        """Whether to try a write now: always while healthy; while faulted, one write (a probe)
        every ``probe_every`` seconds."""
        if self.reason is None:
            return True
        if now >= self.next_probe:
            self.next_probe = now + self.probe_every
            return True
        return False

    def probe_due(self, now: float, idle: float) -> bool:
        """Whether a process that may write rarely should try a small write now: while faulted, as
        :meth:`may_write`; while healthy, once no write was stored for ``idle`` seconds (then at
        most every ``idle`` seconds), so that it learns of a full store without work to write."""
        if self.reason is not None:
            return self.may_write(now)
        if now - self.last_stored >= idle and now >= self.next_probe:
            self.next_probe = now + idle
            return True
        return False

    def reconnected(self, now: float) -> None:
        """The connection to the server came back: while faulted, the next probe is due now. A
        restart is how a full store usually ends (space freed, the server started again), and a
        probe on the old schedule came up to ``probe_every`` later (the full-disk test resumed 11.5 s
        after the space was freed in 6 of 10 runs, 3 s in the others)."""
        if self.reason is not None:
            self.next_probe = min(self.next_probe, now)

    def metrics(self, now: float) -> dict:
        return {"store_fault": self.reason, "store_faults": self.episodes, "store_refused": self.refused,
                "store_fault_s": round(self.seconds + (now - self.since if self.reason else 0.0), 3)}


class StoreWatch:
    """A role's :class:`StoreHealth` with its I/O: the requests that tell a silent store from a
    server that is down or a request that was lost, and the one line per change of state.

    ``probe``: a JetStream request about a stream (its info), answered by a server that is up;
    ``write_probe`` (optional): a probe write of the role's own (:func:`write_probe`: the
    aggregator's ``state_probe``, a learner's ``grad_probe``): if that one is stored, a write that
    timed out was lost (sent to a server that then restarted, say), not refused. ``effect``: what the
    role does meanwhile, in words."""

    def __init__(self, log, effect: str, probe: Callable[[], Awaitable[object]] | None = None,
                 probe_timeout: float = 2.0, probe_every: float = PROBE_EVERY,
                 write_probe: Callable[[], Awaitable[object]] | None = None):
        self.log, self.effect, self.probe, self.write_probe = log, effect, probe, write_probe
        self.probe_timeout = probe_timeout
        # (idle counts from now: a role that has written nothing yet is not idle at its start)
        self.health = StoreHealth(probe_every, last_stored=time.monotonic())

    @property
    def faulted(self) -> bool:
        return self.health.faulted

    def may_write(self) -> bool:
        return self.health.may_write(time.monotonic())

    def attempt_timeout(self, timeout: float) -> float:
        """How long a write waits for its acknowledgement: ``timeout``, and while the store is
        faulted no longer than the probes are spaced (one sent to a server that then restarted,
        a full disk healed, is never answered)."""
        return min(timeout, self.health.probe_every) if self.faulted else timeout

    def probe_due(self, idle: float) -> bool:
        return self.health.probe_due(time.monotonic(), idle)

    async def reconnected(self) -> None:
        """``bus.conn.connect``'s ``after_reconnect``: a faulted role probes at once."""
        self.health.reconnected(time.monotonic())

    async def _answers(self, probe: Callable[[], Awaitable[object]] | None) -> bool:
        if probe is None:
            return False
        try:
            await asyncio.wait_for(probe(), self.probe_timeout)
            return True
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - no answer: the server is down, or (a write) not stored
            return False

    async def _silent_store(self) -> bool:
        """After a write timed out: is it the store that is silent, while the server is up?"""
        if self.write_probe is not None and await self._answers(self.write_probe):
            return False  # a write is stored right now: the one that timed out was lost, not refused
        return await self._answers(self.probe)

    async def failed(self, exc: BaseException, tried_at: float | None = None) -> bool:
        """A write failed with ``exc``: True if it is a store fault (counted; the first of an
        episode logged as ``store_full``), False for any other failure (the caller's to log).
        ``tried_at``: when the write was sent (:meth:`StoreHealth.fault`)."""
        got = classify(exc)
        if got is None:
            return False
        kind, said = got
        if not self.faulted and not store_fault(kind, kind == SILENT and await self._silent_store()):
            return False
        if self.health.fault(kind, time.monotonic(), tried_at):
            self.log.warning("store_full", reason=kind, server=said, effect=self.effect, hint=HINT,
                             message=describe(kind, said))
        return True

    def stored(self) -> None:
        """A write was stored: logs ``store_writable`` if this ends an episode."""
        down = self.health.stored(time.monotonic())
        if down is not None:
            self.log.info("store_writable", down_s=round(down, 3), refused=self.health.refused,
                          episodes=self.health.episodes)

    def metrics(self) -> dict:
        return self.health.metrics(time.monotonic())


async def write_probe(js, subject: str, timeout: float = 5.0) -> None:
    """``PROBE_BYTES`` to ``subject`` (the aggregator's ``state_probe``, one message of it kept; a
    learner's ``grad_probe``, which no consumer reads)."""
    await js.publish(subject, bytes(PROBE_BYTES), timeout=timeout)


async def probe_store(js, subject: str, watch: StoreWatch, idle: float | None = None) -> bool:
    """A probe write: every few seconds while the store is faulted (the role's writes resume once
    one is stored), and after ``idle`` (``STORE_IDLE_PROBE``) seconds without a stored write.
    True if a probe was written and stored."""
    if not watch.probe_due(STORE_IDLE_PROBE if idle is None else idle):
        return False
    tried_at = time.monotonic()
    try:
        await write_probe(js, subject)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - still full, or the server restarting
        await watch.failed(e, tried_at)
        return False
    watch.stored()
    return True
