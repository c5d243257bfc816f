"""Validation: every Reason from a crafted contribution, check order, AppliedSet, NormHistory."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.contribution import Contribution
from aggregator.merge import l2_norm
from aggregator.validate import AppliedSet, NormHistory, Reason, ValidationContext, validate

SIZE = 8


def make(**kw) -> Contribution:
    base = dict(run="r1", model_hash="h1", learner="a", incarnation="i1", fragment=0, round=3,
                base_version=5, inner_steps=10, tokens=1000,
                vector=np.full(SIZE, 0.5, dtype=np.float32))
    base.update(kw)
    return Contribution(**base)


def context(**kw) -> ValidationContext:
    norms = NormHistory(window=16)
    for x in (0.10, 0.12, 0.09, 0.11, 0.10):  # accepted norms per inner step (|v| ~ 1 over 10 steps)
        norms.add(0, x)
    base = dict(run="r1", model_hash="h1", fragment_sizes={0: SIZE, 1: 4},
                current_version={0: 6, 1: 0}, active={"a", "b"}, known={"a", "b", "gone"},
                applied=AppliedSet(), norms=norms, max_staleness=3, norm_outlier_factor=10.0,
                norm_min_history=5, max_tokens_per_step=4096)
    base.update(kw)
    return ValidationContext(**base)


def test_good_contribution_is_accepted():
    c = make()
    assert validate(c, context()) is None
    assert validate(c, context(), norm=l2_norm(c.vector)) is None
    assert c.key == ("a", "i1", 0, 3)
    assert c.staleness(6) == 1


def _applied_with(c: Contribution) -> AppliedSet:
    s = AppliedSet()
    s.record(c)
    return s


NAN = np.full(SIZE, 0.5, dtype=np.float32)
NAN[3] = np.nan
INF = np.full(SIZE, 0.5, dtype=np.float32)
INF[0] = -np.inf

CASES = [
    (Reason.wrong_run, dict(run="other"), {}),
    (Reason.wrong_model, dict(model_hash="h2"), {}),
    (Reason.unknown_learner, dict(learner="mallory"), {}),
    (Reason.inactive_learner, dict(learner="gone"), {}),
    (Reason.wrong_fragment, dict(fragment=7), {}),
    (Reason.bad_counters, dict(inner_steps=0), {}),
    (Reason.bad_counters, dict(tokens=0), {}),
    (Reason.bad_counters, dict(tokens=5), {}),  # fewer tokens than steps
    (Reason.bad_counters, dict(tokens=10 * 5000), {}),  # 5000 tokens/step > 4096
    (Reason.bad_counters, dict(round=-1), {}),
    (Reason.bad_counters, dict(base_version=-2), {}),
    (Reason.bad_counters, dict(inner_steps=2.5), {}),
    (Reason.bad_counters, dict(inner_steps=20), dict(max_inner_steps=16)),
    (Reason.future_version, dict(base_version=7), {}),
    (Reason.too_stale, dict(base_version=2), {}),  # 6 - 2 = 4 > 3
    (Reason.duplicate, {}, dict(applied=_applied_with(make()))),
    (Reason.duplicate, {}, dict(pending=frozenset({("a", "i1", 0, 3)}))),
    (Reason.wrong_dtype, dict(vector=np.zeros(SIZE, dtype=np.float64)), {}),
    (Reason.wrong_dtype, dict(vector=[0.0] * SIZE), {}),
    (Reason.wrong_shape, dict(vector=np.zeros(SIZE + 1, dtype=np.float32)), {}),
    (Reason.wrong_shape, dict(vector=np.zeros((2, SIZE // 2), dtype=np.float32)), {}),
    (Reason.non_finite, dict(vector=NAN), {}),
    (Reason.non_finite, dict(vector=INF), {}),
    (Reason.norm_outlier, dict(vector=np.full(SIZE, 5.0, dtype=np.float32)), {}),  # |v|/10=1.4 > 10*0.1
    # bound 2 x 0.1 x sqrt(8) x 10 steps = 5.66 < |v| = 14.1: from version 0, with no history at all
    (Reason.norm_bound, dict(vector=np.full(SIZE, 5.0, dtype=np.float32), base_version=0),
     dict(max_inner_lr=0.1, norms=NormHistory(), current_version={0: 0, 1: 0})),
    (Reason.norm_bound, dict(vector=np.full(SIZE, 1e6, dtype=np.float32), base_version=0),
     dict(max_inner_lr=0.1, norms=NormHistory(), current_version={0: 1, 1: 0})),
]


def test_norm_bound_accepts_what_honest_adam_steps_can_do():
    # every coordinate moved by the full learning rate on every step: |v| = lr sqrt(n) S, half the bound
    honest = make(vector=np.full(SIZE, 0.1 * 10, dtype=np.float32))
    assert validate(honest, context(max_inner_lr=0.1, norms=NormHistory())) is None
    # the bound grows with the steps: 8.5 is over the bound of 10 steps (5.66), within that of 20
    big = np.full(SIZE, 3.0, dtype=np.float32)
    assert validate(make(vector=big), context(max_inner_lr=0.1)) is Reason.norm_bound
    assert validate(make(vector=big, inner_steps=20, tokens=2000), context(max_inner_lr=0.1)) is None


@pytest.mark.parametrize("reason,change,ctx_change", CASES)
def test_each_reason(reason, change, ctx_change):
    assert validate(make(**change), context(**ctx_change)) is reason


def test_every_reason_is_exercised():
    assert {r for r, _, _ in CASES} == set(Reason)


def test_cheap_checks_come_first():
    # wrong run AND a non-finite vector: the cheap reason wins, the vector is never read
    c = make(run="other", vector=NAN)
    assert validate(c, context()) is Reason.wrong_run
    # stale and duplicate and wrong shape: staleness is reported
    c = make(base_version=1, vector=np.zeros(3, dtype=np.float32))
    assert validate(c, context(applied=_applied_with(make(base_version=1)))) is Reason.too_stale


def test_a_partial_round_is_judged_by_sqrt_of_its_steps_times_its_period():
    """A final sync of 5 of a period of 10 steps: its norm grows like sqrt(5) once the steps' noise
    dominates, so divided by 5 it looked an outlier (two honest islands refused at the end of a
    run); divided by sqrt(5 x 10) it is judged as a round. Never more room than a whole round, and
    a declared period counts up to 64 x the steps."""
    from aggregator.influence import outlier_steps

    v = np.full(SIZE, 2.0, dtype=np.float32)  # |v| = 5.66: 1.13 per step over 5 steps > 10 x median 0.1
    assert validate(make(vector=v, inner_steps=5), context()) is Reason.norm_outlier  # no period declared
    assert validate(make(vector=v, inner_steps=5, period=10), context()) is None  # 5.66 / 7.07 = 0.8 < 1
    assert validate(make(vector=v * 2, inner_steps=5, period=10), context()) is Reason.norm_outlier
    assert outlier_steps(10, 10) == 10 and outlier_steps(20, 10) == 20  # whole and longer rounds: s
    assert outlier_steps(5, 10) < 10  # a partial round gets less room than a whole one
    assert outlier_steps(1, 2**31) == 8.0  # sqrt(1 x 64): a huge declared period buys little


def test_norm_outlier_needs_history_and_can_be_disabled():
    big = make(vector=np.full(SIZE, 5.0, dtype=np.float32))
    few = NormHistory()
    for x in (0.1, 0.1):
        few.add(0, x)
    assert validate(big, context(norms=few)) is None  # only 2 norms known, min_history=5
    assert validate(big, context(norms=few, norm_min_history=2)) is Reason.norm_outlier
    assert validate(big, context(norm_outlier_factor=None)) is None
    assert validate(big, context(norm_outlier_factor=20.0)) is None  # 1.41 per step < 20 * 0.1
    # the same vector over 20 inner steps is a normal contribution: norms are compared per step
    assert validate(make(vector=big.vector, inner_steps=20), context(max_inner_steps=None)) is None
    # other fragments have no history: not checked
    c = make(fragment=1, base_version=0, vector=np.full(4, 1e6, dtype=np.float32))
    assert validate(c, context()) is None


def test_limits_can_be_disabled():
    c = make(base_version=0, tokens=10 * 100_000)
    assert validate(c, context()) is Reason.bad_counters
    assert validate(c, context(max_tokens_per_step=None)) is Reason.too_stale
    assert validate(c, context(max_tokens_per_step=None, max_staleness=None)) is None


def test_overflowing_norm_is_finite_and_an_outlier():
    c = make(vector=np.full(SIZE, 1e30, dtype=np.float32))  # float32 sum of squares overflows
    n = l2_norm(c.vector)
    assert np.isfinite(n) and n == pytest.approx(1e30 * np.sqrt(SIZE), rel=1e-6)
    assert validate(c, context()) is Reason.norm_outlier


def test_context_rejects_bad_config():
    with pytest.raises(ValueError):
        context(max_staleness=-1)
    with pytest.raises(ValueError):
        context(norm_outlier_factor=0.0)
    with pytest.raises(ValueError):
        context(norm_min_history=0)
    with pytest.raises(ValueError):
        context(current_version={0: 1})  # fragment 1 has no version


def test_reason_values_are_metric_labels():
    assert Reason.too_stale == "too_stale"
    assert Reason("norm_outlier") is Reason.norm_outlier


# ---------------------------------------------------------------- AppliedSet


def test_applied_set_rounds():
    s = AppliedSet()
    s.record(make(round=3))
    assert s.is_duplicate(make(round=3))
    # an older round arriving late (redelivered after a crash) was never applied: not a duplicate
    assert not s.is_duplicate(make(round=1))
    s.record(make(round=1))
    assert s.is_duplicate(make(round=1))
    assert not s.is_duplicate(make(round=4))
    assert not s.is_duplicate(make(round=3, fragment=1))
    assert not s.is_duplicate(make(round=3, incarnation="i2"))
    assert not s.is_duplicate(make(round=3, learner="b"))
    assert make(round=2) not in s
    with pytest.raises(ValueError):
        s.record(make(round=3))  # applying twice is a bug
    s.record(make(round=4))
    assert s.highest_round("a", "i1", 0) == 4
    assert len(s) == 1
    s.record(make(round=2))
    s.record(make(round=0))  # rounds 0..4 all applied: the floor absorbs them
    assert s.to_dict()["learners"][0][1][0][1] == [[0, 4, 5, []]]  # fragment 0, floor 4, base 5


def test_applied_set_states_every_learner_s_newest_round_of_a_fragment():
    """``newest_rounds``: what a global head states as merged so far, per learner, for its most
    recently applied incarnation that has a round of the fragment."""
    s = AppliedSet()
    assert s.newest_rounds(0) == []
    s.record(make(round=3))
    s.record(make(round=5))
    s.record(make(round=1, learner="b", incarnation="b1"))
    s.record(make(round=7, fragment=1))
    assert s.newest_rounds(0) == [["a", "i1", 5], ["b", "b1", 1]]
    assert s.newest_rounds(1) == [["a", "i1", 7]]
    s.record(make(round=0, incarnation="i2", fragment=1))  # a restart: its newest incarnation
    assert s.newest_rounds(1) == [["a", "i2", 0]]
    assert s.newest_rounds(0) == [["a", "i1", 5], ["b", "b1", 1]]  # i2 has no round of 0 yet
    assert s.newest_rounds(2) == []


def test_applied_set_gaps_are_bounded():
    s = AppliedSet()
    for r in range(1, 2 + 2 * AppliedSet.max_gaps, 2):  # every other round never arrives
        s.record(make(round=r))
    (entry,) = s.to_dict()["learners"][0][1][0][1]
    assert len(entry[3]) <= AppliedSet.max_gaps
    assert all(s.is_duplicate(make(round=r)) for r in range(1, 2 + 2 * AppliedSet.max_gaps, 2))


def test_a_late_round_is_never_taken_for_a_duplicate_however_many_rounds_overtake_it():
    """The crash loop can hold one round's chunks in flight while hundreds of later rounds are
    applied: that costs one gap, not one entry per later round (the CI failure of stop 10)."""
    s = AppliedSet()
    late, last = 5, 5 + 10 * AppliedSet.max_gaps
    for r in [*range(late), *range(late + 1, last + 1)]:
        s.record(make(round=r))
    assert not s.is_duplicate(make(round=late))
    (entry,) = s.to_dict()["learners"][0][1][0][1]
    assert entry[1:] == [late - 1, 5, [[late + 1, last]]]  # floor 4, base 5, one run
    s.record(make(round=late))
    assert s.is_duplicate(make(round=late))
    assert s.to_dict()["learners"][0][1][0][1] == [[0, last, 5, []]]
    assert s.highest_round("a", "i1", 0) == last


@settings(max_examples=300, deadline=None)
@given(st.permutations(list(range(40))), st.sets(st.integers(0, 39), max_size=6), st.integers(1, 8))
def test_applied_set_matches_a_plain_set_while_gaps_fit(order, never, max_gaps):
    """Any arrival order: exact while at most ``max_gaps`` rounds are missing; beyond that only
    rounds at or below the floor are given up, and every applied round stays a duplicate."""
    s = AppliedSet()
    s.max_gaps = max_gaps
    applied: set[int] = set()
    given_up: list[int] = []
    always_fit = True
    for r in order:
        if r in never:
            continue
        if s.is_duplicate(make(round=r)):  # the aggregator would reject it
            given_up.append(r)
        else:
            s.record(make(round=r))
            applied.add(r)
        (entry,) = s.to_dict()["learners"][0][1][0][1]
        floor, runs = entry[1], entry[3]
        assert len(runs) <= max_gaps
        assert all(lo > floor + 1 and hi >= lo for lo, hi in runs)
        assert all(a[1] + 1 < b[0] for a, b in zip(runs, runs[1:]))  # sorted, disjoint, non-adjacent
        for q in range(45):
            assert s.is_duplicate(make(round=q)) == (q in applied or q <= floor)
        always_fit &= sum(1 for q in range(max(applied)) if q not in applied) <= max_gaps
    assert all(q <= max(applied) for q in given_up)
    if always_fit:
        assert not given_up


def test_applied_set_reads_format_2():
    """States written before the runs (format 2: applied rounds above the floor as a list)."""
    old = {"format": 2, "max_incarnations": 4, "floors": [["a", 1, 3]],
           "learners": [["a", [["i1", [[0, 2, 7, [4, 5, 6, 9]]]]]]]}
    s = AppliedSet.from_dict(old)
    assert [r for r in range(12) if s.is_duplicate(make(round=r))] == [0, 1, 2, 4, 5, 6, 9]
    assert s.to_dict()["learners"] == [["a", [["i1", [[0, 2, 7, [[4, 6], [9, 9]]]]]]]]
    assert s.to_dict()["format"] == 3
    assert s.is_duplicate(make(incarnation="gone", fragment=1, base_version=3))


def test_applied_set_is_bounded_and_still_catches_evicted_replays():
    s = AppliedSet(max_incarnations=2)
    for k in range(10):
        for f in range(3):
            s.record(make(incarnation=f"inc{k}", fragment=f, round=0, base_version=10 * k))
    assert s.incarnations("a") == ["inc8", "inc9"]
    assert len(s) == 2 * 3
    # a replay of an evicted incarnation is still a duplicate (base <= floor of 70)
    assert s.is_duplicate(make(incarnation="inc3", round=0, base_version=30))
    assert s.is_duplicate(make(incarnation="inc7", fragment=2, round=5, base_version=70))
    # a new incarnation that starts from current parameters is accepted
    assert not s.is_duplicate(make(incarnation="fresh", round=0, base_version=95))
    # the floor is per learner
    assert not s.is_duplicate(make(learner="b", incarnation="inc3", round=0, base_version=30))


def test_applied_set_lru_keeps_the_incarnation_in_use():
    s = AppliedSet(max_incarnations=2)
    s.record(make(incarnation="x", round=0))
    s.record(make(incarnation="y", round=0))
    s.record(make(incarnation="x", round=1))  # x used again: y is now the oldest
    s.record(make(incarnation="z", round=0))
    assert s.incarnations("a") == ["x", "z"]


def test_applied_set_msgpack_round_trip():
    s = AppliedSet(max_incarnations=2)
    for k in range(4):
        s.record(make(incarnation=f"inc{k}", fragment=k % 2, round=k, base_version=k))
    s.record(make(learner="b", incarnation="q", fragment=1, round=7, base_version=3))
    blob = msgpack.packb(s.to_dict())
    back = AppliedSet.from_dict(msgpack.unpackb(blob))  # default strict_map_key=True
    assert back.to_dict() == s.to_dict()
    assert back.incarnations("a") == s.incarnations("a")
    probes = [make(incarnation=f"inc{k}", fragment=f, round=r, base_version=b)
              for k in range(5) for f in range(2) for r in range(5) for b in range(4)]
    assert [back.is_duplicate(c) for c in probes] == [s.is_duplicate(c) for c in probes]
    # the copy is independent
    back.record(make(learner="c", round=0))
    assert not s.is_duplicate(make(learner="c", round=0))
    with pytest.raises(ValueError):
        AppliedSet.from_dict({**s.to_dict(), "format": 99})


records = st.lists(
    st.tuples(st.sampled_from("ab"), st.integers(0, 5), st.integers(0, 2), st.integers(0, 3)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(records, st.integers(1, 3))
def test_applied_set_never_forgets_an_applied_contribution(ops, max_inc):
    """Whatever the eviction, every contribution once recorded stays a duplicate."""
    s = AppliedSet(max_incarnations=max_inc)
    applied: list[Contribution] = []
    version = 0
    for learner, inc, frag, bump in ops:
        version += bump  # base versions only grow over time, like the real run
        c = make(learner=learner, incarnation=f"i{inc}", fragment=frag,
                 round=version, base_version=version)
        if not s.is_duplicate(c):
            s.record(c)
            applied.append(c)
        for learner_ in "ab":
            assert len(s.incarnations(learner_)) <= max_inc
    assert all(s.is_duplicate(c) for c in applied)
    back = AppliedSet.from_dict(msgpack.unpackb(msgpack.packb(s.to_dict())))
    assert all(back.is_duplicate(c) for c in applied)


# ---------------------------------------------------------------- NormHistory


def test_norm_history_window_median_and_round_trip():
    h = NormHistory(window=3)
    assert h.median(0) is None and h.count(0) == 0
    for x in (1.0, 100.0, 2.0, 3.0):
        h.add(0, x)
    assert h.count(0) == 3
    assert h.median(0) == 3.0  # window keeps 100, 2, 3
    back = NormHistory.from_dict(msgpack.unpackb(msgpack.packb(h.to_dict())))
    assert back.to_dict() == h.to_dict()
    with pytest.raises(ValueError):
        h.add(0, float("nan"))


def test_contribution_is_frozen():
    c = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.round = 4  # type: ignore[misc]


def test_too_stale_counts_rounds_of_active_learners():
    # current 6, max 3 rounds: base 2 is 4 versions = 4 rounds behind with one learner per round,
    # 2 rounds behind with two (each merging on its own)
    assert validate(make(base_version=2), context()) is Reason.too_stale
    assert validate(make(base_version=2), context(per_round=2)) is None
    assert validate(make(base_version=5), context(current_version={0: 14, 1: 0}, per_round=2)) is Reason.too_stale


def test_outlier_watch_restarts_a_stale_reference_only_for_most_learners():
    from aggregator.validate import OutlierWatch

    w = OutlierWatch()
    active = {"a", "b", "c", "d"}
    # one learner refused again and again (an attacker, or one odd learner): never a restart
    for _ in range(10):
        assert w.refused(0, "a", 5.0, active) is None
    assert w.refused(1, "b", 5.0, active) is None  # another fragment is another matter
    # a second learner on the same fragment: 2 of 4 active, half of them -> restart from their norms
    assert w.refused(0, "b", 7.0, active) == [5.0, 7.0]
    assert w.count(0) == 0  # and it starts counting again
    # learners that are not active do not count (evicted ones, or an attacker's many ids)
    assert w.refused(2, "x", 1.0, active) is None and w.refused(2, "y", 1.0, active) is None
    assert w.refused(2, "a", 1.0, active) is None  # 1 of 4 active
    # with 6 active learners, 2 refused is a minority: 3 are needed
    six = {"a", "b", "c", "d", "e", "f"}
    assert w.refused(3, "a", 1.0, six) is None and w.refused(3, "b", 1.0, six) is None
    assert w.refused(3, "c", 2.0, six) == [1.0, 1.0, 2.0]


def test_norm_history_restart_forgets_the_old_reference():
    h = NormHistory(window=4)
    for x in (1.0, 1.0, 1.0, 1.0):
        h.add(0, x)
    h.add(1, 3.0)
    h.restart(0, [10.0, 12.0])
    assert h.count(0) == 2 and h.median(0) == 11.0 and h.median(1) == 3.0
    h.restart(0, [1.0] * 9)  # bounded by the window
    assert h.count(0) == 4
