"""Feedback to learners about their own contributions: rejected (and why) or held (pure).

The audit trail of rejections (``events.reject``, JetStream) is for operators. A learner is told
on its own subject ``diloco.<run>.feedback.<learner>`` (core NATS, best effort: a learner that is
not connected misses it, and its counts are advisory), so an island can say what became of its
work (``learner.fate``). Notices are coalesced per learner and sent at most once per pass of the
aggregator's loop; at most ``max_learners`` learners and ``max_rounds`` named rounds per notice,
so a flood of forged contributions under many ids costs a bounded amount per pass.

A notice: ``{"learner", "incarnation", "rejected": {reason: count}, "rounds": {reason: [[fragment,
round], ...]}, "held": count, "ts"}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Notice:
    incarnation: str
    rejected: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, list[list[int]]] = field(default_factory=dict)
    held: int = 0


class FeedbackQueue:
    """Notices waiting to be sent, keyed by learner (and incarnation: a new one starts afresh)."""

    def __init__(self, max_learners: int = 256, max_rounds: int = 64):
        self.max_learners, self.max_rounds = max_learners, max_rounds
        self._q: dict[str, _Notice] = {}
        self.dropped = 0  # notices not queued: too many learners in one pass

    def __len__(self) -> int:
        return len(self._q)

    def _notice(self, learner: str, incarnation: str) -> _Notice | None:
        n = self._q.get(learner)
        if n is not None and n.incarnation != incarnation:
            n = None  # another incarnation: only the newest is told
        if n is None:
            if learner not in self._q and len(self._q) >= self.max_learners:
                self.dropped += 1
                return None
            n = self._q[learner] = _Notice(incarnation)
        return n

    def rejected(self, learner: str, incarnation: str, reason: str, fragment: int | None, round_: int | None) -> None:
        n = self._notice(learner, incarnation)
        if n is None:
            return
        n.rejected[reason] = n.rejected.get(reason, 0) + 1
        if fragment is not None and round_ is not None:
            named = n.rounds.setdefault(reason, [])
            if len(named) < self.max_rounds:
                named.append([int(fragment), int(round_)])

    def held(self, learner: str, incarnation: str) -> None:
        n = self._notice(learner, incarnation)
        if n is not None:
            n.held += 1

    def take(self, ts: float) -> list[tuple[str, dict]]:
        """Every queued notice as ``(learner, message)``, and the queue emptied."""
        out = [(learner, {"learner": learner, "incarnation": n.incarnation, "rejected": n.rejected,
                          "rounds": n.rounds, "held": n.held, "ts": ts}) for learner, n in self._q.items()]
        self._q = {}
        return out
