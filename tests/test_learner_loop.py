"""Pure bookkeeping of the learner (learner.loop): schedule, counters, versions, decisions."""

import math

import numpy as np
import pytest

from learner.spec import make_plan
from learner import loop as lp
from bus.fragments import gather_all
from learner.spec import ModelSpec, count_params, init_params

SPEC = ModelSpec(d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=32)


def test_derive_shard_from_trailing_number_hash_or_config():
    assert [lp.derive_shard(f"learner-{i}", 4) for i in range(6)] == [0, 1, 2, 3, 0, 1]
    assert lp.derive_shard("eu-12", 8) == 4
    assert lp.derive_shard("anything", 3, configured=5) == 2
    h = lp.derive_shard("alpha", 7)
    assert 0 <= h < 7 and h == lp.derive_shard("alpha", 7)  # deterministic
    with pytest.raises(ValueError):
        lp.derive_shard("x", 0)


def test_batch_seed_differs_per_incarnation_and_learner():
    a = lp.batch_seed(0, "l0", "inc1")
    assert a == lp.batch_seed(0, "l0", "inc1")
    assert len({a, lp.batch_seed(0, "l0", "inc2"), lp.batch_seed(0, "l1", "inc1"), lp.batch_seed(1, "l0", "inc1")}) == 4
    assert 0 <= a < 2**31


def test_a_resuming_learner_samples_by_its_id_alone_and_one_starting_over_by_its_incarnation():
    assert lp.sampler_seed(0, "l0", "inc1", resume=True) == lp.sampler_seed(0, "l0", "inc2", resume=True)
    assert lp.sampler_seed(0, "l0", "inc1", resume=True) != lp.sampler_seed(0, "l1", "inc1", resume=True)
    assert lp.sampler_seed(0, "l0", "inc1", resume=False) != lp.sampler_seed(0, "l0", "inc2", resume=False)


def test_a_resumed_bookkeeper_continues_the_step_the_tokens_and_the_phase_of_the_schedule():
    fresh = lp.Bookkeeper(num_fragments=4, H=8, tokens_per_step=10)
    due_fresh = {s: fresh.on_step() for s in range(1, 41)}
    for start in (16, 13, 1):
        resumed = lp.Bookkeeper(num_fragments=4, H=8, tokens_per_step=10, start_step=start)
        assert (resumed.step, resumed.tokens, resumed.sent_step) == (start, 10 * start, start)
        due = {}
        while resumed.step < 40:
            fragments = resumed.on_step()
            due[resumed.step] = fragments
        assert due == {s: due_fresh[s] for s in range(start + 1, 41)}  # the same syncs on the same steps


def test_sent_step_is_the_step_of_the_newest_outer_gradient_published():
    b = lp.Bookkeeper(num_fragments=2, H=4, tokens_per_step=1, window=0)
    sent = []
    for _ in range(4):
        for p in b.on_step():
            sent.append((b.step, b.begin_sync(p)))
    (s1, c1), (s2, c2) = sent[:2]
    b.end_sync(c2, ok=False)  # a failed publish does not count
    assert b.sent_step == 0
    b.end_sync(c1, ok=True)
    assert b.sent_step == s1
    with pytest.raises(ValueError):
        lp.Bookkeeper(1, H=1, tokens_per_step=1, start_step=-1)


def test_schedule_counters_and_rounds():
    b = lp.Bookkeeper(num_fragments=4, H=4, tokens_per_step=10)
    for p in range(4):
        b.on_merged(p, 0)
    assert b.offsets == (0, 1, 2, 3)
    due = [b.on_step(0.5) for _ in range(8)]
    # step t: fragment p due when (t - p) % 4 == 0
    assert due == [[1], [2], [3], [0], [1], [2], [3], [0]]
    assert b.step == 8 and b.tokens == 80 and b.step_seconds_total == pytest.approx(4.0)
    c = b.begin_sync(0)
    assert c == lp.Contribution(fragment=0, round=0, base_version=0, steps=8, tokens=80, period=4, seconds=4.0)
    assert b.frags[0].steps == 0 and b.frags[0].inflight
    b.end_sync(c, ok=True)
    assert b.contributions == 1 and b.steps_sent == 8 and b.frags[0].next_round == 1 and not b.frags[0].inflight
    b.on_step()
    c2 = b.begin_sync(0)
    assert (c2.round, c2.steps, c2.tokens) == (1, 1, 10)


def test_unstaggered_schedule_syncs_every_fragment_together():
    b = lp.Bookkeeper(num_fragments=3, H=2, tokens_per_step=1, staggered=False)
    assert b.offsets == (0, 0, 0)
    assert [b.on_step() for _ in range(4)] == [[], [0, 1, 2], [], [0, 1, 2]]


def test_busy_fragment_is_skipped_and_failed_publish_returns_counters():
    b = lp.Bookkeeper(2, H=1, tokens_per_step=5)
    b.on_merged(0, 3)
    b.on_step()
    c = b.begin_sync(0)
    b.on_step()
    assert b.begin_sync(0) is None  # still in flight: skip, counters keep running
    assert b.frags[0].skipped == 1 and b.frags[0].steps == 1
    assert b.inflight() == [0]
    b.end_sync(c, ok=False)  # failed: its work is still in theta, give the counters back
    assert b.frags[0].steps == 2 and b.frags[0].tokens == 10 and b.frags[0].failed == 1
    c3 = b.begin_sync(0)
    assert (c3.round, c3.steps, c3.base_version) == (1, 2, 3)  # round numbers are never reused
    assert b.counters() == {"sent": 0, "skipped": 1, "deferred": 0, "valve": 0, "holds": 0, "holds_expired": 0, "failed": 1}


def test_a_contribution_carries_the_seconds_of_its_steps_and_a_failed_one_gives_them_back():
    """The pace a contribution reports (step_s, the aggregator's on-time quorum): its inner steps'
    own seconds, from the last sync of its fragment."""
    b = lp.Bookkeeper(2, H=2, tokens_per_step=1, staggered=False)
    assert b.on_step(0.5) == [] and b.on_step(1.5) == [0, 1]
    c = b.begin_sync(0)
    assert (c.steps, c.seconds, c.step_s) == (2, 2.0, 1.0)
    assert b.frags[0].seconds == 0.0 and b.frags[1].seconds == 2.0
    b.on_step(-3.0)  # a clock step back is no time, not negative time
    b.end_sync(c, ok=False)
    c2 = b.begin_sync(0)
    assert (c2.steps, c2.seconds) == (3, 2.0)
    assert lp.Contribution(0, 0, 0, 0, 0).step_s == 0.0


def test_versions_wants_merge_staleness():
    b = lp.Bookkeeper(2, H=2, tokens_per_step=1)
    b.on_merged(0, 5)
    b.on_merged(1, 5)
    assert b.versions() == {0: 5, 1: 5}
    assert not b.wants(0, 5) and b.wants(0, 6)
    b.on_downloaded(0, 7)
    assert not b.wants(0, 6) and not b.wants(0, 7) and b.wants(0, 8)  # 7 queued already
    b.on_step()
    c = b.begin_sync(0)
    b.end_sync(c, ok=True)
    assert b.staleness() == 2  # known 7, contribution based on 5
    b.on_merged(0, 7)
    assert b.versions()[0] == 7 and b.frags[0].pending_version == -1
    b.on_head(0, 9)
    assert b.staleness() == 4 and b.wants(0, 9)


def test_resync_overwrites_versions_and_drops_counters():
    b = lp.Bookkeeper(3, H=3, tokens_per_step=2)
    for p in range(3):
        b.on_merged(p, 1)
    for _ in range(2):
        b.on_step()
    b.on_downloaded(2, 4)
    b.on_resync({0: 6, 1: 6, 2: 3})
    assert b.resyncs == 1 and b.versions() == {0: 6, 1: 6, 2: 3}
    assert all(f.steps == 0 and f.tokens == 0 for f in b.frags)
    assert b.frags[2].pending_version == 4 and not b.wants(2, 4) and b.wants(2, 5)  # newer queued version kept


def test_sync_decisions_and_applied_list():
    meta = {"applied": [["l0", "abc", 3], ["l1", "x", 0], ["l0", "abc", 5], ["l0", "old", 4], ["l0", "abc", True],
                        "junk", ["l0", "abc"], ["l0", "abc", 2, 7], ["l0", "abc", 1, 8]]}
    # short form [learner, inc, round]; long form [learner, inc, fragment, round] (aggregator's key)
    assert lp.applied_rounds(meta, "l0", "abc", 2) == [3, 5, 7]
    assert lp.applied_rounds(meta, "l0", "abc", 1) == [3, 5, 8]
    assert lp.applied_rounds(meta, "l0", "zzz", 2) == []
    assert lp.applied_rounds({}, "l0", "abc", 0) == [] and lp.applied_rounds({"applied": "no"}, "l0", "a", 0) == []
    assert not lp.sync_satisfied(None, 10)
    assert not lp.sync_satisfied(5, 4) and lp.sync_satisfied(5, 5) and lp.sync_satisfied(5, 6)


def test_a_head_states_the_highest_round_merged_so_far():
    """``merged_upto``: the ``merged`` list of a head (every learner's highest round merged into it
    or earlier); and a learner that missed the head listing its round opens its window from a later
    one (before, it waited for the valve, 16 periods, and never held)."""
    meta = {"merged": [["l1", "x", 9], "junk", ["l0", "old", 4], ["l0", "abc", True], ["l0", "abc", 5]]}
    assert lp.merged_upto(meta, "l0", "abc") == 5 and lp.merged_upto(meta, "l1", "x") == 9
    assert lp.merged_upto(meta, "l0", "zzz") is None and lp.merged_upto({}, "l0", "abc") is None
    assert lp.merged_upto({"merged": "no"}, "l0", "abc") is None
    b = lp.Bookkeeper(num_fragments=1, H=2, tokens_per_step=1, window=1, hold=1)
    b.on_merged(0, 10)
    b.on_step(), b.on_step()
    _sync(b, 0)  # round 0
    b.on_step(), b.on_step()
    assert b.deferred() == [0]
    # version 11 merged round 0 (its head was missed); version 12's head states it
    b.on_applied(0, [*lp.applied_rounds({"applied": []}, "l0", "abc", 0), 0], 12)
    assert b.merged_any() and b.fetch_due(0, 12, delay=1)
    b.on_downloaded(0, 12)
    b.on_merged(0, 12)
    assert b.on_step() == [0] and b.deferred() == []  # the window opened, no valve


def test_should_resync_only_for_this_incarnation_when_evicted():
    assert lp.should_resync("evicted", "me", "me")
    assert not lp.should_resync("evicted", "old-life", "me")
    for s in ("joining", "active", "suspect", "rejoining"):
        assert not lp.should_resync(s, "me", "me")


def test_synthetic_step_is_deterministic_descent():
    sizes = [100, 57]
    frags = [np.full(n, 0.5, np.float32) for n in sizes]
    dirs = lp.synthetic_directions(sizes, seed=3)
    again = lp.synthetic_directions(sizes, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(dirs, again))
    loss0 = lp.synthetic_step(frags, dirs, lr=0.1, scales=[0.0, 0.0])
    assert loss0 == pytest.approx(0.5 * 0.25)
    assert np.allclose(frags[0], 0.45)  # pure pull toward zero with zero noise scale
    before = [f.copy() for f in frags]
    lp.synthetic_step(frags, dirs, lr=0.1, scales=[1.0, -2.0])
    expect = (1 - 0.1) * before[1] - 0.1 * lp.SYNTHETIC_NOISE * -2.0 * dirs[1]
    assert np.allclose(frags[1], expect, atol=1e-6)
    losses = [lp.synthetic_step(frags, dirs, 0.1, [0.1, 0.1]) for _ in range(50)]
    assert losses[-1] < losses[0]


def test_params_from_fragments_round_trips_the_plan():
    plan = make_plan(SPEC, 4, 1.1)
    params = init_params(SPEC, 0)
    vectors = gather_all(plan, params)
    rebuilt = lp.params_from_fragments(plan, vectors)
    assert set(rebuilt) == set(params)
    assert all(np.array_equal(rebuilt[k], params[k]) for k in params)
    new = np.arange(plan.sizes[2], dtype=np.float32)
    lp.write_fragment(plan, rebuilt, 2, new)
    assert np.array_equal(gather_all(plan, rebuilt)[2], new)
    assert np.array_equal(gather_all(plan, rebuilt)[1], vectors[1])
    assert set(lp.fragment_paths(plan, 2)) == {s.path for s in plan.fragments[2].slices}
    with pytest.raises(ValueError):
        lp.write_fragment(plan, rebuilt, 2, new[:-1])


def test_extra_sleep_rate_meter_and_memory_formula():
    assert lp.extra_sleep(0.2, 1.0) == 0.0 and lp.extra_sleep(0.2, 3.0) == pytest.approx(0.4)
    # a floor keeps one pace: a step the machine slowed waits less, none is stretched with its noise
    assert [round(m + lp.extra_sleep(m, 1.0, 0.13), 9) for m in (0.01, 0.02, 0.05)] == [0.13] * 3
    assert lp.extra_sleep(0.2, 1.0, 0.13) == 0.0  # longer than the floor: not waited
    assert lp.extra_sleep(0.02, 6.0, 0.05) == pytest.approx(0.1)  # both: the longer of the two
    assert lp.extra_sleep(0.01, 6.0, 0.13) == pytest.approx(0.12)
    m = lp.RateMeter(window=10.0)
    assert m.rate(0.0) == 0.0
    for i in range(11):
        m.add(float(i), 100)
    assert m.rate(10.0) == pytest.approx(100.0)
    assert m.rate(100.0) == 0.0  # everything is older than the window
    n = count_params(SPEC)
    plan = make_plan(SPEC, 4, 1.1)
    mem = lp.memory_bytes(n, plan.sizes, error_feedback=True)
    assert mem["params"] == 4 * n and mem["optimizer"] == 8 * n and mem["base"] == 4 * n
    assert mem["residual"] == 4 * n and mem["inflight"] == 2 * 4 * max(plan.sizes)
    assert mem["total"] == 4 * n * 5 + mem["inflight"] and mem["keyframes"] == 0
    assert lp.memory_bytes(n, plan.sizes, error_feedback=False)["residual"] == 0
    # a bfloat16 residual: 2 bytes a value, and the float32 scratch of the largest fragment
    half = lp.memory_bytes(n, plan.sizes, error_feedback=True, residual_dtype="bfloat16")
    assert half["residual"] == 2 * n + 4 * max(plan.sizes) and half["total"] == mem["total"] - 2 * n + 4 * max(plan.sizes)
    assert lp.memory_bytes(n, plan.sizes, error_feedback=True, residual_dtype="bfloat16", scratch=False)["residual"] == 2 * n
    # a quantised downlink: the reader's keyframes (up to one per fragment, N in all) count too
    with_keys = lp.memory_bytes(n, plan.sizes, error_feedback=True, keyframe_params=n)
    assert with_keys["keyframes"] == 4 * n and with_keys["total"] == mem["total"] + 4 * n
    assert lp.rss_mib(2048) == 2.0


def test_fetch_round_waits_for_the_version_holding_its_own_round_until_the_next_sync():
    """A learner ahead of the others: at the delay the newest version is the merge before its
    round's; it waits for its round's merge (issue 24), and takes the newest anyway one step before
    its next sync (its round rejected, or the merges a round behind)."""
    b = lp.Bookkeeper(1, H=8, tokens_per_step=1)
    b.on_merged(0, 4)
    for _ in range(8):
        b.on_step()
    c = b.begin_sync(0)
    b.end_sync(c, ok=True)
    b.on_applied(0, [c.round - 1] if c.round else [], 5)  # an older round of ours in version 5
    for _ in range(2):
        b.on_step()
    assert not b.fetch_due(0, 5, delay=2)  # version 5 does not hold the round just sent
    b.on_applied(0, [], 6)  # another learner's merge: nothing of ours
    b.on_applied(0, [c.round], 7)
    assert not b.fetch_due(0, 6, delay=2) and b.fetch_due(0, 7, delay=2)
    # a round nobody merges: taken anyway at the step before the next sync
    b.on_downloaded(0, 7)
    b.on_merged(0, 7)
    for _ in range(8 - 2):
        b.on_step()
    c = b.begin_sync(0)
    assert c is not None
    for _ in range(6):
        b.on_step()
        assert not b.fetch_due(0, 9, delay=2)
    b.on_step()  # 7 = H - 1 steps since the sync
    assert b.fetch_due(0, 9, delay=2)


def test_fetch_round_once_per_sync_after_the_delay():
    b = lp.Bookkeeper(2, H=8, tokens_per_step=1)
    b.on_merged(0, 0)
    b.on_merged(1, 0)
    for _ in range(8):
        b.on_step()
    assert not b.fetch_due(0, 3, delay=0)  # no sync of fragment 0 yet: nothing is due
    c = b.begin_sync(0)
    assert c is not None and b.frags[0].armed and not b.frags[1].armed
    assert not b.fetch_due(0, 1, delay=0)  # armed, but no version holds our round yet
    b.on_applied(0, [c.round], 1)
    assert b.fetch_due(0, 1, delay=0)
    assert not b.fetch_due(0, 1, delay=2)  # armed, but the delay has not passed
    b.on_step()
    b.on_step()
    assert b.fetch_due(0, 1, delay=2)
    assert not b.fetch_due(0, 0, delay=2)  # not newer than the base
    b.on_downloaded(0, 2)
    # one download per round: disarmed until the next sync
    assert not b.frags[0].armed and not b.fetch_due(0, 5, delay=0)
    b.end_sync(c, ok=True)
    b.on_merged(0, 2)
    assert not b.fetch_due(0, 5, delay=0)
    c2 = b.begin_sync(0)
    b.on_applied(0, [c2.round], 5)
    assert b.fetch_due(0, 5, delay=0) and not b.fetch_due(0, 2, delay=0)
    b.on_resync({0: 6, 1: 6})
    assert not b.frags[0].armed


def test_unsent_fragments_are_those_with_steps_since_their_sync():
    b = lp.Bookkeeper(4, H=4, tokens_per_step=2)
    assert b.unsent_fragments() == []
    for _ in range(6):
        for p in b.on_step():
            b.end_sync(b.begin_sync(p), ok=True)
    # offsets 0,1,2,3 (p=0 at 4): synced at steps 4 (p0), 1 and 5 (p1), 2 and 6 (p2), 3 (p3)
    assert b.unsent_fragments() == [0, 1, 3]
    assert [b.frags[p].steps for p in range(4)] == [2, 1, 0, 3]


# -- Dynamic Local Updates -------------------------------------------------------------------------


@pytest.mark.parametrize("P,H", [(1, 1), (3, 4), (8, 24), (5, 7), (24, 24), (30, 24)])
def test_schedule_with_a_constant_period_is_the_staggered_modular_one(P, H):
    from bus.fragments import due_fragments, sync_offsets

    b = lp.Bookkeeper(P, H=H, tokens_per_step=1)
    for step in range(1, 5 * H + 3):
        assert b.on_step() == due_fragments(step, sync_offsets(P, H), H), step


def test_set_period_keeps_each_fragment_in_phase():
    b = lp.Bookkeeper(4, H=24, tokens_per_step=1)
    due_at = {}
    for step in range(1, 31):
        for p in b.on_step():
            due_at.setdefault(p, []).append(step)
    assert due_at == {0: [24], 1: [6, 30], 2: [12], 3: [18]}
    assert b.set_period(12) and not b.set_period(12)
    seen = {p: [] for p in range(4)}
    for step in range(31, 31 + 48):
        for p in b.on_step():
            seen[p].append(step)
    # every fragment every 12 steps from now on, still spread over the period
    assert all(len(s) == 4 and all(b_ - a == 12 for a, b_ in zip(s, s[1:])) for s in seen.values()), seen
    assert len({s[0] % 12 for s in seen.values()}) == 4
    # back to a longer period: each fragment's next sync moves out proportionally
    b.set_period(24)
    firsts = []
    for step in range(79, 79 + 24):
        firsts += b.on_step()
    assert sorted(firsts) == [0, 1, 2, 3]


def test_period_changes_keep_the_fragments_spread_over_the_period():
    """Dynamic Local Updates change a learner's period now and then. Each change once scaled every
    fragment's steps left on its own, and the rounding put two on one step now and then for good:
    60 changes among 10, 11 and 12 put 8 fragments on 3 steps."""
    import random

    rng = random.Random(0)
    b = lp.Bookkeeper(8, 12, 1)
    last = {p: 0 for p in range(8)}
    for _ in range(60):
        for _ in range(rng.randint(1, 7)):
            for p in b.on_step():
                assert b.step - last[p] <= 2 * 12, (p, b.step, last[p])  # never a sync skipped
                last[p] = b.step
        b.set_period(rng.choice([10, 11, 12, 10.4, 11.7]))
        left = sorted(math.ceil(n) - b.step for n in b._next_due)  # steps to each one's next sync
        assert len(set(left)) == 8 and 1 <= left[0] and left[-1] <= math.ceil(b.period), left  # spread, within a period


def test_a_real_period_gives_rounds_of_floor_and_ceil_steps_that_average_it():
    b = lp.Bookkeeper(8, 12, 1)
    assert b.set_period(10.5) and b.declared_period == 10
    last: dict[int, list[int]] = {p: [] for p in range(8)}
    for _ in range(21 * 20):
        for p in b.on_step():
            last[p].append(b.step)
    for p, at in last.items():
        lengths = [y - x for x, y in zip(at, at[1:])]
        assert set(lengths) == {10, 11} and abs(sum(lengths) / len(lengths) - 10.5) < 0.06, (p, lengths)


def test_dynamic_periods_keep_the_rounds_of_unequal_learners_in_phase():
    """Learners at 1 and 1.42 step times (M=8's fastest and slowest with the speed spread). Rounded
    down to whole steps, the slow one's period (8) made its rounds 11.36 step times against 12, and
    it ran ahead a round every 17; a real period keeps their rounds in phase."""
    H, slow = 12, 1.42

    def rounds_by(t_end: float, period: float, step_time: float) -> int:
        b = lp.Bookkeeper(8, H, 1)
        b.set_period(period)
        n = 0
        while (b.step + 1) * step_time <= t_end:
            n += 0 in b.on_step()
        return n

    fast = rounds_by(50 * H, H, 1.0)
    exact = lp.dynamic_period(H, 1 / slow, [1.0])
    assert fast == 50 and abs(rounds_by(50 * H, exact, slow) - fast) <= 1
    assert rounds_by(50 * H, math.floor(exact), slow) - fast >= 2  # the whole-step period drifts


def test_dynamic_period_is_the_pace_ratio_times_H():
    assert lp.dynamic_period(24, 100.0, [100.0, 200.0]) == 12
    assert lp.dynamic_period(24, 200.0, [100.0, 200.0]) == 24  # the fastest keeps H
    assert lp.dynamic_period(24, 300.0, [100.0]) == 24  # never above H
    assert lp.dynamic_period(24, 1.0, [1000.0]) == 6  # never below H / 4: a forged pace at most quadruples the syncs
    assert lp.dynamic_period(2, 1.0, [1000.0]) == 1 and lp.dynamic_period(1, 1.0, [1000.0]) == 1  # nor below 1
    assert lp.dynamic_period(24, 0.0, [100.0]) == 24  # own rate unknown yet: H
    assert lp.dynamic_period(24, 0.0, [100.0], current=10) == 10
    assert lp.dynamic_period(24, 100.0, [float("nan"), 0.0, -5.0]) == 24  # bad peer rates ignored
    assert lp.dynamic_period(24, 100.0, [210.0]) == pytest.approx(24 * 100 / 210)  # not rounded down (11)
    assert lp.dynamic_period(24, 100.0, [300.0], current=12) == 8


def test_dynamic_period_keeps_the_period_through_pace_noise_within_the_hysteresis():
    """A learner about 1.33x slower than the fastest at H=12: its period moves to 9 once, then
    stays while its pace wanders within 1% of that; a real change still moves it."""
    period, changes = 12.0, 0
    for exact in (9.0, 9.05, 8.95, 9.08, 8.92, 9.02, 8.98):
        new = lp.dynamic_period(12, exact, [12.0], current=period)
        changes += new != period
        period = new
    assert (period, changes) == (9.0, 1)
    assert lp.dynamic_period(12, 8.8, [12.0], current=9.0) == pytest.approx(8.8)
    assert lp.dynamic_period(2, 1.0, [2.0], current=2) == 1  # and a half-speed learner at H=2


def test_pace_leaves_out_the_waits_between_steps_that_the_rate_counts():
    """A learner held for the aggregator half of the time keeps its pace; its rate halves. The
    periods of Dynamic Local Updates are set from paces: set from rates, a hold shortened the period,
    which brought the next hold sooner, which lowered the rate again."""
    rate, pace = lp.RateMeter(window=10.0), lp.PaceMeter(window=2.0)
    t = 0.0
    for i in range(40):
        t += 0.1  # an inner step of 0.1 s: 1000 tokens/s
        rate.add(t, 100)
        pace.add(t, 100, 0.1)
        if i % 2:
            t += 0.2  # held: a step's time and more between steps
    assert pace.pace(t) == pytest.approx(1000.0)
    assert rate.rate(t) < 0.55 * pace.pace(t)
    pace.add(t, 100, 0.0)  # a step of no measurable time (or a clock gone back) adds nothing
    pace.add(t, 100, float("nan"))
    assert lp.PaceMeter().pace(0.0) == 0.0 and pace.pace(t) == pytest.approx(1000.0)
    # held longer than the window: the pace the learner had, not 0 (its peers would drop it)
    assert pace.pace(t + 100.0) == pytest.approx(1000.0) and rate.rate(t + 100.0) == 0.0


def test_the_pace_is_known_a_window_after_the_first_step_and_leaves_that_step_out():
    """The first step compiles the step function (seconds, not milliseconds), and learners starting
    together share the machine with each other's compilations for a while: the first window's paces
    moved every learner's period at M=4 on two cores (docs/BENCHMARKS.md, eighteenth round)."""
    pace = lp.PaceMeter(window=1.0)
    pace.add(1.0, 100, 5.0)  # the compiling step
    for i in range(20):
        pace.add(1.1 + 0.1 * i, 100, 0.1)
    assert pace.pace(2.0) == 0.0  # 0.9 s after the first step counted: not known yet
    assert pace.pace(3.0) == pytest.approx(1000.0)
    assert lp.PaceMeter(skip=0).pace(0.0) == 0.0


def test_a_peers_pace_is_read_from_its_member_record_and_an_older_learners_rate_stands_in():
    assert lp.peer_speed({"state": "active", "pace": 900.0, "tokens_per_s": 300.0}) == (900.0, True)
    # a monitor of an older version: no pace, its rate (the caller then compares its own rate)
    assert lp.peer_speed({"state": "active", "tokens_per_s": 300.0}) == (300.0, False)
    # a pace not known yet (its first window), or a learner of an older version: left out
    assert lp.peer_speed({"state": "active", "pace": 0.0, "tokens_per_s": 300.0}) == (0.0, False)
    for rec in ({"state": "suspect", "pace": 900.0}, {"state": "active", "pace": float("nan")},
                {"state": "active", "pace": True}, {"state": "active", "pace": "fast"}, {}):
        assert lp.peer_speed(rec) == (0.0, False), rec


def test_dynamic_local_updates_are_on_by_default_and_left_out_in_sync_mode():
    from bus.config import from_env
    from learner.config import LearnerConfig

    assert from_env(LearnerConfig, {}).follows_pace
    assert from_env(LearnerConfig, {"DILOCO_MODE": "synthetic"}).follows_pace
    assert not from_env(LearnerConfig, {"DILOCO_MODE": "sync"}).follows_pace  # synchronous rounds stay in phase
    assert not from_env(LearnerConfig, {"DILOCO_DYNAMIC_H": "false"}).follows_pace
    assert from_env(LearnerConfig, {"DILOCO_DYNAMIC_H": "true"}).fetch_delay_for(12) == 1


def test_fetch_delay_default_is_one_step_and_minus_one_is_a_quarter_period():
    """The download of a fragment's merged round may start one step after the sync (fourteenth
    round: H/4 cost 0.7-1.5% at M=8 in the reference); -1 keeps the old H/4, at least 1."""
    from bus.config import from_env
    from learner.config import LearnerConfig

    assert from_env(LearnerConfig, {}).fetch_delay_for(12) == 1
    old = from_env(LearnerConfig, {"DILOCO_FETCH_DELAY": "-1"})
    assert [old.fetch_delay_for(h) for h in (2, 12, 24)] == [1, 3, 6]
    assert from_env(LearnerConfig, {"DILOCO_FETCH_DELAY": "0"}).fetch_delay_for(12) == 0


def _sync(b: lp.Bookkeeper, p: int) -> lp.Contribution:
    c = b.begin_sync(p)
    assert c is not None
    b.end_sync(c, True)
    return c


def test_sync_window_defers_until_the_round_is_merged_into_the_base():
    """Issue 37: a learner never sends round r+1 of a fragment before round r is merged into its
    base, so its staleness is bounded however slow the aggregator is; the steps of the deferred sync
    go out with it (nothing lost), a period is counted from the deferred sync, and the fetch waits
    for exactly the version that holds the round."""
    b = lp.Bookkeeper(num_fragments=1, H=4, tokens_per_step=10, window=1)
    b.on_merged(0, 0)
    assert [b.on_step() for _ in range(4)] == [[], [], [], [0]]
    c0 = _sync(b, 0)
    assert c0.round == 0 and c0.steps == 4
    # the aggregator is slow: round 0 not merged at the next due step -> deferred, not sent
    assert [b.on_step() for _ in range(4)] == [[], [], [], []]
    assert b.deferred() == [0] and b.deferrals == 1 and b.counters()["deferred"] == 1
    # a newer version that does not hold our round is not fetched while deferred ...
    assert not b.fetch_due(0, 1, delay=1)
    # ... the one that does is
    b.on_applied(0, [0], 2)
    assert b.fetch_due(0, 2, delay=1)
    assert b.on_step() == []  # merged, but not yet in the base: still deferred
    b.on_downloaded(0, 2)
    b.on_merged(0, 2)
    assert b.on_step() == [0]  # the next step boundary sends it
    c1 = _sync(b, 0)
    assert c1.round == 1 and c1.steps == 6 and c1.base_version == 2  # the deferred steps went with it
    assert b.deferred() == []
    # the next sync is a whole period later
    b.on_applied(0, [1], 3)
    b.on_merged(0, 3)
    assert [b.on_step() for _ in range(4)] == [[], [], [], [0]]


def test_a_period_change_brings_a_deferred_fragment_back_in_phase_but_not_at_once():
    """A deferred sync goes out off the phase (a whole period is counted from it). A period change
    puts the fragment back at its place in the phase, unless that is less than half a period after
    the sync that just went out (an outer gradient of a step or two: a whole upload for no work)."""
    def deferred_by(extra: int) -> lp.Bookkeeper:
        b = lp.Bookkeeper(num_fragments=1, H=12, tokens_per_step=1, window=1)
        b.on_merged(0, 0)
        assert [b.on_step() for _ in range(12)][-1] == [0]
        _sync(b, 0)
        for _ in range(12 + extra):  # due at 24, deferred for ``extra`` steps: the merge is late
            assert b.on_step() == []
        b.on_applied(0, [0], 1)
        b.on_downloaded(0, 1)
        b.on_merged(0, 1)
        assert b.on_step() == [0] and b.step == 25 + extra  # sent off the phase, at 25 + extra
        _sync(b, 0)
        b.on_applied(0, [1], 2)  # and merged at once: its next sync is not deferred
        b.on_downloaded(0, 2)
        b.on_merged(0, 2)
        return b

    def next_sync(b: lp.Bookkeeper) -> int:
        for _ in range(30):
            if b.on_step() == [0]:
                return b.step
        raise AssertionError("no sync")

    b = deferred_by(8)  # sent at 33: its place in the phase (24 + 11.5 k) is 35.9, 3 steps on
    b.set_period(11.5)
    assert next_sync(b) == 48  # kept a period later (47.4)
    b = deferred_by(1)  # sent at 26: its place, 35.6, is 10 steps on: back in phase there
    b.set_period(11.5)
    assert next_sync(b) == 36


def test_period_changes_at_a_short_period_leave_the_on_phase_syncs_where_they_are():
    """At a period of 1.5 steps a sync on the phase falls up to a step after its real due point: a
    period change must not take it for one off the phase and push it a period on."""
    b = lp.Bookkeeper(num_fragments=1, H=3, tokens_per_step=1)
    b.set_period(1.5)
    at = []
    for i in range(40):
        if b.on_step() == [0]:
            at.append(b.step)
            _sync(b, 0)
        if i % 3 == 0:
            b.set_period(1.5 if i % 2 else 1.52)  # pace noise
    assert {y - x for x, y in zip(at, at[1:])} <= {1, 2}, at


def test_after_a_resync_ends_a_deferral_the_fragment_syncs_once_then_a_period_later():
    """A resync drops the rounds out and ends the deferral of a sync due long ago: it goes out at
    the next step and the next one a whole period later (a period counted from its old due point
    synced it at every step until the schedule caught up)."""
    b = lp.Bookkeeper(num_fragments=1, H=4, tokens_per_step=1, window=1)
    b.on_merged(0, 0)
    assert [b.on_step() for _ in range(4)][-1] == [0]
    _sync(b, 0)
    for _ in range(26):  # due at 8, deferred to step 30: round 0 is never merged
        assert b.on_step() == []
    b.on_resync({0: 5})
    at = []
    for _ in range(12):
        if b.on_step() == [0]:
            c = _sync(b, 0)
            b.on_applied(0, [c.round], b.frags[0].base_version + 1)  # merged at once from now on
            b.on_downloaded(0, b.frags[0].base_version + 1)
            b.on_merged(0, b.frags[0].base_version + 1)
            at.append(b.step)
    assert at == [31, 35, 39], at


def test_sync_window_opens_on_a_rejection_and_after_the_valve():
    b = lp.Bookkeeper(num_fragments=1, H=2, tokens_per_step=1, window=1)
    b.on_merged(0, 0)
    b.on_step(), b.on_step()
    _sync(b, 0)
    b.on_step(), b.on_step()
    assert b.deferred() == [0]
    b.on_rejected(0, 0)  # the aggregator's feedback: round 0 rejected -> resolved
    assert b.on_step() == [0]
    _sync(b, 0)
    # round 1 is never heard of (a lost head): the valve sends after VALVE_PERIODS periods
    assert b.step == 5
    sent = [b.step for _ in range(2 + lp.VALVE_PERIODS * 2 + 4) if b.on_step()]
    assert sent[0] == 7 + lp.VALVE_PERIODS * 2  # deferred at step 7 (due), sent 16 periods later
    assert b.valve_opened == 1


def test_a_sync_deferred_for_hold_periods_holds_the_learner_until_its_round_is_merged():
    """A lagging aggregator costs speed, not the model: once a deferred sync waited ``hold`` periods,
    the learner holds its steps (``holding``) until the round is merged into its base; a hold that
    timed out (``give_up_hold``) holds no more until the sync goes out."""
    b = lp.Bookkeeper(num_fragments=2, H=4, tokens_per_step=1, window=1, hold=1)
    b.on_merged(0, 0), b.on_merged(1, 0)
    sent = []
    for _ in range(4):
        for p in b.on_step():
            sent.append(_sync(b, p))
    assert [c.fragment for c in sent] == [1, 0]  # staggered: fragment 1 at step 2, 0 at step 4
    # nothing merged: fragment 1 is deferred at step 6, fragment 0 at step 8
    for _ in range(5):
        assert b.on_step() == [] and b.holding() == []
    assert b.step == 9 and b.deferred() == [0, 1]
    b.on_step()  # step 10: fragment 1 has waited one period (since step 6)
    assert b.holding() == [1]
    b.on_applied(1, [0], 1)
    b.on_downloaded(1, 1)
    b.on_merged(1, 1)  # its round is in the base: the hold ends, the deferred sync goes out next step
    assert b.holding() == []
    b.on_step(), b.on_step()  # step 12: fragment 0 waited a period (since 8)
    assert b.holding() == [0]
    st = b.hold_state(0)  # what hold_expired logs: round 0 sent at step 4, deferred at 8, nothing merged
    assert (st["step"], st["deferred_at"], st["next_round"], st["merged_round"], st["base_version"]) == (12, 8, 1, -1, 0)
    b.give_up_hold(0)  # timed out: no more holds for it
    b.give_up_hold(0)  # (said again for the same hold: counted once)
    assert b.holding() == [] and b.counters()["holds_expired"] == 1
    for _ in range(8):
        b.on_step()
    assert b.holding() == []
    off = lp.Bookkeeper(num_fragments=1, H=2, tokens_per_step=1, window=1, hold=0)
    off.on_merged(0, 0)
    off.on_step(), off.on_step()
    _sync(off, 0)
    for _ in range(10):
        off.on_step()
    assert off.deferred() == [0] and off.holding() == []  # hold 0: deferred, never held


def test_a_deferred_fragment_takes_the_version_that_merged_its_round_even_after_an_early_download():
    """A learner not admitted yet (a restart rejoining) downloads the newest versions of a deferred
    fragment (admission needs current versions); that used its one download of the round, and once
    admitted it never took the version that merged its round: its hold waited 120 s for it, and its
    peer (quorum all) for its next round (bench.restart: 181 s instead of 56 s)."""
    b = lp.Bookkeeper(num_fragments=1, H=2, tokens_per_step=1, window=1, hold=1)
    b.on_merged(0, 10)
    b.on_step(), b.on_step()
    _sync(b, 0)  # round 0, held by the aggregator until the learner is admitted
    b.on_step(), b.on_step()
    assert b.deferred() == [0]
    assert b.fetch_due(0, 12, delay=1, merging=False)  # not admitted: the newest, for the monitor
    b.on_downloaded(0, 12)
    b.on_merged(0, 12)
    assert not b.fetch_due(0, 13, delay=1)  # admitted now: only the version that holds round 0
    b.on_step(), b.on_step()
    assert b.holding() == [0]
    b.on_applied(0, [0], 14)
    assert b.fetch_due(0, 14, delay=1)  # taken although its round's one download went to version 12
    b.on_downloaded(0, 14)
    b.on_merged(0, 14)
    assert b.holding() == [] and b.on_step() == [0]


def test_a_learner_without_admission_takes_the_version_that_merged_its_deferred_round():
    """In a run without a monitor (or before admission) a deferred fragment's one download goes to
    the newest version at the end of the period; when a later head lists its round, it downloads
    that version, and the window opens (it waited for the valve, 16 periods, before)."""
    b = lp.Bookkeeper(num_fragments=1, H=2, tokens_per_step=1, window=1, hold=1)
    b.on_merged(0, 10)
    b.on_step(), b.on_step()
    _sync(b, 0)
    b.on_step(), b.on_step()
    assert b.deferred() == [0]
    assert b.fetch_due(0, 11, delay=1, merging=False)  # the newest: it does not hold round 0
    b.on_downloaded(0, 11)
    b.on_merged(0, 11)
    assert not b.fetch_due(0, 12, delay=1, merging=False)  # the round's download is used up
    b.on_applied(0, [], 12)  # a head without our round changes nothing
    assert not b.fetch_due(0, 12, delay=1, merging=False)
    b.on_applied(0, [0], 13)
    assert b.fetch_due(0, 13, delay=1, merging=False)
    b.on_downloaded(0, 13)
    assert not b.fetch_due(0, 14, delay=1, merging=False)  # once: pending already holds it
    b.on_merged(0, 13)
    assert b.on_step() == [0] and b.deferred() == []  # the window opened, no valve


def test_holds_apply_once_the_aggregator_merges_the_learner_s_work():
    """``merges_reach``: an admitted learner holds; in a run without a monitor (no membership record)
    a learner holds once a head listed one of its rounds (before, it never held there, and a
    lagging aggregator let it train on alone for up to 16 periods: the guard test +22.0%); a learner
    the monitor knows but has not admitted does not (its work waits for the admission)."""
    b = lp.Bookkeeper(num_fragments=2, H=2, tokens_per_step=1, window=1, hold=1)
    b.on_merged(0, 0), b.on_merged(1, 0)
    assert not b.merged_any()
    assert lp.merges_reach(True, "active", False)
    assert not lp.merges_reach(False, None, b.merged_any())  # no monitor, nothing merged yet
    b.on_step(), b.on_step()
    _sync(b, 1)
    b.on_applied(1, [], 3)  # a head without our round
    assert not b.merged_any()
    b.on_applied(1, [0], 4)
    assert b.merged_any()
    assert lp.merges_reach(False, None, b.merged_any())  # no monitor, its work merged: it holds
    assert not lp.merges_reach(False, "joining", True)  # known to a monitor, not admitted
    assert not lp.merges_reach(False, "evicted", True)


def test_sync_window_zero_never_defers_and_resync_clears_deferral():
    b = lp.Bookkeeper(num_fragments=2, H=2, tokens_per_step=1, window=0)
    for _ in range(8):
        for p in b.on_step():
            _sync(b, p)
    assert b.counters()["deferred"] == 0 and b.counters()["sent"] == 8
    w = lp.Bookkeeper(num_fragments=1, H=2, tokens_per_step=1, window=1)
    w.on_step(), w.on_step()
    _sync(w, 0)
    w.on_step(), w.on_step()
    assert w.deferred() == [0]
    w.on_resync({0: 5})  # evicted while alive: the rounds out are dropped with the local work
    assert w.deferred() == [] and w.window_open(0)


def test_retry_window_says_a_version_s_first_failure_and_tries_it_for_the_timeout():
    failing: dict[int, tuple[int, float]] = {}
    assert lp.retry_window(failing, 1, 5, 100.0, 10.0) == (True, True)
    assert lp.retry_window(failing, 1, 5, 109.0, 10.0) == (False, True)
    assert lp.retry_window(failing, 1, 5, 110.5, 10.0) == (False, False)  # failed for the timeout
    assert lp.retry_window(failing, 1, 6, 111.0, 10.0) == (True, True)  # a new version starts afresh
    assert lp.retry_window(failing, 2, 5, 111.0, 10.0) == (True, True) and failing == {1: (6, 111.0), 2: (5, 111.0)}


def test_lead_of_reads_this_learners_lead_and_ignores_anything_malformed():
    meta = {"lead": [["a", "i1", 0.25], ["b", "i2", -1], ["c", "i3", float("nan")], ["d", "i4", True], "x"]}
    assert lp.lead_of(meta, "a", "i1") == 0.25 and lp.lead_of(meta, "b", "i2") == -1.0
    assert lp.lead_of(meta, "a", "other") is None  # another incarnation's
    assert lp.lead_of(meta, "c", "i3") is None and lp.lead_of(meta, "d", "i4") is None
    assert lp.lead_of({}, "a", "i1") is None and lp.lead_of({"lead": "x"}, "a", "i1") is None


def test_phase_shift_moves_a_share_of_the_lead_per_merge_and_at_most_half_a_round():
    # a lead of 0.2 s at 0.1 s per step is 2 steps; gain 0.5 over 4 fragments: 0.25 steps per merge
    assert lp.phase_shift(0.2, 0.1, 12.0, 4, 0.5) == pytest.approx(0.25)
    assert lp.phase_shift(-0.2, 0.1, 12.0, 4, 0.5) == pytest.approx(-0.25)
    # a round is 1.2 s: a lead of 5 s counts as 0.6 s (half a round)
    assert lp.phase_shift(5.0, 0.1, 12.0, 4, 1.0) == pytest.approx(1.5)
    assert lp.phase_shift(0.2, 0.1, 12.0, 4, 0.0) == 0.0  # off
    assert lp.phase_shift(0.2, 0.0, 12.0, 4, 0.5) == 0.0  # no pace yet
    assert lp.phase_shift(float("nan"), 0.1, 12.0, 4, 0.5) == 0.0


def test_shift_phase_moves_every_fragments_next_sync_and_a_new_period_keeps_the_shift():
    b = lp.Bookkeeper(4, 8, 1)
    for _ in range(9):
        b.on_step()
    before = list(b._next_due)
    b.shift_phase(1.5)
    assert b._next_due == [n + 1.5 for n in before] and b.phase_shifted == 1.5
    b.shift_phase(-0.5)
    assert b._next_due == [n + 1.0 for n in before] and b.phase_shifted == 1.0
    unshifted = lp.Bookkeeper(4, 8, 1)
    for _ in range(9):
        unshifted.on_step()
    b.set_period(4.0)  # half the period: the schedule keeps its phase, the shift included
    unshifted.set_period(4.0)
    assert b._next_due != unshifted._next_due and all(0 < n - b.step <= 4 for n in b._next_due), b._next_due


def test_the_bookkeeper_reports_how_steady_its_steps_were():
    b = lp.Bookkeeper(num_fragments=1, H=4, tokens_per_step=1)
    assert b.step_spread() == (0.0, 0.0)
    for _ in range(10):
        b.on_step(0.1)
    assert b.step_spread() == pytest.approx((0.1, 0.0), abs=1e-9)
    for s in (0.05, 0.15) * 5:  # 20 steps: mean 0.1, standard deviation sqrt(10 * 0.05^2 / 20)
        b.on_step(s)
    mean, cv = b.step_spread()
    assert mean == pytest.approx(0.1) and cv == pytest.approx((0.05 ** 2 / 2) ** 0.5 / 0.1)
