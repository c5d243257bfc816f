"""Decoder-only transformer in pure JAX, driven by the flat parameter dict of ``learner.spec``.

``params`` maps the keys of ``param_shapes(spec)`` to arrays (numpy arrays work: jax converts
them; use ``to_jax`` once to avoid re-copying every step). The architecture is documented in
``learner.spec``; this module only evaluates it:

    h      = embed[x] + pos_embed[:T]
    h     += attn(rmsnorm(h) * attn_norm)          causal softmax(q k^T / sqrt(d_head)) v
    h     += gelu(rmsnorm(h) * mlp_norm @ mlp_in) @ mlp_out
    logits = rmsnorm(h) * final_norm @ (embed^T | unembed)
    loss   = mean over batch and positions of -log softmax(logits)[target]

Matmuls run in float32; keep it that way on CPU (bf16 is slower there).
"""

from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from learner.spec import ModelSpec

#: RMSNorm epsilon.
NORM_EPS = 1e-6


def to_jax(params: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """Copy a numpy parameter dict to float32 jax arrays (same keys)."""
    return {k: jnp.asarray(v, dtype=jnp.float32) for k, v in params.items()}


def to_numpy(params: Mapping[str, jax.Array]) -> dict[str, np.ndarray]:
    """Copy a jax parameter dict back to float32 numpy arrays (same keys)."""
    return {k: np.asarray(v, dtype=np.float32) for k, v in params.items()}


def rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) * scale, over the last axis."""
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + NORM_EPS) * scale


def causal_attention(x: jax.Array, w_qkv: jax.Array, w_out: jax.Array, n_heads: int) -> jax.Array:
    """Multi-head causal self-attention on x [B, T, D]; w_qkv [D, 3D], w_out [D, D]."""
    b, t, d = x.shape
    hd = d // n_heads
    qkv = x @ w_qkv  # [B, T, 3D]
    q, k, v = jnp.split(qkv, 3, axis=-1)
    # [B, T, D] -> [B, H, T, hd]
    q, k, v = (a.reshape(b, t, n_heads, hd).transpose(0, 2, 1, 3) for a in (q, k, v))
    scores = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(hd))  # [B, H, T, T]
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    out = (weights @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    return out @ w_out


def forward(params: Mapping[str, jax.Array], tokens: jax.Array, spec: ModelSpec) -> jax.Array:
    """Logits [B, T, vocab] for int tokens [B, T] with T <= spec.seq_len.

    Position t only sees tokens 0..t (causal). ``spec`` supplies n_layers, n_heads and
    whether the output projection is tied to the embedding.
    """
    t = tokens.shape[-1]
    if t > spec.seq_len:
        raise ValueError(f"sequence length {t} exceeds spec.seq_len {spec.seq_len}")
    h = params["embed"][tokens] + params["pos_embed"][:t]
    for i in range(spec.n_layers):
        p = f"blocks/{i}/"
        h = h + causal_attention(
            rms_norm(h, params[p + "attn_norm"]),
            params[p + "attn_qkv"],
            params[p + "attn_out"],
            spec.n_heads,
        )
        z = rms_norm(h, params[p + "mlp_norm"]) @ params[p + "mlp_in"]
        h = h + jax.nn.gelu(z) @ params[p + "mlp_out"]
    h = rms_norm(h, params["final_norm"])
    w_out = params["embed"].T if spec.tied_embeddings else params["unembed"]
    return h @ w_out


def loss_fn(params: Mapping[str, jax.Array], batch: jax.Array, spec: ModelSpec) -> jax.Array:
    """Mean next-token cross-entropy (nats) of int32 batch [B, seq_len + 1].

    inputs = batch[:, :-1], targets = batch[:, 1:]. A model that ignores its input scores
    log(vocab_size) (5.545 for bytes); that is what a fresh init should give.
    """
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = forward(params, inputs, spec)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.mean(nll)
