"""Bounded influence (pure): the geometric norm bound, the per-merge norm caps, the weight cap, and
that a merge with caps never lets one vector count for more than its cap."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.contribution import Contribution
from aggregator.influence import BOUND_SLACK, cap_scales, cap_weights, norm_bound, norm_caps
from aggregator.merge import l2_norm, merge
from aggregator.step import FragmentState, MergeSettings, merge_step


def test_norm_bound_is_the_adam_geometry():
    # every one of n coordinates moved by lr on each of S steps has norm lr sqrt(n) S
    assert norm_bound(0.01, 100, 8) == pytest.approx(BOUND_SLACK * 0.01 * 10 * 8)
    assert norm_bound(0.01, 100, 0) == 0.0
    with pytest.raises(ValueError):
        norm_bound(0.0, 100, 8)
    with pytest.raises(ValueError):
        norm_bound(float("inf"), 100, 8)


def test_caps_come_from_the_history_median_once_it_exists():
    caps = norm_caps([1.0, 50.0], [8, 8], size=100, history_median=2.0, history_count=3, clip_factor=3.0)
    assert caps.tolist() == [6.0, 6.0]


def test_caps_before_history_are_the_geometric_bound_of_at_most_reference_steps():
    caps = norm_caps([1.0, 1.0], [4, 5000], size=100, history_median=2.0, history_count=2, clip_factor=3.0,
                     min_history=3, max_inner_lr=0.01, reference_steps=8)
    # claiming 5000 steps buys no more than the reference steps' bound
    assert caps.tolist() == pytest.approx([norm_bound(0.01, 100, 4) / BOUND_SLACK, norm_bound(0.01, 100, 8) / BOUND_SLACK])
    # without a declared max_inner_lr and without history: no cap; clip_factor 0: no cap at all
    assert np.isinf(norm_caps([1.0], [8], size=100, history_median=None, history_count=0, clip_factor=3.0)).all()
    assert np.isinf(norm_caps([1.0], [8], size=100, history_median=1.0, history_count=9, clip_factor=0)).all()


def test_cap_scales_and_weights():
    np.testing.assert_allclose(cap_scales([1.0, 4.0, 0.0], [2.0, 2.0, 2.0]), [1.0, 0.5, 1.0])
    np.testing.assert_allclose(cap_weights([1.0, 1.0, 1000.0], 4.0), [1.0, 1.0, 4.0])
    np.testing.assert_allclose(cap_weights([1.0, 1000.0], 0.0), [1.0, 1000.0])  # off


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.01, 1e6), min_size=1, max_size=6), st.sampled_from(["mean", "rda"]),
       st.sampled_from([None, "clip"]), st.floats(0.1, 10.0))
def test_a_capped_merge_never_exceeds_the_largest_cap(mags, method, robust, cap):
    rng = np.random.default_rng(len(mags))
    vecs = []
    for m in mags:
        v = rng.standard_normal(32).astype(np.float32)
        vecs.append((v * np.float32(m / np.linalg.norm(v))).astype(np.float32))
    caps = np.full(len(vecs), cap)
    out = merge(vecs, np.ones(len(vecs)), method, robust, caps=caps)
    assert l2_norm(out) <= cap * (1 + 1e-4)


def _contrib(learner: str, rnd: int, vec: np.ndarray, base: int = 0, steps: int = 8) -> Contribution:
    return Contribution("r", "h", learner, "i", 0, rnd, base, steps, steps * 64, vec)


def test_one_huge_vector_in_the_first_merge_moves_the_fragment_by_at_most_its_cap():
    n = 64
    st0 = FragmentState.initial(0, 0, np.zeros(n, np.float32), MergeSettings())
    settings_ = MergeSettings(max_inner_lr=0.01, reference_steps=8, momentum=0.0, lr=0.7)
    huge = np.full(n, 1e6, np.float32)
    new = merge_step(st0, [_contrib("evil", 1, huge)], settings_, scale=1.0)
    cap = norm_bound(0.01, n, 8) / BOUND_SLACK  # every parameter moved by the full lr on 8 steps
    assert l2_norm(new.params - st0.params) <= 0.7 * cap * (1 + 1e-5)
    assert new.last_clipped == 1 and new.applied_norms.median(0) == pytest.approx(cap)


def test_the_history_records_applied_norms_so_a_clipped_vector_does_not_raise_the_reference():
    n, rng = 64, np.random.default_rng(0)
    s = MergeSettings(max_inner_lr=0.01, reference_steps=8)
    st_ = FragmentState.initial(0, 0, np.zeros(n, np.float32), s)
    for r in range(5):
        st_ = merge_step(st_, [_contrib("a", r, (rng.standard_normal(n) * 0.01).astype(np.float32), st_.version)], s)
    med = st_.applied_norms.median(0)
    st_ = merge_step(st_, [_contrib("evil", 1, np.full(n, 5.0, np.float32), st_.version)], s)
    assert st_.last_clipped == 1
    assert st_.applied_norms.median(0) <= 3.0 * med * (1 + 1e-6)
    assert math.isclose(max(st_.applied_norms.to_dict()["norms"][0][1]), 3.0 * med, rel_tol=1e-6)
