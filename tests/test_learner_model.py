"""Transformer forward pass and loss against an independent numpy reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from learner.model import forward as _forward
from learner.model import loss_fn as _loss_fn
from learner.model import to_jax, to_numpy
from learner.spec import ModelSpec, init_params

TINY = ModelSpec(d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=32)

# Jitted once per (spec, shape): eager op-by-op dispatch is many times slower on CPU.
forward = jax.jit(_forward, static_argnums=2)
loss_fn = jax.jit(_loss_fn, static_argnums=2)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf)(x)


def reference_forward(p: dict, tokens: np.ndarray, spec: ModelSpec) -> np.ndarray:
    """Straight-line float64 numpy transformer: loops over batch, heads and positions."""
    p = {k: v.astype(np.float64) for k, v in p.items()}

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    def gelu(x):  # jax.nn.gelu defaults to the tanh approximation
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))

    b, t = tokens.shape
    d, nh = spec.d_model, spec.n_heads
    hd = d // nh
    out = np.zeros((b, t, spec.vocab_size))
    for bi in range(b):
        h = np.stack([p["embed"][tokens[bi, i]] + p["pos_embed"][i] for i in range(t)])
        for layer in range(spec.n_layers):
            pre = f"blocks/{layer}/"
            x = rms(h, p[pre + "attn_norm"])
            qkv = x @ p[pre + "attn_qkv"]
            q, k, v = qkv[:, :d], qkv[:, d : 2 * d], qkv[:, 2 * d :]
            att = np.zeros((t, d))
            for head in range(nh):
                sl = slice(head * hd, (head + 1) * hd)
                for i in range(t):
                    scores = np.array([q[i, sl] @ k[j, sl] / math.sqrt(hd) for j in range(i + 1)])
                    w = np.exp(scores - scores.max())
                    w /= w.sum()
                    att[i, sl] = sum(w[j] * v[j, sl] for j in range(i + 1))
            h = h + att @ p[pre + "attn_out"]
            z = rms(h, p[pre + "mlp_norm"]) @ p[pre + "mlp_in"]
            h = h + gelu(z) @ p[pre + "mlp_out"]
        h = rms(h, p["final_norm"])
        w_out = p["embed"].T if spec.tied_embeddings else p["unembed"]
        out[bi] = h @ w_out
    return out


def _randomised_params(spec: ModelSpec, seed: int) -> dict:
    """Init params with norms perturbed, so the reference check covers the norm scales too."""
    params = init_params(spec, seed)
    rng = np.random.default_rng(seed)
    for k in params:
        if k.endswith("norm"):
            params[k] = (1.0 + 0.3 * rng.standard_normal(params[k].shape)).astype(np.float32)
        else:
            params[k] = params[k] * 10.0  # larger weights: non-trivial attention patterns
    return params


@pytest.mark.parametrize("tied", [True, False])
def test_forward_matches_numpy_reference(tied):
    spec = ModelSpec(d_model=16, n_layers=2, n_heads=4, d_ff=24, seq_len=8, tied_embeddings=tied)
    params = _randomised_params(spec, 1)
    tokens = np.random.default_rng(2).integers(0, 256, size=(2, 8)).astype(np.int32)
    got = np.asarray(forward(to_jax(params), jnp.asarray(tokens), spec))
    want = reference_forward(params, tokens, spec)
    assert got.shape == (2, 8, 256)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


def test_forward_is_causal():
    params = to_jax(_randomised_params(TINY, 3))
    tokens = np.random.default_rng(4).integers(0, 256, size=(2, 32)).astype(np.int32)
    changed = tokens.copy()
    changed[:, 20:] = (changed[:, 20:] + 17) % 256
    a = np.asarray(forward(params, jnp.asarray(tokens), TINY))
    b = np.asarray(forward(params, jnp.asarray(changed), TINY))
    np.testing.assert_allclose(a[:, :20], b[:, :20], rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[:, 20:], b[:, 20:])
    # a shorter prefix gives the same logits as the full sequence on that prefix
    c = np.asarray(forward(params, jnp.asarray(tokens[:, :12]), TINY))
    np.testing.assert_allclose(a[:, :12], c, rtol=1e-5, atol=1e-5)


def test_loss_at_init_is_log_vocab():
    params = to_jax(init_params(TINY, 0))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(4, 33)), dtype=jnp.int32)
    loss = float(loss_fn(params, batch, TINY))
    assert abs(loss - math.log(256)) < 0.05


def test_loss_is_cross_entropy_of_shifted_targets():
    params = _randomised_params(TINY, 5)
    batch = np.random.default_rng(6).integers(0, 256, size=(3, 33)).astype(np.int32)
    logits = np.asarray(forward(to_jax(params), jnp.asarray(batch[:, :-1]), TINY), dtype=np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    targets = batch[:, 1:]
    want = np.mean(logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0])
    got = float(loss_fn(to_jax(params), jnp.asarray(batch), TINY))
    assert got == pytest.approx(want, rel=1e-5)
    # shifting by one matters: scoring the inputs themselves gives a different number
    wrong = np.mean(logz - np.take_along_axis(logits, batch[:, :-1, None], -1)[..., 0])
    assert abs(got - wrong) > 1e-3


def test_gradients_reach_every_parameter():
    params = to_jax(init_params(TINY, 0))
    batch = jnp.asarray(np.random.default_rng(1).integers(0, 256, size=(2, 33)), dtype=jnp.int32)
    grads = jax.jit(jax.grad(_loss_fn), static_argnums=2)(params, batch, TINY)
    assert set(grads) == set(params)
    for k, g in grads.items():
        g = np.asarray(g)
        assert np.all(np.isfinite(g)), k
        assert np.any(g != 0), k


def test_too_long_sequence_raises():
    params = to_jax(init_params(TINY, 0))
    with pytest.raises(ValueError, match="seq_len"):
        _forward(params, jnp.zeros((1, 33), jnp.int32), TINY)


def test_to_numpy_round_trip():
    params = init_params(TINY, 0)
    back = to_numpy(to_jax(params))
    for k in params:
        assert back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k], params[k])
