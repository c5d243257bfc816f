"""Inner loop: the schedule, clipping, masked weight decay and a loss that falls."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from learner.data import Corpus
from learner.inner import make_eval_fn, make_optimizer, make_schedule, make_train_step
from learner.model import loss_fn, to_jax
from learner.spec import ModelSpec, init_params

TINY = ModelSpec(d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=32)


def test_warmup_then_cosine_values():
    sched = make_schedule(1e-3, warmup_steps=10, total_steps=110, end_lr_fraction=0.1)
    assert float(sched(0)) == 0.0
    assert float(sched(5)) == pytest.approx(5e-4)
    assert float(sched(10)) == pytest.approx(1e-3)
    # halfway through the cosine: end + (peak - end) / 2
    assert float(sched(60)) == pytest.approx(1e-4 + 0.5 * 9e-4, rel=1e-5)
    # a quarter through: end + (peak - end) * (1 + cos(pi / 4)) / 2
    assert float(sched(35)) == pytest.approx(1e-4 + 9e-4 * (1 + math.cos(math.pi / 4)) / 2, rel=1e-5)
    assert float(sched(110)) == pytest.approx(1e-4)
    assert float(sched(500)) == pytest.approx(1e-4)
    values = [float(sched(t)) for t in range(111)]
    assert values[:11] == sorted(values[:11])
    assert values[10:] == sorted(values[10:], reverse=True)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"lr": 0.0, "warmup_steps": 1, "total_steps": 10},
        {"lr": 1e-3, "warmup_steps": 10, "total_steps": 10},
        {"lr": 1e-3, "warmup_steps": -1, "total_steps": 10},
        {"lr": 1e-3, "warmup_steps": 1, "total_steps": 10, "end_lr_fraction": 1.5},
    ],
)
def test_bad_schedule_raises(kwargs):
    with pytest.raises(ValueError):
        make_schedule(**kwargs)


def _first_moment(state) -> dict:
    mus = optax.tree_utils.tree_get_all_with_path(state, "mu")
    assert len(mus) == 1
    return mus[0][1]


def test_clipping_bounds_the_gradient_seen_by_adam():
    params = {"w": jnp.zeros((3, 4)), "s": jnp.zeros((4,))}
    grads = {"w": jnp.full((3, 4), 10.0), "s": jnp.full((4,), 10.0)}  # norm = 40
    b1 = 0.9
    for clip, want in [(1.0, 1.0), (None, 40.0), (100.0, 40.0)]:
        opt = make_optimizer(1e-3, 1, 10, weight_decay=0.0, clip_norm=clip, b1=b1)
        state = opt.init(params)
        _, state = opt.update(grads, state, params)
        # after one update, mu = (1 - b1) * g_clipped
        assert float(optax.tree.norm(_first_moment(state))) == pytest.approx((1 - b1) * want, rel=1e-5)


def test_weight_decay_skips_norm_scales():
    params = {"w": jnp.ones((4, 4)), "norm": jnp.ones((4,))}
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    opt = make_optimizer(0.1, 1, 10, weight_decay=0.5, clip_norm=None)
    state = opt.init(params)
    for _ in range(3):
        updates, state = opt.update(zero, state, params)
        params = optax.apply_updates(params, updates)
    assert np.all(np.asarray(params["norm"]) == 1.0)
    assert np.all(np.asarray(params["w"]) < 1.0)


def _tiny_corpus() -> Corpus:
    text = (
        b"def add(a, b):\n    return a + b\n\n"
        b"def mul(a, b):\n    return a * b\n\n"
        b"class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    ) * 40
    return Corpus(np.frombuffer(text, dtype=np.uint8), heldout_fraction=0.1, source="tiny")


def test_training_loss_falls_and_eval_matches_loss_fn():
    corpus = _tiny_corpus()
    shard = corpus.shard(0, 1, TINY.seq_len, seed=0)
    params = to_jax(init_params(TINY, 0))
    opt = make_optimizer(3e-3, warmup_steps=5, total_steps=40, weight_decay=0.1, clip_norm=1.0)
    opt_state = opt.init(params)
    step = make_train_step(TINY, opt)
    eval_fn = make_eval_fn(TINY)
    held = corpus.heldout_batches(TINY.seq_len, batch_size=8, n_batches=2)

    before = float(np.mean([eval_fn(params, jnp.asarray(b)) for b in held]))
    assert before == pytest.approx(float(loss_fn(params, jnp.asarray(held[0]), TINY)), abs=0.05)
    losses = []
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(shard.batch(8)))
        losses.append(float(loss))
    after = float(np.mean([eval_fn(params, jnp.asarray(b)) for b in held]))

    assert all(np.isfinite(losses))
    assert losses[0] == pytest.approx(math.log(256), abs=0.1)
    assert np.mean(losses[-5:]) < losses[0] - 1.5
    assert after < before - 1.5  # held-out loss falls too
    assert float(eval_fn(params, jnp.asarray(held[0]))) == pytest.approx(
        float(loss_fn(params, jnp.asarray(held[0]), TINY)), rel=1e-5
    )


# -- Muon (DILOCO_INNER_OPTIMIZER=muon) ----------------------------------------------------------------


def test_muon_orthogonalises_the_hidden_matrices_only_at_adamws_update_rms():
    """Muon takes the hidden matrices (an update whose singular values are all alike, scaled to
    an RMS of lr x MUON_RMS); the embeddings and norm scales keep AdamW (first update lr x sign)."""
    from learner.inner import MUON_RMS, _muon_labels

    rng = np.random.default_rng(0)
    params = {"embed": jnp.zeros((16, 8)), "blocks/0/mlp_in": jnp.zeros((8, 24)), "blocks/0/norm": jnp.ones((8,))}
    assert _muon_labels(params) == {"embed": "adam", "blocks/0/mlp_in": "muon", "blocks/0/norm": "adam"}
    grads = {k: jnp.asarray(rng.normal(size=v.shape), jnp.float32) for k, v in params.items()}
    lr = 1e-2
    opt = make_optimizer(lr, 0, 10, weight_decay=0.0, clip_norm=None, kind="muon")
    updates, _ = opt.update(grads, opt.init(params), params)
    hidden = np.asarray(updates["blocks/0/mlp_in"])
    s = np.linalg.svd(hidden, compute_uv=False)
    assert s.min() > 0.5 * s.max()  # orthogonalised (Newton-Schulz: singular values near one another)
    assert float(np.sqrt(np.mean(hidden ** 2))) == pytest.approx(lr * MUON_RMS, rel=0.35)
    # DILOCO_MUON_RMS scales the hidden matrices' update only: twice the RMS, twice the update
    opt2 = make_optimizer(lr, 0, 10, weight_decay=0.0, clip_norm=None, kind="muon", muon_rms=2 * MUON_RMS)
    updates2, _ = opt2.update(grads, opt2.init(params), params)
    np.testing.assert_allclose(np.asarray(updates2["blocks/0/mlp_in"]), 2 * hidden, rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(updates2["embed"]), np.asarray(updates["embed"]))
    for k in ("embed", "blocks/0/norm"):  # Adam's first bias-corrected step: lr x sign(g)
        np.testing.assert_allclose(np.asarray(updates[k]), -lr * np.sign(np.asarray(grads[k])), rtol=1e-3)
    with pytest.raises(ValueError, match="inner optimizer"):
        make_optimizer(lr, 0, 10, kind="sgd")


def test_muon_trains_the_builtin_model():
    corpus = _tiny_corpus()
    shard = corpus.shard(0, 1, TINY.seq_len, seed=0)
    params = to_jax(init_params(TINY, 0))
    opt = make_optimizer(3e-3, warmup_steps=5, total_steps=40, weight_decay=0.1, clip_norm=1.0, kind="muon")
    opt_state = opt.init(params)
    step = make_train_step(TINY, opt)
    losses = [float(step(params, opt_state, jnp.asarray(shard.batch(8)))[2])]
    for _ in range(30):
        params, opt_state, loss = step(params, opt_state, jnp.asarray(shard.batch(8)))
        losses.append(float(loss))
    assert all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < losses[0] - 1.5


def test_the_learner_takes_its_inner_optimizer_from_diloco_inner_optimizer():
    from bus.config import ConfigError, from_env
    from learner.builtin import builtin_backend
    from learner.config import LearnerConfig
    from learner.spec import make_plan

    corpus = _tiny_corpus()
    plan = make_plan(TINY, 2, 1.5)
    for kind in ("adamw", "muon"):
        cfg = from_env(LearnerConfig, {"DILOCO_INNER_OPTIMIZER": kind, "DILOCO_TOTAL_STEPS": "20"})
        backend = builtin_backend(TINY, plan, cfg, corpus.shard(0, 1, TINY.seq_len, seed=0))
        state = backend._init_opt(to_jax(init_params(TINY, 0)))
        assert ("'muon'" in repr(state)) == (kind == "muon")
    with pytest.raises(ConfigError, match="DILOCO_INNER_OPTIMIZER"):
        from_env(LearnerConfig, {"DILOCO_INNER_OPTIMIZER": "sgd"})


def test_the_default_rate_follows_width_inner_optimizer_and_the_learners_expected():
    """docs/learner.md, "Defaults": AdamW 0.008 at d_model <= 64, then 1/width; Muon that times
    DILOCO_NUM_LEARNERS / 2, from 1 to 3 (the reference's sweeps, docs/BENCHMARKS.md "Thirteenth
    round"); a number in DILOCO_INNER_LR wins, and no learner's default exceeds the run's bound."""
    from bus.config import from_env
    from learner.config import LearnerConfig, ModelConfig, auto_inner_lr

    def rate(**env) -> float:
        return from_env(LearnerConfig, {k: str(v) for k, v in env.items()}).lr_for(64)

    assert rate(DILOCO_INNER_OPTIMIZER="adamw", DILOCO_NUM_LEARNERS=8) == pytest.approx(0.008)
    assert [rate(DILOCO_NUM_LEARNERS=m) for m in (1, 2, 3, 4, 8, 100)] == pytest.approx(
        [0.008, 0.008, 0.012, 0.016, 0.024, 0.024])
    assert rate() == pytest.approx(0.016)  # DILOCO_NUM_LEARNERS' default: 4
    assert rate(DILOCO_INNER_LR="0.001", DILOCO_NUM_LEARNERS=8) == 0.001
    cfg = from_env(LearnerConfig, {"DILOCO_NUM_LEARNERS": "8"})
    assert cfg.lr_for(128) == pytest.approx(0.012) and cfg.lr_for(32) == pytest.approx(0.024)
    assert cfg.lr_for(64, learners=2) == pytest.approx(0.008) and cfg.lr_for(None) == 0.0
    assert max(auto_inner_lr(d, k, m) for d in (8, 64, 128) for k in ("adamw", "muon") for m in (1, 8, 10**5)) \
        <= ModelConfig().max_inner_lr
    with pytest.raises(ValueError, match="inner optimizer"):
        auto_inner_lr(64, "sgd", 2)
