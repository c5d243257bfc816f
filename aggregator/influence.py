"""Bounded influence of one contribution (pure): the norm bound and the norm cap of a merge.

A learner's host may be buggy or compromised while it still speaks with its own credentials, and
an honest learner cut off for a while sends one outer gradient of thousands of inner steps. Either
way one vector must not move a fragment by much more than an ordinary contribution does, from
version 0 on, and the outer Nesterov momentum (which keeps applying a gradient for about
1 / (1 - momentum) merges) must not turn one big vector into a run-wide divergence.

Two checks, both per fragment of n parameters:

* **Geometric bound (rejects; holds from version 0, needs no history).** An AdamW inner step moves
  every parameter by at most about its learning rate (the update m / (sqrt(v) + eps) is at most
  about 1 per coordinate, plus weight decay), so S inner steps at a peak learning rate of at most
  ``max_inner_lr`` (declared by the run's manifest) move a fragment by at most

      bound(S) = BOUND_SLACK * max_inner_lr * sqrt(n) * S

  Measured on this project's model (chaos runs, warm-up included) honest 8-step outer gradients
  reached 0.63-0.75 of max_inner_lr * sqrt(n) * S; ``BOUND_SLACK`` = 2 leaves room for weight
  decay and carried quantisation error. A vector above it is rejected as ``norm_bound``.

* **Norm cap (clips; in every merge).** Each contribution's norm is clipped to

      cap = clip_factor * median of the fragment's recent applied norms   (>= min_history known)
      cap = bound(min(S, reference_steps)) / BOUND_SLACK                   (before that)

  so after the first few contributions no single vector counts for more than ``clip_factor``
  ordinary ones, however many steps it claims, and before that no more than an honest AdamW
  learner moving every parameter by the full learning rate on every step (honest ones measured
  at 0.63-0.75 of that). A vector just under the rejection bound sent at version 0, when one
  learner may be the whole run (participation scale 1), was still worth about 3 honest ones and
  left the run measurably worse at its end; at this cap it is worth at most about 1.4.
  The reference is the median of the last 64 *whole-round* norms of the fragment, each recorded as
  sent up to the geometric bound of ``reference_steps`` steps: a median of 64 is moved by one order
  statistic per large vector, not to its size, and no recorded norm exceeds what an honest
  contribution can have. Partial rounds (a staggered fragment's first sync, a final sync) are
  merged but not recorded. Recording them and the clipped norms (this module's first version)
  could lock the reference to the warm-up scale of the first syncs: the next rounds were then all
  clipped to 3x that (measured with ``simulation.reference``: docs/aggregator.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

BOUND_SLACK = 2.0
"""bound(S) = BOUND_SLACK * max_inner_lr * sqrt(n) * S (see module docstring for the measurement)."""


def norm_bound(max_inner_lr: float, size: int, steps: int) -> float:
    """Largest norm an honest outer gradient of ``steps`` AdamW steps of a fragment of ``size``
    parameters can have when no learner's peak learning rate exceeds ``max_inner_lr``."""
    if not (max_inner_lr > 0 and math.isfinite(max_inner_lr)):
        raise ValueError(f"max_inner_lr must be finite and > 0, got {max_inner_lr}")
    return BOUND_SLACK * float(max_inner_lr) * math.sqrt(max(0, int(size))) * max(0, int(steps))


def outlier_steps(inner_steps: int, period: int = 0) -> float:
    """What an outer gradient's norm is divided by for the outlier check and its reference: its
    inner steps s, or, for a round shorter than its learner's declared period p (a final sync, a
    staggered first one), sqrt(s p), at most p. The norm of s steps grows like s while the steps
    drift one way, but like sqrt(s) once their noise dominates (near a minimum, an Adam step is
    about lr whichever way it points): divided by s, a final sync of 6 of 12 steps looked an
    outlier and was rejected, one per island at the end of every short test run
    (tests/test_work_fate.py, under load). A partial round's allowance never exceeds a whole
    round's, so a contribution cannot claim more room by declaring fewer steps; and a declared
    period counts up to 64 s (at most 8x the room of the plain rule: a period is the learner's
    word, and 2**31 would otherwise buy sqrt(2**31))."""
    s = max(1, int(inner_steps))
    p = min(int(period) if period else 0, 64 * s)
    return math.sqrt(s * p) if 0 < s < p else float(s)


def norm_caps(norms: Sequence[float], steps: Sequence[int], *, size: int, history_median: float | None,
              history_count: int, clip_factor: float, min_history: int = 3,
              max_inner_lr: float | None = None, reference_steps: int = 8) -> np.ndarray:
    """Per contribution, the norm it may have in the merge (float64, len M; inf = no cap).

    With at least ``min_history`` applied norms of the fragment known: ``clip_factor`` x their
    median. Before that: the geometric bound of min(steps, reference_steps) inner steps over
    BOUND_SLACK, i.e. every parameter moved by the full learning rate on every step (if the run
    declares ``max_inner_lr``; else no cap). ``clip_factor`` <= 0 disables the cap.
    """
    m = len(norms)
    if len(steps) != m:
        raise ValueError(f"{m} norms but {len(steps)} step counts")
    caps = np.full(m, math.inf, dtype=np.float64)
    if clip_factor <= 0:
        return caps
    if history_median is not None and history_count >= min_history and history_median > 0:
        caps[:] = clip_factor * float(history_median)
    elif max_inner_lr is not None:
        for i, s in enumerate(steps):
            caps[i] = norm_bound(max_inner_lr, size, min(max(1, int(s)), reference_steps)) / BOUND_SLACK
    return caps


def cap_scales(norms: Sequence[float], caps: Sequence[float]) -> np.ndarray:
    """s_i = min(1, cap_i / |v_i|): the factor that brings v_i within its cap (1 for a zero vector)."""
    nrm = np.asarray(norms, dtype=np.float64)
    cap = np.asarray(caps, dtype=np.float64)
    if nrm.shape != cap.shape:
        raise ValueError(f"norms {nrm.shape} and caps {cap.shape} differ in shape")
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(nrm > cap, cap / np.where(nrm > 0, nrm, 1.0), 1.0)


def cap_weights(raw: Sequence[float], max_ratio: float) -> np.ndarray:
    """Raw merge weights with none above ``max_ratio`` x the median raw weight (float64).

    Token weights are tokens x tokens/steps, computed from counters the learner reports: a learner
    claiming a huge batch would otherwise outweigh everyone else in a merge. ``max_ratio`` <= 0
    disables the cap."""
    arr = np.asarray(raw, dtype=np.float64)
    if max_ratio <= 0 or arr.size < 2:
        return arr
    limit = max_ratio * float(np.median(arr))
    return np.minimum(arr, limit) if limit > 0 else arr
