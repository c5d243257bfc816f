"""The island API against a real nats-server: a user's own JAX model (examples/regression.py)
trained by two islands through a model-agnostic aggregator, exported and loaded back; the tree
contract (pure); the race of two islands creating one run; errors a user will make."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import orjson
import pytest

from bus.tree import Leaf, TreeSpec, describe
from tests.system import PY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- the tree contract (pure) --------------------------------------------------------------------


def test_tree_spec_round_trips_hashes_and_names_the_first_difference():
    a = describe({"['w']": np.zeros((3, 4), np.float32), "['n']": np.zeros((), np.int32)})
    assert TreeSpec.from_dict(orjson.loads(orjson.dumps(a.to_dict()))) == a
    assert [leaf.path for leaf in a.synced] == ["['w']"] and a.num_params == 12
    b = describe({"['w']": np.zeros((4, 4), np.float32), "['n']": np.zeros((), np.int32)})
    assert a.tree_hash() != b.tree_hash()
    assert a.first_difference(b) == "leaf ['w']: shape (3, 4), the run's is (4, 4)"
    c = describe({"['w']": np.zeros((3, 4), np.float16), "['n']": np.zeros((), np.int32)})
    assert a.first_difference(c) == "leaf ['w']: dtype float32, the run's is float16"
    d = describe({"['w']": np.zeros((3, 4), np.float32)})  # non-float leaves are not the run's
    assert a.first_difference(d) is None and a.tree_hash() == d.tree_hash()
    e = describe({"['w']": np.zeros((3, 4), np.float32), "['v']": np.zeros(2, np.float32)})
    assert e.first_difference(a) == "leaf ['v'] is not in the run's tree"
    assert a.first_difference(e) == "leaf ['v'] of the run's tree is missing"
    assert a.first_difference(a) is None


def test_trees_without_float_leaves_or_arrays_are_refused():
    with pytest.raises(ValueError, match="no floating-point leaf"):
        describe({"['n']": np.zeros(3, np.int32)})
    with pytest.raises(ValueError, match="leaf x is a str, not an array"):
        describe({"x": "hello"})
    with pytest.raises(ValueError, match="unique"):
        TreeSpec((Leaf("a", (1,), "float32"), Leaf("a", (1,), "float32")))


def test_pytree_fragments_keep_dtype_and_skip_non_float_leaves():
    import jax.numpy as jnp

    from bus.runs import plan_for
    from learner.pytree import TreeParams, tree_spec

    tree = {"a": [jnp.arange(6.0).reshape(2, 3), jnp.ones(5, jnp.bfloat16)], "n": jnp.array(7, jnp.int32)}
    spec = tree_spec(tree)
    assert [leaf.path for leaf in spec.synced] == ["a/0", "a/1"]
    plan = plan_for(spec, 2, 1.1)
    tp = TreeParams(tree, spec, plan)
    vecs = [tp.get_fragment(p) for p in range(2)]
    assert sum(v.size for v in vecs) == 11
    for p in range(2):
        tp.set_fragment(p, vecs[p] + 1)
    out = tp.tree()
    assert out["a"][1].dtype == jnp.bfloat16 and out["n"].dtype == jnp.int32 and int(out["n"]) == 7
    np.testing.assert_allclose(np.asarray(out["a"][0]), np.arange(6.0).reshape(2, 3) + 1)
    np.testing.assert_allclose(np.asarray(out["a"][1], np.float32), 2.0)
    with pytest.raises(ValueError, match="params changed structure"):
        tp.set_tree({"a": [jnp.zeros((2, 3))], "n": jnp.array(1)})


SHARDED = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from bus.runs import plan_for
from learner.pytree import TreeParams, tree_spec
assert len(jax.devices()) == 8, jax.devices()
mesh = Mesh(np.array(jax.devices()), ("d",))
sh = NamedSharding(mesh, P("d"))
tree = {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), sh), "b": jnp.zeros(3)}
tp = TreeParams(tree, tree_spec(tree), plan_for(tree_spec(tree), 4, 1.1))
for p in range(4):
    tp.set_fragment(p, tp.get_fragment(p) * 2)
w = tp.tree()["w"]
assert w.sharding == sh, w.sharding
np.testing.assert_allclose(np.asarray(w), np.arange(64.0).reshape(16, 4) * 2)
print("ok")
'''


def test_sharded_leaves_keep_their_sharding():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([PY, "-c", SHARDED], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


# -- against a real server -----------------------------------------------------------------------


def _env(url: str, run: str, **extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    e.update(DILOCO_NATS_URL=url, DILOCO_RUN=run, JAX_PLATFORMS="cpu", DILOCO_LOG_LEVEL="warning",
             DILOCO_HEARTBEAT_INTERVAL="0.2", DILOCO_QUANTISER="int8", **extra)
    return e


@pytest.mark.timeout(300)
async def test_two_islands_train_a_user_model_export_and_load_back(nats_server, tmp_path):
    run = "reg"
    # `diloco aggregator` as the README shows it: with its embedded monitor (membership required)
    agg = subprocess.Popen([PY, "-m", "diloco.cli", "aggregator"], cwd=ROOT, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env=_env(nats_server.url, run, DILOCO_MODEL="run",
                                                            DILOCO_GRACE="fixed", DILOCO_GRACE_SECONDS="0.1"))
    try:
        islands = [subprocess.Popen([PY, "examples/regression.py", "--island", name, "--steps", "500",
                                     "--mode", mode], cwd=ROOT, env=_env(nats_server.url, run),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for name, mode in (("a", "hook"), ("b", "train"))]
        outs = []
        for p in islands:
            out, err = await asyncio.get_running_loop().run_in_executor(None, p.communicate, None, 240)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
        joined = [float(re.search(r"joined, held-out loss ([\d.]+)", o).group(1)) for o in outs]
        done = [float(re.search(r"done, \d+ steps, held-out loss ([\d.]+)", o).group(1)) for o in outs]
        assert max(done) < 0.5 * min(joined), (joined, done)
        # each island waited in close() for its last rounds: every one it sent was merged
        fates = [re.search(r"rounds sent (\d+), merged (\d+), rejected (\d+)", o).groups() for o in outs]
        assert all(int(s) > 0 and m == s and r == "0" for s, m, r in fates), fates
        out = tmp_path / "reg.npz"
        exp = subprocess.run([PY, "-m", "diloco.cli", "export", "--out", str(out)], cwd=ROOT,
                             env=_env(nats_server.url, run), capture_output=True, text=True, timeout=60)
        assert exp.returncode == 0, exp.stderr
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        try:
            import regression as reg
        finally:
            sys.path.pop(0)
        from learner.island import load_params

        like = reg.init_params(seed=99)
        params = load_params(str(out), like)
        assert params["out"]["w"].dtype == like["out"]["w"].dtype and int(params["seen"]) == 0
        hx, hy = reg.make_data(12345, 1024)
        exported = float(reg.loss_fn(params, hx, hy))
        assert exported < 0.5 * min(joined), (exported, joined)
        with pytest.raises(ValueError, match="shape"):
            load_params(str(out), reg.init_params(width=8))
        # the user's evaluator (as diloco eval for the built-in model) reports the same loss
        from learner.island import evaluate_run

        from bus.config import CommonConfig
        from bus.conn import connect
        from bus.subjects import Subjects
        from monitor.metrics_view import MetricsSnapshot, fold, render_table

        heard = []
        nc = await connect(CommonConfig(nats_url=nats_server.url, run=run), name="watch")

        async def on_metrics(m):
            heard.append(orjson.loads(m.data))

        await nc.subscribe(Subjects(run).metrics_all, cb=on_metrics)
        rec = await asyncio.get_running_loop().run_in_executor(None, lambda: evaluate_run(
            like, lambda prm, b: reg.loss_fn(prm, *b), [(hx, hy)], run=run, nats_url=nats_server.url,
            once=True, env={"DILOCO_MANIFEST_TIMEOUT": "30"}))
        assert rec["role"] == "evaluator" and rec["eval_loss"] == pytest.approx(exported, rel=1e-5, abs=1e-6)
        await asyncio.sleep(0.5)
        await nc.close()
        # what `diloco metrics` shows: the same record, on the subject the built-in evaluator uses
        snap = MetricsSnapshot(run=run)
        for msg in heard:
            snap = fold(snap, msg)
        assert snap.evaluator is not None and snap.evaluator.eval_loss == pytest.approx(rec["eval_loss"])
        table = render_table(snap, width=120)
        assert "evaluator   eval_loss" in table and f"after {rec['merges']} merges" in table, table
        with np.load(str(out)) as f:
            assert orjson.loads(f["__diloco__"].tobytes())["versions"] == rec["versions"]
    finally:
        agg.terminate()
        agg.wait(30)


@pytest.mark.timeout(120)
async def test_two_islands_racing_to_create_a_run_end_with_one_version_zero(nats_server, js):
    import jax.numpy as jnp

    from bus.runs import read_manifest
    from bus.config import CommonConfig
    from bus.subjects import GLOBAL
    from bus.transport import VersionedStore
    from bus.runs import create_tree_run, plan_for
    from learner.pytree import named_float_arrays, tree_spec

    common = CommonConfig(nats_url=nats_server.url, run="race")
    trees = [{"w": jnp.full((40,), float(i + 1))} for i in range(2)]
    spec = tree_spec(trees[0])
    plan = plan_for(spec, 2, 1.1)
    created = await asyncio.gather(*(create_tree_run(js, common, spec, plan, named_float_arrays(t), 1.1)
                                     for t in trees))
    assert sorted(created) == [False, True]
    m = await read_manifest(js, "race")
    assert m is not None and m.model_hash == spec.tree_hash()
    store = VersionedStore(js, "race", GLOBAL)
    from bus import codec

    values = set()
    for p in range(plan.num_fragments):
        head, blob = await store.get(p)
        assert head.version == 0
        values |= set(np.unique(codec.decode_array(blob)).tolist())
    assert len(values) == 1  # one creator's parameters, not a mix


@pytest.mark.timeout(120)
def test_user_errors_are_one_line(nats_server):
    import jax.numpy as jnp

    from learner.island import Island, IslandClosed

    url = nats_server.url
    with pytest.raises(ValueError, match="no floating-point leaf"):
        Island({"n": jnp.zeros(3, jnp.int32)}, run="e", nats_url=url, learner_id="x")
    with pytest.raises(ValueError, match="not an array"):
        Island({"w": "weights"}, run="e", nats_url=url, learner_id="x")
    # an island creates the run from its own tree; steps without an aggregator just count
    tree = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    a = Island(tree, run="e", nats_url=url, learner_id="a", sync_every=2, num_fragments=2, join_timeout=60)
    p = a.params
    np.testing.assert_allclose(np.asarray(p["w"]), 1.0)
    for _ in range(3):
        p = a.step({"w": p["w"] * 0.9, "b": p["b"]}, loss=1.0)
    assert a.step_count == 3
    t_end = time.monotonic() + 10  # the core counts a step the user's thread served itself a moment later
    while a.metrics()["step"] < 3 and time.monotonic() < t_end:
        time.sleep(0.01)
    assert a.metrics()["step"] == 3
    with pytest.raises(ValueError, match="params changed structure"):
        a.step({"w": p["w"]}, loss=1.0)
    # another tree cannot join: one line naming the first differing leaf
    with pytest.raises(RuntimeError, match=r"differs from run 'e'.*leaf w: shape \(4, 4\), the run's is \(4, 3\)"):
        Island({"w": jnp.ones((4, 4)), "b": jnp.zeros(3)}, run="e", nats_url=url, learner_id="c",
               num_fragments=2, join_timeout=30)
    # no aggregator: nothing to wait for (close(wait=0)); the stats say the work was not merged
    assert a.close(wait=0) == 0
    st = a.stats
    assert st["steps"] == 3 and st["sent"] >= 1 and st["merged"] == 0 and st["unresolved"] == st["sent"], st
    with pytest.raises(IslandClosed):
        a.step(p, loss=1.0)


def test_donated_parameters_stop_the_island_with_one_line_saying_so(nats_server):
    """Parameters the user deleted (donated to a train step, ``donate_argnums``) while the island
    still reads them: the island's learner stops, and the user's next step says why."""
    import jax.numpy as jnp

    from learner.island import Island, IslandClosed
    from learner.pytree import DonatedParams, TreeParams, tree_spec
    from bus.runs import plan_for

    tree = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    tp = TreeParams(tree, tree_spec(tree), plan_for(tree_spec(tree), 1, 1.1))
    gone = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    gone["w"].delete()
    tp.set_tree(gone)
    with pytest.raises(DonatedParams, match="leaf w was deleted.*donate"):
        tp.get_fragment(0)
    a = Island(tree, run="don", nats_url=nats_server.url, learner_id="a", sync_every=1, num_fragments=1,
               join_timeout=60, env={"DILOCO_LOG_LEVEL": "error"})
    a.step(gone, loss=1.0)  # taken and handed back; its outer gradient is computed after
    with pytest.raises(IslandClosed, match="learner stopped: DonatedParams: leaf w was deleted"):
        for _ in range(50):
            a.step({"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}, loss=1.0)
    a.close()


def test_export_without_a_run_or_a_version_is_one_line(nats_server, tmp_path):
    out = tmp_path / "m.npz"
    p = subprocess.run([PY, "-m", "diloco.cli", "export", "--out", str(out), "--timeout", "1"], cwd=ROOT,
                       env=_env(nats_server.url, "nothing"), capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and not out.exists()
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "run 'nothing' has no manifest" in lines[0], p.stderr


@pytest.mark.timeout(180)
def test_run_create_from_an_init_file_and_an_island_joins_it(nats_server, tmp_path):
    """`diloco run create --init FILE`: version 0 is the file's parameters (a bfloat16 leaf keeps its
    dtype through the file's record), an island of the same tree joins it without creating
    anything, a second create changes nothing, and a file with a non-float leaf is one line."""
    import jax.numpy as jnp

    from learner.island import Island, save_params

    tree = {"w": jnp.arange(12.0).reshape(4, 3), "h": jnp.full((5,), 0.5, jnp.bfloat16), "n": jnp.array(3)}
    init = tmp_path / "init.npz"
    save_params(tree, str(init))
    env = _env(nats_server.url, "fromfile", DILOCO_NUM_FRAGMENTS="2")

    def create(path) -> subprocess.CompletedProcess:
        return subprocess.run([PY, "-m", "diloco.cli", "run", "create", "--init", str(path)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)

    first = create(init)
    assert first.returncode == 0, first.stderr
    out = orjson.loads(first.stdout)
    assert out["created"] is True and out["params"] == 17 and out["fragments"] == 2
    assert orjson.loads(create(init).stdout)["created"] is False
    like = {"w": jnp.zeros((4, 3)), "h": jnp.zeros((5,), jnp.bfloat16), "n": jnp.array(9)}
    isl = Island(like, run="fromfile", nats_url=nats_server.url, learner_id="j", create=False, join_timeout=60)
    try:
        got = isl.params
        np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(12.0).reshape(4, 3))
        assert got["h"].dtype == jnp.bfloat16 and float(got["h"][0]) == 0.5
        assert int(got["n"]) == 9  # non-float leaves are the island's own
    finally:
        assert isl.close(final_sync=False) == 0
    bad = tmp_path / "bad.npz"
    np.savez(bad, **{"['w']": np.zeros(3, np.float32), "['n']": np.zeros(2, np.int64)})
    r = create(bad)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "leaf ['n'] is int64, not floating point" in lines[0], r.stderr


@pytest.mark.timeout(120)
def test_an_arrival_after_the_hand_back_reaches_the_users_next_step(nats_server, monkeypatch):
    """Hook mode: parameters handed back to the user are replaced by the user's next deposit, so a
    global version that lands after the hand-back must be mixed into that deposit. (It used to be
    applied to the tree already handed back, at the top of the learner's loop, and so lost while
    the learner's base moved on: the next outer gradient then carried minus the global update.)"""
    import jax.numpy as jnp

    from learner.island import HookBackend, Island

    injected = {}
    serve = HookBackend.serve

    def serve_then_arrive(self):
        serve(self)
        learner = injected.get("learner")
        if learner is not None and self._served >= 3 and "vec" not in injected:
            # a version of fragment 0 lands right after a hand-back by the core (step 2, or the first
            # one after it that the core served: quiet steps are served in the user's thread)
            v = learner.book.frags[0].base_version + 1
            vec = learner.base[0] + 1.0
            injected["vec"] = vec
            learner._loop.call_soon_threadsafe(learner.pending.__setitem__, 0, (v, vec))

    monkeypatch.setattr(HookBackend, "serve", serve_then_arrive)
    tree = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    isl = Island(tree, run="late", nats_url=nats_server.url, learner_id="h", sync_every=1000, num_fragments=1,
                 join_timeout=60)
    try:
        isl.learner._loop = isl._loop
        injected["learner"] = isl.learner
        p = isl.params
        seen = []
        for _ in range(12):
            p = isl.step(p, loss=0.0)  # the user's step changes nothing: what comes back is the run's
            seen.append(float(np.asarray(p["w"]).mean()))
            if seen[-1] == 1.0 and len(seen) >= 6:
                break
            if "vec" in injected and seen[-1] != 1.0:
                # the arrival is handed to the core's loop thread, and its swap is prepared in the
                # side thread (learner.swap): on a loaded machine neither may be done before the
                # user's next few (instant) steps, served in the user's thread meanwhile; what is
                # tested is that it reaches the next step once it is ready
                t_end = time.monotonic() + 10
                while (not isl.learner.arrivals_ready() and not np.array_equal(isl.learner.base[0], injected["vec"])
                       and time.monotonic() < t_end):
                    time.sleep(0.005)
        assert "vec" in injected
        assert seen[-1] == 1.0, seen  # the arrival reached the user
        isl.learner._side.submit(lambda: None).result(10)  # bases are written in the side thread
        np.testing.assert_array_equal(isl.learner.base[0], injected["vec"])
        # and no progress is claimed: theta equals the base, the next outer gradient is zero
        assert np.abs(isl._tree.get_fragment(0) - isl.learner.base[0]).max() == 0.0
    finally:
        isl.close(final_sync=False)


@pytest.mark.timeout(120)
def test_an_island_step_never_waits_for_an_outer_gradient(nats_server, monkeypatch):
    """The outer gradient of a due fragment is computed in the island's side thread from a
    snapshot of that step's leaves: with its encoding held up, the user's steps go on. (It used to
    run in the worker that takes the user's next step: at 1B on a GPU each step after a sync
    waited 1.1-1.9 s for it, docs/learner.md; here the user's steps would wait for the release.)"""
    import jax.numpy as jnp

    from bus import codec
    from learner.island import Island

    release, entered = threading.Event(), threading.Event()
    encode = codec.encode_with_feedback

    def held(*a, **kw):
        entered.set()
        release.wait(60)
        return encode(*a, **kw)

    monkeypatch.setattr(codec, "encode_with_feedback", held)
    tree = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    isl = Island(tree, run="held", nats_url=nats_server.url, learner_id="h", sync_every=2, num_fragments=1,
                 join_timeout=60, env={"DILOCO_LOG_LEVEL": "error"})
    timer = threading.Timer(30, release.set)  # (without the side thread the steps end only here)
    timer.start()
    try:
        p = isl.params
        for i in range(12):
            p = isl.step(jax_add(p, 0.5), loss=0.0)
            if i == 3:
                assert entered.wait(20), "no outer gradient was started"
        assert not release.is_set(), "the user's steps waited for the outer gradient"
        np.testing.assert_array_equal(np.asarray(p["w"]), 6.0)  # every step's parameters came back
    finally:
        release.set()
        timer.cancel()
        isl.close(final_sync=False)
    assert isl.learner.book.contributions >= 1 and isl.learner.failure is None


def jax_add(tree, x):
    import jax

    return jax.tree_util.tree_map(lambda a: a + x, tree)


def _hold_swap_preparation(monkeypatch) -> tuple[threading.Event, list]:
    """``learner.swap.prepare`` held until the returned event is set; the swaps it made, in order."""
    from learner import swap

    release, prepared, prepare = threading.Event(), [], swap.prepare

    def held(*a, **kw):
        release.wait(60)
        prepared.append(prepare(*a, **kw))
        return prepared[-1]

    monkeypatch.setattr(swap, "prepare", held)
    return release, prepared


def _arrive(isl, version: int, offset: float) -> None:
    """Fragment 0's ``version`` (the island's base plus ``offset``) handed to its core as its
    download would: pending, its swap queued."""
    lr = isl.learner

    async def arrive():
        lr.pending[0] = (version, np.asarray(lr.base[0]) + np.float32(offset))
        lr._queue_swap(0)
    asyncio.run_coroutine_threadsafe(arrive(), isl._loop).result(10)


@pytest.mark.timeout(120)
def test_an_arrival_is_prepared_off_the_users_thread_and_swapped_in_at_a_step(nats_server, monkeypatch):
    """A new global version is prepared in the island's side thread (learner.swap) while the
    user's steps go on untouched, then swapped into the next step's parameters: theta + (V - base),
    the progress since the base kept; the base becomes V."""
    from learner.island import Island

    import jax.numpy as jnp

    release, prepared = _hold_swap_preparation(monkeypatch)
    tree = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    isl = Island(tree, run="swap", nats_url=nats_server.url, learner_id="s", sync_every=1000, num_fragments=1,
                 join_timeout=60, env={"DILOCO_LOG_LEVEL": "error"})
    lr = isl.learner
    try:
        p, steps = isl.params, 0
        for _ in range(4):
            p, steps = isl.step(jax_add(p, 0.5), loss=0.0), steps + 1  # theta = 2.0, the base still 0.0
        v0 = lr.book.frags[0].base_version

        # V = 1e5: the user's own steps (0.5 each) cannot reach it within the 20 s below, so the
        # loop ends on the swap alone (with V = 10 it ended after 12 plain steps when the machine was
        # loaded and the side thread had not run yet, and the test failed on a swap still to come)
        _arrive(isl, v0 + 1, 1e5)
        for _ in range(4):  # prepared meanwhile (held): the steps are the user's alone
            p, steps = isl.step(jax_add(p, 0.5), loss=0.0), steps + 1
        np.testing.assert_array_equal(np.asarray(p["w"]), 4.0)
        assert lr.book.frags[0].base_version == v0
        release.set()
        t_end = time.monotonic() + 20
        while float(np.asarray(p["w"]).max()) < 1e5 and time.monotonic() < t_end:
            p, steps = isl.step(jax_add(p, 0.5), loss=0.0), steps + 1
            time.sleep(0.01)
        lr._side.submit(lambda: None).result(10)  # bases are written in the side thread: let it finish
        np.testing.assert_array_equal(np.asarray(p["w"]), 0.5 * steps + 1e5)  # the progress kept, V added
        np.testing.assert_array_equal(lr.base[0], 1e5)
        assert lr.book.frags[0].base_version == v0 + 1
        assert [sw.parts is not None for sw in prepared] == [True]  # swapped by the adds, not the plain path
    finally:
        release.set()
        isl.close(final_sync=False)


@pytest.mark.timeout(120)
def test_a_swap_prepared_before_an_outer_gradient_of_its_fragment_is_prepared_again(nats_server, monkeypatch):
    """An arrival prepared against the base b0, then an outer gradient of that fragment (base <-
    theta_k, the progress since b0 sent): the swap is prepared again against theta_k, so the island
    ends where the plain rebase puts it, V + (theta - theta_k), and not V + (theta - b0), which would
    keep the progress it just sent on top of V."""
    from learner.island import Island

    import jax.numpy as jnp

    release, prepared = _hold_swap_preparation(monkeypatch)
    tree = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    isl = Island(tree, run="moved", nats_url=nats_server.url, learner_id="m", sync_every=6, num_fragments=1,
                 join_timeout=60, env={"DILOCO_LOG_LEVEL": "error"})
    lr = isl.learner
    try:
        p, steps = isl.step(jax_add(isl.params, 0.5), loss=0.0), 1
        v0 = lr.book.frags[0].base_version
        assert lr.book.frags[0].next_round == 0

        _arrive(isl, v0 + 1, 1e5)  # V = b0 + 1e5: beyond the user's own steps, so the loop below ends on the swap
        t_end = time.monotonic() + 20
        while lr.book.frags[0].next_round == 0 and time.monotonic() < t_end:  # an outer gradient begins
            p, steps = isl.step(jax_add(p, 0.5), loss=0.0), steps + 1
            time.sleep(0.01)
        assert lr.book.frags[0].next_round == 1, "no outer gradient began"
        release.set()
        while float(np.asarray(p["w"]).max()) < 1e5 and time.monotonic() < t_end:
            p, steps = isl.step(jax_add(p, 0.5), loss=0.0), steps + 1
            time.sleep(0.01)
        lr._side.submit(lambda: None).result(10)
        w = float(np.asarray(p["w"]).max())
        np.testing.assert_array_equal(lr.base[0], 1e5)
        assert len(prepared) == 2 and all(sw.parts is not None for sw in prepared)  # prepared again
        # V + (theta - theta_k): the progress since the sync step k only (k >= 1 steps of 0.5 sent)
        assert 1e5 <= w <= 1e5 + 0.5 * (steps - 1), (w, steps)
        np.testing.assert_array_equal(np.asarray(p["w"]), w)
    finally:
        release.set()
        isl.close(final_sync=False)


@pytest.mark.timeout(180)
def test_a_lock_step_island_s_user_gets_each_merged_version(nats_server):
    """DILOCO_MODE=sync on an island, one island and a real aggregator: every sync waits for its
    merge, and the merged version reaches the user's next parameters (rebased: the steps since the
    sync kept). It used to be mixed in after the hand-back, into parameters the user's next deposit
    replaced, while the base moved to the version: the user never saw a merged version, and the
    next outer gradient carried minus the global update."""
    from learner.island import Island

    import jax.numpy as jnp

    run = "lock"
    agg = subprocess.Popen([PY, "-m", "aggregator"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           env=_env(nats_server.url, run, DILOCO_MODEL="run", DILOCO_REQUIRE_MEMBERSHIP="false",
                                    DILOCO_MODE="sync"))
    try:
        isl = Island({"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}, run=run, nats_url=nats_server.url,
                     learner_id="l", sync_every=2, num_fragments=1, join_timeout=60, max_inner_lr=1.0,
                     env={"DILOCO_MODE": "sync", "DILOCO_LOG_LEVEL": "error", "DILOCO_SYNC_TIMEOUT": "5"})
        lr = isl.learner
        try:
            p, own = isl.params, 0.0
            seen = []
            for _ in range(12):  # the user's own trajectory: +0.5 a step, from 0
                own += 0.5
                p = isl.step(jax_add(p, 0.5), loss=0.0)
                seen.append(float(np.asarray(p["w"]).mean()) - own)
            assert lr.book.frags[0].base_version >= 3, (lr.book.frags[0].base_version, isl.stats)  # merges happened
            assert any(abs(d) > 1e-3 for d in seen), seen  # and the user got them
        finally:
            isl.close(final_sync=False)
        lr._side.shutdown(wait=True)  # what it was given is done (bases are written there)
        # what the island holds beyond its base is its steps since the last sync, nothing else
        progress = isl._tree.get_fragment(0) - lr.base[0]
        np.testing.assert_allclose(progress, 0.5 * lr.book.frags[0].steps, atol=1e-4)
    finally:
        agg.terminate()
        agg.wait(30)


@pytest.mark.timeout(120)
async def test_a_claim_left_by_a_dead_creator_is_taken_over(nats_server, js):
    """A creator that died after its claim and before the manifest would leave the run unusable:
    a claim older than the timeout, with no manifest, is taken over by the next creator (and a
    fresh one is respected)."""
    import jax.numpy as jnp

    from bus.config import CommonConfig
    from bus.runs import CLAIM_KEY, create_tree_run, plan_for, read_manifest
    from bus.streams import Limits, ensure_run
    from bus.subjects import Subjects
    from learner.pytree import named_float_arrays, tree_spec

    common = CommonConfig(nats_url=nats_server.url, run="orphan")
    tree = {"w": jnp.ones((10,))}
    spec = tree_spec(tree)
    plan = plan_for(spec, 1, 1.1)
    await ensure_run(js, "orphan", Limits())
    kv = await js.key_value(Subjects("orphan").bucket("run"))
    await kv.create(CLAIM_KEY, orjson.dumps({"ts": 0.0, "model": "dead"}))  # a claim from long ago
    assert await create_tree_run(js, common, spec, plan, named_float_arrays(tree), 1.1)
    assert (await read_manifest(js, "orphan")).model_hash == spec.tree_hash()
    # a live claim (just now) on another run is left alone
    common2 = CommonConfig(nats_url=nats_server.url, run="busy")
    await ensure_run(js, "busy", Limits())
    kv2 = await js.key_value(Subjects("busy").bucket("run"))
    import time as _time

    await kv2.create(CLAIM_KEY, orjson.dumps({"ts": _time.time(), "model": "alive"}))
    assert not await create_tree_run(js, common2, spec, plan, named_float_arrays(tree), 1.1)
    assert await read_manifest(js, "busy") is None


@pytest.mark.timeout(180)
async def test_the_built_in_transformer_trains_through_the_island_api_in_a_built_in_run(nats_server, nc, js):
    """Nothing of the built-in model is special: its flat dict of named arrays is a tree like any
    other, so an island holding it joins a run of the built-in model (created as `diloco run
    create` does), takes that run's version 0 rather than its own parameters, trains with its own
    optax loop, and the model-agnostic aggregator merges its outer gradients."""
    import jax
    import jax.numpy as jnp
    import optax

    from bus.config import CommonConfig
    from bus.runs import read_manifest
    from learner.builtin import create_builtin_run
    from learner.island import Island
    from learner.model import loss_fn
    from learner.spec import init_params
    from tests.agg_helpers import MODEL, SPEC, TINY
    from tests.system import MetricsTap

    run = "bi"
    common = CommonConfig(nats_url=nats_server.url, run=run)
    assert await create_builtin_run(js, common, MODEL)
    tap = MetricsTap()
    await tap.start(nc, run)
    agg = subprocess.Popen([PY, "-m", "aggregator"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           env=_env(nats_server.url, run, **TINY, DILOCO_REQUIRE_MEMBERSHIP="false",
                                    DILOCO_GRACE="fixed", DILOCO_GRACE_SECONDS="0.1", DILOCO_METRICS_INTERVAL="0.2"))
    try:
        mine = {k: jnp.asarray(v) for k, v in init_params(SPEC, 7).items()}  # not the run's seed
        opt = optax.adamw(1e-3)
        batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (4, SPEC.seq_len + 1)), jnp.int32)

        @jax.jit
        def train_step(p, st, b):
            loss, g = jax.value_and_grad(loss_fn)(p, b, SPEC)
            u, st = opt.update(g, st, p)
            return optax.apply_updates(p, u), st, loss

        def island_run():
            isl = Island(mine, run=run, nats_url=nats_server.url, learner_id="isl", sync_every=4,
                         tokens_per_step=4 * SPEC.seq_len, max_inner_lr=1e-3, join_timeout=60,
                         env={"DILOCO_LOG_LEVEL": "warning", **TINY})
            first = isl.params
            params, _ = isl.train(train_step, opt.init(first), (batch for _ in range(40)))
            return first, isl.learner.book.contributions, isl.model.model_hash

        first, sent, model_hash = await asyncio.get_running_loop().run_in_executor(None, island_run)
        run_v0 = init_params(SPEC, 0)
        for k, v in run_v0.items():  # the run's version 0 (seed 0), not the island's own seed-7 parameters
            np.testing.assert_array_equal(np.asarray(first[k]), v)
        assert model_hash == (await read_manifest(js, run)).model_hash  # the run's (spec) hash, adopted
        assert sent > 0

        def merged():
            return tap.get("aggregator", "agg-0").get("contributions", {}).get("isl", 0)

        for _ in range(100):
            if merged() >= sent:
                break
            await asyncio.sleep(0.1)
        assert merged() == sent, (merged(), sent, tap.get("aggregator", "agg-0").get("rejected"))
        assert not tap.get("aggregator", "agg-0").get("rejected")
    finally:
        agg.terminate()
        agg.wait(30)


@pytest.mark.timeout(180)
def test_an_island_started_again_with_its_id_knows_its_step(nats_server):
    """Issue 38: a user's loop continues its schedule and data loader from ``island.start_step``: the
    step of the newest outer gradient an island of that id published (the run's progress record)."""
    import jax.numpy as jnp

    from learner.island import Island

    tree = {"w": jnp.zeros((8, 4)), "b": jnp.zeros(4)}
    kw = dict(run="again", nats_url=nats_server.url, sync_every=4, num_fragments=1, join_timeout=60)
    first = Island(tree, learner_id="u", **kw)
    try:
        assert first.start_step == 0 and first.stats["start_step"] == 0
        p = first.params
        for _ in range(10):
            p = first.step(jax_tree_add(p, 0.01), loss=1.0)
    finally:
        first.close(final_sync=True, wait=0.5)  # the final sync carries steps 9-10: published at step 10
    again = Island(tree, learner_id="u", **kw)
    try:
        assert again.start_step == 10, again.learner.book.sent_step
        p = again.params
        for _ in range(3):
            p = again.step(p, loss=1.0)
        assert again.step_count == 13 and again.stats["steps"] == 13 and again.stats["start_step"] == 10
    finally:
        again.close(final_sync=False)
    other = Island(tree, learner_id="v", **kw)  # another id starts at 0
    try:
        assert other.start_step == 0
    finally:
        other.close(final_sync=False)


def jax_tree_add(tree, x):
    import jax

    return jax.tree_util.tree_map(lambda a: a + x, tree)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_an_island_s_residual_loses_no_work_in_either_dtype(nats_server, dtype):
    """Error feedback through an island's side thread: what its outer gradients sent plus the
    residual it keeps is its base's whole movement, the residual in bfloat16 by default (half its
    memory; ``bench.island``) and float32 when asked. With a bfloat16 residual the sum is exact to
    the residual's rounding (a few hundredths of an int8 step; a residual lost or a scratch not
    cleared would be off by whole steps)."""
    import jax.numpy as jnp

    from bus import codec
    from learner.island import Island

    blobs: list[tuple[int, bytes]] = []  # (fragment, blob) of every outer gradient prepared
    rng = np.random.default_rng(0)
    tree = {"w": jnp.zeros((64, 48)), "b": jnp.zeros(48)}
    isl = Island(tree, run=f"res-{dtype}", nats_url=nats_server.url, learner_id="r", sync_every=2, num_fragments=4,
                 join_timeout=60, env={"DILOCO_LOG_LEVEL": "error", "DILOCO_SYNC_WINDOW": "0",
                                       "DILOCO_RESIDUAL_DTYPE": dtype})
    prepared = isl.learner._finish_prepare

    def spy(c, blob):
        blobs.append((c.fragment, bytes(blob)))
        return prepared(c, blob)

    isl.learner._finish_prepare = spy  # (before the first step: no sync has begun)
    try:
        base0 = [np.array(b, dtype=np.float64) for b in isl.learner.base]
        p = isl.params
        # steps until every fragment has sent three times: a sync due while that fragment's previous
        # publish is in flight is skipped (its steps go out with the next one), so a fixed 24 steps
        # saw a single sync of a fragment on a loaded machine
        deadline = time.monotonic() + 60
        while min(sum(1 for q, _ in blobs if q == f) for f in range(4)) < 3 and time.monotonic() < deadline:
            step = {k: jnp.asarray(rng.standard_normal(v.shape).astype(np.float32) * 1e-2) for k, v in p.items()}
            p = isl.step({k: p[k] + step[k] for k in p}, loss=0.0)
            time.sleep(0.01)
        isl.close(final_sync=False)
    finally:
        isl.close(final_sync=False)
    lr = isl.learner
    sent = [np.zeros_like(b) for b in base0]
    frags: dict[int, list] = {}
    for p_, b in blobs:  # every fragment's blobs, in order
        frags.setdefault(p_, []).append(np.asarray(codec.decode_array(b), dtype=np.float64).reshape(-1))
    want = "bfloat16" if dtype == "auto" else "float32"
    assert (lr._acc is not None) == (want == "bfloat16")  # the bfloat16 syncs went through the scratch
    for p_, b0 in enumerate(base0):
        assert lr.residual[p_] is not None and lr.residual[p_].dtype.name == want
        got = frags[p_]
        assert len(got) >= 3, "too few syncs to see the residual carried"
        sent[p_] = np.sum(got, axis=0)
        moved = b0 - np.asarray(lr.base[p_], dtype=np.float64)  # an outer gradient is base - theta
        int8_step = max(np.abs(g).max() for g in got) / 127
        off = np.abs(sent[p_] + lr.residual[p_].astype(np.float64) - moved).max()
        assert off < (0.05 if want == "bfloat16" else 1e-3) * int8_step, (off, int8_step)
