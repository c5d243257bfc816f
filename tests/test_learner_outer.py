"""Outer gradient, merge and error feedback: hand-checked numbers and convergence."""

from __future__ import annotations

import numpy as np
import pytest

from bus.fragments import gather, plan_fragments, scatter
from learner.outer import ErrorFeedback, feedback_step, mix, outer_gradient, relative_error


def test_outer_gradient_by_hand():
    base = np.array([1.0, 2.0, -3.0, 0.5], dtype=np.float32)
    local = np.array([0.5, 2.5, -3.0, -0.5], dtype=np.float32)
    delta = outer_gradient(base, local)
    np.testing.assert_array_equal(delta, [0.5, -0.5, 0.0, 1.0])
    assert delta.dtype == np.float32
    # applying the outer gradient with lr 1 recovers the local parameters
    np.testing.assert_array_equal(base - delta, local)


def test_outer_gradient_casts_to_float32_and_checks_shapes():
    d = outer_gradient(np.array([1.0, 2.0]), np.array([0.25, 0.5]))
    assert d.dtype == np.float32
    np.testing.assert_array_equal(d, [0.75, 1.5])
    with pytest.raises(ValueError, match="shapes"):
        outer_gradient(np.zeros(3), np.zeros(4))


def test_mix_by_hand():
    local = np.array([1.0, 2.0, 4.0], dtype=np.float32)
    global_ = np.array([3.0, 2.0, 0.0], dtype=np.float32)
    np.testing.assert_allclose(mix(local, global_, 0.25), [2.5, 2.0, 1.0])
    np.testing.assert_allclose(mix(local, global_, 0.5), [2.0, 2.0, 2.0])
    out = mix(local, global_, 0.0)
    np.testing.assert_array_equal(out, global_)
    assert out is not global_ and out.dtype == np.float32
    out[0] = 99.0
    assert global_[0] == 3.0  # a copy, not an alias


@pytest.mark.parametrize("alpha", [-0.1, 1.0, 1.5])
def test_mix_rejects_bad_alpha(alpha):
    with pytest.raises(ValueError, match="alpha"):
        mix(np.zeros(2), np.zeros(2), alpha)


def test_sync_round_on_a_tiny_model_by_hand():
    """Base -> train -> outer gradient of a fragment -> merge a newer global version."""
    shapes = {"w": (2, 2), "b": (2,)}
    plan = plan_fragments(shapes, 2)
    base = {"w": np.array([[1.0, 1.0], [1.0, 1.0]], np.float32), "b": np.array([0.0, 0.0], np.float32)}
    local = {"w": np.array([[0.5, 1.0], [1.5, 1.0]], np.float32), "b": np.array([0.25, -0.25], np.float32)}
    # Plan by hand: 6 elements, P=2, ideal 3: "w" (4 > 3) is cut into w[0:2] and w[2:4]; the
    # three size-2 pieces go, in (size, path) order b, w[0:2], w[2:4], to the lightest fragment.
    assert [[(s.path, s.start, s.stop) for s in f.slices] for f in plan.fragments] == [
        [("b", 0, 2), ("w", 2, 4)],
        [("w", 0, 2)],
    ]
    d0 = outer_gradient(gather(plan, base, 0), gather(plan, local, 0))
    np.testing.assert_array_equal(d0, [-0.25, 0.25, -0.5, 0.0])  # [b0, b1, w10, w11]
    d1 = outer_gradient(gather(plan, base, 1), gather(plan, local, 1))
    np.testing.assert_array_equal(d1, [0.5, 0.0])  # [w00, w01]
    # A new global version of fragment 1 arrives: overwrite (alpha=0) or half-mix.
    new_global = np.array([2.0, 3.0], np.float32)
    merged0 = scatter(plan, local, 1, mix(gather(plan, local, 1), new_global, 0.0))
    np.testing.assert_array_equal(merged0["w"], [[2.0, 3.0], [1.5, 1.0]])
    assert merged0["b"] is local["b"]  # untouched tensors are shared
    merged_half = scatter(plan, local, 1, mix(gather(plan, local, 1), new_global, 0.5))
    np.testing.assert_allclose(merged_half["w"], [[1.25, 2.0], [1.5, 1.0]])
    np.testing.assert_array_equal(local["w"], [[0.5, 1.0], [1.5, 1.0]])  # not mutated


# ------------------------------------------------------------ error feedback


def sign_mean_abs(x: np.ndarray) -> np.ndarray:
    """1-bit quantiser: sign(x) * mean|x| (a crude stand-in for the real codec)."""
    return (np.sign(x) * np.mean(np.abs(x))).astype(np.float32)


def coarse_grid(x: np.ndarray, step: float = 0.5) -> np.ndarray:
    return (np.round(x / step) * step).astype(np.float32)


def test_feedback_step_by_hand():
    delta = np.array([0.2, 0.9, -0.4], np.float32)
    residual = np.array([0.1, -0.1, 0.0], np.float32)
    sent, new_residual = feedback_step(delta, residual, coarse_grid)
    # corrected = [0.3, 0.8, -0.4] -> grid 0.5 -> [0.5, 1.0, -0.5]
    np.testing.assert_allclose(sent, [0.5, 1.0, -0.5])
    np.testing.assert_allclose(new_residual, [-0.2, -0.2, 0.1], atol=1e-7)
    first, res0 = feedback_step(delta, None, coarse_grid)
    np.testing.assert_allclose(first, [0.0, 1.0, -0.5])
    np.testing.assert_allclose(res0, [0.2, -0.1, 0.1], atol=1e-7)


@pytest.mark.parametrize("quantiser", [sign_mean_abs, coarse_grid])
def test_error_feedback_sum_converges_while_plain_quantisation_drifts(quantiser):
    rng = np.random.default_rng(0)
    dim, rounds = 64, 400
    # Outer gradients with a consistent bias (as in training) plus noise, small against the grid.
    bias = rng.normal(0, 0.05, dim).astype(np.float32)
    ef = ErrorFeedback(quantiser)
    residual = None
    true_sum = np.zeros(dim, np.float64)
    ef_sum = np.zeros(dim, np.float64)
    plain_sum = np.zeros(dim, np.float64)
    ef_errors, plain_errors = [], []
    for r in range(rounds):
        delta = bias + rng.normal(0, 0.05, dim).astype(np.float32)
        sent, residual = ef.compress(delta, residual)
        true_sum += delta
        ef_sum += sent
        plain_sum += quantiser(delta)
        ef_errors.append(np.linalg.norm(ef_sum - true_sum))
        plain_errors.append(np.linalg.norm(plain_sum - true_sum))
        # telescoping identity: sum sent = sum delta - residual
        np.testing.assert_allclose(ef_sum, true_sum - residual, atol=1e-3)
    # error-feedback error stays bounded: no growth between the first and last quarter
    early, late = max(ef_errors[: rounds // 4]), max(ef_errors[-rounds // 4 :])
    assert late <= 2.0 * early + 1e-6
    # relative to the accumulated update it vanishes; without feedback it does not
    assert ef_errors[-1] / np.linalg.norm(true_sum) < 0.1
    assert plain_errors[-1] / np.linalg.norm(true_sum) > 0.3
    assert plain_errors[-1] > 10 * ef_errors[-1]


def test_error_feedback_with_separate_encode_decode():
    scale = 0.25

    def encode(x):
        return np.round(x / scale).astype(np.int8)

    def decode(q):
        return q.astype(np.float32) * scale

    ef = ErrorFeedback(encode, decode)
    payload, residual = ef.compress(np.array([0.3, -0.6], np.float32))
    assert payload.dtype == np.int8
    np.testing.assert_array_equal(payload, [1, -2])
    np.testing.assert_allclose(residual, [0.05, -0.1], atol=1e-7)
    payload, residual = ef.compress(np.array([0.3, -0.6], np.float32), residual)
    np.testing.assert_array_equal(payload, [1, -3])  # corrected [0.35, -0.7]


def test_codec_changing_shape_is_rejected():
    with pytest.raises(ValueError, match="shape"):
        ErrorFeedback(lambda x: x[:-1]).compress(np.ones(3, np.float32))
    with pytest.raises(ValueError, match="shape"):
        feedback_step(np.ones(3, np.float32), np.zeros(2, np.float32), coarse_grid)


def test_relative_error():
    assert relative_error(np.array([3.0, 4.0]), np.array([3.0, 4.0])) == 0.0
    assert relative_error(np.array([3.0, 4.0]), np.array([0.0, 0.0])) == pytest.approx(1.0)
    assert relative_error(np.array([3.0, 4.0]), np.array([3.0, 3.0])) == pytest.approx(0.2)
    assert relative_error(np.zeros(2), np.zeros(2)) == 0.0


def test_rebase_keeps_local_progress_since_the_reference():
    from learner.outer import rebase

    base = np.array([1.0, 2.0, 3.0], np.float32)
    local = np.array([0.5, 2.5, 3.0], np.float32)  # progress since base: -0.5, +0.5, 0
    glob = np.array([10.0, 20.0, 30.0], np.float32)
    out = rebase(local, base, glob)
    assert out.dtype == np.float32 and out is not glob
    np.testing.assert_array_equal(out, [9.5, 20.5, 30.0])
    # no progress: exactly the global version; the next outer gradient (new base - theta) is the progress
    np.testing.assert_array_equal(rebase(base, base, glob), glob)
    np.testing.assert_allclose(outer_gradient(glob, out), base - local)
    with pytest.raises(ValueError):
        rebase(local, base[:2], glob)
