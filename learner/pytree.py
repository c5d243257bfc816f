"""A user's JAX parameter pytree as named leaves, and fragments read from and written into it.

Leaves are named by their key path joined with ``/`` (``dense/kernel``, ``0/w``, ...): stable
for nested dicts, lists, tuples and registered dataclass-like nodes (Flax and Equinox produce
these); a flat dict of named arrays (the built-in model's) is named by its keys. Two leaves that
would get the same name (``{"a/b": x, "a": {"b": y}}``) are refused. Only floating-point leaves are synchronised (``bus.tree``); the others
stay as the user's loop leaves them.

Fragments are float32 host vectors (``bus.fragments``). Reading fragment p moves only the
leaves that fragment touches to the host; writing it back casts each touched leaf to its own dtype
(bfloat16 stays bfloat16) and puts it on its own sharding, so a model sharded over an island's
devices stays sharded as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bus.tree import TreeSpec, describe
from bus.fragments import FragmentPlan


def flatten(tree: Any) -> tuple[list[str], list[Any], Any]:
    """(paths, leaves, treedef) of ``tree``; ValueError (one line) if it has no array leaves."""
    import jax

    try:
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    except Exception as e:  # pragma: no cover - jax accepts any object as a leaf
        raise ValueError(f"params are not a JAX pytree: {e}") from None
    if not flat:
        raise ValueError(f"params are not a JAX pytree of arrays: {type(tree).__name__} has no leaves")
    paths = ["/".join(_key_name(k) for k in kp) or "<root>" for kp, _ in flat]
    return paths, [leaf for _, leaf in flat], treedef


def _key_name(k: Any) -> str:
    """One step of a leaf's path: a dict key, a sequence index, an attribute or a flattened index
    (``{"dense": {"kernel": w}}`` -> ``dense/kernel``, ``[w, b]`` -> ``0``, ``1``): for a flat
    dict of named arrays, as the built-in model's, the names are its keys."""
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def tree_spec(tree: Any) -> TreeSpec:
    """The run contract's description of ``tree`` (ValueError, one line, for anything else)."""
    paths, leaves, _ = flatten(tree)
    return describe(dict(zip(paths, leaves)))


class DonatedParams(ValueError):
    """A leaf of the parameters an island holds was deleted (donated to the user's step)."""


class TreeParams:
    """The current parameters of an island as a pytree, with fragment access by the run's plan."""

    def __init__(self, tree: Any, spec: TreeSpec, plan: FragmentPlan):
        self.spec, self.plan = spec, plan
        self._obj: Any = None
        self._leaves: list | None = None
        self._treedef: Any = None
        self.paths: list[str] = []
        self.index: dict[str, int] = {}
        self.dtypes = {leaf.path: leaf.dtype for leaf in spec.leaves}
        self.set_tree(tree)

    def check(self, tree: Any) -> None:
        """ValueError (one line) unless ``tree`` has the run's structure (cheap: compares treedefs)."""
        import jax

        if self._treedef is not None and jax.tree_util.tree_structure(tree) == self._treedef:
            return
        paths, leaves, _ = flatten(tree)
        if len(paths) != len(self.spec.leaves) or any(p != leaf.path for p, leaf in zip(paths, self.spec.leaves)):
            try:
                why = describe(dict(zip(paths, leaves))).first_difference(self.spec)
            except ValueError as e:
                why = str(e)
            raise ValueError(f"params changed structure: {why or 'leaf order'}")

    def set_tree(self, tree: Any, checked: bool = False) -> Any:
        """Take the user's newest parameters (checked against the run's tree unless ``checked``).
        Returns what held the previous ones: dropping the last reference to it frees their buffers,
        which for a big model takes tens of ms, so the caller chooses where that happens.

        Nothing is flattened here (an island's step takes the tree in the user's thread): the
        leaves are listed when a fragment is first read or written (:meth:`_flatten`), and
        :meth:`tree` hands back the very object taken while nothing was written into it."""
        import jax

        if not checked:
            self.check(tree)
        old = self._leaves if self._leaves is not None else self._obj
        if self._treedef is None:
            self._treedef = jax.tree_util.tree_structure(tree)
        self._obj, self._leaves = tree, None
        return old

    def _flatten(self) -> list:
        if self._leaves is None:
            paths, leaves, treedef = flatten(self._obj)
            self.paths, self._leaves, self._treedef = paths, list(leaves), treedef
            self.index = {p: i for i, p in enumerate(paths)}
        return self._leaves

    @property
    def leaves(self) -> list:
        return self._flatten()

    @property
    def treedef(self) -> Any:
        return self._treedef

    def tree(self) -> Any:
        import jax

        if self._obj is None:  # leaves were written: the tree of them
            self._obj = jax.tree_util.tree_unflatten(self._treedef, self._flatten())
        return self._obj

    def _leaf(self, path: str) -> Any:
        x = self._flatten()[self.index[path]]
        if getattr(x, "is_deleted", None) is not None and x.is_deleted():
            raise DonatedParams(f"leaf {path} was deleted, most likely donated to your train step "
                                "(donate_argnums): an island reads the parameters you hand it while your "
                                "next step runs, so do not donate them")
        return x

    def host(self, path: str) -> np.ndarray:
        """Leaf ``path`` as a float32 numpy array on the host (a copy)."""
        import jax

        return np.array(jax.device_get(self._leaf(path)), dtype=np.float32)

    def view(self, path: str) -> np.ndarray:
        """Leaf ``path`` as a flat host array of its own dtype: no copy where JAX can avoid one
        (a CPU array), else one transfer of the leaf."""
        import jax

        return np.asarray(jax.device_get(self._leaf(path))).reshape(-1)

    def get_fragment(self, p: int) -> np.ndarray:
        """Fragment p as a new float32 vector: only its slices are copied (and cast)."""
        frag = self.plan.fragments[p]
        out = np.empty(frag.size, dtype=np.float32)
        pos, cache = 0, {}
        for s in frag.slices:
            if s.path not in cache:
                cache[s.path] = self.view(s.path)
            out[pos:pos + s.size] = cache[s.path][s.start:s.stop]
            pos += s.size
        return out

    def fold_progress(self, p: int, base: np.ndarray, acc: np.ndarray, chunk: int = 1 << 16) -> None:
        """``acc += base - theta_p`` and ``base <- theta_p`` (float32 vectors of fragment p), in
        chunks read straight from the leaves: no array of the fragment's size (a learner's sync
        with error feedback accumulates its outer gradient into its residual this way)."""
        frag = self.plan.fragments[p]
        if base.shape != (frag.size,) or acc.shape != (frag.size,):
            raise ValueError(f"fragment {p} has {frag.size} values: base {base.shape}, acc {acc.shape}")
        tmp = np.empty(min(chunk, frag.size), dtype=np.float32)
        pos, cache = 0, {}
        for s in frag.slices:
            if s.path not in cache:
                cache[s.path] = self.view(s.path)
            leaf = cache[s.path]
            for a in range(0, s.size, chunk):
                b = min(s.size, a + chunk)
                theta = leaf[s.start + a:s.start + b].astype(np.float32, copy=False)
                old = base[pos + a:pos + b]
                t = tmp[:b - a]
                np.subtract(old, theta, out=t)
                acc[pos + a:pos + b] += t
                old[...] = theta
            pos += s.size

    def set_fragment(self, p: int, vector: np.ndarray) -> None:
        import jax

        frag = self.plan.fragments[p]
        touched: dict[str, np.ndarray] = {}
        pos = 0
        for s in frag.slices:
            if s.path not in touched:
                touched[s.path] = self.host(s.path)
            touched[s.path].reshape(-1)[s.start:s.stop] = vector[pos:pos + s.size]
            pos += s.size
        leaves = self._flatten()
        for path, value in touched.items():
            i = self.index[path]
            old = leaves[i]
            new = value.astype(_np_dtype(self.dtypes[path]))
            if isinstance(old, jax.Array):
                leaves[i] = jax.device_put(new, old.sharding)
            else:
                leaves[i] = new
        self._obj = None  # tree() rebuilds it from the leaves


def _np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def named_float_arrays(tree: Any) -> dict[str, np.ndarray]:
    """path -> float32 host copy of every floating-point leaf of ``tree`` (version 0 of a run)."""
    import jax

    paths, leaves, _ = flatten(tree)
    spec = describe(dict(zip(paths, leaves)))
    return {leaf.path: np.array(jax.device_get(x), dtype=np.float32)
            for leaf, x in zip(spec.leaves, leaves) if leaf.synced}
