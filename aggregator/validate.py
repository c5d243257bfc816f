"""Validation of assembled outer-gradient fragments: accept, or name the reason to reject.

:func:`validate` is pure: it reads a :class:`ValidationContext` snapshot and returns ``None``
(accept) or the first :class:`Reason` that applies. Checks run cheapest first, so a message from
another run never costs a pass over its vector:

    1. wrong_run         c.run != ctx.run
    2. wrong_model       c.model_hash != ctx.model_hash
    3. unknown_learner   learner never admitted to the membership (not in ctx.known)
    4. inactive_learner  known but not active now (suspect or evicted; a learner that *left*,
                         done rather than failed, is in ``ctx.active``: its last work counts)
    5. wrong_fragment    fragment not in the plan owned by this aggregator
    6. bad_counters      inner_steps <= 0, tokens <= 0, tokens < steps, tokens/steps above
                         max_tokens_per_step, steps above max_inner_steps, round < 0 or
                         base_version < 0 (or any of them not an int)
    7. future_version    base_version > current version of the fragment
    8. too_stale         (current - base_version) // per_round > max_staleness (rounds behind)
    9. duplicate         key already applied (see AppliedSet) or buffered for the next merge
   10. wrong_dtype       vector is not a float32 ndarray
   11. wrong_shape       vector is not 1-D of the fragment's size
   12. non_finite        any inf or nan                                  (one pass over vector)
   13. norm_bound        |v| > the geometric bound of its inner steps at the run's declared
                         max_inner_lr (:func:`aggregator.influence.norm_bound`): needs no history,
                         so it holds from version 0
   14. norm_outlier      |v|/steps > k * median of recent accepted norms per inner step (steps of a
                         partial round: sqrt(steps x period), ``influence.outlier_steps``), once at
                         least ``norm_min_history`` norms are known (one pass, shared with 12)

Validation only rejects; the merge then clips every accepted vector to its cap
(:func:`aggregator.influence.norm_caps`), so no single contribution moves a fragment by more than a
few ordinary ones.

After a merge the caller records each applied contribution in :class:`AppliedSet` and its norm in
:class:`NormHistory`; both are small, bounded and serialise to plain lists for persistence.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import AbstractSet, Any

import numpy as np

from aggregator.contribution import Contribution, ContributionKey
from aggregator.influence import norm_bound, outlier_steps
from aggregator.int8vec import all_finite, is_vector
from aggregator.merge import l2_norm


class Reason(str, Enum):
    """Why a contribution was rejected (the value is the metric label)."""

    wrong_run = "wrong_run"
    wrong_model = "wrong_model"
    unknown_learner = "unknown_learner"
    inactive_learner = "inactive_learner"
    wrong_fragment = "wrong_fragment"
    bad_counters = "bad_counters"
    future_version = "future_version"
    too_stale = "too_stale"
    duplicate = "duplicate"
    wrong_dtype = "wrong_dtype"
    wrong_shape = "wrong_shape"
    non_finite = "non_finite"
    norm_bound = "norm_bound"
    norm_outlier = "norm_outlier"


class OutlierWatch:
    """Learners refused as norm outliers, per fragment: when they are most of the run, the
    fragment's norm reference is stale, not they.

    The outlier reference is the median of *accepted* norms. If every honest norm outgrows it (the
    reference was learned during the learning-rate warm-up, when steps are small), every honest
    contribution is refused, nothing new is accepted, and the reference never moves again: the
    fragment is locked (docs/deploy.md; ``simulation.reference`` measured 80-96 honest contributions of
    about 1,500 refused at M=4). So once at least 2 distinct learners, and at least half of the
    active ones, have been refused on a fragment, :meth:`refused` returns their per-step norms and
    the caller restarts the fragment's reference from them (:meth:`NormHistory.restart`); the
    check then waits for ``norm_min_history`` accepted norms again, and the norm caps still bound
    every vector meanwhile. A single learner, or a minority of the active ones, never restarts it.
    """

    def __init__(self) -> None:
        self._refused: dict[int, dict[str, float]] = {}

    def refused(self, fragment: int, learner: str, per_step_norm: float,
                active: AbstractSet[str]) -> list[float] | None:
        """Record a refusal; the norms to restart ``fragment``'s reference from, or None."""
        seen = self._refused.setdefault(fragment, {})
        seen[learner] = float(per_step_norm)
        n = len(set(seen) & set(active))
        if n >= 2 and 2 * n >= len(active):
            del self._refused[fragment]
            return sorted(seen.values())
        return None

    def count(self, fragment: int) -> int:
        return len(self._refused.get(fragment, ()))


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


class NormHistory:
    """The last ``window`` accepted norms per fragment and their median.

    The median is robust to a few bad values, but it follows the data: if many contributions
    in a row are large, the reference grows with them. Raise ``window`` for a steadier reference,
    lower it if legitimate norms drift quickly (for example during learning-rate warm-up) and you
    see norm_outlier rejections of healthy learners.
    """

    def __init__(self, window: int = 64) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self._norms: dict[int, deque[float]] = {}

    def add(self, fragment: int, norm: float) -> None:
        """Record the norm of an applied contribution (finite, >= 0)."""
        if not (math.isfinite(norm) and norm >= 0):
            raise ValueError(f"norm must be finite and >= 0, got {norm}")
        self._norms.setdefault(fragment, deque(maxlen=self.window)).append(float(norm))

    def count(self, fragment: int) -> int:
        return len(self._norms.get(fragment, ()))

    def median(self, fragment: int) -> float | None:
        """Median of the recorded norms of ``fragment``, or None if none yet."""
        d = self._norms.get(fragment)
        return float(statistics.median(d)) if d else None

    def restart(self, fragment: int, norms: Iterable[float]) -> None:
        """Forget ``fragment``'s norms and start again from ``norms`` (see :class:`OutlierWatch`)."""
        self._norms[fragment] = deque((float(x) for x in norms), maxlen=self.window)

    def to_dict(self) -> dict[str, Any]:
        """Plain, msgpack-friendly: {"window": int, "norms": [[fragment, [norm, ...]], ...]}."""
        return {"window": self.window,
                "norms": [[f, list(d)] for f, d in sorted(self._norms.items())]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NormHistory:
        h = cls(int(data["window"]))
        for f, norms in data["norms"]:
            for x in norms:
                h.add(int(f), float(x))
        return h


def _in_runs(runs: list[list[int]], r: int) -> bool:
    """Is round r in one of the sorted, disjoint runs [lo, hi]?"""
    i = bisect.bisect_right(runs, r, key=lambda run: run[0]) - 1
    return i >= 0 and runs[i][1] >= r


def _add_to_runs(runs: list[list[int]], floor: int, r: int, max_gaps: int) -> int:
    """Record round r (> floor, not yet in ``runs``) in place; return the new floor.

    Runs stay sorted, disjoint and non-adjacent, and every run starts above floor + 1 (a run that
    reaches the floor is absorbed into it). With more than ``max_gaps`` runs, the floor jumps over
    the oldest gap."""
    i = bisect.bisect_right(runs, r, key=lambda run: run[0])  # runs[:i] start at or below r
    joins_prev = i > 0 and runs[i - 1][1] + 1 == r
    joins_next = i < len(runs) and runs[i][0] - 1 == r
    if joins_prev and joins_next:
        runs[i - 1][1] = runs[i][1]
        del runs[i]
    elif joins_prev:
        runs[i - 1][1] = r
    elif joins_next:
        runs[i][0] = r
    else:
        runs.insert(i, [r, r])
    if runs[0][0] == floor + 1:
        floor = runs.pop(0)[1]
    while len(runs) > max_gaps:  # give up on the oldest gap: bounded state
        floor = runs.pop(0)[1]
    return floor


class AppliedSet:
    """Bounded record of applied contributions, to reject duplicates and replays.

    Per (learner, incarnation, fragment) it keeps a round *floor* (every round <= floor counts as
    applied), the applied rounds above it as sorted runs of consecutive rounds ``[lo, hi]``, and
    the highest base version applied. Rounds can arrive out of order: after an aggregator crash, a
    chunk set that was mid-assembly is redelivered only after ``ack_wait``, and under repeated
    crashes its chunks can keep landing on processes that die before they hold all of them, while
    hundreds of later rounds are applied. So a round below the highest applied one is NOT a
    duplicate unless it was applied itself. The floor rises over contiguous applied rounds.

    State grows with the number of *gaps* (missing rounds between runs), not with the number of
    rounds applied after a late one: a round in flight for any length of time costs one gap. When
    more than ``max_gaps`` gaps are open (rounds rejected, so never applied, or a learner that
    skips round numbers), the floor jumps over the oldest gap, so only a round that is still in
    flight while ``max_gaps`` newer gaps open after it could be taken for a duplicate.

    Per learner at most ``max_incarnations`` incarnations are kept, least recently applied first
    out. When an incarnation is evicted, the highest base version it had applied per fragment is
    folded into a per-(learner, fragment) floor: a contribution for which no (learner,
    incarnation, fragment) entry is held is a duplicate if its base version is <= the floor. So a
    replay of an evicted incarnation is still caught. The price: a new incarnation's first
    contribution to a fragment is rejected if its base is not newer than every base an evicted
    incarnation applied there, which only happens if it started from parameters older than those
    (a learner restarted from a stale copy). Keep ``max_incarnations`` above the number of
    restarts a learner makes while its old messages can still be redelivered.

    Memory: O(learners x max_incarnations x fragments x open gaps) small entries.
    """

    FORMAT = 3  # 2: applied rounds above the floor as a flat list (still read)
    max_gaps = 256

    def __init__(self, max_incarnations: int = 4) -> None:
        if max_incarnations < 1:
            raise ValueError(f"max_incarnations must be >= 1, got {max_incarnations}")
        self.max_incarnations = max_incarnations
        # learner -> incarnation (LRU order) -> fragment -> [round floor, highest base, runs], runs
        # a sorted list of disjoint, non-adjacent [lo, hi] (applied rounds above floor + 1)
        self._seen: dict[str, OrderedDict[str, dict[int, list]]] = {}
        # (learner, fragment) -> highest base version applied by an evicted incarnation
        self._floor: dict[tuple[str, int], int] = {}

    def __len__(self) -> int:
        """Number of (learner, incarnation, fragment) entries held."""
        return sum(len(frags) for incs in self._seen.values() for frags in incs.values())

    def holds(self, learner: str) -> bool:
        """Whether an applied contribution of ``learner`` (any incarnation) is held."""
        return learner in self._seen

    def incarnations(self, learner: str) -> list[str]:
        """Incarnations held for ``learner``, least recently applied first."""
        return list(self._seen.get(learner, {}))

    def highest_round(self, learner: str, incarnation: str, fragment: int) -> int | None:
        entry = self._seen.get(learner, {}).get(incarnation, {}).get(fragment)
        if entry is None:
            return None
        return entry[2][-1][1] if entry[2] else entry[0]

    def newest_rounds(self, fragment: int) -> list[list]:
        """``[learner, incarnation, highest round]`` of ``fragment`` per learner, for the learner's
        most recently applied incarnation that has one: what a global head states as merged so far
        (a learner that missed the head of the version holding its round learns it from any later
        one: ``learner.loop.merged_upto``)."""
        out = []
        for learner, incs in sorted(self._seen.items()):
            for inc in reversed(incs):
                r = self.highest_round(learner, inc, fragment)
                if r is not None and r >= 0:
                    out.append([learner, inc, r])
                    break
        return out

    def is_duplicate(self, c: Contribution) -> bool:
        """True if round ``c.round`` of its incarnation and fragment was already applied."""
        entry = self._seen.get(c.learner, {}).get(c.incarnation, {}).get(c.fragment)
        if entry is not None and (c.round <= entry[0] or _in_runs(entry[2], c.round)):
            return True
        # Not held (new, or its entry was evicted; possibly its incarnation re-entered the set
        # since): the floor of evicted incarnations' base versions covers evicted entries.
        floor = self._floor.get((c.learner, c.fragment))
        return floor is not None and c.base_version <= floor

    def __contains__(self, c: Contribution) -> bool:
        return self.is_duplicate(c)

    def record(self, c: Contribution) -> None:
        """Mark ``c`` applied. Raises ValueError if it is a duplicate (applying twice is a bug)."""
        if self.is_duplicate(c):
            raise ValueError(f"contribution {c.key} is already applied")
        self._record(c.learner, c.incarnation, c.fragment, int(c.round), int(c.base_version))

    def _record(self, learner: str, incarnation: str, fragment: int, rnd: int, base: int) -> None:
        incs = self._seen.setdefault(learner, OrderedDict())
        frags = incs.setdefault(incarnation, {})
        incs.move_to_end(incarnation)
        entry = frags.get(fragment)
        if entry is None:
            entry = frags[fragment] = [-1, base, []]
        entry[1] = max(entry[1], base)
        entry[0] = _add_to_runs(entry[2], entry[0], rnd, self.max_gaps)
        while len(incs) > self.max_incarnations:
            _, old = incs.popitem(last=False)
            for f, (_, old_base, _) in old.items():
                key = (learner, f)
                self._floor[key] = max(self._floor.get(key, old_base), old_base)

    def copy(self) -> AppliedSet:
        return AppliedSet.from_dict(self.to_dict())

    def to_dict(self) -> dict[str, Any]:
        """Plain, msgpack-friendly form (str keys only, ints, lists)::

            {"format": 3, "max_incarnations": int,
             "learners": [[learner, [[incarnation, [[fragment, floor, base, [[lo, hi], ...]], ...]], ...]], ...],
             "floors": [[learner, fragment, base], ...]}

        Incarnations are listed least recently applied first, which restores the LRU order.
        """
        return {
            "format": self.FORMAT,
            "max_incarnations": self.max_incarnations,
            "learners": [
                [learner, [[inc, [[f, e[0], e[1], [list(r) for r in e[2]]] for f, e in sorted(frags.items())]]
                           for inc, frags in incs.items()]]
                for learner, incs in sorted(self._seen.items())
            ],
            "floors": [[l, f, b] for (l, f), b in sorted(self._floor.items())],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AppliedSet:
        fmt = data.get("format")
        if fmt not in (2, cls.FORMAT):
            raise ValueError(f"unknown AppliedSet format {fmt!r}")
        s = cls(int(data["max_incarnations"]))
        for learner, incs in data["learners"]:
            od: OrderedDict[str, dict[int, list]] = OrderedDict()
            for inc, frags in incs:
                entries = {}
                for f, floor, b, rs in frags:
                    floor, runs = int(floor), []
                    if fmt == 2:  # the applied rounds themselves
                        for x in sorted(int(x) for x in rs):
                            floor = _add_to_runs(runs, floor, x, cls.max_gaps)
                    else:
                        runs = [[int(lo), int(hi)] for lo, hi in rs]
                    entries[int(f)] = [floor, int(b), runs]
                od[str(inc)] = entries
            s._seen[str(learner)] = od
        for learner, f, b in data["floors"]:
            s._floor[(str(learner), int(f))] = int(b)
        return s


@dataclass(frozen=True)
class ValidationContext:
    """What validation needs to know, as of now. Build one per batch of arrivals.

    ``applied`` and ``norms`` are read, never changed, by :func:`validate`. ``known`` should
    contain ``active`` (a learner that is active but not known is reported unknown_learner).

    Operational advice:
    - max_staleness: raise it if you see many too_stale rejections from slow islands (their
      work is then lost entirely; a staleness weight is a gentler discount). None = no limit.
    - norm_outlier_factor (k): a poisoned or diverged learner usually shows up as a norm many
      times the others; k = 10 leaves room for honest variation. None disables the check.
    - norm_min_history: the check stays off until this many norms of the fragment were accepted.
    - max_tokens_per_step: the largest batch (in tokens) a learner can have; catches corrupt
      counters that would otherwise dominate the token weight. None = no limit.
    """

    run: str
    model_hash: str
    fragment_sizes: Mapping[int, int]
    current_version: Mapping[int, int]
    active: AbstractSet[str]
    known: AbstractSet[str]
    applied: AppliedSet = field(default_factory=AppliedSet)
    pending: AbstractSet[ContributionKey] = frozenset()
    norms: NormHistory = field(default_factory=NormHistory)
    max_staleness: int | None = 16
    per_round: int = 1  # versions per round (active learners): staleness is counted in rounds
    norm_outlier_factor: float | None = 10.0
    norm_min_history: int = 5
    max_tokens_per_step: float | None = None
    max_inner_steps: int | None = None
    max_inner_lr: float | None = None  # the manifest's declared peak inner lr (norm_bound); None: no bound

    def __post_init__(self) -> None:
        missing = set(self.fragment_sizes) - set(self.current_version)
        if missing:
            raise ValueError(f"current_version lacks fragments {sorted(missing)}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.norm_outlier_factor is not None and not self.norm_outlier_factor > 0:
            raise ValueError(f"norm_outlier_factor must be > 0, got {self.norm_outlier_factor}")
        if self.norm_min_history < 1:
            raise ValueError(f"norm_min_history must be >= 1, got {self.norm_min_history}")
        if self.max_tokens_per_step is not None and not self.max_tokens_per_step >= 1:
            raise ValueError(f"max_tokens_per_step must be >= 1, got {self.max_tokens_per_step}")
        if self.max_inner_steps is not None and self.max_inner_steps < 1:
            raise ValueError(f"max_inner_steps must be >= 1, got {self.max_inner_steps}")


def _bad_counters(c: Contribution, ctx: ValidationContext) -> bool:
    if not all(_is_int(x) for x in (c.inner_steps, c.tokens, c.round, c.base_version)):
        return True
    if c.inner_steps <= 0 or c.tokens <= 0 or c.round < 0 or c.base_version < 0:
        return True
    if c.tokens < c.inner_steps:  # every inner step consumes at least one token
        return True
    if ctx.max_inner_steps is not None and c.inner_steps > ctx.max_inner_steps:
        return True
    if ctx.max_tokens_per_step is not None and c.tokens / c.inner_steps > ctx.max_tokens_per_step:
        return True
    return False


def validate(
    c: Contribution, ctx: ValidationContext, *, norm: float | None = None
) -> Reason | None:
    """None if ``c`` may be merged, else the first Reason in the order of the module docstring.

    ``norm`` may carry |c.vector| already computed with :func:`aggregator.merge.l2_norm` (inf or
    nan exactly when the vector holds inf or nan). Compute it once and keep it: ``merge(...,
    norms=)`` and :meth:`NormHistory.add` want it too. Without it the norm is computed here, in
    the same pass that detects inf/nan.
    """
    if c.run != ctx.run:
        return Reason.wrong_run
    if c.model_hash != ctx.model_hash:
        return Reason.wrong_model
    if c.learner not in ctx.known:
        return Reason.unknown_learner
    if c.learner not in ctx.active:
        return Reason.inactive_learner
    if not _is_int(c.fragment) or c.fragment not in ctx.fragment_sizes:
        return Reason.wrong_fragment
    if _bad_counters(c, ctx):
        return Reason.bad_counters
    current = ctx.current_version[c.fragment]
    if c.base_version > current:
        return Reason.future_version
    if ctx.max_staleness is not None and (current - c.base_version) // max(1, ctx.per_round) > ctx.max_staleness:
        return Reason.too_stale
    if c.key in ctx.pending or ctx.applied.is_duplicate(c):
        return Reason.duplicate
    v = c.vector
    if not is_vector(v) or v.dtype != np.float32:
        return Reason.wrong_dtype
    if v.ndim != 1 or v.size != ctx.fragment_sizes[c.fragment]:
        return Reason.wrong_shape
    nrm = l2_norm(v) if norm is None else float(norm)
    # A finite sum of squares proves every value finite; otherwise look (rare path).
    if not math.isfinite(nrm) and not all_finite(v):
        return Reason.non_finite
    if ctx.max_inner_lr is not None and nrm > norm_bound(ctx.max_inner_lr, v.size, c.inner_steps):
        return Reason.norm_bound
    if ctx.norm_outlier_factor is not None and ctx.norms.count(c.fragment) >= ctx.norm_min_history:
        # norms per inner step: a fragment's first sync may cover a few warm-up steps only, and a
        # raw-norm median taken from those would reject every later honest contribution
        med = ctx.norms.median(c.fragment)
        if med is not None and nrm / outlier_steps(c.inner_steps, c.period) > ctx.norm_outlier_factor * med:
            return Reason.norm_outlier
    return None
