"""The run contract for any model: a description of its parameter tree (pure, numpy only).

A run of a user's own model knows nothing of the model but this: the leaves of its parameter tree,
each a path (its key path joined with ``/``, e.g. ``dense/kernel``; ``learner.pytree``), a shape and a
dtype. The floating-point leaves are the ones a run synchronises; the others (step counters,
integer buffers) stay on each island. The fragment plan is made from the float leaves' shapes
(``bus.fragments.plan_fragments``), and the manifest of a run carries the tree description
and a hash of it, so a learner whose tree differs from the run's is refused with one line naming
the first leaf that differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

FLOAT_KINDS = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Leaf:
    path: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def synced(self) -> bool:
        """Floating-point leaves are synchronised; the rest stay on each island."""
        return self.dtype in FLOAT_KINDS

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass(frozen=True)
class TreeSpec:
    """The leaves of a parameter tree, in the tree's own (flattening) order."""

    leaves: tuple[Leaf, ...]

    def __post_init__(self) -> None:
        paths = [leaf.path for leaf in self.leaves]
        if len(set(paths)) != len(paths):
            raise ValueError("leaf paths must be unique")
        if not any(leaf.synced for leaf in self.leaves):
            raise ValueError("the parameter tree has no floating-point leaf: nothing to train across islands "
                             f"(leaf dtypes: {sorted({leaf.dtype for leaf in self.leaves}) or 'none'})")

    @property
    def synced(self) -> tuple[Leaf, ...]:
        return tuple(leaf for leaf in self.leaves if leaf.synced)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """path -> shape of the synced leaves: what the fragment plan is made from."""
        return {leaf.path: leaf.shape for leaf in self.synced}

    @property
    def num_params(self) -> int:
        """Values synchronised (float leaves only)."""
        return sum(leaf.size for leaf in self.synced)

    def to_dict(self) -> dict:
        return {"leaves": [[leaf.path, list(leaf.shape), leaf.dtype] for leaf in self.leaves]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "TreeSpec":
        try:
            leaves = tuple(Leaf(str(p), tuple(int(x) for x in s), str(t)) for p, s, t in d["leaves"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed tree description: {e}") from None
        return cls(leaves)

    def tree_hash(self) -> str:
        """16 hex digits of sha256 over the canonical description of the synced leaves (paths,
        shapes, dtypes, in order). Non-float leaves are each island's own: not part of the run."""
        data = json.dumps(TreeSpec(self.synced).to_dict(), separators=(",", ":"), sort_keys=True).encode()
        return hashlib.sha256(data).hexdigest()[:16]

    def first_difference(self, other: "TreeSpec") -> str | None:
        """None if the synced (float) leaves are equal, else one line naming the first that differs
        (ours against ``other``, the run's). Non-float leaves are not compared: they are not synced."""
        ours, run = self.synced, other.synced
        theirs = {leaf.path: leaf for leaf in run}
        mine = {leaf.path for leaf in ours}
        for leaf in ours:
            if leaf.path not in theirs:
                return f"leaf {leaf.path} is not in the run's tree"
        for o in run:
            if o.path not in mine:
                return f"leaf {o.path} of the run's tree is missing"
        for i, leaf in enumerate(ours):
            o = theirs[leaf.path]
            if o.shape != leaf.shape:
                return f"leaf {leaf.path}: shape {leaf.shape}, the run's is {o.shape}"
            if o.dtype != leaf.dtype:
                return f"leaf {leaf.path}: dtype {leaf.dtype}, the run's is {o.dtype}"
            if run[i].path != leaf.path:
                return f"leaf {leaf.path} is at position {i}, the run's tree has {run[i].path} there"
        return None


def describe(arrays: Mapping[str, object]) -> TreeSpec:
    """The TreeSpec of named arrays (anything with ``shape`` and ``dtype``; numpy or JAX)."""
    leaves = []
    for path, a in arrays.items():
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise ValueError(f"leaf {path} is a {type(a).__name__}, not an array")
        leaves.append(Leaf(str(path), tuple(int(x) for x in a.shape), np.dtype(a.dtype).name))
    return TreeSpec(tuple(leaves))
