"""Models as Flax NNX and Equinox users write them, trained by two islands against a real
nats-server and a model-agnostic aggregator (examples/flax_nnx.py, examples/equinox_mlp.py),
exported with ``diloco export`` and loaded back with ``load_params``: the float leaves are the
run's, the local leaves (an NNX dropout key and count, an Equinox MLP's activation functions) are
the very objects of the model passed as ``like``, and were never sent."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import numpy as np
import orjson
import pytest

from tests.system import PY
from tests.test_island import _env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = "200"


def _example(name: str):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        __import__(name)
        return sys.modules[name]
    finally:
        sys.path.pop(0)


async def _train_and_export(nats_server, tmp_path, run: str, script: str, args_a: list[str],
                            args_b: list[str]) -> tuple[list[float], list[float], str]:
    """Two islands of ``script`` (a: hook mode, b: train mode) through an aggregator, then
    ``diloco export``: (joined losses, done losses, the exported file)."""
    # `diloco aggregator` as the README shows it (its embedded monitor admits the islands, and
    # knows when one left: the other's last rounds are merged without it)
    agg = subprocess.Popen([PY, "-m", "diloco.cli", "aggregator"], cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env=_env(nats_server.url, run, DILOCO_MODEL="run",
                                                            DILOCO_GRACE="fixed", DILOCO_GRACE_SECONDS="0.1"))
    try:
        islands = [subprocess.Popen([PY, script, "--island", name, "--steps", STEPS, "--sync-every", "10", *args],
                                    cwd=ROOT, env=_env(nats_server.url, run), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
                   for name, args in (("a", ["--mode", "hook", *args_a]), ("b", ["--mode", "train", *args_b]))]
        outs = []
        for p in islands:
            out, err = await asyncio.get_running_loop().run_in_executor(None, p.communicate, None, 120)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
        joined = [float(re.search(r"joined, held-out loss ([\d.]+)", o).group(1)) for o in outs]
        done = [float(re.search(rf"done, {STEPS} steps, held-out loss ([\d.]+)", o).group(1)) for o in outs]
        # each island waited in close() for its last rounds: every one it sent was merged
        fates = [re.search(r"rounds sent (\d+), merged (\d+), rejected (\d+)", o).groups() for o in outs]
        assert all(int(s) > 0 and m == s and r == "0" for s, m, r in fates), fates
        assert max(done) < 0.5 * min(joined), (joined, done)
        out = str(tmp_path / f"{run}.npz")
        exp = subprocess.run([PY, "-m", "diloco.cli", "export", "--out", out], cwd=ROOT,
                             env=_env(nats_server.url, run), capture_output=True, text=True, timeout=60)
        assert exp.returncode == 0, exp.stderr
        return joined, done, out
    finally:
        agg.terminate()
        agg.wait(30)


def _check_loaded(path: str, like, loaded) -> dict[str, np.ndarray]:
    """Every float leaf of ``loaded`` is the file's, every other leaf is ``like``'s own object and is
    not in the file. Returns the file's arrays."""
    from learner.pytree import flatten, tree_spec

    spec = tree_spec(like)
    _, like_leaves, _ = flatten(like)
    paths, leaves, _ = flatten(loaded)
    assert paths == [leaf.path for leaf in spec.leaves]
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files if k != "__diloco__"}
    assert sorted(arrays) == sorted(leaf.path for leaf in spec.synced)
    for leaf, x, mine in zip(spec.leaves, leaves, like_leaves):
        if leaf.synced:
            assert x.dtype == mine.dtype
            np.testing.assert_array_equal(np.asarray(x, np.float32), arrays[leaf.path])
        else:
            assert x is mine, leaf.path
    return arrays


@pytest.mark.timeout(180)
async def test_two_islands_train_a_flax_nnx_model_with_dropout(nats_server, js, tmp_path):
    import jax
    from flax import nnx

    from learner.island import load_params

    # island a hands over the module itself, island b the state of nnx.split: the same run
    joined, done, out = await _train_and_export(nats_server, tmp_path, "nnx", "examples/flax_nnx.py",
                                                ["--tree", "module"], ["--tree", "state"])
    fx = _example("flax_nnx")
    graphdef, like = fx.split(fx.make_model(seed=99, dropout_seed=7))
    loaded = load_params(out, like)
    assert isinstance(loaded, nnx.State)
    arrays = _check_loaded(out, like, loaded)
    assert "drop/rngs/key/value" not in arrays and "drop/rngs/count/value" not in arrays
    key = loaded["drop"]["rngs"]["key"][...]
    assert jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(like["drop"]["rngs"]["key"][...]))
    hx, hy = fx.make_data(12345, 1024)
    exported = fx.held_out_loss(graphdef, loaded, hx, hy)
    assert exported < 0.5 * min(joined), (exported, joined, done)
    # the module itself as ``like``: a module comes back, with the same values
    module_like = fx.make_model(seed=99, dropout_seed=7)
    as_module = load_params(out, module_like)
    assert isinstance(as_module, nnx.Module)
    _check_loaded(out, module_like, as_module)
    assert fx.held_out_loss(graphdef, as_module, hx, hy) == pytest.approx(exported, rel=1e-6)
    # the run's manifest describes the local leaves too (deterministically), outside its hash
    from bus.runs import read_manifest
    from bus.tree import TreeSpec
    from learner.pytree import tree_spec

    m = await read_manifest(js, "nnx")
    tree = TreeSpec.from_dict(m.tree)
    assert tree == tree_spec(like) and m.model_hash == tree.tree_hash()
    assert {leaf.path: leaf.dtype for leaf in tree.local} == {"drop/rngs/count/value": "uint32",
                                                              "drop/rngs/key/value": "key<fry>"}
    with np.load(out) as f:
        assert "drop/rngs/key/value" not in orjson.loads(f["__diloco__"].tobytes()).get("dtypes", {})


@pytest.mark.timeout(180)
async def test_two_islands_train_an_equinox_mlp_as_it_is(nats_server, tmp_path):
    import equinox as eqx

    from learner.island import load_params

    joined, done, out = await _train_and_export(nats_server, tmp_path, "eqx", "examples/equinox_mlp.py", [], [])
    ex = _example("equinox_mlp")
    like = ex.make_model(seed=99)
    loaded = load_params(out, like)
    assert isinstance(loaded, eqx.nn.MLP)
    arrays = _check_loaded(out, like, loaded)
    assert "activation" not in arrays and "final_activation" not in arrays
    assert loaded.activation is like.activation and loaded.final_activation is like.final_activation
    hx, hy = ex.make_data(12345, 1024)
    exported = float(ex.loss_fn(loaded, hx, hy))
    assert exported < 0.5 * min(joined), (exported, joined, done)
    with pytest.raises(ValueError, match="shape"):
        load_params(out, ex.make_model(width=8))
