"""merge_step with the defaults is timing-independent: the same contributions, grouped into merges
in any way (per arrival with K=1, or all at once), give the same fragment as one synchronous
DiLoCo round per M contributions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.contribution import Contribution
from aggregator.merge import l2_norm
from aggregator.outer_opt import NesterovSGD
from aggregator.step import (FragmentState, MergeSettings, merge_step, momentum_part, open_rounds, participation_scale,
                             round_work)
from aggregator.trust import TrustSettings
from aggregator.weights import StalenessPolicy

M, N = 3, 24


#: these tests check the merge's arithmetic on independent random vectors, which agree with each other
#: no more than noise does: trust across rounds (which judges directions, and so depends on grouping)
#: is off here. tests/test_aggregator_trust.py shows it changes nothing for learners that agree.
NO_TRUST = TrustSettings(mode="off")

#: the grouping tests build every contribution on version 0 (open-loop by construction); they check how
#: the momentum groups work, so they count it all as closed-loop (the open-loop rule: tests below)
CLOSED = 10**6


def _contribs(rounds: int, seed: int = 0) -> list[Contribution]:
    rng = np.random.default_rng(seed)
    return [Contribution("r", "h", f"l{i}", "inc", 0, r, 0, 8, 8 * 64,
                         (rng.standard_normal(N) * 0.01).astype(np.float32))
            for r in range(rounds) for i in range(M)]


def _apply(groups: list[list[Contribution]], s: MergeSettings) -> np.ndarray:
    st_ = FragmentState.initial(0, 0, np.ones(N, np.float32), s)
    for g in groups:
        st_ = merge_step(st_, g, s, scale=participation_scale(len(g), M), per_round=M)
    return st_.params


def test_participation_scale_counts_contributions():
    assert participation_scale(1, 3) == pytest.approx(1 / 3)
    assert participation_scale(6, 3) == pytest.approx(2.0)  # a backlog of two rounds
    assert participation_scale(0, 0) == 1.0


def test_run_participants_keep_leavers_and_drop_the_silent_after_the_window():
    from aggregator.step import run_participants

    recent = {"a": 100.0, "b": 70.0, "c": 10.0}
    merged = {"a", "b", "c", "d"}
    # c left (its budget reached): it keeps its share however long ago it last sent; b, silent and
    # not active (evicted), counts for the window only
    assert run_participants({"d"}, {"c"}, recent, 100.0, 30.0, merged) == {"a", "b", "c", "d"}
    assert run_participants({"d"}, {"c"}, recent, 100.1, 30.0, merged) == {"a", "c", "d"}
    assert run_participants(set(), set(), recent, 200.0, 30.0, merged) == set()
    # a leaver none of whose work was merged (stopped before its first sync) does not count
    assert run_participants({"d"}, {"c", "e"}, recent, 200.0, 30.0, merged) == {"c", "d"}


def _grouped(cs: list[Contribution], sizes: list[int]) -> list[list[Contribution]]:
    groups, i = [], 0
    for k in sizes:
        if i >= len(cs):
            break
        groups.append(cs[i:i + k])
        i += k
    return groups + ([cs[i:]] if i < len(cs) else [])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=12))
def test_without_momentum_any_grouping_makes_the_synchronous_progress(sizes):
    # constant staleness (the grouping changes versions, not the work) and no caps in the way
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, trust=NO_TRUST, momentum=0.0)
    cs = _contribs(4)
    synchronous = _apply([cs[j:j + M] for j in range(0, len(cs), M)], s)  # one merge per round of M
    np.testing.assert_allclose(_apply(_grouped(cs, sizes), s), synchronous, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([[1, 1, 1], [2, 1], [1, 2], [3]]), min_size=4, max_size=4))
def test_with_momentum_any_grouping_within_rounds_makes_the_synchronous_progress(splits):
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, trust=NO_TRUST, momentum=0.9,
                      momentum_open_rounds=CLOSED)
    cs = _contribs(4)
    synchronous = _apply([cs[j:j + M] for j in range(0, len(cs), M)], s)
    got = _apply(_grouped(cs, [k for split in splits for k in split]), s)
    np.testing.assert_allclose(got, synchronous, rtol=1e-5, atol=1e-6)


def test_per_arrival_merges_with_momentum_equal_synchronous_rounds():
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, trust=NO_TRUST, momentum=0.9,
                      momentum_open_rounds=CLOSED)
    cs = _contribs(5, seed=3)
    per_arrival = _apply([[c] for c in cs], s)
    synchronous = _apply([cs[j:j + M] for j in range(0, len(cs), M)], s)
    np.testing.assert_allclose(per_arrival, synchronous, rtol=1e-5, atol=1e-6)


def _c(learner: str, rnd: int, steps: int, period: int, vec: np.ndarray) -> Contribution:
    return Contribution("r", "h", learner, "inc", 0, rnd, 0, steps, steps * 64, vec, period=period)


def test_a_contribution_holds_its_share_of_a_round():
    v = np.zeros(N, np.float32)
    assert _c("a", 0, 24, 24, v).round_share == 1.0
    assert _c("a", 0, 6, 24, v).round_share == 0.25  # a staggered fragment's first sync, a final sync
    assert _c("a", 0, 30, 24, v).round_share == 1.0  # at most a round
    assert _c("a", 0, 6, 0, v).round_share == 1.0  # period not declared (an older learner): a round
    assert round_work([_c("a", 0, 24, 24, v), _c("a", 1, 2, 24, v), _c("b", 0, 24, 24, v)]) == pytest.approx(2 + 1 / 12)
    assert participation_scale(2 + 1 / 12, 2) == pytest.approx(1 + 1 / 24)
    assert participation_scale(0.25, 2) == pytest.approx(0.125)


def test_a_short_final_sync_neither_inflates_the_step_nor_takes_a_momentum_step():
    """Two learners' full rounds and one learner's 2-step final sync in one merge (simulation.reference
    found it): the model moves by the two rounds' mean plus the small one's token-weighted share, and
    the momentum of ``rounds`` advances only once a whole round of work is in."""
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, trust=NO_TRUST, momentum=0.9, lr=1.0)
    a, b = np.full(N, 0.01, np.float32), np.full(N, 0.03, np.float32)
    tail = np.full(N, 0.001, np.float32)
    st0 = FragmentState.initial(0, 0, np.zeros(N, np.float32), s)
    # a first round whose momentum is in force
    st1 = merge_step(st0, [_c("a", 0, 24, 24, a), _c("b", 0, 24, 24, b)], s,
                     scale=participation_scale(2, 2), per_round=2)
    cs = [_c("a", 1, 24, 24, a), _c("a", 2, 2, 24, tail), _c("b", 1, 24, 24, b)]
    st2 = merge_step(st1, cs, s, scale=participation_scale(round_work(cs), 2), per_round=2)
    mean = (24 * a + 2 * tail + 24 * b) / 50  # token weights: tokens x batch
    moved = st1.params - st2.params
    # g x (1 + 1/24) (not x 1.5, as counting contributions did), plus one momentum step beta * t
    t = 0.9 * st1.opt.momentum + (mean * (1 + 1 / 24)).astype(np.float32)
    np.testing.assert_allclose(moved, mean * (1 + 1 / 24) + 0.9 * t, rtol=1e-5)
    # a final sync alone: a twelfth of a round, so no momentum step
    st3 = merge_step(st2, [_c("b", 2, 2, 24, tail)], s, scale=participation_scale(1 / 12, 2), per_round=2)
    np.testing.assert_allclose(st2.params - st3.params, tail / 24, rtol=1e-3, atol=1e-8)  # float32 params


# -- the momentum is fed by closed-loop work only (issue 24) ----------------------------------------


def _cb(learner: str, rnd: int, base: int, vec: np.ndarray) -> Contribution:
    return Contribution("r", "h", learner, "inc", 0, rnd, base, 24, 24 * 64, vec, period=24)


def _outage(momentum: float, open_rounds: int = 1, backlog: int = 20, groups: int = 1):
    """Two learners in step for 10 rounds (each round's base is the version before it), then the
    aggregator is down while both train on alone for ``backlog`` rounds on the same base; the backlog is
    merged ``groups`` rounds per merge. Returns the distance moved during the backlog, per round."""
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, trust=NO_TRUST, momentum=momentum,
                      momentum_open_rounds=open_rounds)
    d = np.full(N, 0.01, np.float32)
    st_ = FragmentState.initial(0, 0, np.zeros(N, np.float32), s)
    for r in range(10):
        cs = [_cb("a", r, st_.version, d), _cb("b", r, st_.version, d)]
        st_ = merge_step(st_, cs, s, scale=participation_scale(2, 2), per_round=2)
    before, base = st_.params.copy(), st_.version
    for r in range(10, 10 + backlog, groups):
        cs = [_cb(x, k, base, d) for k in range(r, min(r + groups, 10 + backlog)) for x in "ab"]
        st_ = merge_step(st_, cs, s, scale=participation_scale(len(cs), 2), per_round=2)
    return float(np.mean(st_.params - before)) * -1 / backlog / 0.01 / s.lr, st_


@pytest.mark.parametrize("groups", [1, 4, 20])
def test_an_outage_backlog_is_not_extrapolated_by_the_momentum(groups):
    """The case that had made momentum 0 the default (docs/RELIABILITY.md, issue 12): a backlog of
    open-loop rounds, merged after an outage, moved the model lr/(1-beta) x its work. Now it moves it
    by about the work itself (plain SGD) whatever the grouping; without the rule it moves 2x (0.5) or
    10x (0.9) the work, which is what the momentum would make of closed-loop rounds."""
    for beta in (0.5, 0.9):
        per_round, st_ = _outage(beta, groups=groups)
        # the work itself (1.0 per round) plus what the momentum of the closed-loop rounds before the
        # outage and of the first open round adds: a constant, spread over 20 rounds
        assert 1.0 <= per_round < 1.0 + (beta / (1 - beta)) * 2 / 20 + 1e-6, (beta, groups, per_round)
        unguarded, _ = _outage(beta, open_rounds=CLOSED, groups=groups)
        if groups == 1:  # one round per merge: the momentum compounds as for closed-loop rounds
            assert unguarded > 1.0 + 0.6 * beta / (1 - beta), (beta, unguarded)
        if groups < 20:  # (the whole backlog in one merge is closed-loop by the rule: the mean round bounds it)
            assert unguarded > per_round


def test_closed_loop_rounds_keep_the_momentum_and_open_rounds_counts_the_learners_own_rounds():
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, trust=NO_TRUST, momentum=0.5, lr=1.0)
    d = np.full(N, 0.01, np.float32)
    st_ = FragmentState.initial(0, 0, np.zeros(N, np.float32), s)
    ref, rs = NesterovSGD(1.0, 0.5), None
    q = np.zeros(N, np.float32)
    rs = ref.init(q)
    for r in range(6):  # in step: each round from the previous round's version = synchronous Nesterov
        st_ = merge_step(st_, [_cb("a", r, st_.version, d), _cb("b", r, st_.version, d)], s,
                         scale=participation_scale(2, 2), per_round=2)
        q, rs = ref.step(q, d, rs)
    np.testing.assert_allclose(st_.params, q, rtol=1e-5)
    assert st_.recent["a"] == [1, 2, 3, 4, 5, 6]
    assert open_rounds(st_, _cb("a", 6, 6, d)) == 0
    assert open_rounds(st_, _cb("a", 6, 5, d)) == 1  # one round ahead: still closed-loop (default 1)
    assert open_rounds(st_, _cb("a", 6, 3, d)) == 3
    assert open_rounds(st_, _cb("c", 0, 0, d)) == 0  # a learner new to the fragment
    assert FragmentState.from_bytes(st_.to_bytes()).recent == st_.recent


def test_a_mixed_merge_feeds_the_momentum_exactly_its_closed_loop_part():
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, trust=NO_TRUST, momentum=0.5, lr=1.0)
    a, b = np.full(N, 0.01, np.float32), np.full(N, 0.03, np.float32)
    st_ = FragmentState.initial(0, 0, np.zeros(N, np.float32), s)
    for r in range(3):
        st_ = merge_step(st_, [_cb("a", r, st_.version, a), _cb("b", r, st_.version, b)], s,
                         scale=participation_scale(2, 2), per_round=2)
    t0 = st_.opt.momentum.copy()
    # a is closed-loop, b sends its third round on version 0 (open for 3 rounds)
    cs = [_cb("a", 3, st_.version, a), _cb("b", 3, 0, b)]
    g = (a + b) / 2  # equal token weights, scale 2/2
    assert open_rounds(st_, cs[1]) == 3
    mg, work = momentum_part(st_, cs, s, np.array([0.5, 0.5]), [l2_norm(a), l2_norm(b)],
                             np.array([np.inf, np.inf]), 1.0, 1.0)
    np.testing.assert_allclose(mg, a / 2, rtol=1e-6)  # a's share of the mean
    assert work == pytest.approx(0.5)
    st2 = merge_step(st_, cs, s, scale=participation_scale(2, 2), per_round=2)
    # half a round of closed-loop work waits, folded into the trace (beta * t0 + B); no milestone yet
    assert st2.opt.folded and st2.opt.progress == pytest.approx(0.5)
    np.testing.assert_allclose(st2.opt.momentum, 0.5 * t0 + a / 2, rtol=1e-6)
    np.testing.assert_allclose(st_.params - st2.params, g, rtol=1e-5)  # the whole merge as plain SGD
    # a merge with only open-loop work takes no work and leaves the momentum alone
    st3 = merge_step(st2, [_cb("b", 4, 0, b)], s, scale=participation_scale(1, 2), per_round=2)
    np.testing.assert_array_equal(st3.opt.momentum, st2.opt.momentum)
    assert st3.opt.progress == pytest.approx(st2.opt.progress)


def _int8(vec: np.ndarray) -> np.ndarray:
    """The Int8Vector intake keeps of ``vec`` sent int8 (decoded block by block where it is read)."""
    from aggregator.contribution import from_grad_message
    from bus import codec
    from bus.protocol import grad_meta

    meta = grad_meta(run="r", model="h", learner="l", incarnation="i", fragment=0, round_=0, base_version=0,
                     inner_steps=1, tokens=1, region="x")
    return from_grad_message(meta, codec.encode_array(vec, "int8")).vector


@pytest.mark.parametrize("robust", [None, "clip"])
def test_the_merge_applied_block_by_block_is_bitwise_the_merge_then_the_step(robust):
    """The defaults (the mean into the ``rounds`` optimizer) apply the merged outer gradient block by
    block, with no buffer of the fragment's size (issue 41: 0.5 bytes per value at 8 fragments).
    Over merges of int8 and float32 contributions, stale and open-loop ones (the momentum's
    part), norm caps from the history and the default trust settings, the state is bit for bit the
    one the whole merge then the whole step give, across blocks (three here)."""
    from aggregator.merge import DEFAULT_BLOCK
    from aggregator.step import fuses

    n = 2 * DEFAULT_BLOCK + 12_345
    s = MergeSettings(robust=robust, momentum_open_rounds=0)
    assert fuses(s) and not fuses(MergeSettings(method="rda")) and not fuses(MergeSettings(robust="trim"))
    rng = np.random.default_rng(3)
    a = FragmentState.initial(0, 0, rng.standard_normal(n).astype(np.float32), s)
    b = FragmentState.initial(0, 0, a.params.copy(), s)
    for r in range(6):
        cs = []
        for i, learner in enumerate(["x", "y", "z"][: 1 + r % 3]):
            vec = (rng.standard_normal(n) * (0.01 if learner != "z" else 0.05)).astype(np.float32)
            base = a.version if (r + i) % 2 else max(0, a.version - 2)  # some stale, some open-loop
            cs.append(Contribution("r", "h", learner, "inc", 0, r, base, 24, 24 * 64,
                                   _int8(vec) if i != 1 else vec, period=24))
        scale = participation_scale(len(cs), 3)
        a = merge_step(a, cs, s, scale=scale, per_round=3, inplace=True, fused=True)
        b = merge_step(b, cs, s, scale=scale, per_round=3, inplace=True, fused=False)
        assert a.to_bytes() == b.to_bytes(), r
        assert a.last_grad_norm == b.last_grad_norm and a.last_clipped == b.last_clipped
    assert a.version == 6 and a.opt.count == 6
