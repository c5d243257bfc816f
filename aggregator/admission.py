"""Contributions that arrive before their learner is admitted: held for a while, not rejected.

A learner heartbeats from its start, but its admission takes a chain of hops: heartbeat -> monitor
(which wants the learner to hold the current versions) -> members bucket -> the aggregator's
watch. A fast first sync, a monitor that is restarting or taking over the lease, or a suspect
learner whose heartbeat is late can put an outer gradient at the aggregator before that chain ends.
Rejecting it as ``unknown_learner`` / ``inactive_learner`` threw honest work away (CI run of stop
19: two of a fresh learner's first contributions).

So a contribution whose only fault is that its learner is not admitted *yet* is held, in arrival
order, while its learner's state is one that can still become active (not in the members bucket,
``joining``, ``rejoining``, ``suspect``) and for at most ``wait`` seconds. Each sweep hands back
the held items whose learner is now admitted (validate them again: staleness and duplicates may
have changed meanwhile) and those whose wait ran out or whose learner was evicted (validate them
again too: the reason they are then rejected for is the current one). An ``evicted`` learner's
contributions are never held: its work was from before it went silent.

Held bytes are bounded (``max_bytes``): beyond that a contribution is rejected at once, so a flood
from ids that never join (possible only without auth) cannot exhaust the aggregator's memory.

Pure: no clock reads, no I/O. Items are opaque to this module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WAITING_STATES = frozenset({None, "joining", "rejoining", "suspect"})
"""Membership states from which a learner can still become active without a new incarnation."""

ADMITTED_STATES = frozenset({"active", "left"})


@dataclass
class Held:
    item: Any
    learner: str
    since: float
    nbytes: int


class AdmissionHold:
    """Arrival-ordered contributions waiting for their learner's admission."""

    def __init__(self, wait: float, max_bytes: int):
        if wait < 0 or max_bytes < 0:
            raise ValueError(f"wait and max_bytes must be >= 0, got {wait}, {max_bytes}")
        self.wait, self.max_bytes = wait, max_bytes
        self.items: list[Held] = []
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def offer(self, item: Any, learner: str, state: str | None, nbytes: int, now: float,
              since: float | None = None) -> bool:
        """Hold ``item`` if its learner may still be admitted, the wait allows and there is room.

        ``since`` is when the item was first held (an item handed back by :meth:`sweep` and still
        not admissible keeps its original time, so the wait is not restarted)."""
        since = now if since is None else since
        if state not in WAITING_STATES or now - since >= self.wait:
            return False
        if self.nbytes + nbytes > self.max_bytes:
            return False
        self.items.append(Held(item, learner, since, nbytes))
        self.nbytes += nbytes
        return True

    def sweep(self, state_of: Callable[[str], str | None], now: float) -> list[Held]:
        """Take out, in arrival order, the items to decide now: learner admitted, wait over, or
        learner in a state it cannot be admitted from (evicted). The rest stay held."""
        out, keep = [], []
        for h in self.items:
            st = state_of(h.learner)
            if st in ADMITTED_STATES or st not in WAITING_STATES or now - h.since >= self.wait:
                out.append(h)
            else:
                keep.append(h)
        if out:
            self.items = keep
            self.nbytes = sum(h.nbytes for h in keep)
        return out

    def next_deadline(self) -> float | None:
        """The earliest time a held item's wait runs out (None if nothing is held)."""
        return min((h.since + self.wait for h in self.items), default=None)
