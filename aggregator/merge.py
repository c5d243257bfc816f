"""Merging M outer-gradient vectors of one fragment into one (numpy only, pure, fast).

Notation: v_1..v_M are flat float32 vectors of length n (one per accepted contribution), w_i >= 0
their weights (see :mod:`aggregator.weights`), W = sum_i w_i, |.| the Euclidean norm.

- weighted mean:      mean = sum_i w_i v_i / W
- radial-directional  rda  = (sum_i w_i |v_i| / W) * unit(sum_i w_i unit(v_i)),  unit(x) = x/|x|
  averaging (RDA):    (unit(0) = 0: a zero vector adds weight to the magnitude, not the direction)
- clip to median:     v_i <- v_i * min(1, median_j |v_j| / |v_i|)
- trimmed mean:       per coordinate, drop the floor(f*M) smallest and largest values, then the
                      weighted mean of the rest.

Outer gradients of different learners are nearly orthogonal, so the plain mean of M of them has a
norm about 1/sqrt(M) of theirs; RDA keeps the weighted mean norm and the weighted mean direction
(DESIGN.md section 3, Decoupled DiLoCo). Use "mean" where the contributions point the same way
(the published recipe kept plain averaging for the embedding fragment).

Speed and memory. Merging is memory-bound, so every kernel reads each input once and never stacks
copies of the inputs: the output is accumulated in place, block by block, so the block of ``out``
and one scratch block stay in cache while each input streams through once.

- ``weighted_mean`` / ``rda``: the output (n float32, pass ``out=`` to reuse a buffer) plus one
  scratch block (``block`` float32 values, 1 MiB by default). ``rda`` also reads every input once
  more to take its norm unless you pass ``norms=`` (validation already computed them: reuse them).
- Fastest input layout: one C-contiguous (M, n) float32 matrix whose rows are the contributions
  (decode messages straight into its rows); then the sum is a single BLAS matrix-vector product.
- ``trimmed_mean`` sorts each coordinate: tens of times slower than the mean (0.3-0.6 GB/s of
  input on one core here) and holds an (M, block) stack plus its argsort (about 20 bytes x M x
  block) per block.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Literal, Union

import numpy as np

from aggregator.influence import cap_scales
from aggregator.int8vec import Int8Vector, is_vector, read

Vectors = Union[Sequence[np.ndarray], np.ndarray]
"""A sequence of M flat float32 vectors of equal length (arrays or :class:`aggregator.int8vec.Int8Vector`
s, decoded block by block as they are read), or an (M, n) float32 matrix."""

DEFAULT_BLOCK = 1 << 18
"""Elements per block for the streaming kernels (1 MiB of float32: fits in L2/L3 with ``out``)."""

MIN_DIRECTION_NORM = 1e-30
"""RDA: vectors with a norm at most this have no direction (they still count in the magnitude)."""

CANCEL_TOL = 1e-6
"""RDA: if |sum_i w_i unit(v_i)| / W is at most this, the directions cancel and the result is 0."""

METHODS = ("mean", "rda")
ROBUST = (None, "none", "clip", "trim")


def block_slices(n: int, block: int = DEFAULT_BLOCK) -> Iterator[slice]:
    """Consecutive slices of length ``block`` (the last may be shorter) covering range(n)."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    for start in range(0, n, block):
        yield slice(start, min(start + block, n))


def l2_norm(v) -> float:
    """|v| in one read pass: a BLAS dot (float32 accumulation) per block of ``DEFAULT_BLOCK`` values,
    the blocks summed in float64. ``v``: a flat float32 array or an Int8Vector (decoded block by
    block: the same blocks, so the same norm bit for bit as its decoded array's).

    If the float32 sum of squares overflows (values above ~1e19), underflows towards subnormals
    (norms below ~1e-15) or the vector holds inf/nan, the norm is recomputed blockwise in
    float64, so the result is accurate, and inf or nan only if it truly is.
    """
    if isinstance(v, Int8Vector):
        scratch = np.empty(min(DEFAULT_BLOCK, max(v.size, 1)), dtype=np.float32)
    else:
        v, scratch = np.asarray(v).reshape(-1), None
    s = 0.0
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for sl in block_slices(v.size, DEFAULT_BLOCK):
            blk = read(v, sl, scratch)
            s += float(np.dot(blk, blk))
    if 1e-30 < s < math.inf:
        return math.sqrt(s)
    total = 0.0
    for sl in block_slices(v.size, 1 << 16):
        blk = read(v, sl, scratch).astype(np.float64)
        total += float(np.dot(blk, blk))
    return math.sqrt(total)


def _as_rows(vectors: Vectors) -> tuple[Sequence[np.ndarray], int]:
    """Check the inputs: M >= 1 flat float32 vectors of one length n. Returns (rows, n).

    ``rows`` is the matrix itself for a 2-D input (so the gemv path can see it), else a list.
    """
    if isinstance(vectors, np.ndarray):
        if vectors.ndim != 2:
            raise ValueError(f"a matrix of vectors must be 2-D (M, n), got shape {vectors.shape}")
        rows: Sequence[np.ndarray] = vectors
    else:
        rows = list(vectors)
    if len(rows) == 0:
        raise ValueError("cannot merge zero vectors")
    n = rows[0].shape[-1] if rows[0].ndim else -1
    for i, v in enumerate(rows):
        if not is_vector(v) or v.ndim != 1:
            raise ValueError(f"vector {i} is not a flat 1-D array")
        if v.dtype != np.float32:
            raise ValueError(f"vector {i} has dtype {v.dtype}, expected float32")
        if v.size != n:
            raise ValueError(f"vector {i} has length {v.size}, expected {n}")
    return rows, n


def _check_weights(w: np.ndarray | Sequence[float], m: int) -> np.ndarray:
    """Weights as float64, length m, finite, >= 0, positive sum."""
    arr = np.asarray(w, dtype=np.float64)
    if arr.ndim != 1 or arr.size != m:
        raise ValueError(f"expected {m} weights, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"weights must be finite and >= 0, got {arr}")
    if arr.sum() <= 0:
        raise ValueError("weights sum to zero: nothing to merge")
    return arr


def _out_buffer(out: np.ndarray | None, n: int, rows: Sequence[np.ndarray]) -> np.ndarray:
    """``out`` checked (contiguous float32, length n, not overlapping an input) or a new array."""
    if out is None:
        return np.empty(n, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (n,) or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous float32 array of shape ({n},)")
    overlaps = (np.may_share_memory(out, rows) if isinstance(rows, np.ndarray)
                else any(np.may_share_memory(out, v.codes if isinstance(v, Int8Vector) else v) for v in rows))
    if overlaps:
        raise ValueError("out must not overlap the input vectors")
    return out


def _combine(rows: Vectors, coeffs: np.ndarray, out: np.ndarray, block: int) -> float:
    """out = sum_i coeffs_i * rows_i in float32, each input read once; returns |out|^2.

    A contiguous (M, n) float32 matrix goes through one BLAS gemv; a sequence is streamed
    block by block (:func:`combine_blocks`) so the output block and one scratch block stay in
    cache, and |out|^2 is summed per block while the block is still in cache. Rows with
    coefficient 0 are not read.
    """
    if isinstance(rows, np.ndarray) and rows.flags.c_contiguous:
        np.dot(coeffs.astype(np.float32), rows, out=out)
        nrm = l2_norm(out)
        return nrm * nrm
    sq = 0.0
    for sl, o, s in combine_blocks(rows, coeffs, out.size, block, out=out):
        sq += s
    if not 1e-30 < sq < math.inf:  # float32 over/underflow inside a block: recompute exactly
        nrm = l2_norm(out)
        return nrm * nrm
    return sq


def combine_blocks(rows: Vectors, coeffs: np.ndarray, n: int, block: int = DEFAULT_BLOCK,
                   out: np.ndarray | None = None) -> Iterator[tuple[slice, np.ndarray, float]]:
    """sum_i coeffs_i * rows_i one block at a time: (slice, its values, their float32 sum of squares)
    per block of ``block`` values, in order. The values are ``out[slice]`` when ``out`` is given,
    else one scratch block reused (valid until the next block is asked for): a consumer that applies
    each block at once needs no buffer of size n (``aggregator.step.merge_step``)."""
    c32 = np.asarray(coeffs).astype(np.float32)
    terms = [(rows[i], c32[i]) for i in range(len(rows)) if c32[i] != 0]
    m = min(block, max(n, 1))
    scratch = np.empty(m, dtype=np.float32)
    own = np.empty(m, dtype=np.float32) if out is None else None
    for sl in block_slices(n, block):
        o = out[sl] if out is not None else own[: sl.stop - sl.start]
        if not terms:
            o.fill(0.0)
            yield sl, o, 0.0
            continue
        s = scratch[: o.size]
        with np.errstate(over="ignore", invalid="ignore", under="ignore"):  # (not around the yield)
            v0, c0 = terms[0]
            np.multiply(read(v0, sl, o), c0, out=o)  # an Int8Vector's block is decoded into o itself
            for v, c in terms[1:]:
                np.multiply(read(v, sl, s), c, out=s)
                np.add(o, s, out=o)
            sq = float(np.dot(o, o))
        yield sl, o, sq


def _norms(rows: Sequence[np.ndarray], norms: np.ndarray | Sequence[float] | None) -> np.ndarray:
    if norms is None:
        return np.array([l2_norm(v) for v in rows], dtype=np.float64)
    arr = np.asarray(norms, dtype=np.float64)
    if arr.shape != (len(rows),) or not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"norms must be {len(rows)} finite values >= 0, got {arr}")
    return arr


def weighted_mean(
    vectors: Vectors,
    w: np.ndarray | Sequence[float],
    *,
    out: np.ndarray | None = None,
    block: int = DEFAULT_BLOCK,
    gain: float = 1.0,
) -> np.ndarray:
    """mean = gain x sum_i w_i v_i / W, accumulated in float32 into ``out`` (allocated if None).

    Weights need not be normalised. Memory: ``out`` plus one scratch block; inputs are not copied.
    """
    rows, coeffs, n = linear_terms(vectors, w, gain=gain)
    buf = _out_buffer(out, n, rows)
    _combine(rows, coeffs, buf, block)
    return buf


def _rda(
    rows: Sequence[np.ndarray],
    wt: np.ndarray,
    norms: np.ndarray,
    magnitudes: np.ndarray,
    out: np.ndarray,
    block: int,
) -> np.ndarray:
    """RDA with separate norms for the direction (unit(v_i) = v_i/norms_i) and the magnitude.

    Each term (w_i/W) v_i/|v_i| has norm w_i/W <= 1, so the float32 sum u stays O(1). A vector
    with |v| <= MIN_DIRECTION_NORM counts as zero for the direction (its unit vector cannot be
    formed in float32); |u| <= CANCEL_TOL means the directions cancel to within rounding.
    """
    target = float(np.dot(wt, magnitudes) / wt.sum())
    has_dir = norms > MIN_DIRECTION_NORM
    coeffs = np.where(has_dir, (wt / wt.sum()) / np.where(has_dir, norms, 1.0), 0.0)
    if target == 0.0 or not np.any(coeffs > 0):  # every vector is zero (or weighs nothing)
        out.fill(0.0)
        return out
    u = math.sqrt(_combine(rows, coeffs, out, block))
    if not u > CANCEL_TOL * float(wt[has_dir].sum() / wt.sum()):
        out.fill(0.0)  # directions cancel: no defined direction, so no step
        return out
    np.multiply(out, np.float32(target / u), out=out)
    return out


def rda(
    vectors: Vectors,
    w: np.ndarray | Sequence[float],
    *,
    norms: np.ndarray | Sequence[float] | None = None,
    out: np.ndarray | None = None,
    block: int = DEFAULT_BLOCK,
) -> np.ndarray:
    """Radial-directional averaging: (sum_i w_i |v_i| / W) * unit(sum_i w_i unit(v_i)).

    Computed as u = sum_i (w_i/|v_i|) v_i (one streaming pass), then out = u * target/|u|.
    Zero vectors (|v| <= MIN_DIRECTION_NORM) count in the magnitude average but carry no
    direction; if every vector is zero, or the unit vectors cancel (|sum w_i unit(v_i)| / W <=
    CANCEL_TOL), the result is the zero vector (no step).

    Pass ``norms`` (|v_i|, e.g. from validation) to skip a full read of the inputs.
    Memory: ``out`` plus one scratch block.
    """
    rows, n = _as_rows(vectors)
    wt = _check_weights(w, len(rows))
    nrm = _norms(rows, norms)
    buf = _out_buffer(out, n, rows)
    return _rda(rows, wt, nrm, nrm, buf, block)


def clip_scales(norms: np.ndarray | Sequence[float]) -> np.ndarray:
    """s_i = min(1, median_j |v_j| / |v_i|): the factor that clips v_i to the median norm."""
    arr = np.asarray(norms, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("need at least one norm")
    med = float(np.median(arr))
    return np.where(arr > med, med / np.where(arr > 0, arr, 1.0), 1.0)


def clip_to_median_norm(
    vectors: Vectors, *, norms: np.ndarray | Sequence[float] | None = None
) -> list[np.ndarray]:
    """Scale each vector whose norm exceeds the median norm down to the median norm.

    Returns a list: vectors at or below the median are returned as they are (same objects, not
    copied), clipped ones are new arrays. :func:`merge` does not call this: it folds the same
    factors into the weights and costs nothing extra. Against one poisoned learner this bounds
    its influence to what an ordinary learner has; with M = 2 the median is the mean of the two.
    """
    rows, _ = _as_rows(vectors)
    scales = clip_scales(_norms(rows, norms))
    return [v if s >= 1.0 else v * np.float32(s) for v, s in zip(rows, scales)]


def trimmed_mean(
    vectors: Vectors,
    w: np.ndarray | Sequence[float],
    trim_fraction: float,
    *,
    out: np.ndarray | None = None,
    block: int | None = None,
) -> np.ndarray:
    """Coordinate-wise trimmed weighted mean.

    With k = floor(trim_fraction * M): for every coordinate j, sort v_1[j]..v_M[j], drop the k
    smallest and the k largest, and return sum w_i v_i[j] / sum w_i over the values kept (each
    value keeps its own learner's weight). trim_fraction must be in [0, 0.5). With fewer than
    1/trim_fraction vectors, k = 0 and this is the weighted mean: trimming needs M >= 3 to act.

    Memory: ``out`` plus an (M, block) float32 stack and its argsort per block (default block:
    about 2**20 / M elements, i.e. ~20 MiB of temporaries at most).
    """
    rows, n = _as_rows(vectors)
    m = len(rows)
    wt = _check_weights(w, m)
    if not 0.0 <= trim_fraction < 0.5:
        raise ValueError(f"trim_fraction must be in [0, 0.5), got {trim_fraction}")
    k = int(math.floor(trim_fraction * m))
    buf = _out_buffer(out, n, rows)
    if k == 0:
        _combine(rows, wt / wt.sum(), buf, DEFAULT_BLOCK)
        return buf
    blk = block if block is not None else max(1024, (1 << 20) // m)
    equal = bool(np.all(wt == wt[0]))
    w_col = wt.astype(np.float32)[:, None]
    stack = np.empty((m, min(blk, n)), dtype=np.float32)
    for sl in block_slices(n, blk):
        size = sl.stop - sl.start
        s = stack[:, :size]
        for i, v in enumerate(rows):
            if isinstance(v, Int8Vector):
                v.read(sl, s[i])
            else:
                s[i] = v[sl]
        if equal:
            s.sort(axis=0)
            np.mean(s[k : m - k], axis=0, out=buf[sl])
            continue
        order = np.argsort(s, axis=0)
        kept = order[k : m - k]
        vals = np.take_along_axis(s, kept, axis=0)
        ws = np.take_along_axis(np.broadcast_to(w_col, s.shape), kept, axis=0)
        num = np.einsum("ij,ij->j", vals, ws)
        den = ws.sum(axis=0)
        # A coordinate whose kept values all have weight 0: fall back to their plain mean.
        np.divide(num, den, out=buf[sl], where=den > 0)
        zero = den <= 0
        if np.any(zero):
            buf[sl][zero] = vals[:, zero].mean(axis=0)
    return buf


def merge(
    vectors: Vectors,
    w: np.ndarray | Sequence[float],
    method: Literal["mean", "rda"] = "rda",
    robust: Literal["none", "clip", "trim"] | None = None,
    *,
    trim_fraction: float = 0.2,
    norms: np.ndarray | Sequence[float] | None = None,
    caps: np.ndarray | Sequence[float] | None = None,
    out: np.ndarray | None = None,
    block: int = DEFAULT_BLOCK,
    gain: float = 1.0,
) -> np.ndarray:
    """Merge one fragment's contributions: ``method`` in {"mean", "rda"}, ``robust`` in
    {None, "clip", "trim"} ("none" is accepted for None). ``gain`` multiplies the result, folded
    into the coefficients of the one streaming pass (no second pass, no temporary).

    ``caps`` (one per vector, inf = none): every vector is first scaled down to at most its cap
    (bounded influence, :mod:`aggregator.influence`), folded into the weights like "clip".

    - robust="clip": every vector above the median norm is scaled down to it before merging
      (folded into the weights: no extra pass, no copy). Works with both methods; with RDA the
      directions are unchanged and only the magnitude average uses the clipped norms.
    - robust="trim": coordinate-wise trimmed mean (``trim_fraction``); only with method="mean"
      (RDA's magnitude/direction split has no coordinate-wise form). Slower, see trimmed_mean.

    Turn on a robust mode when a broken or hostile learner may pass validation (norm outlier
    rejection catches only norms above k x the running median). "clip" is nearly free; "trim"
    also resists a few coordinates blown up while the norm stays plausible, but needs M >= 3 and
    costs tens of times the mean.
    """
    if method not in METHODS:
        raise ValueError(f"unknown merge method {method!r}, expected one of {METHODS}")
    if robust not in ROBUST:
        raise ValueError(f"unknown robust mode {robust!r}, expected one of {ROBUST}")
    if robust == "none":
        robust = None
    if robust == "trim" and method != "mean":
        raise ValueError("robust='trim' is only defined for method='mean'")
    gain = float(gain)
    if not (math.isfinite(gain) and gain >= 0):
        raise ValueError(f"gain must be finite and >= 0, got {gain}")
    capped = caps is not None and bool(np.any(np.isfinite(np.asarray(caps, dtype=np.float64))))
    if not capped and robust == "trim":
        return _gained(trimmed_mean(vectors, w, trim_fraction, out=out), gain)
    if method == "mean" and robust != "trim":
        rows, coeffs, n = linear_terms(vectors, w, robust, norms=norms, caps=caps, gain=gain)
        buf = _out_buffer(out, n, rows)
        _combine(rows, coeffs, buf, block)
        return buf
    rows, n = _as_rows(vectors)
    wt = _check_weights(w, len(rows))
    nrm = _norms(rows, norms)  # needed by RDA, clipping and caps
    scales = cap_scales(nrm, np.asarray(caps, dtype=np.float64)) if capped else np.ones(len(rows))
    if robust == "trim":  # coordinate-wise: scale the capped vectors themselves (copies)
        rows = [v if s >= 1.0 else v * np.float32(s) for v, s in zip(rows, scales)]
        return _gained(trimmed_mean(rows, wt, trim_fraction, out=out), gain)
    if robust == "clip":
        scales = scales * clip_scales(nrm * scales)
    return _rda(rows, wt, nrm, nrm * scales * gain, _out_buffer(out, n, rows), block)


def linear_terms(vectors: Vectors, w: np.ndarray | Sequence[float], robust: str | None = None, *,
                 norms: np.ndarray | Sequence[float] | None = None, caps: np.ndarray | Sequence[float] | None = None,
                 gain: float = 1.0) -> tuple[Vectors, np.ndarray, int]:
    """The mean merge (``robust`` None or "clip", with ``caps``) as sum_i c_i v_i: (rows, the
    coefficients c, n). :func:`merge` combines them into its output; ``aggregator.step`` applies
    them block by block (:func:`combine_blocks`)."""
    if robust not in (None, "none", "clip"):
        raise ValueError(f"the mean with robust={robust!r} is not a linear combination")
    gain = float(gain)
    capped = caps is not None and bool(np.any(np.isfinite(np.asarray(caps, dtype=np.float64))))
    rows, n = _as_rows(vectors)
    wt = _check_weights(w, len(rows))
    if not capped and robust != "clip":
        return rows, wt * gain / wt.sum(), n
    nrm = _norms(rows, norms)  # needed by clipping and caps
    scales = cap_scales(nrm, np.asarray(caps, dtype=np.float64)) if capped else np.ones(len(rows))
    if robust == "clip":
        scales = scales * clip_scales(nrm * scales)
    return rows, wt * scales * gain / wt.sum(), n


def _gained(buf: np.ndarray, gain: float) -> np.ndarray:
    if gain != 1.0:
        np.multiply(buf, np.float32(gain), out=buf)
    return buf
