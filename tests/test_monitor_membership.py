"""Tests of the pure membership core (monitor/membership.py): no server, no clock."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.membership import (
    ALLOWED_EDGES,
    Heartbeat,
    HeartbeatLimits,
    InvalidHeartbeat,
    Member,
    MembershipConfig,
    State,
    Transition,
    count_states,
    forgettable,
    heartbeat_to_dict,
    holds_current,
    is_counted_in_quorum,
    lagging_fragments,
    member_from_dict,
    member_to_dict,
    on_heartbeat,
    on_tick,
    transition_to_dict,
    validate_heartbeat,
)

CFG = MembershipConfig()  # heartbeat 1 s, suspect 3 s, evict 5 s, grace = evict, lag 2
T0 = 1_700_000_000.0


def hb(
    learner: str = "l0",
    incarnation: str = "inc-a",
    versions: dict[int, int] | None = None,
    step: int = 10,
    region: str = "us-east",
    sent_at: float = T0,
) -> Heartbeat:
    return Heartbeat(
        learner=learner,
        region=region,
        incarnation=incarnation,
        step=step,
        tokens_per_s=1000.0,
        versions=versions or {},
        sent_at=sent_at,
    )


def edges(transitions: list[Transition]) -> list[tuple[State | None, State]]:
    return [(t.old, t.new) for t in transitions]


def active_member(now: float = T0, learner: str = "l0") -> dict[str, Member]:
    members, ts = on_heartbeat({}, hb(learner), now, None, CFG)
    assert members[learner].state is State.ACTIVE, ts
    return members


# --------------------------------------------------------------------------- config


def test_config_defaults_match_the_issue():
    assert (CFG.heartbeat_interval, CFG.suspect_after, CFG.evict_after) == (1.0, 3.0, 5.0)
    assert CFG.effective_startup_grace == 5.0
    assert MembershipConfig(startup_grace=12.0).effective_startup_grace == 12.0
    assert MembershipConfig(startup_grace=0).effective_startup_grace == 0.0


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"suspect_after": 5.0, "evict_after": 5.0}, "suspect_after"),
        ({"suspect_after": 6.0, "evict_after": 5.0}, "suspect_after"),
        ({"heartbeat_interval": 0.0}, "heartbeat_interval"),
        ({"heartbeat_interval": -1.0}, "heartbeat_interval"),
        ({"heartbeat_interval": 3.0}, "heartbeat_interval"),
        ({"evict_after": math.nan}, "evict_after"),
        ({"evict_after": math.inf}, "evict_after"),
        ({"suspect_after": True}, "suspect_after"),
        ({"startup_grace": -1.0}, "startup_grace"),
        ({"max_version_lag": -1}, "max_version_lag"),
        ({"max_version_lag": 1.5}, "max_version_lag"),
    ],
)
def test_config_validation_names_the_bad_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        MembershipConfig(**kwargs)


# --------------------------------------------------------------------------- versions


def test_holds_current_with_lag():
    current = {0: 10, 1: 7}
    assert holds_current({0: 10, 1: 7}, current, 0)
    assert holds_current({0: 8, 1: 5}, current, 2)
    assert not holds_current({0: 7, 1: 7}, current, 2)
    assert lagging_fragments({0: 7, 1: 4}, current, 2) == (0, 1)
    assert lagging_fragments({0: 10}, current, 2) == (1,)  # missing fragment is not held
    assert not holds_current({}, {0: 0}, 2)  # ... even when the lag would cover version 0
    assert holds_current({}, None, 0) and holds_current({}, {}, 0)  # no versions yet
    assert holds_current(((0, 10), (1, 7)), current, 0)  # tuple form too


def test_heartbeat_versions_are_canonical_and_hashable():
    a = hb(versions={1: 4, 0: 3})
    assert a.versions == ((0, 3), (1, 4))
    assert a == hb(versions={0: 3, 1: 4})
    hash(a)
    with pytest.raises(ValueError):
        hb(versions={0: -1})


# --------------------------------------------------------------------------- heartbeat paths


def test_new_learner_joins_then_becomes_active_when_no_versions_exist():
    members, ts = on_heartbeat({}, hb(), T0, None, CFG)
    assert edges(ts) == [(None, State.JOINING), (State.JOINING, State.ACTIVE)]
    m = members["l0"]
    assert m.state is State.ACTIVE and m.since == T0 and m.last_seen == T0
    assert m.reason == "no global versions yet"
    assert all(t.at == T0 and t.reason for t in ts)
    assert is_counted_in_quorum(m)


def test_joining_waits_for_current_versions():
    current = {0: 10, 1: 10}
    members, ts = on_heartbeat({}, hb(versions={0: 0, 1: 0}), T0, current, CFG)
    assert edges(ts) == [(None, State.JOINING)]
    assert members["l0"].state is State.JOINING
    assert not is_counted_in_quorum(members["l0"])

    members, ts = on_heartbeat(members, hb(versions={0: 9, 1: 7}), T0 + 1, current, CFG)
    assert ts == [] and members["l0"].state is State.JOINING  # fragment 1 lags by 3 > 2

    members, ts = on_heartbeat(members, hb(versions={0: 9, 1: 8}), T0 + 2, current, CFG)
    assert edges(ts) == [(State.JOINING, State.ACTIVE)]
    assert ts[0].at == T0 + 2 and "current global versions" in ts[0].reason
    assert members["l0"].versions == ((0, 9), (1, 8))
    assert members["l0"].last_seen == T0 + 2


def test_heartbeats_from_an_active_learner_change_nothing_but_liveness():
    members = active_member()
    before = members["l0"]
    members, ts = on_heartbeat(members, hb(step=99, versions={0: 1}), T0 + 1, {0: 50}, CFG)
    assert ts == []
    m = members["l0"]
    assert m.state is State.ACTIVE and m.since == before.since and m.reason == before.reason
    assert m.last_seen == T0 + 1 and m.step == 99  # a lagging active learner is not demoted


def test_inputs_are_not_mutated():
    members = active_member()
    snapshot = dict(members)
    on_heartbeat(members, hb("l1"), T0 + 1, None, CFG)
    on_tick(members, T0 + 100, T0 - 100, CFG)
    assert members == snapshot


# --------------------------------------------------------------------------- tick paths


def test_silence_counts_only_up_to_what_the_monitor_has_read():
    """``heard_until`` (when the intake was last empty): a heartbeat waiting in the monitor's own
    queue is not silence. Counted up to T0 + 2.0 nothing moves at T0 + 9; up to ``now``, evicted."""
    started = T0 - 100
    members, ts = on_tick(active_member(), T0 + 9.0, started, CFG, heard_until=T0 + 2.0)
    assert ts == [] and members["l0"].state is State.ACTIVE
    members, ts = on_tick(active_member(), T0 + 9.0, started, CFG, heard_until=T0 + 3.5)
    assert edges(ts) == [(State.ACTIVE, State.SUSPECT)] and ts[0].at == T0 + 9.0
    members, ts = on_tick(active_member(), T0 + 9.0, started, CFG, heard_until=T0 + 20)  # never past now
    assert edges(ts) == [(State.ACTIVE, State.EVICTED)]


def test_active_becomes_suspect_then_evicted_then_rejoins():
    started = T0 - 100  # monitor long past its startup grace
    members = active_member()

    members, ts = on_tick(members, T0 + 2.9, started, CFG)
    assert ts == [] and members["l0"].state is State.ACTIVE

    members, ts = on_tick(members, T0 + 3.0, started, CFG)
    assert edges(ts) == [(State.ACTIVE, State.SUSPECT)]
    assert ts[0].at == T0 + 3.0 and "no heartbeat for 3.0s" in ts[0].reason
    assert not is_counted_in_quorum(members["l0"])

    members, ts = on_tick(members, T0 + 4.9, started, CFG)
    assert ts == []

    members, ts = on_tick(members, T0 + 5.0, started, CFG)
    assert edges(ts) == [(State.SUSPECT, State.EVICTED)]
    assert "evict_after=5s" in ts[0].reason and members["l0"].since == T0 + 5.0

    members, ts = on_tick(members, T0 + 50, started, CFG)
    assert ts == [] and members["l0"].state is State.EVICTED  # evicted stays evicted

    current = {0: 20}
    members, ts = on_heartbeat(members, hb(versions={0: 3}), T0 + 60, current, CFG)
    assert edges(ts) == [(State.EVICTED, State.REJOINING)]
    assert ts[0].reason == "heartbeat after eviction"

    members, ts = on_heartbeat(members, hb(versions={0: 20}), T0 + 61, current, CFG)
    assert edges(ts) == [(State.REJOINING, State.ACTIVE)]
    assert is_counted_in_quorum(members["l0"])


def test_only_members_evicted_forget_after_ago_are_forgotten():
    started = T0 - 100
    members = {**active_member(), **active_member(learner="l1", now=T0 + 1)}
    members, _ = on_tick(members, T0 + 5.0, started, CFG)  # l0 evicted at T0 + 5; l1 suspect
    assert members["l0"].state is State.EVICTED and members["l1"].state is State.SUSPECT
    assert forgettable(members, T0 + 65.0, 60.0) == ["l0"]
    assert forgettable(members, T0 + 64.9, 60.0) == []  # counted from the eviction, not the silence
    assert forgettable(members, T0 + 1e6, 0.0) == []  # 0: never
    members, _ = on_tick(members, T0 + 9.0, started, CFG)  # l1 evicted at T0 + 9
    assert forgettable(members, T0 + 69.0, 60.0) == ["l0", "l1"]
    # a forgotten learner that comes back is new: it joins again
    del members["l0"]
    members, ts = on_heartbeat(members, hb(), T0 + 70, None, CFG)
    assert edges(ts) == [(None, State.JOINING), (State.JOINING, State.ACTIVE)]


def test_suspect_recovers_when_heartbeats_return_before_eviction():
    started = T0 - 100
    members = active_member()
    members, _ = on_tick(members, T0 + 4, started, CFG)
    assert members["l0"].state is State.SUSPECT
    members, ts = on_heartbeat(members, hb(), T0 + 4.5, {0: 99}, CFG)  # no version check to recover
    assert edges(ts) == [(State.SUSPECT, State.ACTIVE)]
    assert "4.5s of silence" in ts[0].reason
    members, ts = on_tick(members, T0 + 6, started, CFG)  # silence counted from the new heartbeat
    assert ts == [] and members["l0"].state is State.ACTIVE


def test_tick_jumping_past_evict_after_evicts_an_active_learner_directly():
    members = active_member()
    members, ts = on_tick(members, T0 + 30, T0 - 100, CFG)
    assert edges(ts) == [(State.ACTIVE, State.EVICTED)]


def test_silent_joining_and_rejoining_learners_are_evicted_without_suspect():
    started = T0 - 100
    members, _ = on_heartbeat({}, hb("a", versions={0: 0}), T0, {0: 10}, CFG)
    members, _ = on_heartbeat(members, hb("b"), T0, None, CFG)
    members, _ = on_tick(members, T0 + 6, started, CFG)
    members, _ = on_heartbeat(members, hb("b", versions={0: 0}), T0 + 7, {0: 10}, CFG)
    assert (members["a"].state, members["b"].state) == (State.EVICTED, State.REJOINING)
    members, ts = on_tick(members, T0 + 7 + 4, started, CFG)
    assert ts == []  # rejoining never becomes suspect
    members, ts = on_tick(members, T0 + 7 + 5, started, CFG)
    assert edges(ts) == [(State.REJOINING, State.EVICTED)]


def test_tick_transitions_are_sorted_by_learner():
    members: dict[str, Member] = {}
    for name in ("c", "a", "b"):
        members, _ = on_heartbeat(members, hb(name), T0, None, CFG)
    _, ts = on_tick(members, T0 + 10, T0 - 100, CFG)
    assert [t.learner for t in ts] == ["a", "b", "c"]
    assert {t.new for t in ts} == {State.EVICTED}


# --------------------------------------------------------------------------- restarted monitor


def test_restarted_monitor_evicts_nobody_during_startup_grace():
    # The previous monitor stored these members long ago (KV); a new monitor starts at T0+1000.
    members = active_member(T0)
    members, _ = on_heartbeat(members, hb("dead"), T0, None, CFG)
    started = T0 + 1000

    for dt in (0.0, 1.0, 2.9):
        members, ts = on_tick(members, started + dt, started, CFG)
        assert ts == [], dt  # silence is counted from the monitor's start, not from last_seen

    members, ts = on_tick(members, started + 3.0, started, CFG)
    assert {t.new for t in ts} == {State.SUSPECT}  # suspect is allowed, eviction is not

    members, ts = on_heartbeat(members, hb("l0"), started + 3.5, None, CFG)  # l0 is alive
    assert edges(ts) == [(State.SUSPECT, State.ACTIVE)]

    members, ts = on_tick(members, started + 4.99, started, CFG)
    assert ts == []
    members, ts = on_tick(members, started + 5.0, started, CFG)
    assert [(t.learner, t.new) for t in ts] == [("dead", State.EVICTED)]
    assert members["l0"].state is State.ACTIVE


def test_startup_grace_longer_than_evict_after_delays_eviction():
    cfg = MembershipConfig(startup_grace=20.0)
    started = T0
    members = active_member(T0)
    members, ts = on_tick(members, T0 + 19.9, started, cfg)
    assert edges(ts) == [(State.ACTIVE, State.SUSPECT)]
    members, ts = on_tick(members, T0 + 20.0, started, cfg)
    assert edges(ts) == [(State.SUSPECT, State.EVICTED)]


def test_startup_grace_applies_to_members_first_seen_by_this_monitor_too():
    cfg = MembershipConfig(startup_grace=10.0)
    members = active_member(T0 + 1)
    _, ts = on_tick(members, T0 + 7, T0, cfg)
    assert edges(ts) == [(State.ACTIVE, State.SUSPECT)]
    _, ts = on_tick(members, T0 + 10, T0, cfg)
    assert edges(ts) == [(State.ACTIVE, State.EVICTED)]


# --------------------------------------------------------------------------- incarnations


@pytest.mark.parametrize("suspect_first", [False, True])
def test_new_incarnation_of_an_active_or_suspect_learner_rejoins(suspect_first):
    members = active_member()
    if suspect_first:
        members, _ = on_tick(members, T0 + 3.5, T0 - 100, CFG)
        assert members["l0"].state is State.SUSPECT
    old_state = members["l0"].state
    current = {0: 5}
    members, ts = on_heartbeat(members, hb(incarnation="inc-b", versions={}), T0 + 4, current, CFG)
    assert edges(ts) == [(old_state, State.REJOINING)]
    assert "inc-b" in ts[0].reason and "inc-a" in ts[0].reason
    assert members["l0"].incarnation == "inc-b"
    members, ts = on_heartbeat(members, hb(incarnation="inc-b", versions={0: 5}), T0 + 5, current, CFG)
    assert edges(ts) == [(State.REJOINING, State.ACTIVE)]


def test_new_incarnation_already_holding_current_versions_passes_through_rejoining():
    members = active_member()
    members, ts = on_heartbeat(members, hb(incarnation="inc-b"), T0 + 1, None, CFG)
    assert edges(ts) == [(State.ACTIVE, State.REJOINING), (State.REJOINING, State.ACTIVE)]


def test_new_incarnation_after_eviction_is_named_in_the_reason():
    members = active_member()
    members, _ = on_tick(members, T0 + 9, T0 - 100, CFG)
    members, ts = on_heartbeat(members, hb(incarnation="inc-b", versions={}), T0 + 10, {0: 1}, CFG)
    assert edges(ts) == [(State.EVICTED, State.REJOINING)]
    assert "new incarnation inc-b" in ts[0].reason


def test_new_incarnation_while_joining_keeps_joining():
    members, _ = on_heartbeat({}, hb(versions={}), T0, {0: 5}, CFG)
    members, ts = on_heartbeat(members, hb(incarnation="inc-b", versions={}), T0 + 1, {0: 5}, CFG)
    assert ts == [] and members["l0"].state is State.JOINING
    assert members["l0"].incarnation == "inc-b"


def test_clock_stepping_back_never_makes_transition_times_go_backwards():
    members, _ = on_heartbeat({}, hb(versions={}), T0, {0: 5}, CFG)
    members, ts = on_heartbeat(members, hb(versions={0: 5}), T0 - 50, {0: 5}, CFG)
    assert edges(ts) == [(State.JOINING, State.ACTIVE)]
    assert ts[0].at == T0 and members["l0"].last_seen == T0


# --------------------------------------------------------------------------- serialisation


def test_member_round_trips_through_json():
    members, _ = on_heartbeat({}, hb(versions={0: 3, 7: 1}, step=42), T0, {0: 3, 7: 1}, CFG)
    m = members["l0"]
    raw = json.loads(json.dumps(member_to_dict(m)))
    assert raw["state"] == "active" and raw["versions"] == {"0": 3, "7": 1}
    assert member_from_dict(raw) == m


@pytest.mark.parametrize(
    "patch",
    [
        {"state": "zombie"},
        {"last_seen": "yesterday"},
        {"since": None},
        {"versions": {"x": 1}},
        {"step": -1},
        {"schema": 99},
        {"learner": 5},
    ],
)
def test_member_from_dict_rejects_corrupt_values(patch):
    raw = member_to_dict(active_member()["l0"]) | patch
    with pytest.raises(ValueError):
        member_from_dict(raw)


def test_member_from_dict_rejects_missing_fields_and_non_objects():
    raw = member_to_dict(active_member()["l0"])
    del raw["incarnation"]
    with pytest.raises(ValueError, match="incarnation"):
        member_from_dict(raw)
    with pytest.raises(ValueError):
        member_from_dict([1, 2])  # type: ignore[arg-type]


def test_transition_and_count_states_are_json_able():
    members, ts = on_heartbeat({}, hb(), T0, None, CFG)
    d = [transition_to_dict(t) for t in ts]
    assert json.loads(json.dumps(d))[0] == {
        "learner": "l0", "old": None, "new": "joining", "reason": ts[0].reason, "at": T0,
    }
    assert count_states(members) == {
        "joining": 0, "active": 1, "suspect": 0, "evicted": 0, "rejoining": 0, "left": 0,
    }


# --------------------------------------------------------------------------- validate_heartbeat


def raw_hb(**patch):
    d = heartbeat_to_dict(hb(versions={0: 3, 1: 4}, sent_at=T0))
    d.update(patch)
    return d


def test_validate_heartbeat_round_trips():
    raw = json.loads(json.dumps(raw_hb(extra_field="ignored")))
    assert validate_heartbeat(raw, now=T0) == hb(versions={0: 3, 1: 4}, sent_at=T0)


def test_validate_heartbeat_accepts_list_versions_and_int_tokens():
    got = validate_heartbeat(raw_hb(versions=[[1, 4], [0, 3]], tokens_per_s=5), now=T0)
    assert got.versions == ((0, 3), (1, 4)) and got.tokens_per_s == 5.0


@pytest.mark.parametrize(
    "patch, reason",
    [
        ({"learner": ""}, "bad_id"),
        ({"learner": "x" * 65}, "bad_id"),
        ({"learner": "a.b"}, "bad_id"),  # a dot would split the NATS subject
        ({"learner": "a\x1b[2J"}, "bad_id"),
        ({"region": 7}, "bad_id"),
        ({"incarnation": "i" * 129}, "bad_incarnation"),
        ({"incarnation": None}, "bad_incarnation"),
        ({"step": -1}, "bad_step"),
        ({"step": 1.5}, "bad_step"),
        ({"step": True}, "bad_step"),
        ({"step": 2**70}, "bad_step"),
        ({"tokens_per_s": math.nan}, "bad_tokens_per_s"),
        ({"tokens_per_s": -3.0}, "bad_tokens_per_s"),
        ({"tokens_per_s": math.inf}, "bad_tokens_per_s"),
        ({"tokens_per_s": "fast"}, "bad_tokens_per_s"),
        ({"sent_at": math.nan}, "bad_sent_at"),
        ({"sent_at": -1.0}, "bad_sent_at"),
        ({"sent_at": T0 + 31}, "from_future"),
        ({"sent_at": T0 - 301}, "too_old"),
        ({"versions": "v3"}, "bad_versions"),
        ({"versions": {"-1": 3}}, "bad_versions"),
        ({"versions": {"0": -3}}, "bad_versions"),
        ({"versions": {"0": 1.0}}, "bad_versions"),
        ({"versions": {" 1": 1}}, "bad_versions"),
        ({"versions": [[0, 1], [0, 2]]}, "bad_versions"),
        ({"versions": [[0, 1, 2]]}, "bad_versions"),
        ({"versions": {str(i): 0 for i in range(5000)}}, "bad_versions"),
        ({"versions": {"4096": 0}}, "bad_versions"),
    ],
)
def test_validate_heartbeat_rejects_absurd_values(patch, reason):
    with pytest.raises(InvalidHeartbeat) as info:
        validate_heartbeat(raw_hb(**patch), now=T0)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError) and str(info.value).startswith(reason)


@pytest.mark.parametrize("field", ["learner", "region", "incarnation", "step", "tokens_per_s", "versions", "sent_at"])
def test_validate_heartbeat_reports_missing_fields(field):
    raw = raw_hb()
    del raw[field]
    with pytest.raises(InvalidHeartbeat, match=field) as info:
        validate_heartbeat(raw, now=T0)
    assert info.value.reason == "missing_field"


def test_validate_heartbeat_limits_are_configurable():
    validate_heartbeat(raw_hb(sent_at=T0 - 10_000), now=T0, limits=HeartbeatLimits(max_age=None))
    with pytest.raises(InvalidHeartbeat):
        validate_heartbeat(raw_hb(sent_at=T0 + 5), now=T0, limits=HeartbeatLimits(max_clock_skew=1.0))
    with pytest.raises(InvalidHeartbeat):
        validate_heartbeat([1, 2], now=T0)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from(["learner", "region", "incarnation", "step", "tokens_per_s", "versions", "sent_at", "x"]),
        json_values,
    )
    | json_values
)
def test_validate_heartbeat_only_ever_raises_invalid_heartbeat(raw):
    try:
        got = validate_heartbeat(raw, now=T0)
    except InvalidHeartbeat as exc:
        assert exc.reason
    else:
        assert isinstance(got, Heartbeat)


# --------------------------------------------------------------------------- property: state machine

LEARNERS = ["a", "b", "c"]
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("hb"),
            st.sampled_from(LEARNERS),
            st.sampled_from(["i1", "i2"]),
            st.integers(0, 12),  # version held of fragment 0
            st.floats(-2.0, 8.0),  # time step; negative = clock stepped back
        ),
        st.tuples(st.just("tick"), st.floats(-2.0, 8.0)),
        st.tuples(st.just("merge"), st.integers(0, 3)),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops, st.floats(0.0, 20.0), st.sampled_from([None, 0.0, 2.0, 12.0]), st.integers(0, 2))
def test_random_sequences_only_take_allowed_edges(seq, start_offset, grace, lag):
    cfg = MembershipConfig(startup_grace=grace, max_version_lag=lag)
    started = T0
    now = T0 + start_offset
    current: dict[int, int] | None = None
    members: dict[str, Member] = {}
    last_at: dict[str, float] = {}
    for op in seq:
        if op[0] == "merge":
            current = {0: (current or {0: 0})[0] + op[1]}
            continue
        now += op[-1]
        before = members
        if op[0] == "hb":
            _, name, inc, ver, _ = op
            members, ts = on_heartbeat(members, hb(name, inc, versions={0: ver}), now, current, cfg)
            assert all(t.learner == name for t in ts)
        else:
            members, ts = on_tick(members, now, started, cfg)
            # a tick evicts nobody during the startup grace, and leaves no overdue member behind
            if now < started + cfg.effective_startup_grace:
                assert all(t.new is not State.EVICTED for t in ts)
            else:
                for m in members.values():
                    if m.state is not State.EVICTED:
                        assert now - max(m.last_seen, started) < cfg.evict_after
            for m in members.values():
                if m.state is State.ACTIVE:
                    assert now - max(m.last_seen, started) < cfg.suspect_after
        # every transition is an allowed edge, chains from the previous state, and never goes
        # back in time for its learner
        state = {k: m.state for k, m in before.items()}
        for t in ts:
            assert (t.old, t.new) in ALLOWED_EDGES
            assert t.old == state.get(t.learner)
            assert t.reason
            assert t.at >= last_at.get(t.learner, -math.inf)
            state[t.learner] = t.new
            last_at[t.learner] = t.at
        # members agree with the transitions; untouched members are unchanged
        for name, m in members.items():
            assert m.state is state[name]
            if name in last_at:
                assert m.since == last_at[name]
            if not any(t.learner == name for t in ts) and name in before:
                assert m.state is before[name].state and m.since == before[name].since
        # and survive the KV round trip
        for m in members.values():
            assert member_from_dict(json.loads(json.dumps(member_to_dict(m)))) == m



# -- leaving: a learner that is done is not a failure ------------------------------------------------


def test_a_leaving_heartbeat_makes_a_member_left_and_silence_then_evicts_nobody():
    from dataclasses import replace

    members, _ = on_heartbeat({}, hb(versions={0: 1}), T0, {0: 1}, CFG)
    assert members["l0"].state is State.ACTIVE
    members, ts = on_heartbeat(members, replace(hb(versions={0: 1}, step=400), leaving=True), T0 + 1, {0: 1}, CFG)
    assert members["l0"].state is State.LEFT and edges(ts) == [(State.ACTIVE, State.LEFT)]
    assert "left at step 400" in ts[0].reason
    again, ts = on_heartbeat(members, replace(hb(versions={0: 1}), leaving=True), T0 + 1.5, {0: 1}, CFG)
    assert again["l0"].state is State.LEFT and ts == []  # the leaving heartbeat twice: nothing new
    later, ts = on_tick(members, T0 + 1000, T0 - 100, CFG)
    assert later["l0"].state is State.LEFT and ts == []  # silent on purpose: never suspect or evicted
    assert forgettable(later, T0 + 1000, 600.0) == ["l0"]
    back, ts = on_heartbeat(later, hb(incarnation="inc-b", versions={0: 1}), T0 + 1001, {0: 1}, CFG)
    assert edges(ts) == [(State.LEFT, State.REJOINING), (State.REJOINING, State.ACTIVE)]
    assert all(edge in ALLOWED_EDGES for edge in edges(ts))


def test_a_first_heartbeat_that_leaves_joins_and_leaves():
    from dataclasses import replace

    members, ts = on_heartbeat({}, replace(hb(), leaving=True), T0, None, CFG)
    assert members["l0"].state is State.LEFT
    assert edges(ts) == [(None, State.JOINING), (State.JOINING, State.LEFT)]


def test_leaving_goes_on_the_wire_and_is_validated():
    from dataclasses import replace

    raw = heartbeat_to_dict(replace(hb(sent_at=T0), leaving=True))
    assert raw["leaving"] is True and validate_heartbeat(raw, now=T0).leaving
    assert "leaving" not in heartbeat_to_dict(hb(sent_at=T0))
    assert validate_heartbeat(heartbeat_to_dict(hb(sent_at=T0)), now=T0).leaving is False
    with pytest.raises(InvalidHeartbeat) as e:
        validate_heartbeat(raw_hb(leaving="yes"), now=T0)
    assert e.value.reason == "bad_leaving"
