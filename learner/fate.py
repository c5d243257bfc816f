"""What became of an island's work (pure: no clock reads, no I/O).

Every outer gradient an island publishes is one *round* of one fragment, ``(fragment, round)``. Its
fate reaches the island two ways:

* **merged**: the head of every global version lists the contributions its merge used
  (``"applied"``, read by ``learner.loop.applied_rounds``);
* **rejected** or **held**: the aggregator sends the island a feedback message on
  ``diloco.<run>.feedback.<learner>`` (core NATS, best effort) for each rejection (with its
  reason) and for contributions it holds because the island is not admitted yet.

:class:`WorkLedger` keeps the counts (what ``Island.stats`` and the learner metrics show) and the
set of rounds whose fate is not known yet (what ``close()`` waits for). :meth:`WorkLedger.advice`
says, once per cause, what a user should be told when work is not being merged: a warning line
naming the likely cause (no monitor, the run ended before admission, another run, rejections).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: What a rejection reason most likely means for the island's user (aggregator.validate.Reason).
REJECT_HINTS: dict[str, str] = {
    "unknown_learner": ("this island was never admitted to the run: is a monitor running for it (`diloco monitor`, "
                        "or the aggregator's embedded one, DILOCO_EMBEDDED_MONITOR)?"),
    "inactive_learner": "the monitor does not count this island as active (evicted for silence, or not admitted yet)",
    "too_stale": ("its outer gradients were based on global versions too old (DILOCO_MAX_STALENESS): it syncs "
                  "rarely compared with the merges, or downloads slowly"),
    "future_version": "its outer gradients name a global version the aggregator does not have (another run's state?)",
    "wrong_run": "its outer gradients carry another run's id",
    "wrong_model": "its model differs from the run's (another run of the same name, recreated?)",
    "duplicate": "the aggregator holds this round already (a restart of the island with the same incarnation?)",
    "norm_bound": ("its outer gradients are larger than max_inner_lr x steps allows: declare your peak learning rate "
                   "(Island(max_inner_lr=...), DILOCO_MAX_INNER_LR when the run is created)"),
    "norm_outlier": "its outer gradients are far larger than the other islands' (a diverging island, or a bug)",
    "non_finite": "its outer gradients hold NaN or Inf: the island's training diverged",
}
DEFAULT_HINT = "see the aggregator's log (contribution_rejected) for the details"

#: rounds kept in the set of unresolved rounds at most (older ones are forgotten, counted as unknown)
MAX_OUTSTANDING = 100_000


@dataclass(frozen=True)
class Advice:
    """A warning to log once: its event name, the message for the user, the fields for the log."""

    event: str
    message: str
    fields: Mapping[str, object] = field(default_factory=dict)


@dataclass
class WorkLedger:
    """Rounds sent, merged, rejected (by reason) and held, and what is still unresolved."""

    sent: int = 0
    merged: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    held: int = 0  # contributions the aggregator said it holds (not admitted yet); not a fate
    last_merged_version: dict[int, int] = field(default_factory=dict)
    outstanding: set[tuple[int, int]] = field(default_factory=set)  # (fragment, round) sent, fate unknown
    heads_seen: int = 0  # global versions seen at all (is an aggregator publishing?)
    last_merge_at: float | None = None
    first_sent_at: float | None = None
    warned: list[str] = field(default_factory=list)  # every warning given, in order ("rejected:<reason>", ...)
    _said: set[str] = field(default_factory=set)
    _unmerged_since: int = 0  # rounds sent since the last merge of ours

    # -- events ---------------------------------------------------------------------------------

    def on_sent(self, fragment: int, round_: int, now: float) -> None:
        self.sent += 1
        self._unmerged_since += 1
        if self.first_sent_at is None:
            self.first_sent_at = now
        if len(self.outstanding) < MAX_OUTSTANDING:
            self.outstanding.add((int(fragment), int(round_)))

    def on_head(self, fragment: int, version: int, rounds: Iterable[int], now: float) -> int:
        """A global head of ``fragment`` at ``version`` listing our ``rounds``: how many of them are
        newly merged (a round listed by two versions, or merged after a reported rejection, counts
        once)."""
        self.heads_seen += 1
        new = 0
        for r in rounds:
            key = (int(fragment), int(r))
            if key in self.outstanding:
                self.outstanding.remove(key)
                new += 1
        if new:
            self.merged += new
            self._unmerged_since = 0
            self.last_merge_at = now
            self.last_merged_version[int(fragment)] = max(int(version), self.last_merged_version.get(int(fragment), -1))
            self._said.discard("work_not_merged")  # warn again if it stops again
        return new

    def on_rejected(self, reason: str, rounds: Iterable[tuple[int, int]], count: int) -> bool:
        """The aggregator rejected ``count`` contributions for ``reason`` (``rounds``: those it
        named). True the first time this reason is seen (the caller warns then)."""
        first = reason not in self.rejected
        named = 0
        for p, r in rounds:
            named += 1
            self.outstanding.discard((int(p), int(r)))
        self.rejected[reason] = self.rejected.get(reason, 0) + max(int(count), named)
        if first:
            self.warned.append(f"rejected:{reason}")
        return first

    def on_held(self, count: int) -> None:
        self.held += max(0, int(count))

    # -- views ----------------------------------------------------------------------------------

    @property
    def rejected_total(self) -> int:
        return sum(self.rejected.values())

    def stats(self) -> dict:
        """Counts for ``Island.stats`` and the metrics (rounds: one outer gradient of one fragment)."""
        return {"sent": self.sent, "merged": self.merged, "rejected": dict(self.rejected),
                "rejected_total": self.rejected_total, "unresolved": len(self.outstanding), "held": self.held,
                "last_merged_version": {str(p): v for p, v in sorted(self.last_merged_version.items())},
                "warned": list(self.warned)}

    def summary(self) -> str:
        """One line: what became of the rounds sent."""
        rej = ", ".join(f"{n} {r}" for r, n in sorted(self.rejected.items()))
        return (f"{self.sent} rounds sent, {self.merged} merged, {self.rejected_total} rejected"
                + (f" ({rej})" if rej else "") + f", {len(self.outstanding)} not merged (yet)")

    def advice(self, now: float, *, admitted: bool, member_state: str | None, num_fragments: int,
               admit_after: float, unmerged_rounds: int, unmerged_seconds: float) -> list[Advice]:
        """Warnings due now, each once (``work_not_merged`` again after a merge).

        ``admitted``: the monitor lists the island active or left. ``admit_after``: seconds after
        the first round sent without admission before ``not_admitted``. ``work_not_merged`` needs
        both ``unmerged_rounds`` rounds per fragment sent since our last merged one and
        ``unmerged_seconds`` since that merge (or the first round sent): a fast island next to a
        slow one (every active learner in every merge) sends a few rounds per merge, and is fine."""
        out: list[Advice] = []
        if (not admitted and self.first_sent_at is not None and now - self.first_sent_at >= admit_after
                and "not_admitted" not in self._said):
            self._said.add("not_admitted")
            self.warned.append("not_admitted")
            out.append(Advice("not_admitted", (
                f"not admitted to the run {now - self.first_sent_at:.0f} s after its first outer gradient "
                f"(membership: {member_state or 'none'}): its work is held, then rejected. Is a monitor running "
                "for this run (`diloco monitor`, or the aggregator's embedded one)?"),
                {"member_state": member_state, "held": self.held}))
        since = self.last_merge_at if self.last_merge_at is not None else self.first_sent_at
        if (self._unmerged_since >= unmerged_rounds * max(1, num_fragments) and since is not None
                and now - since >= unmerged_seconds and "work_not_merged" not in self._said):
            self._said.add("work_not_merged")
            self.warned.append("work_not_merged")
            out.append(Advice("work_not_merged", self._why_unmerged(admitted, member_state),
                              {"sent_since_merge": self._unmerged_since, "merged": self.merged,
                               "rejected": dict(self.rejected), "heads_seen": self.heads_seen}))
        return out

    def _why_unmerged(self, admitted: bool, member_state: str | None) -> str:
        head = f"none of the last {self._unmerged_since} outer gradients was merged: "
        if self.rejected:
            top = max(self.rejected.items(), key=lambda kv: kv[1])[0]
            return head + f"rejected ({top}): {REJECT_HINTS.get(top, DEFAULT_HINT)}"
        if not admitted:
            return head + (f"the island is not admitted (membership: {member_state or 'none'}): is a monitor "
                           "running for this run?")
        if self.heads_seen == 0:
            return head + "no global version was published at all: is an aggregator running for this run?"
        return head + "the aggregator publishes versions without them: see its log (held, rejected, behind?)"


def reject_hint(reason: str) -> str:
    return REJECT_HINTS.get(reason, DEFAULT_HINT)
