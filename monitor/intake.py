"""The monitor's heartbeat intake: decoding and validating heartbeats, and the membership changes
they and the passage of time make (synchronous, in memory).

A mixin of ``monitor.service.MonitorService``; the state machine itself is :mod:`monitor.membership`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from bus.codec import CodecError, loads_json
from monitor.membership import (
    Heartbeat,
    HeartbeatLimits,
    InvalidHeartbeat,
    Member,
    Transition,
    on_heartbeat,
    on_tick,
    validate_heartbeat,
)

#: Heartbeats larger than this are dropped before parsing (4096 fragments fit in ~70 KB).
MAX_HEARTBEAT_BYTES = 256 * 1024
_MAX_PENDING_EVENTS = 100_000


def parse_heartbeat(subject: str, data: bytes, now: float, limits: HeartbeatLimits = HeartbeatLimits()) -> Heartbeat:
    """Decode and validate one heartbeat message; raises :class:`InvalidHeartbeat` with a reason.

    Reasons beyond :func:`validate_heartbeat`'s: ``oversized`` (more than MAX_HEARTBEAT_BYTES),
    ``not_json`` (includes NaN/Infinity literals, which are not JSON) and ``subject_mismatch``
    (the learner id in the payload is not the last token of ``hb.<learner>``: a learner may only
    speak for itself).
    """
    if len(data) > MAX_HEARTBEAT_BYTES:
        raise InvalidHeartbeat("oversized", f"{len(data)} bytes > {MAX_HEARTBEAT_BYTES}")
    try:
        raw = loads_json(data)
    except CodecError as e:
        raise InvalidHeartbeat("not_json", str(e)[:120]) from None
    hb = validate_heartbeat(raw, now=now, limits=limits)
    token = subject.rsplit(".", 1)[-1]
    if token != hb.learner:
        raise InvalidHeartbeat("subject_mismatch", f"learner {hb.learner!r} sent on subject {subject[:120]!r}")
    return hb


#: a tick this many tick periods (``heartbeat_interval / 2``) after the one before: the process
#: stalled between them (:meth:`HeartbeatIntake.tick`)
STALL_TICKS = 4


class HeartbeatIntake:
    """Heartbeats and ticks of a ``MonitorService``: rejections counted, members updated,
    transitions queued for the leader to publish."""

    if TYPE_CHECKING:  # the state is the MonitorService's (set in its __init__)
        def __getattr__(self, name: str) -> Any: ...
        members: dict[str, Member]
        _since_yield: int
        _drained_at: float | None
        _ticked_at: float | None

    # -- heartbeats and ticks (synchronous state changes) ---------------------------------------

    def _reject(self, reason: str, detail: str, subject: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        ok, suppressed = self._throttle.allow(reason, time.monotonic())
        if ok:
            self.log.warning("heartbeat_rejected", reason=reason, detail=detail[:200], subject=subject[:120],
                             suppressed_since_last=suppressed)
        else:
            self.log.debug("heartbeat_rejected", reason=reason, detail=detail[:200])

    def _apply_heartbeat(self, hb: Heartbeat, now: float, subject: str) -> None:
        old = self.members.get(hb.learner)
        if old is None and len(self.members) >= self.cfg.max_members:
            self._reject("too_many_members", f"already tracking {len(self.members)} learners", subject)
            return
        # on_heartbeat only reads the heartbeat's own learner: pass just that entry (O(1))
        new, transitions = on_heartbeat({} if old is None else {hb.learner: old}, hb, now,
                                        self.current_versions or None, self.mcfg)
        self.members[hb.learner] = new[hb.learner]
        self.stats["heartbeats"] += 1
        self._changed((hb.learner,), transitions)

    def _changed(self, names: Iterable[str], transitions: list[Transition]) -> None:
        self._dirty.update(names)
        if not transitions:
            return
        self.stats["transitions"] += len(transitions)
        leader = self._leader
        for t in transitions:
            (self.log.info if leader else self.log.debug)(
                "transition", learner=t.learner, old=None if t.old is None else t.old.value, new=t.new.value,
                reason=t.reason, leader=leader)
        if leader:
            self._events.extend(transitions)
            while len(self._events) > _MAX_PENDING_EVENTS:
                self._events.popleft()
                self.stats["events_dropped"] += 1
        self._wake.set()

    async def _on_heartbeat_msg(self, msg) -> None:
        now = time.time()
        try:
            hb = parse_heartbeat(msg.subject, msg.data or b"", now, self.limits)
        except InvalidHeartbeat as e:
            self._reject(e.reason, e.detail, msg.subject)
        except Exception as e:  # noqa: BLE001 - a heartbeat must never take the monitor down
            self._reject("unreadable", repr(e), msg.subject)
        else:
            try:
                self._apply_heartbeat(hb, now, msg.subject)
            except Exception as e:  # noqa: BLE001
                self._reject("apply_failed", repr(e), msg.subject)
        self._since_yield += 1
        if self._since_yield >= 64:  # a burst must not starve the lease renewal
            self._since_yield = 0
            await asyncio.sleep(0)

    def tick(self, now: float, backlog: int = 0) -> list[Transition]:
        """Apply the passage of time (exposed for tests); returns the transitions. ``backlog``:
        heartbeats received and not read yet (a flood, or a busy loop). Silence is then counted
        up to when the intake was last empty, for at most ``evict_after`` more: a learner whose
        heartbeat waits in our own queue is not evicted for it, and a flood that never ends
        delays evictions by no more than that (tests/test_monitor_service.py, the flood: the
        real learner was evicted once in the suite, "no heartbeat for 1.1s", behind 5,000).

        A tick that comes long after the one before (more than ``STALL_TICKS`` tick periods: a tick
        that wrote thousands of records, a process the machine did not run) counts silence only up
        to that previous tick: heartbeats sent meanwhile may wait unread in the socket, where no
        backlog counts them (the flood test's real learner was evicted once more, in a suite run on
        an overloaded machine). The next tick judges them: by then the loop has run its reader, and
        what it has not processed yet is the backlog above."""
        assert self.started_at is not None
        prev, self._ticked_at = self._ticked_at, now
        if not backlog:
            self._drained_at = now
        heard = max(self._drained_at or now, now - self.mcfg.evict_after)
        if prev is not None and now - prev > STALL_TICKS * self.mcfg.heartbeat_interval / 2:
            heard = min(heard, prev)
        new, transitions = on_tick(self.members, now, self.started_at, self.mcfg, heard_until=heard)
        if transitions:
            self.members = new
            self._changed([t.learner for t in transitions], transitions)
        return transitions
