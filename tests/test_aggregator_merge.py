"""Merging: weighted mean and RDA by hand, RDA keeps the norm, robust modes, properties, memory."""

from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from aggregator.merge import (
    MIN_DIRECTION_NORM,
    block_slices,
    clip_scales,
    clip_to_median_norm,
    l2_norm,
    merge,
    rda,
    trimmed_mean,
    weighted_mean,
)


def f32(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def orthogonal(m: int, n: int, norm: float, seed: int = 0) -> list[np.ndarray]:
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, m)))
    return [(norm * q[:, i]).astype(np.float32) for i in range(m)]


# ---------------------------------------------------------------- by hand


def test_weighted_mean_by_hand():
    out = weighted_mean([f32(1, 2), f32(3, 4)], [1, 3])
    np.testing.assert_allclose(out, [2.5, 3.5])  # (1*[1,2] + 3*[3,4]) / 4
    assert out.dtype == np.float32
    np.testing.assert_allclose(weighted_mean([f32(1, 2), f32(3, 4)], [0.25, 0.75]), [2.5, 3.5])
    np.testing.assert_allclose(merge([f32(1, 2), f32(3, 4)], [1, 3], "mean", "none"), [2.5, 3.5])


def test_rda_by_hand():
    # |v1| = 3, |v2| = 1, equal weights: magnitude 2, direction unit([1,0] + [0,1])
    out = rda([f32(3, 0), f32(0, 1)], [1, 1])
    np.testing.assert_allclose(out, [math.sqrt(2), math.sqrt(2)], rtol=1e-6)
    # weights 3:1 -> magnitude (9 + 1) / 4 = 2.5, direction unit([3, 1])
    out = rda([f32(3, 0), f32(0, 1)], [3, 1])
    np.testing.assert_allclose(out, 2.5 * np.array([3, 1]) / math.sqrt(10), rtol=1e-6)


@pytest.mark.parametrize("m", [2, 4, 16, 64])
def test_rda_keeps_the_norm_that_the_mean_loses(m):
    vs = orthogonal(m, 256, norm=3.0, seed=m)
    w = np.ones(m)
    assert l2_norm(rda(vs, w)) == pytest.approx(3.0, rel=1e-5)
    assert l2_norm(weighted_mean(vs, w)) == pytest.approx(3.0 / math.sqrt(m), rel=1e-5)
    # and the RDA direction is the mean's direction
    a, b = rda(vs, w), weighted_mean(vs, w)
    assert float(np.dot(a, b)) / (l2_norm(a) * l2_norm(b)) == pytest.approx(1.0, abs=1e-6)


def test_rda_zero_vectors():
    # a zero vector counts in the magnitude, not the direction
    np.testing.assert_allclose(rda([f32(0, 0), f32(2, 0)], [1, 1]), [1.0, 0.0])
    np.testing.assert_array_equal(rda([f32(0, 0), f32(0, 0)], [1, 2]), [0.0, 0.0])
    # exactly opposite directions: no direction, no step
    np.testing.assert_array_equal(rda([f32(1, 2), f32(-1, -2)], [1, 1]), [0.0, 0.0])
    # a zero-weight vector is ignored entirely
    np.testing.assert_allclose(rda([f32(5, 0), f32(0, 1)], [0, 1]), [0.0, 1.0])


def test_trimmed_mean_by_hand():
    vs = [f32(1, 10), f32(2, 20), f32(3, 30), f32(100, -1000)]
    # k = floor(0.25 * 4) = 1: drop one low and one high per coordinate
    np.testing.assert_allclose(trimmed_mean(vs, [1, 1, 1, 1], 0.25), [2.5, 15.0])
    # weighted: coordinate 0 keeps 2 (w=1) and 3 (w=3): (2 + 9) / 4
    # coordinate 1 keeps 10 (w=1) and 20 (w=1): 15
    np.testing.assert_allclose(trimmed_mean(vs, [1, 1, 3, 1], 0.25), [2.75, 15.0])
    # fewer than 1/f vectors: nothing trimmed, plain weighted mean
    np.testing.assert_allclose(trimmed_mean(vs[:3], [1, 1, 1], 0.25), [2.0, 20.0])


def test_clip_to_median_norm():
    small, mid, big = f32(1, 0), f32(0, 2), f32(30, 40)  # norms 1, 2, 50
    out = clip_to_median_norm([small, mid, big])
    assert out[0] is small and out[1] is mid  # not copied
    assert l2_norm(out[2]) == pytest.approx(2.0)
    np.testing.assert_allclose(out[2], [1.2, 1.6])  # direction kept
    np.testing.assert_allclose(clip_scales([1, 2, 50]), [1, 1, 0.04])


# ---------------------------------------------------------------- robustness


def poisoned(m: int = 8, n: int = 512, seed: int = 1):
    rng = np.random.default_rng(seed)
    d = rng.standard_normal(n).astype(np.float32)
    d /= l2_norm(d)
    honest = [(d + 0.3 * rng.standard_normal(n) / math.sqrt(n)).astype(np.float32)
              for _ in range(m - 1)]
    bad = (-1000.0 * d).astype(np.float32)
    return d, honest + [bad]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.dot(a, b)) / (l2_norm(a) * l2_norm(b))


def test_robust_modes_limit_one_poisoned_vector():
    d, vs = poisoned()
    w = np.ones(len(vs))
    assert cosine(merge(vs, w, "mean"), d) < -0.9  # plain mean follows the attacker
    # RDA's direction only counts the attacker once (unit vectors), but its magnitude is blown up
    assert cosine(merge(vs, w, "rda"), d) > 0.9
    assert l2_norm(merge(vs, w, "rda")) > 100
    for method, robust in [("mean", "clip"), ("rda", "clip"), ("mean", "trim")]:
        out = merge(vs, w, method, robust, trim_fraction=0.2)
        assert cosine(out, d) > 0.9, (method, robust)
        assert l2_norm(out) < 1.5, (method, robust)


def test_clip_in_merge_equals_explicit_clipping():
    _, vs = poisoned(m=5)
    w = np.arange(1, 6, dtype=float)
    clipped = clip_to_median_norm(vs)
    np.testing.assert_allclose(merge(vs, w, "mean", "clip"), weighted_mean(clipped, w),
                               rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(merge(vs, w, "rda", "clip"), rda(clipped, w),
                               rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------- layouts and buffers


def test_matrix_sequence_and_blocks_agree():
    rng = np.random.default_rng(3)
    mat = rng.standard_normal((6, 1001)).astype(np.float32)
    rows = [mat[i].copy() for i in range(6)]
    w = rng.random(6) + 0.1
    nrm = [l2_norm(v) for v in rows]
    for method in ("mean", "rda"):
        ref = merge(rows, w, method)
        np.testing.assert_allclose(merge(mat, w, method), ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(merge(rows, w, method, block=7), ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(merge(mat[:, ::2], w, method),  # not contiguous
                                   merge([r[::2] for r in rows], w, method), rtol=1e-5,
                                   atol=1e-6)
    np.testing.assert_allclose(rda(rows, w, norms=nrm), rda(rows, w), rtol=1e-6)
    np.testing.assert_allclose(trimmed_mean(rows, w, 0.2, block=10),
                               trimmed_mean(mat, w, 0.2), rtol=1e-6)
    assert [(s.start, s.stop) for s in block_slices(10, 4)] == [(0, 4), (4, 8), (8, 10)]


def test_out_buffer_is_reused_and_checked():
    vs = [f32(1, 2, 3), f32(3, 2, 1)]
    out = np.empty(3, dtype=np.float32)
    assert merge(vs, [1, 1], "mean", out=out) is out
    np.testing.assert_allclose(out, [2, 2, 2])
    assert merge(vs, [1, 1], "rda", out=out) is out
    with pytest.raises(ValueError, match="overlap"):
        merge(vs, [1, 1], "mean", out=vs[0])
    with pytest.raises(ValueError):
        merge(vs, [1, 1], "mean", out=np.empty(3, dtype=np.float64))


def test_bad_inputs():
    with pytest.raises(ValueError):
        merge([], [], "mean")
    with pytest.raises(ValueError):
        merge([f32(1, 2), f32(1, 2, 3)], [1, 1])
    with pytest.raises(ValueError):
        merge([np.zeros(2)], [1.0])  # float64
    with pytest.raises(ValueError):
        merge([f32(1, 2)], [-1.0])
    with pytest.raises(ValueError):
        merge([f32(1, 2)], [0.0])
    with pytest.raises(ValueError):
        merge([f32(1, 2)], [1.0, 2.0])
    with pytest.raises(ValueError):
        merge([f32(1, 2)], [1.0], "median")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        merge([f32(1, 2)], [1.0], "rda", "trim")
    with pytest.raises(ValueError):
        merge([f32(1, 2)], [1.0], "mean", "krum")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        trimmed_mean([f32(1, 2)], [1.0], 0.5)
    with pytest.raises(ValueError):
        rda([f32(1, 2)], [1.0], norms=[float("nan")])


def test_l2_norm_edge_cases():
    assert l2_norm(np.full(4, 1e20, dtype=np.float32)) == pytest.approx(2e20, rel=1e-6)
    assert math.isnan(l2_norm(f32(1, np.nan)))
    assert math.isinf(l2_norm(f32(1, np.inf)))
    assert l2_norm(np.zeros(0, dtype=np.float32)) == 0.0


def test_merge_does_not_copy_its_inputs():
    """Peak extra memory is the output plus a block, not M copies (numpy reports to tracemalloc)."""
    m, n = 16, 1 << 18
    vs = [np.ones(n, dtype=np.float32) for _ in range(m)]
    w = np.ones(m)
    nrm = [l2_norm(v) for v in vs]
    for method in ("mean", "rda"):
        tracemalloc.start()
        merge(vs, w, method, norms=nrm, block=1 << 14)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 1.5 * n * 4, (method, peak)  # output (1x) + one block + small change


# ---------------------------------------------------------------- properties

finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@st.composite
def batches(draw, min_m: int = 1, max_m: int = 8):
    m = draw(st.integers(min_m, max_m))
    n = draw(st.integers(1, 12))
    mat = draw(hnp.arrays(np.float32, (m, n), elements=finite))
    w = draw(hnp.arrays(np.float64, (m,), elements=st.floats(0.01, 100)))
    return mat, w


@settings(max_examples=150, deadline=None)
@given(batches())
def test_mean_is_inside_the_coordinate_range(batch):
    mat, w = batch
    out = merge(list(mat), w, "mean")
    tol = 1e-4 * (1 + np.abs(mat).max())
    assert np.all(out >= mat.min(axis=0) - tol) and np.all(out <= mat.max(axis=0) + tol)
    np.testing.assert_allclose(out, np.average(mat.astype(np.float64), axis=0, weights=w),
                               rtol=1e-4, atol=tol)
    trimmed = merge(list(mat), w, "mean", "trim", trim_fraction=0.3)
    assert np.all(trimmed >= mat.min(axis=0) - tol) and np.all(trimmed <= mat.max(axis=0) + tol)


def direction_is_defined(mat: np.ndarray, w: np.ndarray) -> bool:
    """False when the unit vectors (nearly) cancel: RDA's direction is then ill-conditioned."""
    norms = np.array([l2_norm(v) for v in mat])
    # vectors with norm <= MIN_DIRECTION_NORM (e.g. subnormals) count as zero for the direction
    u = sum((wi / ni * v.astype(np.float64) for wi, ni, v in zip(w, norms, mat) if ni > MIN_DIRECTION_NORM),
            np.zeros(mat.shape[1]))
    return bool(np.linalg.norm(u) > 1e-3 * w.max())


@settings(max_examples=150, deadline=None)
@given(batches(), st.randoms(use_true_random=False))
def test_permutation_and_weight_scale_invariance(batch, rnd):
    mat, w = batch
    perm = list(range(len(mat)))
    rnd.shuffle(perm)
    for method in ("mean", "rda"):
        if method == "rda" and not direction_is_defined(mat, w):
            continue
        a = merge(list(mat), w, method)
        b = merge([mat[i] for i in perm], w[perm] * 7.0, method)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


@settings(max_examples=150, deadline=None)
@given(batches())
def test_rda_norm_is_the_weighted_mean_norm(batch):
    mat, w = batch
    norms = np.array([l2_norm(v) for v in mat])
    out = rda(list(mat), w)
    if not direction_is_defined(mat, w):
        return
    expected = float(np.dot(w, norms) / w.sum())
    assert l2_norm(out) == pytest.approx(expected, rel=1e-3, abs=1e-3)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(np.float32, st.integers(1, 16), elements=finite),
       hnp.arrays(np.float64, st.integers(1, 6), elements=st.floats(0.1, 10)))
def test_parallel_vectors(v, scales):
    """Identical vectors merge to themselves; positive multiples: RDA = weighted mean."""
    w = np.ones(scales.size)
    same = [v.copy() for _ in scales]
    np.testing.assert_allclose(merge(same, w, "mean"), v, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(merge(same, w, "rda"), v, rtol=1e-4, atol=1e-4)
    multiples = [(s * v).astype(np.float32) for s in scales]
    np.testing.assert_allclose(merge(multiples, w, "rda"), merge(multiples, w, "mean"),
                               rtol=1e-4, atol=1e-3)
