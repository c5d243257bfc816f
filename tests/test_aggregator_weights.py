"""Weights: token weight x staleness factor, normalised; values computed by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aggregator.contribution import Contribution
from aggregator.weights import (
    StalenessPolicy,
    contribution_weights,
    normalise,
    token_weight,
)


def make(tokens: int, steps: int, base: int, fragment: int = 0) -> Contribution:
    return Contribution(run="r", model_hash="h", learner="a", incarnation="i", fragment=fragment,
                        round=0, base_version=base, inner_steps=steps, tokens=tokens,
                        vector=np.zeros(2, dtype=np.float32))


def test_token_weight_is_quantity_times_quality():
    assert token_weight(1000, 10) == 1000 * 100  # 1000 tokens x 100 tokens/step
    assert token_weight(48, 24) == 96.0
    assert token_weight(0, 5) == 0.0
    with pytest.raises(ValueError):
        token_weight(10, 0)
    with pytest.raises(ValueError):
        token_weight(-1, 1)


def test_staleness_factors_by_hand():
    const = StalenessPolicy("constant")
    assert [const.factor(d) for d in (0, 1, 50)] == [1.0, 1.0, 1.0]
    poly = StalenessPolicy("polynomial", a=0.5)
    assert poly.factor(0) == 1.0
    assert poly.factor(3) == pytest.approx(0.5)  # (1+3)^-0.5
    assert poly.factor(8) == pytest.approx(1 / 3)  # 9^-0.5
    assert StalenessPolicy("polynomial", a=1.0).factor(4) == pytest.approx(0.2)
    hinge = StalenessPolicy("hinge", a=0.5, b=2)
    assert hinge.factor(0) == 1.0
    assert hinge.factor(2) == 1.0
    assert hinge.factor(3) == pytest.approx(1 / 1.5)  # 1/(0.5*1+1)
    assert hinge.factor(4) == pytest.approx(0.5)  # 1/(0.5*2+1)
    assert hinge.factor(12) == pytest.approx(1 / 6)  # 1/(0.5*10+1)
    with pytest.raises(ValueError):
        poly.factor(-1)


def test_policy_validation():
    with pytest.raises(ValueError):
        StalenessPolicy("exponential")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        StalenessPolicy("polynomial", a=-0.5)
    with pytest.raises(ValueError):
        StalenessPolicy("hinge", a=float("nan"))
    with pytest.raises(ValueError):
        StalenessPolicy("hinge", b=-1)
    with pytest.raises(ValueError):
        StalenessPolicy("hinge", b=1.5)  # type: ignore[arg-type]


def test_contribution_weights_by_hand():
    # q1 = 100 * 10 = 1000, fresh (d=0);  q2 = 200 * 20 = 4000, d = 3
    cs = [make(100, 10, base=5), make(200, 10, base=2)]
    w = contribution_weights(cs, 5, StalenessPolicy("polynomial", a=1.0))
    # s2 = 1/4: raw = [1000, 1000]
    np.testing.assert_allclose(w, [0.5, 0.5])
    w = contribution_weights(cs, 5)  # constant: raw [1000, 4000]
    np.testing.assert_allclose(w, [0.2, 0.8])
    w = contribution_weights(cs, 5, StalenessPolicy("hinge", a=1.0, b=1))
    # s2 = 1/(1*(3-1)+1) = 1/3: raw [1000, 4000/3] -> [3/7, 4/7]
    np.testing.assert_allclose(w, [3 / 7, 4 / 7])
    w = contribution_weights(cs, 5, StalenessPolicy("polynomial", a=1.0), token_weighted=False)
    np.testing.assert_allclose(w, [0.8, 0.2])  # raw [1, 1/4]
    assert w.dtype == np.float64 and w.sum() == pytest.approx(1.0)


def test_quality_beats_quantity_alone():
    # same tokens, half the steps (twice the batch): weighs twice as much
    w = contribution_weights([make(1000, 20, 0), make(1000, 10, 0)], 0)
    np.testing.assert_allclose(w, [1 / 3, 2 / 3])


def test_versions_per_fragment():
    cs = [make(10, 10, base=1, fragment=0), make(10, 10, base=9, fragment=1)]
    w = contribution_weights(cs, {0: 4, 1: 9}, StalenessPolicy("polynomial", a=0.5))
    # d = 3 -> 0.5 ; d = 0 -> 1
    np.testing.assert_allclose(w, [1 / 3, 2 / 3])


def test_errors_are_clear():
    with pytest.raises(ValueError, match="no contributions"):
        contribution_weights([], 0)
    with pytest.raises(ValueError, match="zero"):
        contribution_weights([make(0, 10, 0), make(0, 5, 0)], 0)
    with pytest.raises(ValueError, match="negative staleness"):
        contribution_weights([make(10, 1, base=3)], 2)
    with pytest.raises(ValueError):
        normalise([])
    with pytest.raises(ValueError):
        normalise([1.0, float("inf")])
    with pytest.raises(ValueError):
        normalise([1.0, -0.5])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 10**6), st.integers(1, 1000), st.integers(0, 30)),
             min_size=1, max_size=20),
    st.sampled_from([StalenessPolicy("constant"), StalenessPolicy("polynomial", a=0.5),
                     StalenessPolicy("hinge", a=0.5, b=4)]),
)
def test_weights_are_a_distribution_and_staleness_never_helps(items, policy):
    cs = [make(max(t, s), s, base=30 - d) for t, s, d in items]
    w = contribution_weights(cs, 30, policy)
    assert w.shape == (len(cs),)
    assert np.all(w > 0) and w.sum() == pytest.approx(1.0)
    # making one contribution staler never increases its weight
    older = [make(c.tokens, c.inner_steps, c.base_version - (i == 0)) for i, c in enumerate(cs)]
    assert contribution_weights(older, 30, policy)[0] <= w[0] + 1e-12


def test_staleness_is_counted_in_rounds_of_active_learners():
    from aggregator.weights import rounds_behind

    assert [rounds_behind(10, b, 4) for b in (10, 9, 7, 6, 2)] == [0, 0, 0, 1, 2]
    assert rounds_behind(10, 7, 1) == 3 and rounds_behind(10, 7, 0) == 3  # per_round < 1 counts as 1
    assert rounds_behind(5, 6, 4) < 0  # a base from the future stays negative (rejected by validation)
    # four learners of one round, merged one by one (K=1): 0..3 versions behind, all weighted alike
    cs = [make(1000, 10, base) for base in (7, 8, 9, 10)]
    np.testing.assert_allclose(contribution_weights(cs, 10, StalenessPolicy("polynomial", 0.5), per_round=4),
                               [0.25] * 4)
    w = contribution_weights(cs, 10, StalenessPolicy("polynomial", 0.5))  # counted in versions
    assert w[0] < w[1] < w[2] < w[3]
