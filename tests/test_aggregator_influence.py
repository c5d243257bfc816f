"""Bounded influence (pure): the geometric norm bound, the per-merge norm caps, the weight cap, and
that a merge with caps never lets one vector count for more than its cap."""

from __future__ import annotations


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
    # its norm enters the reference as at most the honest bound of 8 steps, not as 1e6 x sqrt(n)
    assert new.last_clipped == 1 and new.applied_norms.median(0) == pytest.approx(BOUND_SLACK * cap)


def test_a_clipped_vector_barely_moves_the_reference_it_is_measured_against():
    """The reference is the median of the last 64 norms: one huge vector is clipped in its merge and
    moves the median by one order statistic, not to its own size."""
    n, rng = 64, np.random.default_rng(0)
    s = MergeSettings(max_inner_lr=0.01, reference_steps=8)
    st_ = FragmentState.initial(0, 0, np.zeros(n, np.float32), s)
    honest = []
    for r in range(5):
        v = (rng.standard_normal(n) * 0.01).astype(np.float32)
        honest.append(l2_norm(v))
        st_ = merge_step(st_, [_contrib("a", r, v, st_.version)], s)
    med = st_.applied_norms.median(0)
    st_ = merge_step(st_, [_contrib("evil", 1, np.full(n, 5.0, np.float32), st_.version)], s)
    assert st_.last_clipped == 1
    assert med <= st_.applied_norms.median(0) <= max(honest) < 0.2 * l2_norm(np.full(n, 5.0, np.float32)) / 40


def test_honest_norms_that_grow_through_warm_up_are_clipped_for_one_round_only():
    """Staggered first syncs cover a few steps at a tiny warm-up learning rate, so a fragment's first
    norms can be 100x smaller than its later ones. The reference follows them: one round is clipped
    (to 3x the first ones), not every round until 32 of 64 recorded norms are clipped ones."""
    n, M, rng = 256, 4, np.random.default_rng(1)
    s = MergeSettings(max_inner_lr=0.01, reference_steps=24, momentum=0.0, lr=0.7)
    st_ = FragmentState.initial(0, 0, np.zeros(n, np.float32), s)
    clipped = []
    for r in range(6):
        scale = 1e-4 if r == 0 else 1e-2
        contribs = [_contrib(f"l{m}", r, (rng.standard_normal(n) * scale).astype(np.float32), st_.version)
                    for m in range(M)]
        st_ = merge_step(st_, contribs, s, scale=1.0, per_round=M)
        clipped.append(st_.last_clipped)
    assert clipped == [0, M, 0, 0, 0, 0], clipped


def test_a_partial_round_does_not_set_the_clip_reference():
    """A staggered fragment's first sync (3 of 24 steps) is merged but not recorded as a reference:
    the first whole rounds are then capped by the geometric bound only, and set the reference."""
    n, rng = 256, np.random.default_rng(2)
    s = MergeSettings(max_inner_lr=0.01, reference_steps=24, momentum=0.0, lr=0.7)
    st_ = FragmentState.initial(0, 0, np.zeros(n, np.float32), s)
    part = [Contribution("r", "h", f"l{m}", "i", 0, 0, 0, 3, 3 * 64,
                         (rng.standard_normal(n) * 1e-4).astype(np.float32), period=24) for m in range(4)]
    st_ = merge_step(st_, part, s, scale=0.5, per_round=4)
    assert st_.applied_norms.count(0) == 0
    whole = [Contribution("r", "h", f"l{m}", "i", 0, 1, st_.version, 24, 24 * 64,
                          (rng.standard_normal(n) * 1e-2).astype(np.float32), period=24) for m in range(4)]
    st_ = merge_step(st_, whole, s, scale=1.0, per_round=4)
    assert st_.last_clipped == 0 and st_.applied_norms.count(0) == 4
