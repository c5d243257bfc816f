"""Outer optimizers: numpy Nesterov against optax, Delayed Nesterov by hand, ownership, state."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from aggregator.outer_opt import (
    RoundNesterov,
    RoundNesterovState,
    DelayedNesterov,
    DelayedNesterovState,
    NesterovSGD,
    NesterovState,
    make_outer_optimizer,
)

N = 1000
STEPS = 10


def data(seed: int = 0, n: int = N, steps: int = STEPS):
    rng = np.random.default_rng(seed)
    params = rng.standard_normal(n).astype(np.float32)
    grads = [(0.1 * rng.standard_normal(n)).astype(np.float32) for _ in range(steps)]
    return params, grads


def optax_reference(params: np.ndarray, grads: list[np.ndarray], lr: float, momentum: float):
    import jax.numpy as jnp
    import optax

    opt = optax.sgd(lr, momentum=momentum, nesterov=True)
    p = jnp.asarray(params)
    state = opt.init(p)
    for g in grads:
        updates, state = opt.update(jnp.asarray(g), state, p)
        p = optax.apply_updates(p, updates)
    trace = state[0].trace
    return np.asarray(p), np.asarray(trace)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("lr,momentum", [(0.7, 0.9), (0.1, 0.5)])
def test_nesterov_matches_optax(inplace, lr, momentum):
    params, grads = data()
    ref_p, ref_t = optax_reference(params, grads, lr, momentum)
    opt = NesterovSGD(lr, momentum, block=128)  # small blocks: exercise the block loop
    p, state = params.copy(), opt.init(params)
    for g in grads:
        p, state = opt.step(p, g, state, inplace=inplace)
    assert state.count == STEPS
    np.testing.assert_allclose(p, ref_p, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state.momentum, ref_t, rtol=1e-6, atol=1e-6)
    # the tolerance discriminates: heavy-ball momentum (no look-ahead) is far from optax
    q, t = params.astype(np.float64), np.zeros(N)
    for g in grads:
        t = g + momentum * t
        q = q - lr * t
    assert not np.allclose(q, ref_p, rtol=1e-4, atol=1e-4)


def test_delayed_nesterov_period_1_is_nesterov():
    params, grads = data(1)
    ref_p, _ = optax_reference(params, grads, 0.7, 0.9)
    a, b = NesterovSGD(), DelayedNesterov(period=1)
    pa, sa = params.copy(), a.init(params)
    pb, sb = params.copy(), b.init(params)
    assert sb.buffer is None  # no gradient buffer needed
    for g in grads:
        pa, sa = a.step(pa, g, sa)
        pb, sb = b.step(pb, g, sb)
    np.testing.assert_array_equal(pa, pb)
    np.testing.assert_array_equal(sa.momentum, sb.momentum)
    np.testing.assert_allclose(pb, ref_p, rtol=1e-6, atol=1e-6)


def delayed_reference(params, grads, lr, beta, period):
    """Delayed Nesterov (Liu et al. 2401.09135) written plainly in float64."""
    p = params.astype(np.float64)
    m = np.zeros_like(p)
    delta = np.zeros_like(p)
    for i, g in enumerate(grads, start=1):
        g = g.astype(np.float64)
        delta += g
        if i % period == 0:
            m = beta * m + delta / period
            delta[:] = 0
            p = p - lr * (g / period + beta * m)
        else:
            p = p - lr * g / period
    return p, m


@pytest.mark.parametrize("period", [2, 3, 5])
@pytest.mark.parametrize("inplace", [False, True])
def test_delayed_nesterov_matches_reference(period, inplace):
    params, grads = data(2, steps=11)
    ref_p, ref_m = delayed_reference(params, grads, 0.7, 0.9, period)
    opt = DelayedNesterov(0.7, 0.9, period, block=100)
    p, s = params.copy(), opt.init(params)
    for g in grads:
        p, s = opt.step(p, g, s, inplace=inplace)
    np.testing.assert_allclose(p, ref_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s.momentum, ref_m, rtol=1e-5, atol=1e-6)
    assert s.count == 11
    # it really is different from applying Nesterov at every merge
    q, t = params.copy(), NesterovSGD().init(params)
    for g in grads:
        q, t = NesterovSGD().step(q, g, t)
    assert np.abs(p - q).max() > 1e-3


def test_delayed_nesterov_by_hand():
    """N=2, two merges from zero momentum: one Nesterov step on the mean gradient."""
    opt = DelayedNesterov(lr=0.5, momentum=0.5, period=2)
    p0 = np.array([1.0, 1.0], dtype=np.float32)
    g1 = np.array([1.0, 0.0], dtype=np.float32)
    g2 = np.array([3.0, 2.0], dtype=np.float32)
    s = opt.init(p0)
    p1, s = opt.step(p0, g1, s)
    np.testing.assert_allclose(p1, [0.75, 1.0])  # p0 - 0.5 * g1 / 2; momentum untouched
    np.testing.assert_array_equal(s.momentum, [0, 0])
    np.testing.assert_array_equal(s.buffer, [1, 0])
    p2, s = opt.step(p1, g2, s)
    # m = 0.5*0 + (g1+g2)/2 = [2, 1];  p2 = p1 - 0.5*(g2/2 + 0.5*m) = p1 - 0.5*[2.5, 1.5]
    np.testing.assert_allclose(s.momentum, [2.0, 1.0])
    np.testing.assert_array_equal(s.buffer, [0, 0])
    np.testing.assert_allclose(p2, [-0.5, 0.25])
    # total move = -lr * (mean(g) + beta * m) = -0.5 * ([2, 1] + [1, 0.5])
    np.testing.assert_allclose(p2 - p0, -0.5 * np.array([3.0, 1.5]))


def test_ownership():
    params, grads = data(3, steps=1)
    g = grads[0]
    for opt in (NesterovSGD(), DelayedNesterov(period=2)):
        s0 = opt.init(params)
        p_before, g_before = params.copy(), g.copy()
        p, s = opt.step(params, g, s0)
        np.testing.assert_array_equal(params, p_before)  # inputs untouched
        np.testing.assert_array_equal(g, g_before)
        assert not np.shares_memory(p, params)
        assert not np.shares_memory(s.momentum, s0.momentum)
        assert not np.any(s0.momentum)
        mine = params.copy()
        p2, s2 = opt.step(mine, g, s0, inplace=True)
        assert p2 is mine and s2.momentum is s0.momentum  # updated in place, same buffers
        np.testing.assert_array_equal(p2, p)
        np.testing.assert_array_equal(g, g_before)  # the outer gradient is only read


def test_state_round_trip_through_msgpack():
    params, grads = data(4)
    for opt in (NesterovSGD(), DelayedNesterov(period=3), DelayedNesterov(period=1)):
        p, s = params.copy(), opt.init(params)
        for g in grads[:4]:
            p, s = opt.step(p, g, s)
        d = s.to_dict()
        blob = msgpack.packb({k: (v.tobytes() if isinstance(v, np.ndarray) else v)
                              for k, v in d.items()})
        raw = msgpack.unpackb(blob)
        restored = {k: (np.frombuffer(v, dtype=np.float32) if isinstance(v, bytes) else v)
                    for k, v in raw.items()}
        cls = NesterovState if d["kind"] == "nesterov" else DelayedNesterovState
        s2 = cls.from_dict(restored)
        assert s2.count == s.count
        pa, pb = p.copy(), p.copy()
        sa = s
        for g in grads[4:]:
            pa, sa = opt.step(pa, g, sa)
            pb, s2 = opt.step(pb, g, s2, inplace=True)  # restored arrays are writable copies
        np.testing.assert_array_equal(pa, pb)
    with pytest.raises(ValueError):
        NesterovState.from_dict({"kind": "delayed_nesterov", "momentum": [], "count": 0})


def test_validation():
    with pytest.raises(ValueError):
        NesterovSGD(lr=0.0)
    with pytest.raises(ValueError):
        NesterovSGD(momentum=1.0)
    with pytest.raises(ValueError):
        DelayedNesterov(period=0)
    opt = NesterovSGD()
    p = np.zeros(3, dtype=np.float32)
    with pytest.raises(ValueError):
        opt.step(p, np.zeros(4, dtype=np.float32), opt.init(p))
    with pytest.raises(ValueError):
        opt.step(p, np.zeros(3, dtype=np.float64), opt.init(p))
    with pytest.raises(ValueError):
        DelayedNesterov(period=2).step(p, p, DelayedNesterov(period=1).init(p))
    assert isinstance(make_outer_optimizer("nesterov"), NesterovSGD)
    assert make_outer_optimizer("delayed_nesterov", period=4).period == 4
    assert make_outer_optimizer("delayed", period=2, lr=0.5) == DelayedNesterov(0.5, 0.9, 2)
    with pytest.raises(ValueError):
        make_outer_optimizer("adam")


def test_merge_step_discounts_staleness_in_rounds():
    """Same-round contributions (per_round = 4, 3 versions behind) get no discount; counted in
    versions they would (polynomial, a = 0.5: 1/sqrt(4) = 0.5)."""
    from aggregator.contribution import Contribution
    from aggregator.step import FragmentState, MergeSettings, merge_step

    from aggregator.weights import StalenessPolicy

    s = MergeSettings(method="mean", optimizer="nesterov", lr=1.0, momentum=0.0,
                      staleness=StalenessPolicy("polynomial", 0.5))
    st = FragmentState.initial(0, 3, np.zeros(4, np.float32), s)
    c = Contribution("r", "h", "a", "i", 0, 0, 0, 10, 1000, np.ones(4, np.float32))
    rounds = merge_step(st, [c], s, per_round=4)
    versions = merge_step(st, [c], s)
    np.testing.assert_allclose(rounds.params, -1.0)
    np.testing.assert_allclose(versions.params, -0.5)
    assert rounds.last_per_round == 4 and FragmentState.from_bytes(rounds.to_bytes()).last_per_round == 4


# -- RoundNesterov: momentum once per round of work, however arrivals group ------------------------


def _round_run(groups, deltas, beta=0.9, lr=0.7, M=3):
    """Apply rounds of M deltas each, merged in ``groups`` (sizes summing to M per round)."""
    opt = RoundNesterov(lr, beta)
    p = np.zeros(deltas[0][0].size, np.float32)
    s = opt.init(p)
    for rnd in deltas:
        i = 0
        for g in groups:
            part = rnd[i:i + g]
            i += g
            merged = (np.mean(part, axis=0) * np.float32(len(part) / M)).astype(np.float32)  # mean x n/M
            p, s = opt.step(p, merged, s, work=len(part) / M)
    return p, s


@pytest.mark.parametrize("groups", [(3,), (1, 1, 1), (2, 1), (1, 2)])
def test_round_nesterov_is_one_synchronous_nesterov_step_per_round_whatever_the_grouping(groups):
    rng = np.random.default_rng(1)
    deltas = [[rng.standard_normal(16).astype(np.float32) for _ in range(3)] for _ in range(4)]
    p, s = _round_run(groups, deltas)
    ref = NesterovSGD(0.7, 0.9)
    q = np.zeros(16, np.float32)
    rs = ref.init(q)
    for rnd in deltas:
        q, rs = ref.step(q, np.mean(rnd, axis=0).astype(np.float32), rs)
    np.testing.assert_allclose(p, q, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s.momentum, rs.momentum, rtol=1e-5, atol=1e-5)
    assert s.progress == pytest.approx(0.0) and s.buffer is None  # zero after the round: freed


def test_round_nesterov_state_round_trips_and_carries_a_partial_round():
    opt = RoundNesterov(0.5, 0.9)
    p = np.ones(4, np.float32)
    s = opt.init(p)
    p, s = opt.step(p, np.full(4, 0.1, np.float32), s, work=2 / 3)
    # no round completed yet: a plain step only, the round's work so far folded into the trace
    # (beta * 0 + 0.1), no buffer held apart
    assert s.progress == pytest.approx(2 / 3) and s.folded and s.buffer is None
    np.testing.assert_allclose(s.momentum, 0.1)
    np.testing.assert_allclose(p, 1 - 0.5 * 0.1)
    s2 = RoundNesterovState.from_dict(s.to_dict())
    assert s2.progress == s.progress and s2.folded and np.array_equal(s2.momentum, s.momentum)
    p3, s3 = opt.step(p, np.full(4, 0.1, np.float32), s2, work=2 / 3)
    assert s3.progress == pytest.approx(1 / 3) and not s3.folded  # round done, the rest carried
    np.testing.assert_allclose(s3.momentum, 0.2)  # t = 0.9 * 0 + (0.1 + 0.1)
    np.testing.assert_allclose(p3, p - 0.5 * 0.1 - 0.5 * 0.9 * 0.2, rtol=1e-6)
    with pytest.raises(ValueError):
        opt.step(p, np.zeros(4, np.float32), s, work=float("nan"))


def test_round_nesterov_takes_one_mean_round_into_the_momentum_from_a_backlog_merge():
    """A merge that completes 20 rounds at once (a backlog) moves theta by all of them (plain SGD) but
    feeds the momentum their mean round, not their sum (issue 24: no extrapolation of a backlog)."""
    opt = RoundNesterov(1.0, 0.9)
    p = np.zeros(8, np.float32)
    s = opt.init(p)
    g = np.full(8, 0.01, np.float32)
    p1, s1 = opt.step(p, g * 20, s, work=20.0)
    np.testing.assert_allclose(s1.momentum, g, rtol=1e-6)
    np.testing.assert_allclose(p1, -(20 * g + 0.9 * g), rtol=1e-6)
    # the part fed to the momentum can be given: a factor, or an array
    _, s2 = opt.step(p, g, s, work=1.0, momentum_grad=0.0)
    assert not s2.momentum.any()
    _, s3 = opt.step(p, g, s, work=1.0, momentum_grad=g / 2)
    np.testing.assert_allclose(s3.momentum, g / 2, rtol=1e-6)
    _, s4 = opt.step(p, g, s, work=1.0, momentum_grad=0.25)
    np.testing.assert_allclose(s4.momentum, g / 4, rtol=1e-6)
    with pytest.raises(ValueError):
        opt.step(p, g, s, momentum_grad=-1.0)


@pytest.mark.parametrize("momentum_grad", [None, 0.0, 0.5, "array"])
@pytest.mark.parametrize("work", [1.0, 2.0, 0.5])
def test_round_nesterov_without_a_buffer_is_the_same_step_as_with_a_zero_one(momentum_grad, work):
    """After a completed round the buffer is zero and is not held (K = all: no buffer ever); a
    merge then gives what a zero buffer gives, and allocates one only for a partial round."""
    rng = np.random.default_rng(4)
    p = rng.standard_normal(1000).astype(np.float32)
    g = rng.standard_normal(1000).astype(np.float32)
    t = rng.standard_normal(1000).astype(np.float32)
    mg = rng.standard_normal(1000).astype(np.float32) if momentum_grad == "array" else momentum_grad
    opt = RoundNesterov(0.7, 0.5, block=256)
    without = RoundNesterovState(t.copy(), None, 0.0, 3)
    with_zero = RoundNesterovState(t.copy(), np.zeros(1000, np.float32), 0.0, 3)
    p1, s1 = opt.step(p, g, without, work=work, momentum_grad=mg)
    p2, s2 = opt.step(p, g, with_zero, work=work, momentum_grad=mg)
    np.testing.assert_array_equal(p1, p2)
    np.testing.assert_array_equal(s1.momentum, s2.momentum)
    assert s1.progress == s2.progress
    # a checkpoint's buffer (written before the trace held it) is folded in: none is held after
    assert s1.buffer is None and s2.buffer is None
    assert s1.folded == s2.folded == (work < 1.0)


def test_round_nesterov_folds_a_checkpoints_partial_round_as_it_would_have_been_applied():
    """A state written before the buffer was folded into the trace (t and B apart) completes its
    round exactly as the old step did: t <- beta * t + B + m, theta <- theta - lr * (g + beta * t)."""
    rng = np.random.default_rng(5)
    p, g, t, b = (rng.standard_normal(300).astype(np.float32) for _ in range(4))
    old = RoundNesterovState.from_dict({"kind": "round_nesterov", "momentum": t, "buffer": b, "progress": 0.5,
                                        "count": 7})
    p1, s1 = RoundNesterov(0.7, 0.9, block=128).step(p, g, old, work=0.5)
    t_ref = 0.9 * t.astype(np.float64) + b + g
    np.testing.assert_allclose(s1.momentum, t_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(p1, p - 0.7 * g - 0.7 * 0.9 * t_ref, rtol=1e-5, atol=1e-5)
    assert s1.progress == pytest.approx(0.0) and not s1.folded and s1.buffer is None and s1.count == 8


@pytest.mark.parametrize("momentum_grad", [None, 0.5, "array"])
@pytest.mark.parametrize("work", [1.0, 0.5, 3.0])
@pytest.mark.parametrize("inplace", [False, True])
def test_a_bfloat16_momentum_is_the_float32_step_with_the_trace_rounded_where_it_is_stored(momentum_grad, work,
                                                                                           inplace):
    """DILOCO_OUTER_MOMENTUM_DTYPE=bfloat16: each block is computed in float32 from the stored trace,
    so the parameters are bit for bit the float32 step's from the same (rounded) trace, and the new
    trace is that step's, rounded once where it is stored."""
    from aggregator.outer_opt import momentum_dtype

    bf16 = momentum_dtype("bfloat16")
    rng = np.random.default_rng(6)
    p, g = (rng.standard_normal(1000).astype(np.float32) for _ in range(2))
    t = (rng.standard_normal(1000) * 0.1).astype(bf16)
    mg = rng.standard_normal(1000).astype(np.float32) if momentum_grad == "array" else momentum_grad
    for folded in (False, True):
        opt = RoundNesterov(0.7, 0.5, block=256)
        ref_p, ref_s = opt.step(p.copy(), g, RoundNesterovState(t.astype(np.float32), None, 0.25, 3, folded),
                                work=work, momentum_grad=mg)
        state = RoundNesterovState(t.copy(), None, 0.25, 3, folded)
        got_p, got_s = opt.step(p.copy(), g, state, work=work, momentum_grad=mg, inplace=inplace)
        np.testing.assert_array_equal(got_p, ref_p)
        assert got_s.momentum.dtype == bf16 and (got_s.momentum is state.momentum) == inplace
        np.testing.assert_array_equal(got_s.momentum.view(np.uint16), ref_s.momentum.astype(bf16).view(np.uint16))
        assert got_s.progress == ref_s.progress and got_s.folded == ref_s.folded
    # made at init in the dtype asked for; a state round-trips in its own dtype
    s0 = make_outer_optimizer("rounds", lr=0.7, momentum=0.5, dtype="bfloat16").init(p)
    assert s0.momentum.dtype == bf16 and not s0.momentum.any()
    back = RoundNesterovState.from_dict(got_s.to_dict())
    assert back.momentum.dtype == bf16 and np.array_equal(back.momentum.view(np.uint16), got_s.momentum.view(np.uint16))
    assert make_outer_optimizer("rounds").init(p).momentum.dtype == np.float32
    with pytest.raises(ValueError, match="momentum dtype"):
        RoundNesterov(0.7, 0.5, dtype="float16")
    with pytest.raises(ValueError, match="momentum must be"):
        opt.step(p, g, RoundNesterovState(t.astype(np.float16), None, 0.0, 0))


def test_a_bfloat16_momentum_with_another_optimizer_is_a_one_line_config_error():
    from aggregator.config import AggregatorConfig
    from aggregator.step import MergeSettings
    from bus.config import ConfigError, from_env

    with pytest.raises(ConfigError, match="rounds only") as e:
        from_env(AggregatorConfig, {"DILOCO_OUTER_MOMENTUM_DTYPE": "bfloat16", "DILOCO_OUTER_OPTIMIZER": "nesterov"})
    assert "\n" not in str(e.value)
    cfg = from_env(AggregatorConfig, {"DILOCO_OUTER_MOMENTUM_DTYPE": "bfloat16"})
    assert MergeSettings.from_config(cfg).make_optimizer().dtype == "bfloat16"
