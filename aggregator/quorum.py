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
  (``DILOCO_QUORUM=all``, the default) is every active learner;
- all active learners contributed -> merge now;
- fewer than K -> wait (no deadline: nothing to merge yet);
- quorum reached -> merge when the grace window, started at the moment quorum was reached,
  has run out; until then report the deadline so the caller can set a timer.

Operational advice: if versions advance at the pace of the slowest learner, K is too high or the
grace too long; if the slow learner's contributions keep arriving just after each merge (high
staleness), lengthen the grace (fixed) or raise gamma (adaptive, still < 1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import AbstractSet, Literal, Union

Contributors = Union[Mapping[str, float], AbstractSet[str]]
"""learner -> arrival time (seconds, the clock of ``now``), or just the set of learners."""


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
    """Exponential moving averages (factor ``alpha``) of what the grace window needs.

    - per learner, seconds per inner step, from consecutive arrivals of the same learner and
      incarnation for this fragment: (t - t_previous) / inner_steps of the later contribution;
      a new incarnation (restart) resets that learner's clock instead of counting the downtime;
    - sync_time: seconds from the merge decision to the published version.

    Keep one per fragment. Immutable: every ``observe_*`` returns a new object.
    """

    alpha: float = 0.2
    step_time: Mapping[str, float] = field(default_factory=dict)
    last_arrival: Mapping[str, tuple[str, float]] = field(default_factory=dict)
    sync_time: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def _ema(self, old: float | None, x: float) -> float:
        return x if old is None else (1 - self.alpha) * old + self.alpha * x

    def observe_arrival(
        self, learner: str, incarnation: str, t: float, inner_steps: int
    ) -> ArrivalStats:
        """Record that ``learner`` delivered a contribution of ``inner_steps`` steps at ``t``."""
        last = dict(self.last_arrival)
        steps = dict(self.step_time)
        prev = self.last_arrival.get(learner)
        if prev is not None and prev[0] == incarnation and t > prev[1] and inner_steps > 0:
            steps[learner] = self._ema(steps.get(learner), (t - prev[1]) / inner_steps)
        last[learner] = (incarnation, t)
        return replace(self, step_time=steps, last_arrival=last)

    def observe_sync(self, seconds: float) -> ArrivalStats:
        """Record the time from a merge decision to its published version."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"sync time must be finite and >= 0, got {seconds}")
        return replace(self, sync_time=self._ema(self.sync_time, seconds))

    def forget(self, learner: str) -> ArrivalStats:
        """Drop a learner (evicted): it no longer sets the pace."""
        return replace(self,
                       step_time={k: v for k, v in self.step_time.items() if k != learner},
                       last_arrival={k: v for k, v in self.last_arrival.items() if k != learner})

    def fastest_step_time(self, among: AbstractSet[str] | None = None) -> float | None:
        """Smallest per-learner step time (optionally among ``among``), or None if none known."""
        times = [v for k, v in self.step_time.items() if among is None or k in among]
        return min(times) if times else None

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
) -> Decision:
    """Merge the fragment now, or wait (see module docstring for the rules).

    ``contributors`` maps each learner whose contribution is buffered to its arrival time; the
    grace window then starts when the K-th active learner arrived. Given only a set of learners,
    the window starts at ``first_arrival`` (earlier, so never longer). ``first_arrival`` is the
    arrival time of the first buffered contribution, active or not.
    """
    if K < 0:
        raise ValueError(f"K must be >= 1, or 0 for every active learner, got {K}")
    counted = [c for c in contributors if c in active]
    n, n_active = len(counted), len(active)
    k_eff = n_active if K == 0 else min(K, n_active)
    if n_active > 0 and n == n_active:
        return Decision(True, None, f"all {n_active} active contributed")
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
