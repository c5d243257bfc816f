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


def test_the_base_follows_a_swap_whether_or_not_it_moved_meanwhile():
    """Not moved: the base becomes the version itself, bit for bit. Moved (an outer gradient of the
    fragment was prepared after D was taken: base <- theta_k): theta and base both move by D, so
    what the next outer gradient holds is the progress since step k, exactly as after the plain
    rebase."""
    from learner import swap

    tp = _tree_params(1)
    theta0 = tp.get_fragment(0)
    base_b = theta0 - np.float32(0.25)
    version = base_b + np.float32(0.5)
    sw = _swap(tp, 0, 7, version, base_b, gen=3)
    assert swap.new_base(sw, base_b.copy(), 3) is version  # the generation did not move

    theta_k = theta0 + np.float32(0.125)  # a sync at step k sent base_b - theta_k; base <- theta_k
    tp.set_fragment(0, theta_k + np.float32(0.0625))  # progress since step k, then the swap lands
    tp.add_to_slices(sw.parts)
    base = swap.new_base(sw, theta_k.copy(), 4)
    progress = tp.get_fragment(0) - base
    bf16 = np.array([s.path == "h" for s in tp.plan.fragments[0].slices for _ in range(s.size)])
    np.testing.assert_allclose(progress[~bf16], 0.0625, atol=1e-6)
    np.testing.assert_allclose(progress[bf16], 0.0625, atol=0.05)


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
