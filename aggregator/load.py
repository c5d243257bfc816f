"""How busy the aggregator is: the share of wall time it spent taking contributions in and merging
(pure: times are passed in).

An aggregator busy all of the time cannot keep up with its learners: their outer gradients wait in
the GRAD stream, and without the learners' sync window (``learner.loop.Bookkeeper``, issue 37) every
one of them would be merged against a global version many rounds newer than its base. The learners
defer their syncs instead; the aggregator says once that it is the bottleneck (``aggregator_saturated``)
and once when it keeps up again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

#: busy share from which the aggregator says it is saturated, and below which it says it keeps up again
SATURATED = 0.9
KEEPING_UP = 0.7


@dataclass
class BusyMeter:
    """Seconds of work over a sliding window of ``window`` seconds."""

    window: float = 10.0
    start: float | None = None
    _events: deque = field(default_factory=deque)

    def add(self, t: float, seconds: float) -> None:
        """``seconds`` of work that ended at ``t``."""
        if self.start is None:
            self.start = t - max(0.0, seconds)
        self._events.append((float(t), max(0.0, float(seconds))))
        while self._events and self._events[0][0] < t - self.window:
            self._events.popleft()

    def share(self, now: float) -> float:
        """Busy share of the last ``window`` seconds (of the time since the first work, if shorter)."""
        if self.start is None:
            return 0.0
        span = min(self.window, max(1e-9, now - self.start))
        busy = sum(s for t, s in self._events if t >= now - self.window)
        return min(1.0, busy / span)


@dataclass
class PhaseClock:
    """Where the aggregator's loop spends its wall time: seconds per phase since the start
    (``poll``: waiting on the server for chunks; ``intake``: decoding and validating them;
    ``commit``: merge-log records; ``publish``: global versions; ``merge``; ``checkpoint``; ``other``).
    Each :meth:`lap` books the time since the previous one to a phase. Published in the metrics as
    ``loop_s``; a watcher takes differences over a window (``bench.scale_synth``'s ``loop_share``)."""

    totals: dict[str, float] = field(default_factory=dict)
    last: float | None = None

    def lap(self, phase: str, now: float) -> float:
        if self.last is not None:
            self.totals[phase] = self.totals.get(phase, 0.0) + max(0.0, now - self.last)
        self.last = now
        return now

    def rounded(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.totals.items()}


def saturation_change(share: float, saturated: bool, full_window: bool) -> bool | None:
    """The new saturated flag when it changes (True: say ``aggregator_saturated``; False: say it keeps
    up again), or None. Judged only over a whole window, with hysteresis."""
    if not saturated and full_window and share >= SATURATED:
        return True
    if saturated and share < KEEPING_UP:
        return False
    return None
