"""Contribution weights: Decoupled DiLoCo token weight times an asynchronous-FL staleness factor.

For contribution m with tokens T_m and inner steps S_m, computed from global version b_m of its
fragment, while the fragment is now at version v:

    token weight     q_m = T_m * (T_m / S_m)        ("quantity x quality": tokens, times tokens
                                                      per step, i.e. the learner's batch size)
    staleness        d_m = (v - b_m) // R  in rounds: R = versions per round, the number of active
                     learners (each merges on its own with K=1); >= 0, validation rejects d < 0
                     and d > max_staleness. Contributions of the same round are not stale: with
                     K=1 the third to arrive is 2 versions behind the base all three started from.
    factor           s(d) = 1                                  constant
                     s(d) = (1 + d)^-a                         polynomial (FedAsync, a=0.5 common)
                     s(d) = 1 if d <= b else 1/(a (d - b) + 1) hinge
    weight           w_m = q_m * s(d_m) / sum_j q_j * s(d_j)   (normalised: sum_m w_m = 1)

Operational advice: Liu et al. (arXiv 2401.09135) found staleness weights alone did not close the
gap to synchronous training; they matter most with slow islands (d of several versions). If a slow
learner's contributions barely move the model, lower ``a`` or use a hinge with ``b`` at the
staleness the slow learner normally has; if it drags the model back, raise ``a``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from aggregator.contribution import Contribution
from aggregator.influence import cap_weights

StalenessKind = Literal["constant", "polynomial", "hinge"]
KINDS: tuple[str, ...] = ("constant", "polynomial", "hinge")


@dataclass(frozen=True)
class StalenessPolicy:
    """How much a contribution computed d versions ago still counts (see module docstring).

    ``a`` is the exponent (polynomial) or the slope (hinge); ``b`` is the hinge's free staleness:
    contributions at most ``b`` versions old count in full.
    """

    kind: StalenessKind = "constant"
    a: float = 0.5
    b: int = 4

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown staleness kind {self.kind!r}, expected one of {KINDS}")
        if not (math.isfinite(self.a) and self.a >= 0):
            raise ValueError(f"staleness a must be finite and >= 0, got {self.a}")
        if isinstance(self.b, bool) or not isinstance(self.b, int) or self.b < 0:
            raise ValueError(f"staleness b must be an int >= 0, got {self.b!r}")

    def factor(self, d: int) -> float:
        """s(d) for staleness d >= 0 (raises ValueError for d < 0: a base from the future)."""
        if d < 0:
            raise ValueError(f"negative staleness {d}: base version is ahead of the fragment")
        if self.kind == "constant":
            return 1.0
        if self.kind == "polynomial":
            return float((1.0 + d) ** -self.a)
        if d <= self.b:
            return 1.0
        return 1.0 / (self.a * (d - self.b) + 1.0)


def token_weight(tokens: int, steps: int) -> float:
    """q = tokens * (tokens / steps). Raises ValueError unless tokens >= 0 and steps > 0."""
    if steps <= 0 or tokens < 0:
        raise ValueError(f"token weight needs steps > 0 and tokens >= 0, got {tokens}, {steps}")
    return float(tokens) * (float(tokens) / float(steps))


def normalise(raw: np.ndarray | Sequence[float]) -> np.ndarray:
    """raw / sum(raw) as float64. Raises ValueError on empty, negative, non-finite or all-zero."""
    arr = np.asarray(raw, dtype=np.float64)
    if arr.size == 0:
        raise ValueError("no weights to normalise (no contributions)")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"weights must be finite and >= 0, got {arr}")
    total = float(arr.sum())
    if total <= 0:
        raise ValueError("all weights are zero: every contribution had zero tokens or factor")
    return arr / total


def rounds_behind(current_version: int, base_version: int, per_round: int = 1) -> int:
    """Staleness in rounds: (current - base) // per_round (negative for a base from the future)."""
    return (int(current_version) - int(base_version)) // max(1, int(per_round))


def contribution_weights(
    contribs: Sequence[Contribution],
    current_version: int | Mapping[int, int],
    policy: StalenessPolicy = StalenessPolicy(),
    *,
    token_weighted: bool = True,
    per_round: int = 1,
    max_weight_ratio: float = 0.0,
) -> np.ndarray:
    """w_m = q_m * s(rounds_behind(current_version, base_version_m, per_round)), normalised to sum 1
    (float64, len M).

    ``current_version`` is the fragment's version now (an int, or a mapping fragment -> version
    when the contributions are of several fragments). ``token_weighted=False`` sets every q_m = 1
    (plain staleness-weighted average).

    ``max_weight_ratio`` > 0: no raw weight above that many times the median raw weight
    (:func:`aggregator.influence.cap_weights`), so counters a learner reports cannot let its
    contribution outweigh the others by more than that factor.

    Raises ValueError on an empty list, a base version ahead of the current one, non-positive
    steps, or when every weight is zero.
    """
    if len(contribs) == 0:
        raise ValueError("no contributions to weight")
    raw = np.empty(len(contribs), dtype=np.float64)
    for i, c in enumerate(contribs):
        v = current_version[c.fragment] if isinstance(current_version, Mapping) else current_version
        q = token_weight(c.tokens, c.inner_steps) if token_weighted else 1.0
        raw[i] = q * policy.factor(rounds_behind(v, c.base_version, per_round))
    return normalise(cap_weights(raw, max_weight_ratio))
