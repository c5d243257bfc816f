"""The run contract for any model: a description of its parameter tree (pure, numpy only).

A run of a user's own model knows nothing of the model but this: the leaves of its parameter tree,
each a path (its key path joined with ``/``, e.g. ``dense/kernel``; ``learner.pytree``), a shape and a
dtype. The floating-point array leaves (float16, bfloat16, float32, float64) are the ones a run
synchronises; every other leaf stays on each island and is never sent:

* integer and bool arrays (step counters, integer buffers, legacy ``uint32`` PRNG keys, an NNX
  ``Rngs`` count): their numpy dtype name (``int32``, ``uint32``, ``bool``);
* typed PRNG keys (``jax.random.key``, the key of ``nnx.Dropout(rngs=...)``): their JAX dtype, e.g.
  ``key<fry>``, and their shape;
* anything that is not an array (the activation functions of an Equinox module, Python scalars,
  strings): ``object:<type name>`` (``object:custom_jvp``, ``object:function``, ``object:float``),
  shape ``()``. A Python ``float`` in a tree is local too: in Equinox modules such floats are
  hyperparameters (``eqx.nn.Dropout.p``); a scalar to train is a ``jnp.array(0.5)``.

The description is deterministic (type names, never object identities or addresses), so islands
holding the same model describe it alike. The fragment plan is made from the float leaves' shapes
(``bus.fragments.plan_fragments``), and the manifest of a run carries the tree description and a
hash of its synced leaves, so a learner whose tree differs from the run's is refused with one line
naming the first synced leaf that differs; local leaves may differ between islands. A leaf that
claims to be an array but cannot be described (a shape that is not sizes, a dtype neither numpy nor
JAX keys know) is refused with one line naming it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

FLOAT_KINDS = ("float16", "bfloat16", "float32", "float64")
OBJECT_PREFIX = "object:"  # the dtype of a leaf that is not an array: ``object:<type name>``


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
            objects = [leaf for leaf in self.leaves if leaf.dtype.startswith(OBJECT_PREFIX)]
            kind = objects[0].dtype[len(OBJECT_PREFIX):] if objects else ""
            article = "an" if kind[:1].lower() in "aeiou" else "a"
            hint = f"; leaf {objects[0].path} is {article} {kind}, not an array" if objects else ""
            raise ValueError("the parameter tree has no floating-point leaf: nothing to train across islands "
                             f"(leaf dtypes: {sorted({leaf.dtype for leaf in self.leaves}) or 'none'}{hint})")

    @property
    def synced(self) -> tuple[Leaf, ...]:
        return tuple(leaf for leaf in self.leaves if leaf.synced)

    @property
    def local(self) -> tuple[Leaf, ...]:
        """The leaves each island keeps to itself (never sent)."""
        return tuple(leaf for leaf in self.leaves if not leaf.synced)

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


def describe_leaf(path: str, a: object) -> Leaf:
    """The Leaf of one value: an array (anything with ``shape`` and ``dtype``; numpy or JAX) by its
    shape and dtype name, a typed PRNG key by its JAX dtype (``key<fry>``), anything else as
    ``object:<type name>`` of shape ``()``. ValueError (one line naming the leaf) for an array-like
    value whose shape is not sizes or whose dtype is neither numpy's nor a PRNG key's."""
    path = str(path)
    if (isinstance(a, type)  # a class (np.float32) has shape and dtype attributes too
            or not (hasattr(a, "shape") and hasattr(a, "dtype")) or getattr(a, "dtype") is None):
        return Leaf(path, (), OBJECT_PREFIX + type(a).__name__)
    try:
        shape = tuple(int(x) for x in a.shape)  # type: ignore[attr-defined]
    except (TypeError, ValueError):
        shape = None
    if shape is None or any(x < 0 for x in shape):
        raise ValueError(f"leaf {path} is a {type(a).__name__} of shape {getattr(a, 'shape')!r}, "
                         "not a shape of sizes: pass concrete arrays")
    return Leaf(path, shape, dtype_name(path, a))


def dtype_name(path: str, a: object) -> str:
    """numpy's name of ``a``'s dtype (``float32``, ``bfloat16``, ``int32``), or a typed PRNG key's JAX
    dtype (``key<fry>``, ``key<rbg>``). ValueError naming the leaf for any other dtype: it might be a
    float that would silently never be synced."""
    dt = getattr(a, "dtype")
    try:
        return np.dtype(dt).name
    except (TypeError, ValueError):
        pass
    name = str(dt)
    if name.startswith("key<") and name.endswith(">"):
        return name
    raise ValueError(f"leaf {path} is a {type(a).__name__} of dtype {name}, which is neither a numpy dtype nor "
                     "a JAX PRNG key: convert it to a JAX or numpy array")


def describe(arrays: Mapping[str, object]) -> TreeSpec:
    """The TreeSpec of named leaves (arrays, numpy or JAX, and any other values: :func:`describe_leaf`)."""
    return TreeSpec(tuple(describe_leaf(path, a) for path, a in arrays.items()))
