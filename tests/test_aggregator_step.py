"""merge_step with the defaults is timing-independent: the same contributions, grouped into merges
in any way (per arrival with K=1, or all at once), give the same fragment as one synchronous
DiLoCo round per M contributions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.contribution import Contribution
from aggregator.step import FragmentState, MergeSettings, merge_step, participation_scale
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
