"""Quorum and grace: decisions and reasons, adaptive window, ArrivalStats, invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.quorum import (AUTO, AUTO_SHARE, INPUT_LAG_MAX, OBSERVED_FLOOR, ArrivalStats, Decision, GracePolicy, decide,
                               grace_window, input_clock)

ACTIVE4 = {"a", "b", "c", "d"}
FIXED1 = GracePolicy("fixed", grace=1.0)


def test_quorum_reached_then_grace():
    d = decide(0.2, 0.0, {"a": 0.0}, ACTIVE4, K=1, grace=FIXED1)
    assert d == Decision(False, 1.0, "quorum 1/4 reached (K=1), grace 0.8s left", 1.0)
    d = decide(1.0, 0.0, {"a": 0.0}, ACTIVE4, K=1, grace=FIXED1)
    assert d.merge and d.wait_until is None
    assert d.reason == "quorum 1/4 reached (K=1), grace 1.0s expired"


def test_all_active_contributed_merges_at_once():
    d = decide(0.01, 0.0, {"a": 0.0, "b": 0.0, "c": 0.0, "d": 0.01}, ACTIVE4, K=1, grace=FIXED1)
    assert d.merge and d.wait_until is None
    assert d.reason == "all 4 active contributed"


def test_waiting_for_quorum_has_no_deadline():
    d = decide(5.0, 0.0, {"a": 0.0}, ACTIVE4, K=2, grace=FIXED1)
    assert d == Decision(False, None, "waiting for quorum 1/2 (4 active)")
    d = decide(5.0, 0.0, {}, {"a"}, K=1, grace=FIXED1)
    assert d.reason == "waiting for quorum 0/1 (1 active)" and not d.merge
    d = decide(5.0, 0.0, {"x": 0.0}, set(), K=1, grace=FIXED1)
    assert not d.merge and d.wait_until is None  # nobody active: nothing counts


def test_evicted_learners_neither_count_nor_are_waited_for():
    # "gone" contributed but is evicted: it does not count towards the quorum of 2
    d = decide(5.0, 0.0, {"a": 0.0, "gone": 0.0}, {"a", "b"}, K=2, grace=FIXED1)
    assert not d.merge and d.reason.startswith("waiting for quorum 1/2")
    # the only active learner contributed: merge now, never wait for the evicted one
    d = decide(0.0, 0.0, {"a": 0.0}, {"a"}, K=1, grace=FIXED1)
    assert d.merge and d.reason == "all 1 active contributed"
    # K above the number of active learners is capped: no deadlock after evictions
    d = decide(0.0, 0.0, {"a": 0.0, "b": 0.0}, {"a", "b"}, K=3, grace=FIXED1)
    assert d.merge


def test_grace_starts_when_quorum_is_reached():
    arrivals = {"a": 0.0, "b": 0.5}
    d = decide(1.0, 0.0, arrivals, ACTIVE4, K=2, grace=FIXED1)
    assert not d.merge and d.wait_until == pytest.approx(1.5)
    # with only a set of contributors, the window starts at the first arrival (never longer)
    d = decide(1.0, 0.0, {"a", "b"}, ACTIVE4, K=2, grace=FIXED1)
    assert d.merge


def test_zero_grace_merges_at_quorum():
    d = decide(0.0, 0.0, {"a": 0.0}, ACTIVE4, K=1, grace=GracePolicy("fixed", grace=0.0))
    assert d.merge


def stats_with(step_time: float, sync_time: float | None) -> ArrivalStats:
    s = ArrivalStats(alpha=1.0)
    s = s.observe_arrival("a", "i", 0.0, 10)
    s = s.observe_arrival("a", "i", 10 * step_time, 10)
    if sync_time is not None:
        s = s.observe_sync(sync_time)
    return s


def test_adaptive_grace_from_slack():
    pol = GracePolicy("adaptive", grace=3.0, max_grace=10.0, gamma=0.5, tau=2)
    st_ = stats_with(step_time=1.0, sync_time=0.2)
    # slack = 2 * 1.0 - (0 + 0.2) = 1.8 -> grace = 0.9
    assert grace_window(pol, st_, quorum_time=0.0) == pytest.approx(0.9)
    d = decide(0.5, 0.0, {"a": 0.0}, ACTIVE4, K=1, grace=pol, stats=st_)
    assert d.grace == pytest.approx(0.9) and d.wait_until == pytest.approx(0.9)
    assert d.reason == "quorum 1/4 reached (K=1), grace 0.4s left"
    # the time spent reaching quorum eats the slack: quorum_time 0.8 -> slack 1.0 -> 0.5
    d = decide(0.9, 0.0, {"a": 0.0, "b": 0.8}, ACTIVE4, K=2, grace=pol, stats=st_)
    assert d.grace == pytest.approx(0.5) and d.wait_until == pytest.approx(1.3)
    # capped by max_grace
    pol_cap = GracePolicy("adaptive", max_grace=2.0, gamma=0.9, tau=2)
    assert grace_window(pol_cap, stats_with(100.0, 0.0), 0.0) == pytest.approx(2.0)
    # no slack left: merge at quorum
    assert grace_window(pol, stats_with(0.05, 0.5), 0.0) == 0.0
    d = decide(0.0, 0.0, {"a": 0.0}, ACTIVE4, K=1, grace=pol, stats=stats_with(0.05, 0.5))
    assert d.merge
    # nothing observed yet: the fallback window, capped by max_grace
    assert grace_window(pol, None, 0.0) == 3.0
    assert grace_window(pol, ArrivalStats(), 0.0) == 3.0
    assert grace_window(GracePolicy("adaptive", grace=3.0, max_grace=1.0), None, 0.0) == 1.0


def test_adaptive_grace_follows_the_fastest_active_learner():
    s = ArrivalStats(alpha=1.0)
    for learner, st_time in (("fast", 1.0), ("slow", 3.0)):
        s = s.observe_arrival(learner, "i", 0.0, 10).observe_arrival(learner, "i", 10 * st_time, 10)
    pol = GracePolicy("adaptive", max_grace=100.0, gamma=0.5, tau=2)
    assert grace_window(pol, s, 0.0) == pytest.approx(1.0)  # 0.5 * 2 * 1.0
    assert grace_window(pol, s, 0.0, active={"slow"}) == pytest.approx(3.0)  # fast evicted
    assert grace_window(pol, s.forget("fast"), 0.0) == pytest.approx(3.0)


def test_grace_policy_validation():
    assert GracePolicy("adaptive", gamma=0.0).gamma == 0.0  # never wait beyond the quorum
    for bad in (1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError):
            GracePolicy("adaptive", gamma=bad)
    with pytest.raises(ValueError):
        GracePolicy("sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        GracePolicy(grace=-1.0)
    with pytest.raises(ValueError):
        GracePolicy(max_grace=float("inf"))
    with pytest.raises(ValueError):
        GracePolicy(tau=0)


def test_arrival_stats_ema_and_restarts():
    s = ArrivalStats(alpha=0.5)
    s = s.observe_arrival("a", "i1", 0.0, 10)
    assert s.fastest_step_time() is None
    s = s.observe_arrival("a", "i1", 20.0, 10)  # 2.0 s/step
    assert s.step_time["a"] == pytest.approx(2.0)
    s = s.observe_arrival("a", "i1", 30.0, 10)  # 1.0 s/step -> EMA 0.5*2 + 0.5*1
    assert s.step_time["a"] == pytest.approx(1.5)
    # a restart: the downtime is not a step time
    s2 = s.observe_arrival("a", "i2", 500.0, 10)
    assert s2.step_time["a"] == pytest.approx(1.5)
    s2 = s2.observe_arrival("a", "i2", 505.0, 10)
    assert s2.step_time["a"] == pytest.approx(0.5 * 1.5 + 0.5 * 0.5)
    assert s.step_time["a"] == pytest.approx(1.5)  # immutable: the old object is unchanged
    s = s.observe_sync(1.0).observe_sync(3.0)
    assert s.sync_time == pytest.approx(2.0)
    assert s.slack(tau=2, quorum_time=0.5) == pytest.approx(2 * 1.5 - (0.5 + 2.0))
    with pytest.raises(ValueError):
        s.observe_sync(-1.0)
    with pytest.raises(ValueError):
        ArrivalStats(alpha=0.0)


learners = st.sampled_from(["a", "b", "c", "d", "e", "f"])


@settings(max_examples=300, deadline=None)
@given(
    active=st.sets(learners),
    arrivals=st.dictionaries(learners, st.floats(0, 10)),
    evicted_extra=st.dictionaries(st.sampled_from(["x", "y"]), st.floats(0, 10)),
    K=st.integers(1, 7),
    grace=st.floats(0, 5),
    dt=st.floats(0, 20),
)
def test_decision_invariants(active, arrivals, evicted_extra, K, grace, dt):
    first = min(arrivals.values(), default=0.0)
    now = max(arrivals.values(), default=0.0) + dt
    pol = GracePolicy("fixed", grace=grace)
    d = decide(now, first, arrivals, active, K, pol)
    counted = set(arrivals) & active
    if active and counted == active:
        assert d.merge  # everyone active is in: never wait
    if d.merge:
        assert len(counted) >= min(K, len(active)) and counted
    else:
        assert d.wait_until is None or d.wait_until > now
        assert d.reason
    # contributions from learners that are not active change nothing
    both = {**evicted_extra, **arrivals}
    d2 = decide(now, min(both.values(), default=first), both, active, K, pol)
    assert (d2.merge, d2.wait_until) == (d.merge, d.wait_until)


def test_quorum_all_waits_for_every_active_learner_and_only_those():
    """K = 0 (DILOCO_QUORUM=all, the default): one merge per round of every active learner; an
    evicted learner is not waited for, and one that joins is (the quorum follows the membership)."""
    d = decide(9.0, 0.0, {"a": 0.0, "b": 0.1, "c": 0.2}, ACTIVE4, K=0, grace=FIXED1)
    assert not d.merge and d.wait_until is None and "3/4" in d.reason
    assert decide(9.0, 0.0, {"a": 0.0, "b": 0.1, "c": 0.2}, {"a", "b", "c"}, K=0, grace=FIXED1).merge
    assert decide(0.0, 0.0, {"a": 0.0}, {"a"}, K=0, grace=FIXED1).merge
    with pytest.raises(ValueError):
        decide(0.0, 0.0, {"a": 0.0}, {"a"}, K=-2, grace=FIXED1)


def test_quorum_setting_reads_all_auto_or_a_count():
    from aggregator.config import AggregatorConfig, quorum_value
    from bus.config import from_env

    assert quorum_value("all") == 0 and quorum_value(" ALL ") == 0 and quorum_value("3") == 3
    assert quorum_value("auto") == AUTO and quorum_value(" Auto ") == AUTO
    assert from_env(AggregatorConfig, {}).quorum == AUTO  # the default: rounds that close on time
    assert from_env(AggregatorConfig, {"DILOCO_QUORUM": "auto"}).quorum == AUTO
    for bad in ("0", "-1", "many", ""):
        with pytest.raises(ValueError, match="'all', 'auto' or an integer"):
            quorum_value(bad)


def test_arrival_stats_time_each_fragment_apart():
    """A learner sends its P fragments in turn: arrivals of different fragments are a fraction of a
    period apart and are not its step time (they read P times too fast before)."""
    s = ArrivalStats(alpha=1.0)
    for k in range(4):  # fragments 0..3 of H = 8 steps, one every 2 steps of 1 s
        s = s.observe_arrival("a", "i", 2.0 * k, 8, fragment=k, period=8)
    assert s.fastest_step_time() is None  # no fragment arrived twice yet
    s = s.observe_arrival("a", "i", 8.0, 8, fragment=0, period=8)
    assert s.step_time["a"] == pytest.approx(1.0)
    assert s.expected("a", 1) == pytest.approx(2.0 + 8.0) and s.expected("a", 9) is None
    # a reported pace wins over arrivals (its own steps, holds and transfers excluded)
    s = s.observe_arrival("a", "i", 10.0, 8, fragment=1, step_s=0.5, period=8)
    assert s.step_time["a"] == pytest.approx(0.5) and s.round_time("a") == pytest.approx(4.0)
    assert s.expected("a", 1) == pytest.approx(14.0)
    for bad in (float("nan"), float("inf"), -1.0):  # not a pace: the arrivals decide
        assert s.observe_arrival("a", "i", 40.0, 8, fragment=3, step_s=bad).step_time["a"] == pytest.approx(
            (40.0 - 6.0) / 8)
    assert s.forget("a").expected("a", 1) is None and not s.forget("a").period


def paced(**learners: tuple[float, float]) -> ArrivalStats:
    """Stats where each learner (step seconds, last arrival of fragment 0) has period 10."""
    s = ArrivalStats(alpha=1.0)
    for name, (step_s, last) in learners.items():
        s = s.observe_arrival(name, "i", last, 10, fragment=0, step_s=step_s, period=10)
    return s


def test_on_time_quorum_waits_for_learners_due_before_the_deadline():
    # a and b step at 1 s (period 10 s), c at 1.5 s (15 s): the round opened by a at t=10 may stay
    # open until 10 + 0.5 x 10 = 15; b is due at 10.5, c at 15.5
    s = paced(a=(1.0, 0.0), b=(1.0, 0.5), c=(1.5, 0.5))
    d = decide(10.0, 10.0, {"a": 10.0}, {"a", "b", "c"}, AUTO, FIXED1, s)
    assert not d.merge and d.wait_until == pytest.approx(10 + AUTO_SHARE * 10)  # b is expected in time
    d = decide(10.5, 10.0, {"a": 10.0, "b": 10.5}, {"a", "b", "c"}, AUTO, FIXED1, s)
    assert d.merge and "1 missing are not expected within 5.0s" in d.reason  # c would hold the round
    # c expected at 14.5 instead: the round waits for it, and merges when it comes
    s2 = paced(a=(1.0, 0.0), b=(1.0, 0.5), c=(1.4, -0.5))
    d = decide(10.5, 10.0, {"a": 10.0, "b": 10.5}, {"a", "b", "c"}, AUTO, FIXED1, s2)
    assert not d.merge and d.wait_until == pytest.approx(15.0)
    d = decide(14.5, 10.0, {"a": 10.0, "b": 10.5, "c": 14.5}, {"a", "b", "c"}, AUTO, FIXED1, s2)
    assert d.merge and d.reason == "all 3 active contributed"
    # c is late (stopped, or slower than it was): the round closes at its deadline, not later
    d = decide(15.0, 10.0, {"a": 10.0, "b": 10.5}, {"a", "b", "c"}, AUTO, FIXED1, s2)
    assert d.merge and "round closed at 5.0s" in d.reason


def test_on_time_quorum_with_unknown_pace_waits_like_all():
    d = decide(99.0, 0.0, {"a": 0.0}, {"a", "b"}, AUTO, FIXED1, ArrivalStats())
    assert not d.merge and d.wait_until is None and "pace unknown" in d.reason
    d = decide(99.0, 0.0, {"a": 0.0}, {"a", "b"}, AUTO, FIXED1, None)
    assert not d.merge and d.wait_until is None
    # the contributor's pace known, the missing one's not: it is waited for until the deadline
    s = paced(a=(1.0, -10.0))
    d = decide(0.0, 0.0, {"a": 0.0}, {"a", "b"}, AUTO, FIXED1, s)
    assert not d.merge and d.wait_until == pytest.approx(5.0)
    assert decide(5.0, 0.0, {"a": 0.0}, {"a", "b"}, AUTO, FIXED1, s).merge
    assert not decide(5.0, 0.0, {}, {"a", "b"}, AUTO, FIXED1, s).merge  # nothing to merge


@settings(max_examples=300, deadline=None)
@given(
    active=st.sets(learners, min_size=1),
    arrivals=st.dictionaries(learners, st.floats(0, 10), min_size=1),
    paces=st.dictionaries(learners, st.tuples(st.floats(0.01, 5), st.floats(-20, 10))),
    dt=st.floats(0, 40),
)
def test_on_time_quorum_invariants(active, arrivals, paces, dt):
    """Never waits past the earliest contributor's deadline, never merges nothing, always merges
    once every active learner is in; the round closes no later than K = all would."""
    s = paced(**paces)
    first = min(arrivals.values())
    now = max(arrivals.values()) + dt
    d = decide(now, first, arrivals, active, AUTO, FIXED1, s)
    counted = set(arrivals) & active
    ends = [arrivals[c] + AUTO_SHARE * s.round_time(c) for c in counted if s.round_time(c) is not None]
    if counted == active:
        assert d.merge
    if d.merge:
        assert counted
    else:
        assert d.wait_until is None or d.wait_until > now
        if ends:
            assert d.wait_until == pytest.approx(min(ends))
        else:
            assert d.wait_until is None
    if decide(now, first, arrivals, active, 0, FIXED1, s).merge:
        assert d.merge


def test_a_reported_pace_cannot_shrink_a_round_below_a_share_of_the_observed_one():
    """step_s is the learner's word: a learner reporting a microsecond per step (a bug, or to split
    every round it is in) still has a round time of a quarter of what the aggregator sees it take."""
    s = ArrivalStats(alpha=1.0)
    s = s.observe_arrival("liar", "i", 0.0, 10, fragment=0, step_s=1e-6, period=10)
    assert s.round_time("liar") == pytest.approx(1e-5)  # nothing observed yet: its word
    s = s.observe_arrival("liar", "i", 12.0, 10, fragment=0, step_s=1e-6, period=10)
    assert s.round_time("liar") == pytest.approx(OBSERVED_FLOOR * 12.0)
    # an honest pace is above the floor: it stands
    s = s.observe_arrival("honest", "i", 0.0, 10, fragment=0, step_s=1.1, period=10)
    s = s.observe_arrival("honest", "i", 12.0, 10, fragment=0, step_s=1.1, period=10)
    assert s.round_time("honest") == pytest.approx(11.0)
    assert "liar" not in s.forget("liar").interval


def test_deadlines_are_judged_at_the_time_everything_on_the_server_had_been_read():
    """``input_clock``: the real time once the input is drained; the drain's time while the
    aggregator is behind its input (a deadline cannot pass for a contribution it has not read);
    never more than INPUT_LAG_MAX behind (an input that never drains does not stop time)."""
    assert input_clock(100.0, 100.0) == 100.0
    assert input_clock(100.0, 100.5) == 100.0  # drained after the look began: the real time
    assert input_clock(100.0, 99.4) == 99.4  # busy since 99.4: what came meanwhile is unread
    assert input_clock(100.0, 0.0) == 100.0 - INPUT_LAG_MAX
    assert input_clock(100.0, 95.0, lag_max=2.0) == 98.0
    # a round whose deadline passed while the aggregator was busy is not closed by it
    stats = ArrivalStats().observe_arrival("a", "i", 99.0, 10, 0, step_s=0.1, period=10)
    d = decide(input_clock(100.0, 99.2), 99.0, {"a": 99.0}, {"a", "b"}, AUTO, GracePolicy(), stats, 0)
    assert not d.merge and d.wait_until == pytest.approx(99.0 + AUTO_SHARE * 1.0)
    assert decide(100.0, 99.0, {"a": 99.0}, {"a", "b"}, AUTO, GracePolicy(), stats, 0).merge


def test_arrival_leads_are_each_learners_time_before_the_merges_median_arrival():
    from aggregator.quorum import arrival_leads

    got = arrival_leads([("a", "i1", 10.0), ("b", "i2", 10.5), ("c", "i3", 11.5), ("a", "i1", 10.2)])
    # a's newest arrival counts (10.2); the median of 10.2, 10.5, 11.5 is 10.5
    assert got == [["a", "i1", 0.3], ["b", "i2", 0.0], ["c", "i3", -1.0]]
    assert arrival_leads([("a", "i1", 1.0), ("b", "i2", 2.0)]) == [["a", "i1", 0.5], ["b", "i2", -0.5]]
    assert arrival_leads([("a", "i1", 1.0), ("a", "i1", 2.0)]) == []  # one learner: no spread
    assert arrival_leads([]) == []


def test_arrival_leads_against_the_round_s_phase_pull_split_groups_together():
    """The on-time quorum split a round of 2 s: a, b merged at 10.0-10.1, c, d at 10.6-10.7. Against
    their own merge each group reads leads near 0 and nothing pulls the groups together; against
    every learner's last arrival, taken the short way round a round, the early group reads itself
    early and the late one late, by about half their distance."""
    from aggregator.quorum import arrival_leads, round_offset

    phases = {"a": 10.0, "b": 10.1, "c": 8.6, "d": 8.7}  # c, d: their previous round's arrivals
    early = arrival_leads([("a", "i", 10.0), ("b", "i", 10.1)], phases=phases, round_s=2.0)
    # a's offsets: itself 0, b 0.1, c and d 0.6 and 0.7 (-1.4 and -1.3 the short way round): 0.35
    assert early == [["a", "i", 0.35], ["b", "i", 0.25]]
    phases = {"a": 10.0, "b": 10.1, "c": 10.6, "d": 10.7}
    late = arrival_leads([("c", "i", 10.6), ("d", "i", 10.7)], phases=phases, round_s=2.0)
    assert late == [["c", "i", -0.25], ["d", "i", -0.35]]
    assert arrival_leads([("c", "i", 10.6), ("d", "i", 10.7)]) == [["c", "i", 0.05], ["d", "i", -0.05]]
    # a learner merged alone still reads its lead over the others (its own merge gives none)
    assert arrival_leads([("c", "i", 10.6)], phases=phases, round_s=2.0) == [["c", "i", -0.25]]
    assert arrival_leads([("c", "i", 10.6)], phases={"c": 10.6}, round_s=2.0) == []  # nobody else
    assert round_offset(1.9, 2.0) == pytest.approx(-0.1) and round_offset(-1.9, 2.0) == pytest.approx(0.1)
    assert round_offset(0.3, 2.0) == pytest.approx(0.3)


def test_round_phases_take_the_learners_syncing_now_and_their_round_time():
    from aggregator.quorum import ArrivalStats, arrival_leads, round_phases

    st = ArrivalStats(alpha=1.0)
    for who, t in (("a", 10.0), ("b", 10.5), ("gone", 3.0)):
        st = st.observe_arrival(who, "i", t, 12, fragment=1, step_s=0.1, period=12)
    phases, r = round_phases(st, 1, {"a", "b", "gone", "new"}, now=10.5)
    assert r == pytest.approx(1.2) and phases == {"a": 10.0, "b": 10.5}  # "gone": 7.5 s ago; "new": none yet
    assert round_phases(st, 0, {"a"}, now=10.5) == ({}, pytest.approx(1.2))  # nothing of fragment 0
    assert round_phases(ArrivalStats(), 1, {"a"}, now=1.0) == ({}, None)
    # once a learner's gap between two arrivals of a fragment is seen, it is the round: a declared
    # period (a floor) times a pace (the steps alone) is short, and a short round misreads a peer's
    # arrival of a round ago as earlier than it was. Rounds of 1.07 s at a declared 10 steps of
    # 0.1 s: a merges alone at 10.0, b comes 0.05 s later (its last arrival, 8.98, a round before)
    st = ArrivalStats(alpha=1.0)
    for who, t in (("b", 7.91), ("a", 8.93), ("b", 8.98), ("a", 10.0)):
        st = st.observe_arrival(who, "i", t, 10, fragment=0, step_s=0.1, period=10)
    phases, r = round_phases(st, 0, {"a", "b"}, now=10.0)
    assert r == pytest.approx(1.07) and phases == {"a": 10.0, "b": 8.98}
    assert arrival_leads([("a", "i", 10.0)], phases=phases, round_s=r) == [["a", "i", 0.025]]  # early
    assert arrival_leads([("a", "i", 10.0)], phases=phases, round_s=1.0) == [["a", "i", -0.01]]  # misread

def test_the_round_s_leads_are_the_median_of_each_learners_wrapped_offsets():
    """arrival_leads reads every learner's offsets from one sorted list of phases: the same as
    taking, for each, the median of its offsets to all the others the short way round."""
    import random

    from aggregator.quorum import arrival_leads, round_offset

    rng = random.Random(3)
    for _ in range(300):
        n, r = rng.randint(2, 12), rng.uniform(0.5, 5.0)
        phases = {f"l{i}": rng.uniform(0, 40) for i in range(n)}
        merged = rng.sample(sorted(phases), rng.randint(1, n))
        arrivals = [(x, "i", phases[x]) for x in merged]
        got = {x: lead for x, _, lead in arrival_leads(arrivals, digits=9, phases=phases, round_s=r)}
        for x in merged:
            offs = sorted([0.0] + [round_offset(v - phases[x], r) for k, v in phases.items() if k != x])
            m = len(offs)
            want = offs[m // 2] if m % 2 else (offs[m // 2 - 1] + offs[m // 2]) / 2
            assert got[x] == pytest.approx(want, abs=1e-6), (x, phases, r)
