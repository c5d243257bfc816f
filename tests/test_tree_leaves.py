"""Trees as users bring them (pure, no server): which leaves a run synchronises and which stay on
each island (typed and legacy PRNG keys, functions, Python scalars, strings, integer arrays), the
tree description's determinism, fragments read from and written into Equinox modules and Flax
NNX states and modules (local leaves come back as the user's own objects), save/load of such
models, and the one-line errors naming a leaf that cannot be described."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import orjson
import pytest

from tests.system import PY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _dtypes(spec) -> dict[str, str]:
    return {leaf.path: leaf.dtype for leaf in spec.leaves}


def _nnx_model(seed: int = 0, width: int = 8, dropout_seed: int = 0):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(3, width, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)
            self.out = nnx.Linear(width, 1, rngs=rngs)

    return Net(nnx.Rngs(params=seed, dropout=dropout_seed))


def _eqx_model(seed: int = 0, width: int = 8):
    import equinox as eqx
    import jax

    return eqx.nn.MLP(3, 1, width, 2, key=jax.random.key(seed))


def _round_trip(tree, num_fragments: int = 2):
    """Every fragment read, +1, written back: (TreeParams, the tree handed back)."""
    from bus.runs import plan_for
    from learner.pytree import TreeParams, tree_spec

    spec = tree_spec(tree)
    tp = TreeParams(tree, spec, plan_for(spec, num_fragments, 1.1))
    for p in range(num_fragments):
        tp.set_fragment(p, tp.get_fragment(p) + 1.0)
    return tp, tp.tree()


def _assert_round_trip(tree, out) -> None:
    """``out`` has ``tree``'s structure, its float leaves are ``tree``'s + 1 in their own dtype, and
    every other leaf is the very object of ``tree``."""
    import jax

    from learner.pytree import flatten, tree_spec

    assert type(out) is type(tree)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(tree)
    spec = tree_spec(tree)
    _, before, _ = flatten(tree)
    _, after, _ = flatten(out)
    for leaf, a, b in zip(spec.leaves, before, after):
        if leaf.synced:
            assert b.dtype == a.dtype and isinstance(b, jax.Array), leaf.path
            np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32) + 1, rtol=1e-6)
        else:
            assert b is a, leaf.path


# -- which leaves are synced -------------------------------------------------------------------------


def test_typed_prng_keys_are_local_with_their_jax_dtype_and_shape():
    import jax
    import jax.numpy as jnp

    from learner.pytree import tree_spec

    tree = {"w": jnp.ones((2, 3)), "k": jax.random.key(0), "ks": jax.random.split(jax.random.key(1), 4),
            "rbg": jax.random.key(2, impl="rbg"), "legacy": jax.random.PRNGKey(3)}
    spec = tree_spec(tree)
    assert _dtypes(spec) == {"k": "key<fry>", "ks": "key<fry>", "legacy": "uint32", "rbg": "key<rbg>",
                             "w": "float32"}
    leaves = {leaf.path: leaf for leaf in spec.leaves}
    assert leaves["k"].shape == () and leaves["ks"].shape == (4,) and leaves["legacy"].shape == (2,)
    assert [leaf.path for leaf in spec.synced] == ["w"] and spec.num_params == 6


def test_functions_scalars_strings_and_integer_arrays_are_local_float_arrays_synced():
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from learner.pytree import tree_spec

    tree = {"relu": jax.nn.relu, "fn": lambda x: x, "name": "mlp", "none": None, "n": 3, "p": 0.5, "flag": True,
            "cls": np.float32, "count": jnp.zeros((), jnp.int32), "mask": np.ones(4, bool),
            "w32": jnp.ones(3), "w16": np.ones(2, np.float16), "wbf": jnp.ones(2, ml_dtypes.bfloat16),
            "w64": np.float64(1.5)}
    spec = tree_spec(tree)
    assert "none" not in _dtypes(spec)  # None is no leaf of a JAX pytree
    assert _dtypes(spec) == {
        "cls": "object:type", "count": "int32", "flag": "object:bool", "fn": "object:function",
        "mask": "bool", "n": "object:int", "name": "object:str", "p": "object:float",
        "relu": "object:custom_jvp", "w16": "float16", "w32": "float32", "w64": "float64", "wbf": "bfloat16"}
    assert sorted(leaf.path for leaf in spec.synced) == ["w16", "w32", "w64", "wbf"]
    assert all(leaf.shape == () for leaf in spec.leaves if leaf.dtype.startswith("object:"))


def test_equinox_and_nnx_trees_describe_their_local_leaves():
    import jax

    from learner.pytree import tree_spec

    eqx_spec = tree_spec(_eqx_model())
    assert {leaf.path: leaf.dtype for leaf in eqx_spec.local} == {"activation": "object:custom_jvp",
                                                                  "final_activation": "object:function"}
    assert [leaf.path for leaf in eqx_spec.synced][:2] == ["layers/0/weight", "layers/0/bias"]
    model = _nnx_model()
    from flax import nnx

    _, state = nnx.split(model)
    nnx_spec = tree_spec(state)
    assert {leaf.path: leaf.dtype for leaf in nnx_spec.local} == {"drop/rngs/count/value": "uint32",
                                                                  "drop/rngs/key/value": "key<fry>"}
    assert len(jax.tree_util.tree_leaves(model)) == len(nnx_spec.leaves)  # an NNX module is a pytree too
    assert tree_spec(model) == nnx_spec  # ... described as its state: the same run


def test_a_python_float_hyperparameter_of_an_equinox_module_is_local():
    import equinox as eqx
    import jax

    from learner.pytree import tree_spec

    class Net(eqx.Module):
        linear: eqx.nn.Linear
        dropout: eqx.nn.Dropout
        scale: float

    net = Net(eqx.nn.Linear(3, 2, key=jax.random.key(0)), eqx.nn.Dropout(0.1), 2.0)
    d = _dtypes(tree_spec(net))
    assert d == {"linear/weight": "float32", "linear/bias": "float32", "dropout/p": "object:float",
                 "dropout/inference": "object:bool", "scale": "object:float"}


# -- the description is deterministic and comparable ---------------------------------------------------


DESCRIBE = r'''
import orjson, sys
sys.path.insert(0, "tests")
from test_tree_leaves import _eqx_model, _nnx_model
from flax import nnx
from learner.pytree import tree_spec
out = {}
for name, tree in (("eqx", _eqx_model(seed=5)), ("nnx", nnx.split(_nnx_model(seed=5, dropout_seed=9))[1])):
    spec = tree_spec(tree)
    out[name] = [spec.to_dict(), spec.tree_hash()]
print(orjson.dumps(out).decode())
'''


def test_the_description_is_deterministic_across_processes_and_seeds():
    from bus.tree import TreeSpec
    from flax import nnx

    from learner.pytree import tree_spec

    mine = {"eqx": tree_spec(_eqx_model(seed=0)), "nnx": tree_spec(nnx.split(_nnx_model(seed=1, dropout_seed=2))[1])}
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([PY, "-c", DESCRIBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    theirs = orjson.loads(p.stdout)
    for name, spec in mine.items():
        d, h = theirs[name]
        assert d == spec.to_dict() and h == spec.tree_hash(), name  # another process, other seeds: equal
        again = TreeSpec.from_dict(orjson.loads(orjson.dumps(d)))
        assert again == spec and again.first_difference(spec) is None
    # local leaves are not the run's: another activation, another key kind, no key at all
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    other = eqx.nn.MLP(3, 1, 8, 2, activation=jnp.tanh, final_activation=jax.nn.sigmoid, key=jax.random.key(3))
    assert tree_spec(other).tree_hash() == mine["eqx"].tree_hash()
    assert tree_spec(other).first_difference(mine["eqx"]) is None
    wider = tree_spec(_eqx_model(width=9))
    assert wider.first_difference(mine["eqx"]) == "leaf layers/0/weight: shape (9, 3), the run's is (8, 3)"
    a = tree_spec({"w": jnp.ones(3), "k": jax.random.key(0)})
    b = tree_spec({"w": jnp.ones(3), "k": jax.random.PRNGKey(0)})
    assert a.tree_hash() == b.tree_hash() == tree_spec({"w": jnp.ones(3)}).tree_hash()


# -- fragments into and out of the user's own objects -------------------------------------------------


def test_tree_params_round_trip_an_equinox_module():
    model = _eqx_model()
    tp, out = _round_trip(model)
    _assert_round_trip(model, out)
    assert out.activation is model.activation and out.final_activation is model.final_activation
    tp.check(_eqx_model(seed=4))  # same structure, other values: fine
    with pytest.raises(ValueError, match=r"params changed structure: leaf layers/0/weight: shape \(9, 3\)"):
        tp.check(_eqx_model(width=9))
    with pytest.raises(ValueError, match="leaf activation is not synchronised"):
        tp.host("activation")  # a local leaf is never read


def test_a_step_whose_local_leaves_came_or_went_is_refused_naming_the_leaf():
    import jax
    import jax.numpy as jnp

    from bus.runs import plan_for
    from learner.pytree import TreeParams, tree_spec

    tree = {"w": jnp.ones(3), "n": 1}
    tp = TreeParams(tree, tree_spec(tree), plan_for(tree_spec(tree), 1, 1.1))
    tp.check({"w": jnp.zeros(3), "n": "another local value"})  # local leaves may change value and type
    with pytest.raises(ValueError, match="^params changed structure: leaf k is new$"):
        tp.check({"w": jnp.ones(3), "n": 1, "k": jax.random.key(0)})
    with pytest.raises(ValueError, match="^params changed structure: leaf n is missing$"):
        tp.check({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match=r"^params changed structure: leaf w: dtype float16, the run's is float32$"):
        tp.check({"w": jnp.ones(3, jnp.float16), "n": 1, "k": 2})  # another treedef: compared leaf by leaf


def test_tree_params_round_trip_an_nnx_state_and_an_nnx_module():
    import jax
    from flax import nnx

    model = _nnx_model()
    _, state = nnx.split(model)
    _, out = _round_trip(state)
    _assert_round_trip(state, out)
    assert isinstance(out, nnx.State)
    assert out["drop"]["rngs"]["key"].get_value() is state["drop"]["rngs"]["key"].get_value()
    _, out_m = _round_trip(model, num_fragments=3)
    _assert_round_trip(model, out_m)
    assert isinstance(out_m, nnx.Module) and out_m is not model
    assert jax.random.key_data(out_m.drop.rngs.key[...]).tolist() == jax.random.key_data(
        model.drop.rngs.key[...]).tolist()


def test_save_and_load_params_of_equinox_and_nnx_models_keep_likes_local_leaves(tmp_path):
    from flax import nnx

    from learner.island import load_params, save_params
    from learner.pytree import flatten, tree_spec

    _, trained = _round_trip(_eqx_model())
    _, state = nnx.split(_nnx_model())
    _, trained_state = _round_trip(state)
    for name, tree, like in (("eqx", trained, _eqx_model(seed=7)),
                             ("nnx", trained_state, nnx.split(_nnx_model(seed=7, dropout_seed=3))[1]),
                             ("nnx-module", trained_state, _nnx_model(seed=7, dropout_seed=3))):
        path = str(tmp_path / f"{name}.npz")
        save_params(tree, path)
        with np.load(path) as f:
            assert sorted(k for k in f.files if k != "__diloco__") == sorted(x.path for x in tree_spec(tree).synced)
        loaded = load_params(path, like)
        assert type(loaded) is type(like)
        spec = tree_spec(like)
        _, got, _ = flatten(loaded)
        _, src, _ = flatten(tree)
        _, mine, _ = flatten(like)
        for leaf, g, s, m in zip(spec.leaves, got, src, mine):
            if leaf.synced:
                np.testing.assert_array_equal(np.asarray(g), np.asarray(s))
            else:
                assert g is m, (name, leaf.path)


# -- what is refused, in one line naming the leaf ----------------------------------------------------


class _Odd:
    """Claims to be an array, but its shape is not sizes or its dtype is no numpy one."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = shape, dtype


class _TorchLikeDtype:
    def __str__(self) -> str:
        return "torch.float32"


def test_unrepresentable_leaves_are_one_line_naming_the_leaf():
    import jax
    import jax.numpy as jnp

    from bus.tree import describe
    from learner.pytree import tree_spec

    w = jnp.ones(3)
    with pytest.raises(ValueError, match=r"^leaf odd is a _Odd of shape \(None, 3\), not a shape of sizes"):
        tree_spec({"w": w, "odd": _Odd((None, 3), np.float32)})
    with pytest.raises(ValueError, match=r"^leaf t is a _Odd of dtype torch\.float32, which is neither a numpy dtype "
                                         r"nor a JAX PRNG key"):
        describe({"w": w, "t": _Odd((2,), _TorchLikeDtype())})
    with pytest.raises(ValueError, match=r"^leaf a/b is a jax.ShapeDtypeStruct"):
        tree_spec({"w": w, "a": {"b": jax.ShapeDtypeStruct((3,), jnp.float32)}})
    seen = []

    @jax.jit
    def inside(p):
        with pytest.raises(ValueError, match=r"^leaf w is a traced value \(\w+\), not an array") as e:
            tree_spec(p)
        seen.append(str(e.value))
        return p["w"]

    inside({"w": w})
    assert len(seen) == 1 and "\n" not in seen[0]
    # a tree of nothing but non-arrays says which leaf is not an array
    with pytest.raises(ValueError, match=r"no floating-point leaf.*; leaf n is an int, not an array\)$"):
        tree_spec({"name": "mlp", "n": 3})
    with pytest.raises(ValueError, match=r"no floating-point leaf.*; leaf name is a str, not an array\)$"):
        tree_spec({"name": "mlp", "k": jax.random.key(0)})


def test_local_leaves_summary_names_the_local_leaves_in_one_line():
    import jax
    import jax.numpy as jnp

    from learner.pytree import local_leaves_summary, tree_spec

    assert local_leaves_summary(tree_spec({"w": jnp.ones(3)})) is None
    line = local_leaves_summary(tree_spec(_eqx_model()))
    assert line == ("2 of 8 leaves stay on this island, never sent: activation (custom_jvp), "
                    "final_activation (function)")
    many = {"w": jnp.ones(3), **{f"k{i}": jax.random.key(i) for i in range(9)}}
    line = local_leaves_summary(tree_spec(many), limit=3)
    assert line == "9 of 10 leaves stay on this island, never sent: k0 (key<fry>), k1 (key<fry>), k2 (key<fry>), " \
                   "and 6 more"
    assert "\n" not in line
