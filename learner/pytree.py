"""A user's JAX parameter pytree as named leaves, and fragments read from and written into it.

Leaves are named by their key path joined with ``/`` (``dense/kernel``, ``0/w``, ...): stable
for nested dicts, lists, tuples and registered dataclass-like nodes (Flax and Equinox produce
these); a flat dict of named arrays (the built-in model's) is named by its keys. Two leaves that
would get the same name (``{"a/b": x, "a": {"b": y}}``) are refused.

Trees come as users have them: a Flax NNX ``nnx.State`` (``nnx.split(model)``) or the NNX module
itself (a pytree in Flax 0.12), an Equinox module with its activation functions as leaves, a
dict of arrays. Only floating-point array leaves are synchronised (``bus.tree``); the others
(integer and bool arrays, PRNG keys typed or legacy, functions, Python scalars, strings) stay as
the user's loop leaves them: they are never read, never sent, and the tree handed back holds the
user's own objects for them (:func:`local_leaves_summary` names them in one line).

Fragments are float32 host vectors (``bus.fragments``). Reading fragment p moves only the
leaves that fragment touches to the host; writing it back casts each touched leaf to its own dtype
(bfloat16 stays bfloat16) and puts it on its own sharding, so a model sharded over an island's
devices stays sharded as it was.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bus.tree import OBJECT_PREFIX, TreeSpec, describe
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
    return _describe(paths, leaves)


def _describe(paths: list[str], leaves: list[Any]) -> TreeSpec:
    """``bus.tree.describe`` of the named leaves, refusing (one line naming the leaf) the values
    that look like arrays but hold none: a tracer (the island called inside ``jax.jit``) and an
    abstract ``jax.ShapeDtypeStruct``."""
    import jax

    for path, x in zip(paths, leaves):
        if isinstance(x, jax.core.Tracer):
            raise ValueError(f"leaf {path} is a traced value ({type(x).__name__}), not an array: "
                             "hand the island concrete parameters, outside jax.jit")
        if isinstance(x, jax.ShapeDtypeStruct):
            raise ValueError(f"leaf {path} is a jax.ShapeDtypeStruct (a shape, no values), not an array")
    return describe(dict(zip(paths, leaves)))


def local_leaves_summary(spec: TreeSpec, limit: int = 6) -> str | None:
    """One line naming the leaves of ``spec`` that stay local to each island (never sent), at most
    ``limit`` of them then a count, or None if every leaf is synced. For instance ``3 of 9 leaves stay
    on this island, never sent: activation (custom_jvp), final_activation (function), seen (int32)``."""
    local = spec.local
    if not local:
        return None

    def kind(dtype: str) -> str:
        return dtype[len(OBJECT_PREFIX):] if dtype.startswith(OBJECT_PREFIX) else dtype

    names = [f"{leaf.path} ({kind(leaf.dtype)})" for leaf in local[:limit]]
    more = f", and {len(local) - limit} more" if len(local) > limit else ""
    return (f"{len(local)} of {len(spec.leaves)} leaves stay on this island, never sent: "
            f"{', '.join(names)}{more}")


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
        self._synced = frozenset(leaf.path for leaf in spec.synced)
        self.shapes = {leaf.path: tuple(leaf.shape) for leaf in spec.synced}
        # each synced leaf's sharding as last flattened (None: not a JAX array): an arrival's delta
        # is put there ahead of its swap (learner.swap), from another thread
        self.placement: dict[str, Any] = {}
        self.set_tree(tree)
        if tree is not None:
            self._flatten()  # the placement of the first tree (an island that created the run loads nothing)

    def check(self, tree: Any) -> None:
        """ValueError (one line) unless ``tree`` has the run's structure (cheap: compares treedefs).
        A tree of another treedef (an Equinox module whose static fields differ, say) is compared
        leaf by leaf: its synced leaves must be the run's, its local ones may be anything."""
        import jax

        if self._treedef is not None and jax.tree_util.tree_structure(tree) == self._treedef:
            return
        paths, leaves, _ = flatten(tree)
        try:
            why = _describe(paths, leaves).first_difference(self.spec)
        except ValueError as e:
            why = str(e)
        run = [leaf.path for leaf in self.spec.leaves]
        if why is None and paths != run:  # the synced leaves are the run's: a local leaf came or went
            new, gone = [p for p in paths if p not in set(run)], [p for p in run if p not in set(paths)]
            why = (f"leaf {new[0]} is new" if new else f"leaf {gone[0]} is missing" if gone else "leaf order")
        if why is not None:
            raise ValueError(f"params changed structure: {why}")

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
            self.placement = {p: getattr(x, "sharding", None) for p, x in zip(paths, leaves) if p in self._synced}
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
        if path not in self._synced:  # local leaves (keys, functions, counters) are never read
            raise ValueError(f"leaf {path} is not synchronised ({self.dtypes.get(path, 'not in the tree')})")
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

    def view(self, path: str, leaves: dict[str, Any] | None = None) -> np.ndarray:
        """Leaf ``path`` as a flat host array of its own dtype: no copy where JAX can avoid one
        (a CPU array), else one transfer of the leaf. ``leaves``: a snapshot taken by
        :meth:`fragment_leaves` (read from another thread while the parameters move on)."""
        import jax

        x = self._leaf(path) if leaves is None else leaves[path]
        return np.asarray(jax.device_get(x)).reshape(-1)

    def fragment_leaves(self, p: int) -> dict[str, Any]:
        """The leaves fragment p reads, by path: a snapshot of this step's parameters (JAX arrays
        are immutable, so holding them costs nothing until the user's loop would have freed them).
        An island's outer gradient is computed from it in the learner's side thread while the
        user's next steps run (``learner.core``)."""
        return {s.path: self._leaf(s.path) for s in self.plan.fragments[p].slices}

    def get_fragment(self, p: int, leaves: dict[str, Any] | None = None) -> np.ndarray:
        """Fragment p as a new float32 vector: only its slices are copied (and cast)."""
        frag = self.plan.fragments[p]
        out = np.empty(frag.size, dtype=np.float32)
        pos, cache = 0, {}
        for s in frag.slices:
            if s.path not in cache:
                cache[s.path] = self.view(s.path, leaves)
            out[pos:pos + s.size] = cache[s.path][s.start:s.stop]
            pos += s.size
        return out

    def fold_progress(self, p: int, base: np.ndarray, acc: np.ndarray, chunk: int = 1 << 16,
                      leaves: dict[str, Any] | None = None, overwrite: bool = False) -> None:
        """``acc += base - theta_p`` (``overwrite``: ``acc = base - theta_p``) and ``base <- theta_p``
        (float32 vectors of fragment p), in chunks read straight from the leaves (or the snapshot
        ``leaves``): no array of the fragment's size (a learner's sync with a float32 residual
        accumulates its outer gradient into the residual this way; with a bfloat16 one it writes it
        into a scratch)."""
        frag = self.plan.fragments[p]
        if base.shape != (frag.size,) or acc.shape != (frag.size,):
            raise ValueError(f"fragment {p} has {frag.size} values: base {base.shape}, acc {acc.shape}")
        tmp = np.empty(min(chunk, frag.size), dtype=np.float32)
        pos, cache = 0, {}
        for s in frag.slices:
            if s.path not in cache:
                cache[s.path] = self.view(s.path, leaves)
            leaf = cache[s.path]
            for a in range(0, s.size, chunk):
                b = min(s.size, a + chunk)
                theta = leaf[s.start + a:s.start + b].astype(np.float32, copy=False)
                old = base[pos + a:pos + b]
                if overwrite:
                    np.subtract(old, theta, out=acc[pos + a:pos + b])
                else:
                    t = tmp[:b - a]
                    np.subtract(old, theta, out=t)
                    acc[pos + a:pos + b] += t
                old[...] = theta
            pos += s.size

    def add_to_slices(self, parts: list[tuple[str, int, Any, Any]]) -> None:
        """``leaf[start:start + n] += d`` for each (path, start, d, compiled add) of an arrival
        prepared by ``learner.swap.prepare``: one dispatch per slice (an accelerator runs the adds
        after the call returns). A leaf whose placement changed since the preparation (its sharding,
        or no longer a JAX array) is added on the host and put back where it is now."""
        import jax

        leaves = self._flatten()
        new: dict[int, Any] = {}
        for path, start, d, fn in parts:
            i = self.index[path]
            x = new.get(i, leaves[i])
            if isinstance(x, jax.Array) and x.sharding == d.sharding:
                new[i] = fn(x, d) if d.size == x.size and start == 0 else fn(x, d, np.int32(start))
                continue
            host = np.array(jax.device_get(x), dtype=np.float32)
            host.reshape(-1)[start:start + d.size] += np.asarray(jax.device_get(d), dtype=np.float32)
            host = host.astype(np_dtype(self.dtypes[path]))
            new[i] = jax.device_put(host, x.sharding) if isinstance(x, jax.Array) else host
        for i, x in new.items():
            leaves[i] = x
        self._obj = None  # tree() rebuilds it from the leaves

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
            new = value.astype(np_dtype(self.dtypes[path]))
            if isinstance(old, jax.Array):
                leaves[i] = jax.device_put(new, old.sharding)
            else:
                leaves[i] = new
        self._obj = None  # tree() rebuilds it from the leaves


def np_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def named_float_arrays(tree: Any) -> dict[str, np.ndarray]:
    """path -> float32 host copy of every floating-point leaf of ``tree`` (version 0 of a run)."""
    import jax

    paths, leaves, _ = flatten(tree)
    spec = _describe(paths, leaves)
    return {leaf.path: np.array(jax.device_get(x), dtype=np.float32)
            for leaf, x in zip(spec.leaves, leaves) if leaf.synced}
