"""When to merge a fragment: minimum quorum, then a bounded grace window (pure functions).

Decoupled DiLoCo (DESIGN.md section 3): the syncer merges fragment p once at least K learners
reported, then waits a bounded grace window for more. A learner keeps training for tau inner
steps after sending its fragment; the merged fragment should be back before then, so

    slack = tau * step_time - (quorum_time + sync_time)
    grace = min(max_grace, gamma * slack),   0 <= gamma < 1     (adaptive)
    grace = GracePolicy.grace                                     (fixed)

where step_time is the inner-step time of the fastest active learner (the one that would notice a
late merge first), quorum_time the time this round took from first arrival to quorum, and
sync_time the usual time from merge decision to published version (both observed, see
:class:`ArrivalStats`). The rules of :func:`decide`:

- only ACTIVE learners count; an evicted learner is never waited for;
- K is capped at the number of active learners, so evictions never deadlock a fragment; K = 0
  (``DILOCO_QUORUM=all``) is every active learner;
- all active learners contributed -> merge now;
- fewer than K -> wait (no deadline: nothing to merge yet);
- quorum reached -> merge when the grace window, started at the moment quorum was reached,
  has run out; until then report the deadline so the caller can set a timer.

K = AUTO (``DILOCO_QUORUM=auto``) closes each round on time instead of on a count: a round of
fragment p stays open at most until

    deadline = min over its contributors c of  (arrival_c + AUTO_SHARE * period_c * step_c)

(the fastest contributor's next sync of p is one period after its arrival; the merged version must
be back before then, or that learner defers its sync), and closes earlier once every active learner
contributed, or once each one missing is expected after the deadline (its last arrival of p plus
its period times its step time: :meth:`ArrivalStats.expected`). Learners of one speed arrive
together and merge together, as with all; a slower one that would hold the round past the
deadline goes into the next round instead of holding the fast ones back. A missing learner of
unknown pace is waited for until the deadline; a round whose contributors' pace is unknown waits
for every active learner, as K = all.

Operational advice: if versions advance at the pace of the slowest learner, K is too high or the
grace too long; if the slow learner's contributions keep arriving just after each merge (high
staleness), lengthen the grace (fixed) or raise gamma (adaptive, still < 1).
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Literal, Union

Contributors = Union[Mapping[str, float], AbstractSet[str]]
"""learner -> arrival time (seconds, the clock of ``now``), or just the set of learners."""

#: ``K`` of the on-time quorum (``DILOCO_QUORUM=auto``, see the module docstring)
AUTO = -1
#: the share of its contributors' fastest period a round of the on-time quorum may stay open: the
#: rest is the merge, the publish and the download before that learner's next sync of the fragment
AUTO_SHARE = 0.5
#: a learner's round time is at least this share of the time the aggregator saw between two of its
#: contributions of one fragment: the pace it reports cannot close rounds much faster than it works
OBSERVED_FLOOR = 0.25
#: the most seconds the clock deadlines are judged by (:func:`input_clock`) trails the real one
INPUT_LAG_MAX = 10.0


def input_clock(now: float, drained_at: float, lag_max: float = INPUT_LAG_MAX) -> float:
    """The time a deadline (a grace window, an on-time round) is judged at: ``now``, but no later
    than ``drained_at``, the newest moment the aggregator had read everything its server held for it.
    A busy aggregator (merging, or slowed) finds on its next look that a deadline has passed while
    the contribution that would have made it in by then sits unread on the server: judged by the
    real clock, the round closed without it. In the guard test with a 30x slower aggregator,
    DILOCO_QUORUM=auto closed rounds half full that way (docs/aggregator.md, step 3). At most
    ``lag_max`` seconds behind ``now``, so an input that never drains (a backlog, a lost server)
    does not hold deadlines for ever."""
    return max(min(now, drained_at), now - lag_max)


@dataclass(frozen=True)
class GracePolicy:
    """Grace window after quorum: ``fixed`` seconds, or ``adaptive`` = min(max_grace, gamma*slack).

    ``grace`` is also the adaptive window used before enough has been observed to estimate the
    slack (it is then capped at ``max_grace``). ``tau`` is the number of inner steps a learner
    overlaps with communication (Streaming DiLoCo; the published default is 2).
    """

    mode: Literal["fixed", "adaptive"] = "fixed"
    grace: float = 1.0
    max_grace: float = 10.0
    gamma: float = 0.5
    tau: int = 2

    def __post_init__(self) -> None:
        if self.mode not in ("fixed", "adaptive"):
            raise ValueError(f"grace mode must be 'fixed' or 'adaptive', got {self.mode!r}")
        if not (math.isfinite(self.grace) and self.grace >= 0):
            raise ValueError(f"grace must be finite and >= 0, got {self.grace}")
        if not (math.isfinite(self.max_grace) and self.max_grace >= 0):
            raise ValueError(f"max_grace must be finite and >= 0, got {self.max_grace}")
        if not 0 <= self.gamma < 1:
            raise ValueError(f"gamma must be in [0, 1), got {self.gamma}")
        if self.tau < 1:
            raise ValueError(f"tau must be >= 1, got {self.tau}")


@dataclass(frozen=True)
class ArrivalStats:
    """Exponential moving averages (factor ``alpha``) of what the grace window and the on-time
    quorum need.

    - per learner, seconds per inner step: the pace the learner reports with each contribution
      (``step_s``: its inner steps' own time, holds and transfers excluded), or, from a learner
      that does not report it, from consecutive arrivals of the same learner, incarnation and
      fragment: (t - t_previous) / inner_steps of the later contribution (a learner sends its P
      fragments in turn, so arrivals of different fragments are a fraction of a period apart); a
      new incarnation (restart) resets that clock instead of counting the downtime;
    - per learner, its sync period in inner steps (declared with each contribution), and the
      seconds between two of its arrivals of one fragment (observed: the floor of its round time,
      :data:`OBSERVED_FLOOR`, so a reported pace cannot shrink it below a share of what it does);
    - per (learner, fragment), the last arrival;
    - sync_time: seconds from the merge decision to the published version.

    One per aggregator. Immutable: every ``observe_*`` returns a new object.
    """

    alpha: float = 0.2
    step_time: Mapping[str, float] = field(default_factory=dict)
    last_arrival: Mapping[tuple[str, int], tuple[str, float]] = field(default_factory=dict)
    period: Mapping[str, int] = field(default_factory=dict)
    interval: Mapping[str, float] = field(default_factory=dict)
    sync_time: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else (1 - self.alpha) * old + self.alpha * x

    def observe_arrival(
        self, learner: str, incarnation: str, t: float, inner_steps: int, fragment: int = 0,
        step_s: float = 0.0, period: int = 0,
    ) -> ArrivalStats:
        """Record that ``learner`` delivered fragment ``fragment``'s contribution of ``inner_steps``
        steps at ``t``, at a reported ``step_s`` seconds per step (0: not reported) and sync period
        ``period`` (0: not declared; the contribution's steps stand in)."""
        last = dict(self.last_arrival)
        steps = dict(self.step_time)
        intervals = dict(self.interval)
        key = (learner, int(fragment))
        prev = self.last_arrival.get(key)
        gap = t - prev[1] if prev is not None and prev[0] == incarnation and t > prev[1] else None
        if gap is not None:
            intervals[learner] = self._ema(intervals.get(learner), gap)
        if math.isfinite(step_s) and step_s > 0:
            steps[learner] = self._ema(steps.get(learner), float(step_s))
        elif gap is not None and inner_steps > 0:
            steps[learner] = self._ema(steps.get(learner), gap / inner_steps)
        last[key] = (incarnation, t)
        periods = dict(self.period)
        if period > 0 or inner_steps > 0:
            periods[learner] = int(period) if period > 0 else int(inner_steps)
        return replace(self, step_time=steps, last_arrival=last, period=periods, interval=intervals)

    def observe_sync(self, seconds: float) -> ArrivalStats:
        """Record the time from a merge decision to its published version."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"sync time must be finite and >= 0, got {seconds}")
        return replace(self, sync_time=self._ema(self.sync_time, seconds))

    def forget(self, learner: str) -> ArrivalStats:
        """Drop a learner (evicted): it no longer sets the pace."""
        return replace(self,
                       step_time={k: v for k, v in self.step_time.items() if k != learner},
                       last_arrival={k: v for k, v in self.last_arrival.items() if k[0] != learner},
                       period={k: v for k, v in self.period.items() if k != learner},
                       interval={k: v for k, v in self.interval.items() if k != learner})

    def fastest_step_time(self, among: AbstractSet[str] | None = None) -> float | None:
        """Smallest per-learner step time (optionally among ``among``), or None if none known."""
        times = [v for k, v in self.step_time.items() if among is None or k in among]
        return min(times) if times else None

    def round_time(self, learner: str) -> float | None:
        """Seconds of one sync period of ``learner`` (period x step time, at least OBSERVED_FLOOR x
        the seconds observed between two of its contributions of one fragment), or None if unknown."""
        st, h = self.step_time.get(learner), self.period.get(learner)
        if st is None or not h:
            return None
        return max(st * h, OBSERVED_FLOOR * self.interval.get(learner, 0.0))

    def expected(self, learner: str, fragment: int) -> float | None:
        """When ``learner``'s next contribution of ``fragment`` is due to arrive: its last arrival
        of that fragment plus one period of its steps (None if either is unknown)."""
        last, rt = self.last_arrival.get((learner, int(fragment))), self.round_time(learner)
        return None if last is None or rt is None else last[1] + rt

    def slack(self, tau: int, quorum_time: float,
              among: AbstractSet[str] | None = None) -> float | None:
        """tau * step_time - (quorum_time + sync_time), or None until step_time is known."""
        st = self.fastest_step_time(among)
        if st is None:
            return None
        return tau * st - (quorum_time + (self.sync_time or 0.0))


@dataclass(frozen=True)
class Decision:
    """merge now, or wait: until ``wait_until`` (a timer), or for more arrivals (None)."""

    merge: bool
    wait_until: float | None
    reason: str
    grace: float | None = None  # the grace window in force, seconds (None before quorum)


def grace_window(
    policy: GracePolicy,
    stats: ArrivalStats | None,
    quorum_time: float,
    active: AbstractSet[str] | None = None,
) -> float:
    """The grace window in seconds: fixed, or min(max_grace, gamma * max(slack, 0))."""
    if policy.mode == "fixed":
        return policy.grace
    slack = None if stats is None else stats.slack(policy.tau, quorum_time, active)
    if slack is None:
        return min(policy.grace, policy.max_grace)
    return min(policy.max_grace, policy.gamma * max(slack, 0.0))


def decide(
    now: float,
    first_arrival: float,
    contributors: Contributors,
    active: AbstractSet[str],
    K: int,
    grace: GracePolicy,
    stats: ArrivalStats | None = None,
    fragment: int = 0,
) -> Decision:
    """Merge the fragment now, or wait (see module docstring for the rules).

    ``contributors`` maps each learner whose contribution is buffered to its arrival time; the
    grace window then starts when the K-th active learner arrived. Given only a set of learners,
    the window starts at ``first_arrival`` (earlier, so never longer). ``first_arrival`` is the
    arrival time of the first buffered contribution, active or not. ``fragment`` is the
    fragment decided (the on-time quorum, K = AUTO, looks up its learners' arrivals of it).
    """
    if K < AUTO:
        raise ValueError(f"K must be >= 1, 0 for every active learner or {AUTO} for on time, got {K}")
    counted = [c for c in contributors if c in active]
    n, n_active = len(counted), len(active)
    if n_active > 0 and n == n_active:
        return Decision(True, None, f"all {n_active} active contributed")
    if K == AUTO:
        return _on_time(now, first_arrival, contributors, counted, active, stats, fragment)
    k_eff = n_active if K == 0 else min(K, n_active)
    if n == 0 or n < k_eff:
        return Decision(False, None,
                        f"waiting for quorum {n}/{max(k_eff, 1)} ({n_active} active)")
    if isinstance(contributors, Mapping):
        quorum_at = sorted(contributors[c] for c in counted)[k_eff - 1]
    else:
        quorum_at = first_arrival
    quorum_at = max(quorum_at, first_arrival)
    window = grace_window(grace, stats, quorum_at - first_arrival, active)
    deadline = quorum_at + window
    head = f"quorum {n}/{n_active} reached (K={K or 'all'})"
    if now >= deadline:
        return Decision(True, None, f"{head}, grace {window:.1f}s expired", window)
    return Decision(False, deadline, f"{head}, grace {deadline - now:.1f}s left", window)


def _on_time(
    now: float,
    first_arrival: float,
    contributors: Contributors,
    counted: list[str],
    active: AbstractSet[str],
    stats: ArrivalStats | None,
    fragment: int,
) -> Decision:
    """K = AUTO: the round closes at its deadline, or once nobody missing is expected before it."""
    n, n_active = len(counted), len(active)
    head = f"on time {n}/{n_active}"
    if n == 0:
        return Decision(False, None, f"{head}: waiting for a contribution")
    ends = []
    for c in counted:
        rt = None if stats is None else stats.round_time(c)
        if rt is not None:
            at = contributors[c] if isinstance(contributors, Mapping) else first_arrival
            ends.append(max(at, first_arrival) + AUTO_SHARE * rt)
    if not ends:  # nobody's pace known yet: every active learner, as K = all
        return Decision(False, None, f"{head}: pace unknown, waiting for all")
    deadline = min(ends)
    window = deadline - first_arrival
    if now >= deadline:
        return Decision(True, None, f"{head}, round closed at {window:.1f}s", window)
    missing = [m for m in active if m not in contributors]
    expected = [None if stats is None else stats.expected(m, fragment) for m in missing]
    if all(e is not None and e > deadline for e in expected):
        return Decision(True, None, f"{head}, the {len(missing)} missing are not expected within "
                        f"{window:.1f}s", window)
    return Decision(False, deadline, f"{head}, {deadline - now:.1f}s left", window)


def arrival_leads(arrivals: Sequence[tuple[str, str, float]], digits: int = 3,
                  phases: Mapping[str, float] | None = None, round_s: float | None = None) -> list[list]:
    """How long before the others each learner's contribution came (pure): ``[learner,
    incarnation, seconds]`` per learner of a merge (its newest arrival when it had several),
    positive for an early one. In the head of the version the merge made (``"lead"``), for the
    learners' phase lock (DILOCO_PHASE_LOCK, ``learner.loop.phase_shift``), and in its ``merged``
    line: how far apart the learners' rounds reach the aggregator, which decides how full the
    on-time quorum's rounds are (docs/BENCHMARKS.md, twentieth round). Differences of the
    aggregator's own clock: no clock is shared.

    With ``phases`` (every learner's last arrival of the fragment, those of the merge included) and
    the round's seconds ``round_s``: against the median of all of them, each taken the short way
    round a round (:func:`round_offset`), so that when the on-time quorum splits a round into an
    early and a late merge each group reads its lead over the whole run's phase, not over its own
    (where it reads 0: the twenty-second round; docs/BENCHMARKS.md). Without them, against the
    merge's median arrival, and none for a merge of fewer than two learners."""
    newest: dict[tuple[str, str], float] = {}
    for learner, inc, t in arrivals:
        key = (learner, inc)
        newest[key] = max(newest.get(key, t), t)
    if phases is not None and round_s is not None and round_s > 0 and math.isfinite(round_s):
        # every learner's phase in the round, the merge's at their arrivals here, sorted once: a
        # learner's offsets to the others, taken the short way round, are then the sorted phases
        # read from half a round before its own (O(M log M) a merge, not O(k M log M))
        own = {learner: t for (learner, _), t in newest.items()}
        ph = sorted(v % round_s for v in {**phases, **own}.values())
        if len(ph) < 2:  # nobody else syncing: no lead
            return []
        return [[learner, inc, round(_rotated_median(ph, t % round_s, round_s), digits)]
                for (learner, inc), t in sorted(newest.items())]
    if len(newest) < 2:
        return []
    median = statistics.median(newest.values())
    return [[learner, inc, round(median - t, digits)] for (learner, inc), t in sorted(newest.items())]


def round_offset(dt: float, round_s: float) -> float:
    """``dt`` seconds taken the short way round a round of ``round_s``: in [-round_s / 2, round_s / 2)."""
    return (dt + round_s / 2) % round_s - round_s / 2


def _rotated_median(ph: Sequence[float], mine: float, round_s: float) -> float:
    """The median of ``round_offset(p - mine, round_s)`` over the sorted phases ``ph`` (each in
    [0, round_s), ``mine`` among them): those offsets in increasing order are ``ph`` read from the
    first phase at or after half a round before ``mine``, round the end."""
    n = len(ph)
    start = bisect.bisect_left(ph, (mine - round_s / 2) % round_s)

    def offset(k: int) -> float:
        return round_offset(ph[(start + k) % n] - mine, round_s)

    return offset(n // 2) if n % 2 else (offset(n // 2 - 1) + offset(n // 2)) / 2


def round_phases(stats: ArrivalStats, fragment: int, learners: AbstractSet[str],
                 now: float) -> tuple[dict[str, float], float | None]:
    """What :func:`arrival_leads` measures a merge against (pure): the last arrival of ``fragment``
    of every learner in ``learners`` (the merge's and the active ones) whose last arrival is within
    a round and a half of ``now`` (one that stopped syncing drops out), and the round: the median
    over ``learners`` of the seconds seen between two arrivals of one fragment
    (``ArrivalStats.interval``; before a learner's second, its period times its pace). Not the
    period times the pace where the gap is known: a declared period is the floor of a real one and
    the pace leaves out what a learner does between steps, so that round is short, and a peer's
    arrival a round ago would read as earlier than it is (None when nothing is known: the leads are
    then the merge's own)."""
    rounds = [r for r in (stats.interval.get(x) or stats.round_time(x) for x in learners) if r is not None and r > 0]
    if not rounds:
        return {}, None
    r = statistics.median(rounds)
    phases = {}
    for x in learners:
        last = stats.last_arrival.get((x, int(fragment)))
        if last is not None and now - last[1] <= 1.5 * r:
            phases[x] = last[1]
    return phases, r
