"""TrainBackend (run it for me, in the learner core's worker thread) without a server."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bus.runs import plan_for
from learner.backends import NO_STEP, TrainBackend
from learner.pytree import tree_spec


def _model():
    params = {"dense": {"w": jnp.ones((4, 3)), "b": jnp.zeros(3, jnp.bfloat16)}, "count": jnp.array(0, jnp.int32)}
    opt = optax.adamw(1e-2)

    def loss_fn(p, x):
        return jnp.mean((x @ p["dense"]["w"] + p["dense"]["b"].astype(jnp.float32)) ** 2)

    @jax.jit
    def train_step(p, st, x):
        float_p = {"dense": p["dense"]}
        loss, g = jax.value_and_grad(loss_fn)(float_p, x)
        u, st = opt.update(g, st, float_p)
        new = optax.apply_updates(float_p, u)
        new["dense"]["b"] = new["dense"]["b"].astype(jnp.bfloat16)
        return {**new, "count": p["count"] + 1}, st, loss

    return params, opt, train_step


def test_train_backend_steps_until_the_batches_end_and_keeps_its_optimizer_state_through_loads():
    params, opt, train_step = _model()
    spec = tree_spec(params)
    plan = plan_for(spec, 2, 1.1)
    x = jnp.ones((2, 4))
    built = []
    b = TrainBackend(train_step, (x for _ in range(3)), spec, plan,
                     build=lambda vecs: built.append(vecs) or params, init_opt=lambda p: opt.init({"dense": p["dense"]}))
    zeros = [np.zeros(n, np.float32) for n in plan.sizes]
    b.load(zeros)  # first load: the tree is built from the vectors (by the caller's builder)
    assert built == [zeros] and b.opt_state is not None
    state0 = b.opt_state
    v0 = [b.get_fragment(p) for p in range(plan.num_fragments)]
    assert b.compile() > 0  # jitted: compiled ahead, with the first batch kept for the first step
    losses = [b.step() for _ in range(3)]
    assert all(isinstance(loss, float) for loss in losses)
    assert b.step() is NO_STEP  # three batches: three steps
    tree = b.params.tree()
    assert int(tree["count"]) == 3 and tree["dense"]["b"].dtype == jnp.bfloat16  # non-float leaf is the step's
    moved = [b.get_fragment(p) for p in range(plan.num_fragments)]
    assert any(np.abs(m - v).max() > 0 for m, v in zip(moved, v0))
    b.load(v0)  # a resync: parameters replaced, the inner optimizer state kept (DiLoCo)
    assert all(np.array_equal(b.get_fragment(p), v0[p]) for p in range(plan.num_fragments))
    assert b.opt_state is not state0 and int(b.params.tree()["count"]) == 3


def test_a_step_that_changes_the_tree_is_refused_in_one_line():
    params, opt, _ = _model()
    spec = tree_spec(params)

    def bad_step(p, st, x):
        return {"other": p["dense"]["w"]}, st, 0.0

    b = TrainBackend(bad_step, iter([1]), spec, plan_for(spec, 1, 1.1), params=params, opt_state=())
    assert b.compile() == 0.0  # not a jax.jit function: nothing to compile
    with pytest.raises(ValueError, match="params changed structure"):
        b.step()


def test_train_backend_needs_params_or_a_builder():
    params, _, step = _model()
    spec = tree_spec(params)
    with pytest.raises(ValueError, match="params or build"):
        TrainBackend(step, iter(()), spec, plan_for(spec, 1, 1.1), opt_state=())
    with pytest.raises(ValueError, match="opt_state or init_opt"):
        TrainBackend(step, iter(()), spec, plan_for(spec, 1, 1.1), params=params)


def test_fold_progress_is_the_outer_gradient_added_to_the_accumulator_and_moves_the_base():
    """What a learner's sync with error feedback does without a fragment-sized temporary: bitwise
    acc + (base - theta), then base = theta (bfloat16 leaves cast, chunks smaller than a leaf)."""
    from learner.pytree import TreeParams

    rng = np.random.default_rng(0)
    params = {"a": jnp.asarray(rng.standard_normal((50, 7)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal(300), jnp.bfloat16), "n": jnp.arange(3)}
    spec = tree_spec(params)
    plan = plan_for(spec, 2, 1.1)
    tp = TreeParams(params, spec, plan)
    for p in range(plan.num_fragments):
        theta = tp.get_fragment(p)
        base = (theta + rng.standard_normal(theta.size).astype(np.float32) * 0.1).astype(np.float32)
        acc = rng.standard_normal(theta.size).astype(np.float32) * 1e-3
        want = acc + (base - theta)
        other = base.copy()
        tp.fold_progress(p, base, acc, chunk=64)
        assert np.array_equal(acc, want) and np.array_equal(base, theta)
        # overwrite: the outer gradient itself, whatever the accumulator held before (a bfloat16
        # residual's sync writes it into a scratch left as the previous sync left it)
        scratch = np.full(theta.size, np.nan, np.float32)
        outer = other - theta
        tp.fold_progress(p, other, scratch, chunk=64, overwrite=True)
        assert np.array_equal(scratch, outer) and np.array_equal(other, theta)
    with pytest.raises(ValueError, match="values"):
        tp.fold_progress(0, np.zeros(3, np.float32), np.zeros(3, np.float32))


def _hook():
    import threading

    from learner.backends import HookBackend
    from learner.pytree import TreeParams

    params, _, _ = _model()
    spec = tree_spec(params)
    return HookBackend(TreeParams(params, spec, plan_for(spec, 2, 1.1)), threading.Event()), params


def _core(hook, steps: int, log: list):
    """What the learner core does with a hook backend: take a step, and serve it unless the user's
    thread did (then nothing may be mixed into it: it is the user's already)."""
    import threading

    def run():
        hook.serve()  # joined
        for _ in range(steps):
            loss = hook.step()
            if loss is NO_STEP:
                return
            early = hook.took_early()
            log.append((loss, early))
            if not early:
                hook.params.set_fragment(0, hook.params.get_fragment(0) + 1.0)  # an arrival mixed in
                hook.serve()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_quiet_step_is_served_in_the_users_thread_and_comes_back_as_it_went():
    import time

    hook, params = _hook()
    log: list = []
    t = _core(hook, 3, log)
    while not hook._parked:
        time.sleep(0.001)
    p1 = jax.tree_util.tree_map(lambda x: x + 1 if x.dtype != jnp.int32 else x, params)
    out = hook.exchange(p1, jnp.float32(0.5), lambda: True, quiet=lambda: True)
    assert out is p1 and hook.fast_steps == 1  # no hand-off, no copy
    while not log or not hook._parked:  # the core counted it, freed the previous leaves, parks again
        time.sleep(0.001)
    assert log == [(0.5, True)] and hook._previous is None
    # something to mix in (not quiet): the user's thread waits for the core, which mixes it in
    out = hook.exchange(p1, 0.25, lambda: True, quiet=lambda: False)
    assert log[-1] == (0.25, False) and hook.fast_steps == 1
    from learner.pytree import TreeParams

    plan = hook.params.plan
    np.testing.assert_array_equal(TreeParams(out, hook.params.spec, plan).get_fragment(0),
                                  TreeParams(p1, hook.params.spec, plan).get_fragment(0) + 1.0)
    hook.close()
    t.join(5)


def test_the_fast_path_is_not_taken_while_the_core_is_busy():
    hook, params = _hook()
    log: list = []
    hook._served = 1  # joined, but the core is not parked in step() (it computes the last step's sync)
    import threading

    got: list = []
    th = threading.Thread(target=lambda: got.append(hook.exchange(params, 1.0, lambda: True, quiet=lambda: True)))
    th.start()
    th.join(0.3)
    assert th.is_alive() and hook.fast_steps == 0  # waits: a deposit, taken when the core comes back
    t = _core(hook, 1, log)
    th.join(5)
    assert got and log == [(1.0, False)]
    hook.close()
    t.join(5)


def test_an_islands_step_is_timed_in_the_users_thread_whatever_the_core_does_meanwhile():
    """The pace of an island (Dynamic Local Updates) is its user's step: from the parameters handed
    back to the next deposit. The core's wait for that deposit is not it: a core slower than the
    user's step found the deposit waiting (a pace many times too high), a faster one waited the rest
    of the step."""
    import threading
    import time

    hook, params = _hook()
    seen: list = []

    def core():  # takes each step, then works 0.15 s: longer than the user's 0.05 s step
        hook.serve()
        for _ in range(4):
            if hook.step() is NO_STEP:
                return
            seen.append(hook.user_step_s)
            if not hook.took_early():
                hook.serve()
            time.sleep(0.15)

    t = threading.Thread(target=core, daemon=True)
    t.start()
    tree = params
    for _ in range(4):
        tree = hook.exchange(tree, 0.0, lambda: True, quiet=lambda: False)
        time.sleep(0.05)  # the user's step
    t.join(5)
    hook.close()
    assert seen[0] == 0.0  # the first deposit's step began before the island saw it: left out
    assert all(0.045 <= s < 0.14 for s in seen[1:]), seen  # the user's 0.05 s, not the core's 0.15 s
