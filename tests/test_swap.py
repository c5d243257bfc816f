"""An arrived version swapped into an island's parameters (learner.swap): the same rebase as the
plain path, on slices of leaves and on bfloat16 leaves, with a base that moved meanwhile; and the
fragments it cannot serve fall back to the plain path. Pure: JAX on the CPU, no server."""

from __future__ import annotations

import os
import subprocess

import numpy as np

from tests.system import PY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tree_params(num_fragments: int = 3):
    import jax.numpy as jnp

    from bus.runs import plan_for
    from learner.pytree import TreeParams, tree_spec

    rng = np.random.default_rng(0)
    tree = {"big": jnp.asarray(rng.standard_normal((40, 9)), jnp.float32),  # split over fragments
            "h": jnp.asarray(rng.standard_normal(17), jnp.bfloat16),
            "n": jnp.array(3, jnp.int32)}
    spec = tree_spec(tree)
    return TreeParams(tree, spec, plan_for(spec, num_fragments, 1.1))


def _swap(tp, p, version, vector, base, gen=0):
    from learner import swap

    tp.leaves  # noqa: B018 (flattened once: the placement is known, as after an island's first step)
    return swap.prepare(tp.plan.fragments[p], version, vector, base, gen, dict(tp.placement), tp.shapes, tp.dtypes)


def test_a_swap_is_the_plain_rebase_on_slices_and_bfloat16_leaves():
    from learner.outer import rebase
    from learner.pytree import TreeParams

    tp = _tree_params()
    plain = TreeParams(tp.tree(), tp.spec, tp.plan)
    assert any(len(f.slices) > 1 or f.slices[0].start > 0 for f in tp.plan.fragments)  # slices are tested
    rng = np.random.default_rng(1)
    for p, frag in enumerate(tp.plan.fragments):
        base = tp.get_fragment(p) - rng.standard_normal(frag.size).astype(np.float32) * 0.01  # progress made
        version = base + rng.standard_normal(frag.size).astype(np.float32) * 0.1
        sw = _swap(tp, p, 5, version, base)
        assert sw.parts is not None and len(sw.parts) == len(frag.slices)
        tp.add_to_slices(sw.parts)
        plain.set_fragment(p, rebase(plain.get_fragment(p), base, version))
        got, want = tp.get_fragment(p), plain.get_fragment(p)
        bf16 = np.array([s.path == "h" for s in frag.slices for _ in range(s.size)])
        # theta + (V - base) against V + (theta - base): float32 rounding; bfloat16 leaves round
        # to their 8 bits either way
        np.testing.assert_allclose(got[~bf16], want[~bf16], rtol=0, atol=1e-6)
        np.testing.assert_allclose(got[bf16], want[bf16], rtol=2 ** -7, atol=1e-3)
    out = tp.tree()
    assert out["h"].dtype.name == "bfloat16" and out["big"].shape == (40, 9) and int(out["n"]) == 3


def test_a_leaf_whose_placement_changed_since_the_preparation_is_added_on_the_host():
    """The user's step may hand back a leaf placed elsewhere than when the swap was prepared (here:
    a numpy array instead of a JAX one): that slice is added on the host and put back as it is now."""
    import jax.numpy as jnp

    tp = _tree_params(2)
    rng = np.random.default_rng(2)
    before = [tp.get_fragment(p) for p in range(2)]
    swaps = []
    for p, frag in enumerate(tp.plan.fragments):
        d = rng.standard_normal(frag.size).astype(np.float32)
        swaps.append((_swap(tp, p, 1, before[p] + d, before[p]), d))
    moved = dict(tp.tree())
    moved["big"] = np.asarray(moved["big"])  # no longer a JAX array
    tp.set_tree(moved)
    for sw, _ in swaps:
        assert sw.parts is not None
        tp.add_to_slices(sw.parts)
    for p, (_, d) in enumerate(swaps):
        got = tp.get_fragment(p) - before[p]
        bf16 = np.array([s.path == "h" for s in tp.plan.fragments[p].slices for _ in range(s.size)])
        np.testing.assert_allclose(got[~bf16], d[~bf16], atol=1e-5)
        np.testing.assert_allclose(got[bf16], d[bf16], atol=0.05)
    out = tp.tree()
    assert isinstance(out["big"], np.ndarray) and out["h"].dtype == jnp.bfloat16


def test_a_fragment_it_cannot_place_takes_the_plain_path():
    tp = _tree_params(1)
    frag = tp.plan.fragments[0]
    tp.leaves  # noqa: B018
    from learner import swap

    v = np.zeros(frag.size, np.float32)
    placement = dict(tp.placement)
    placement["big"] = None  # a numpy leaf, or one not flattened yet
    assert swap.prepare(frag, 1, v, v, 0, placement, tp.shapes, tp.dtypes).parts is None


SHARDED = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bus.runs import plan_for
from learner import swap
from learner.pytree import TreeParams, tree_spec
mesh = Mesh(np.array(jax.devices()), ("d",))
tree = {"w": jax.device_put(jnp.zeros((16, 4)), NamedSharding(mesh, P("d"))), "b": jnp.zeros(3)}
tp = TreeParams(tree, tree_spec(tree), plan_for(tree_spec(tree), 1, 1.1))
tp.leaves
v = np.ones(67, np.float32)
sw = swap.prepare(tp.plan.fragments[0], 1, v, v * 0, 0, dict(tp.placement), tp.shapes, tp.dtypes)
print("plain" if sw.parts is None else "swap")
'''


def test_a_leaf_sharded_over_devices_takes_the_plain_path():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([PY, "-c", SHARDED], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "plain", p.stderr[-2000:]
