"""merge_step with the defaults is timing-independent: the same contributions, grouped into merges
in any way (per arrival with K=1, or all at once), give the same fragment as one synchronous
DiLoCo round per M contributions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.contribution import Contribution
from aggregator.step import FragmentState, MergeSettings, merge_step, participation_scale, round_work
from aggregator.weights import StalenessPolicy

M, N = 3, 24


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
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, momentum=0.0)
    cs = _contribs(4)
    synchronous = _apply([cs[j:j + M] for j in range(0, len(cs), M)], s)  # one merge per round of M
    np.testing.assert_allclose(_apply(_grouped(cs, sizes), s), synchronous, rtol=1e-5, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([[1, 1, 1], [2, 1], [1, 2], [3]]), min_size=4, max_size=4))
def test_with_momentum_any_grouping_within_rounds_makes_the_synchronous_progress(splits):
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, momentum=0.9)
    cs = _contribs(4)
    synchronous = _apply([cs[j:j + M] for j in range(0, len(cs), M)], s)
    got = _apply(_grouped(cs, [k for split in splits for k in split]), s)
    np.testing.assert_allclose(got, synchronous, rtol=1e-5, atol=1e-6)


def test_per_arrival_merges_with_momentum_equal_synchronous_rounds():
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, momentum=0.9)
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
    """Two learners' full rounds and one learner's 2-step final sync in one merge (bench.reference
    found it): the model moves by the two rounds' mean plus the small one's token-weighted share, and
    the momentum of ``rounds`` advances only once a whole round of work is in."""
    s = MergeSettings(staleness=StalenessPolicy("constant"), clip_factor=0.0, momentum=0.9, lr=1.0)
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
