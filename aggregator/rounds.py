"""Lock-step rounds across fragments: which fragments, ready to merge, wait for the rest of their
round (a pure function).

A synchronous learner (``DILOCO_MODE=sync``, contributions marked ``lockstep``) sends every
fragment of round r together and trains on only once each of them is merged. The aggregator
decides each fragment on its own, so when the membership changes between the decisions of one
round (a learner admitted after fragment 0 merged and before fragment 1 did), the new learner's
round 0 lands in round r of fragment 1 and in round r+1 of fragment 0. From then on the two
fragments merge half a round apart and every round waits one inner step more for the learner out
of phase: measured in ``bench.goodput``'s data-parallel mode, a round of 0.47 s instead of 0.27 s
for the rest of the run, goodput 0.30 instead of 0.47.

The rule: fragments p and q are *paired* when the same (learner, incarnation, round) of a lock-step
contribution is buffered in both. A fragment ready to merge is held while a paired fragment still
waits for a learner whose contribution to it can arrive without p's merge:

- a learner with nothing of its own buffered in p (newly admitted: its round goes to every
  fragment), or
- a learner with round r buffered in p whose round r has not been merged into q yet (the rest of
  its round is in flight).

A learner whose round r is already merged into q sends q nothing more until p's round r is merged
(it waits for it): holding p for that learner would stall both, so it never holds p. The caller
bounds every hold in time (the grace window), which covers a round whose other fragment never
comes (its publish failed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import AbstractSet

RoundKey = tuple[str, str, int]
"""(learner, incarnation, round) of a lock-step contribution."""

MergedRound = Callable[[int, str, str], "int | None"]
"""(fragment, learner, incarnation) -> the highest round of theirs merged into it, or None."""


def _can_arrive(p: int, q: int, learner: str, keys: Mapping[int, AbstractSet[RoundKey]],
                merged_round: MergedRound) -> bool:
    """Can ``learner``'s next contribution to q arrive while p's buffered round waits?"""
    mine = [(inc, r) for (name, inc, r) in keys.get(p, ()) if name == learner]
    if not mine:
        return True
    for inc, r in mine:
        done = merged_round(q, learner, inc)
        if done is None or done < r:
            return True
    return False


def held_for_round(ready: AbstractSet[int], missing: Mapping[int, AbstractSet[str]],
                   keys: Mapping[int, AbstractSet[RoundKey]], merged_round: MergedRound) -> set[int]:
    """The fragments of ``ready`` that must not merge yet (see the module docstring).

    ``ready``: fragments whose quorum decision is to merge now; ``missing``: for each fragment that
    is not ready, the active learners it still waits for; ``keys``: for each fragment, the
    (learner, incarnation, round) of the lock-step contributions in its buffer (other
    contributions are never paired); ``merged_round``: what each fragment has merged already.
    """
    held: set[int] = set()
    for p in ready:
        mine = keys.get(p, set())
        if not mine:
            continue
        for q, waiting in missing.items():
            if q == p or q in ready or not waiting or not (mine & keys.get(q, set())):
                continue
            if any(_can_arrive(p, q, a, keys, merged_round) for a in waiting):
                held.add(p)
                break
    return held
