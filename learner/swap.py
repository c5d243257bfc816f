"""An arrived global version swapped into an island's parameters without holding the user's step.

The rebase of fragment p on arrival of a new global version Theta_p (``learner.outer.rebase``)

    theta_p <- Theta_p + (theta_p - base_p),   base_p <- Theta_p

is the same as ``theta_p <- theta_p + D_p`` with ``D_p = Theta_p - base_p``. Everything but that
last add is known the moment the version is downloaded: the learner's side thread computes D_p,
puts it on the leaf's device and compiles the add (:func:`prepare`), while the user's steps go on;
at the next step boundary the island only dispatches one compiled add per slice of the fragment
(:meth:`learner.pytree.TreeParams.add_to_slices`), which on an accelerator returns before the add
has run, and on a CPU is one pass over the fragment's values, not the host round trip of every
touched leaf (get, rebase, cast, put) that the plain path pays.

D_p is taken against the base as it will be when the swap lands: the side thread runs everything
that moves a base (outer gradients: ``base_p <- theta_k``, swaps, resyncs) in the order it was
queued, and the learner counts, per fragment, what it queued (``gen``). A swap prepared before more
base-moving work of its fragment was queued is prepared again (``learner.core._swap_in``): with the
base moved to theta_k, the old D would add back the progress the outer gradient just sent. So an
island ends exactly where the plain rebase puts it (up to float32 rounding: ``theta + (Theta -
base)`` against ``Theta + (theta - base)``), and its base is Theta_p itself, bit for bit.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np

from bus.fragments import Fragment
from learner.pytree import np_dtype


@dataclasses.dataclass
class Swap:
    """Fragment ``fragment``'s version ``version`` ready to be swapped in.

    ``parts``: (leaf path, start in the flattened leaf, D of that slice on the leaf's device, the
    compiled add), or None when the fragment has a leaf this path cannot serve (a leaf sharded over
    several devices, a numpy leaf, a leaf whose placement is not known yet): then the plain rebase
    runs at the step boundary. ``gen``: the learner's count of base-moving work queued for this
    fragment when the preparation was queued."""

    fragment: int
    version: int
    vector: np.ndarray
    gen: int
    parts: list[tuple[str, int, Any, Any]] | None


_compiled: dict[tuple, Any] = {}
_lock = threading.Lock()


def _add(shape: tuple[int, ...], dtype: Any, n: int, full: bool, sharding: Any):
    """The compiled ``leaf[start:start + n] += d`` (in float32, cast back to the leaf's dtype) for
    one leaf shape, dtype, slice length and placement, compiled once per process."""
    import jax
    import jax.numpy as jnp

    key = (shape, str(dtype), n, full, sharding)
    with _lock:
        fn = _compiled.get(key)
    if fn is not None:
        return fn
    leaf = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    d = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding)
    if full:
        def add_full(x, d):
            return (x.astype(jnp.float32) + d.reshape(shape)).astype(x.dtype)
        fn = jax.jit(add_full).lower(leaf, d).compile()
    else:
        def add_slice(x, d, start):
            flat = x.reshape(-1)
            seg = jax.lax.dynamic_slice(flat, (start,), (n,))
            seg = (seg.astype(jnp.float32) + d).astype(x.dtype)
            return jax.lax.dynamic_update_slice(flat, seg, (start,)).reshape(shape)
        fn = jax.jit(add_slice).lower(leaf, d, jax.ShapeDtypeStruct((), jnp.int32)).compile()
    with _lock:
        _compiled[key] = fn
    return fn


def placeable(sharding: Any) -> bool:
    """A leaf on one device: its slice of D goes there whole."""
    try:
        return sharding is not None and len(sharding.device_set) == 1
    except Exception:
        return False


def prepare(frag: Fragment, version: int, vector: np.ndarray, base: np.ndarray, gen: int,
            placement: dict[str, Any], shapes: dict[str, tuple[int, ...]], dtypes: dict[str, str]) -> Swap:
    """Side thread: D = vector - base for fragment ``frag``, sliced by leaf, put on each leaf's
    device, with the compiled add of each slice. ``placement``: each leaf's sharding as the island
    last saw it (``TreeParams.placement``)."""
    import jax

    paths = {s.path for s in frag.slices}
    if not all(placeable(placement.get(p)) for p in paths):
        return Swap(frag.index, version, vector, gen, None)
    d = np.subtract(vector, base, dtype=np.float32)
    parts = []
    pos = 0
    for s in frag.slices:
        shape = tuple(shapes[s.path])
        size = int(np.prod(shape, dtype=np.int64)) if shape else 1
        full = s.start == 0 and s.stop == size
        sh = placement[s.path]
        fn = _add(shape, np_dtype(dtypes[s.path]), s.size, full, sh)
        parts.append((s.path, s.start, jax.device_put(d[pos:pos + s.size], sh), fn))
        pos += s.size
    del d
    return Swap(frag.index, version, vector, gen, parts)
