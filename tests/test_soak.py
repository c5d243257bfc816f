"""The soak's fault trace (bench.soak_trace): pure and seeded, no server. The soak itself runs for
minutes: ``python -m bench.soak --quick``."""

import pytest

from bench.soak_trace import CUT, KINDS, MIN_UP, REPAIR, actions, fault_trace, kind_counts, summary


def test_the_trace_is_a_pure_function_of_its_seed():
    a = fault_trace(3, 1800.0, 100, 3)
    assert a == fault_trace(3, 1800.0, 100, 3)
    assert a != fault_trace(4, 1800.0, 100, 3)
    assert [f.at for f in a] == sorted(f.at for f in a)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("duration,kills,learners", [(1800.0, 100, 3), (60.0, 10, 3), (360.0, 25, 4), (60.0, 10, 1)])
def test_counts_per_kind_and_every_instant_inside_the_window(seed, duration, kills, learners):
    trace = fault_trace(seed, duration, kills, learners)
    s = summary(trace)
    assert s["kills"] == kills
    assert min(s["kills_by_kind"].values()) >= max(1, kills // 10)  # every kind, at least its minimum
    assert set(s["kills_by_kind"]) == set(KINDS)
    assert s["partitions"] == max(1, round(kills / 5))
    for f in trace:
        assert 0 <= f.at < f.end < duration
        lo, hi = REPAIR if f.action == "kill" else CUT
        assert lo <= f.repair <= hi
        if f.action == "cut" or f.kind == "learner":
            assert f.target in {f"l{i}" for i in range(learners)}
        else:
            assert f.target == f.kind
    assert all(0 <= t < duration for t, _, _ in actions(trace))


@pytest.mark.parametrize("seed", range(20))
def test_a_target_is_never_killed_while_down_nor_a_link_cut_twice(seed):
    trace = fault_trace(seed, 120.0, 30, 2, partitions=12)
    for action in ("kill", "cut"):
        for target in {f.target for f in trace if f.action == action}:
            mine = [f for f in trace if f.action == action and f.target == target]
            for a, b in zip(mine, mine[1:]):
                assert b.at >= a.end + MIN_UP - 1e-9  # restarted (healed) and up a while first
    # faults of different targets do overlap (the realistic case the runner must handle)
    kills = [f for f in trace if f.action == "kill"]
    assert any(a.target != b.target and b.at < a.end for a, b in zip(kills, kills[1:]))


def test_the_actions_pair_every_fault_with_its_repair():
    trace = fault_trace(0, 60.0, 10, 3)
    acts = actions(trace)
    assert len(acts) == 2 * len(trace)
    assert [t for t, _, _ in acts] == sorted(t for t, _, _ in acts)
    for f in trace:
        back = "start" if f.action == "kill" else "heal"
        assert (f.at, f.action, f.target) in acts and (f.end, back, f.target) in acts


def test_learners_share_kills_and_cuts_evenly():
    trace = fault_trace(5, 1800.0, 100, 3)
    for action in ("kill", "cut"):
        per = [sum(1 for f in trace if f.action == action and f.target == f"l{i}") for i in range(3)]
        assert max(per) - min(per) <= 1 and min(per) >= 1, (action, per)


def test_kill_instants_spread_over_the_window():
    """Exponential up-times scaled to the window: kills are not bunched at its start or end."""
    trace = fault_trace(1, 1800.0, 100, 3)
    at = [f.at for f in trace if f.action == "kill"]
    for q in range(4):
        n = sum(1 for t in at if q * 450 <= t < (q + 1) * 450)
        assert 10 <= n <= 40, (q, n)


def test_kind_minimums_and_weights():
    import random

    c = kind_counts(random.Random(0), 100, 10)
    assert sum(c.values()) == 100 and min(c.values()) >= 10
    # the weights favour learners (three of them) over the monitor and the evaluator, on average
    tot = dict.fromkeys(KINDS, 0)
    for seed in range(200):
        for k, v in kind_counts(random.Random(seed), 100, 10).items():
            tot[k] += v
    assert tot["learner"] > tot["aggregator"] > tot["monitor"]


def test_impossible_traces_are_refused():
    with pytest.raises(ValueError):
        fault_trace(0, 60.0, 4, 3)  # fewer kills than kinds: not every kind could appear
    with pytest.raises(ValueError):
        fault_trace(0, 10.0, 100, 3)  # a hundred kills with their repairs do not fit ten seconds
    with pytest.raises(ValueError):
        fault_trace(0, 60.0, 10, 0)


def test_unchanged_spans_find_a_fragment_whose_versions_stop_moving():
    from bench.soak import unchanged_spans

    # fragment 0 moves every version; fragment 1 repeats one content from t=10 to t=80 (8 versions),
    # then moves again; fragment 2 is stuck at the end since t=50 (heads may arrive out of order)
    heads = [(float(t), 0, v, 1000 + v) for v, t in enumerate(range(0, 100, 10))]
    heads += [(0.0, 1, 0, 7), (10.0, 1, 1, 8)] + [(10.0 + 10 * i, 1, 1 + i, 8) for i in range(1, 8)] + [(90.0, 1, 9, 9)]
    heads += [(50.0 + 10 * i, 2, 5 + i, 3) for i in range(5)][::-1] + [(40.0, 2, 4, 2)]
    u = unchanged_spans(heads, t0=0.0)
    assert u["0"]["unchanged_versions"] == 0 and u["0"]["longest_unchanged_s"] == 0.0
    assert u["1"]["unchanged_versions"] == 7 and u["1"]["longest_unchanged_s"] == 70.0
    assert u["1"]["unchanged_at_end_s"] == 0.0 and u["1"]["unchanged_since_s"] is None
    assert u["2"]["unchanged_versions"] == 4 and u["2"]["unchanged_at_end_s"] == 40.0
    assert u["2"]["unchanged_since_s"] == 50.0
