"""What a Byzantine learner sends (pure): outer gradients that pass every check of the aggregator.

Issue 29. Each kind keeps the shape, the counters and (but for ``random``) the norm of an honest
contribution, so validation, the norm bound, the outlier check and the norm caps all pass it:

* ``sign``: the negation of the outer gradient the learner really trained (same norm);
* ``random``: a direction drawn at random, at the median honest norm of the fragment;
* ``replay``: one of the learner's own earlier whole-round vectors again, under a new round number
  (a fresh object, so no duplicate check sees it);
* ``corrupt``: the learner trains on corrupted data (the tokens of every sequence shuffled) and
  sends what it trained, honestly.

Used by the in-process reference (``simulation.reference``, ``RefConfig.byzantine``) and by the system
benchmark's lying learner (``bench.byzantine_learner``), so both attack the same way.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

KINDS = ("sign", "random", "replay", "corrupt")
REPLAY_KEPT = 16  # whole-round vectors a replaying learner keeps per fragment to replay from


def sign_flip(delta: np.ndarray) -> np.ndarray:
    return -np.asarray(delta, dtype=np.float32)


def random_direction(size: int, norm: float, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random direction of ``size`` values scaled to ``norm``."""
    v = rng.standard_normal(size).astype(np.float32)
    n = float(np.linalg.norm(v))
    return v * np.float32(norm / n) if n > 0 else v


def replay_pick(kept: list[np.ndarray], rng: np.random.Generator) -> np.ndarray | None:
    """One of the learner's own earlier vectors (uniformly), or None before it has any."""
    if not kept:
        return None
    return kept[int(rng.integers(len(kept)))]


def keep_for_replay(kept: list[np.ndarray], vec: np.ndarray) -> list[np.ndarray]:
    return (kept + [np.array(vec, copy=True)])[-REPLAY_KEPT:]


def shuffle_tokens(batch: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Every sequence's tokens in a random order (each row permuted on its own): the learner still
    trains, on data without its order, and its outer gradients point wherever that leads."""
    b = np.array(batch, copy=True)
    if b.ndim < 2:
        return rng.permutation(b)
    idx = np.argsort(rng.random(b.shape), axis=-1)
    return np.take_along_axis(b, idx, axis=-1)


def corrupted(batches: Iterator, seed: int) -> Iterator:
    """``batches`` with :func:`shuffle_tokens` applied to every one (a numpy batch of token ids)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    for b in batches:
        yield shuffle_tokens(b, rng)
