"""Model spec: the architecture of a run, its parameter shapes and its deterministic init.

numpy only (no jax): the aggregator imports this module to build version 0 of the global
parameters, and every learner checks ``spec_hash(spec)`` against the run's before it trains.

The model is a decoder-only, pre-norm transformer over byte tokens::

    x_0   = embed[tokens] + pos_embed[:T]
    x'    = x_l + attn(rms(x_l) * attn_norm)            (causal, n_heads heads, no biases)
    x_l+1 = x'  + mlp_out(gelu(mlp_in(rms(x') * mlp_norm)))
    logits = (rms(x_L) * final_norm) @ W_out,   W_out = embed^T (tied) or unembed (untied)

Parameter keys are flat, '/'-joined strings in a fixed order (``param_shapes``); every other
module (model, fragments, aggregator) is driven by these keys and shapes.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

import numpy as np

from bus.fragments import FragmentPlan, plan_fragments
from bus.protocol import Manifest
from bus.runs import RunMismatch

#: Bump when the forward pass changes in a way that makes old parameters meaningless with the
#: same shapes (e.g. a different norm or activation). It is part of ``spec_hash``.
ARCH_VERSION = 1

#: Base standard deviation of the GPT-2 style init.
INIT_STD = 0.02


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of the run. Two processes with equal specs have identically shaped params.

    The defaults (about 0.85M parameters) are sized for CPU benchmarks on a small machine.
    ``seq_len`` is the context length: the learned position table has ``seq_len`` rows, and
    training batches carry ``seq_len + 1`` tokens (inputs plus shifted targets).
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    seq_len: int = 128
    tied_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"ModelSpec.{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"ModelSpec.{name} must be >= 1, got {value}")
        if self.vocab_size < 2:
            raise ValueError(f"ModelSpec.vocab_size must be >= 2, got {self.vocab_size}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelSpec.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); head size = d_model / n_heads"
            )
        if not isinstance(self.tied_embeddings, bool):
            raise ValueError(
                f"ModelSpec.tied_embeddings must be a bool, got {self.tied_embeddings!r}"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head: d_model / n_heads."""
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (JSON-safe), the inverse of ``from_dict``."""
        return {k: (bool(v) if isinstance(v, bool) else int(v)) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelSpec":
        """Build a spec from a mapping; unknown keys raise ValueError (typos must not pass)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelSpec field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


def param_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Flat parameter shapes in canonical order.

    Keys: ``embed`` [V, D], ``pos_embed`` [S, D], for each block i ``blocks/i/attn_norm`` [D],
    ``blocks/i/attn_qkv`` [D, 3D] (columns: q | k | v, each head-major), ``blocks/i/attn_out``
    [D, D], ``blocks/i/mlp_norm`` [D], ``blocks/i/mlp_in`` [D, F], ``blocks/i/mlp_out`` [F, D],
    then ``final_norm`` [D] and, when untied, ``unembed`` [D, V]. No biases.
    """
    d, f, v = spec.d_model, spec.d_ff, spec.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (v, d), "pos_embed": (spec.seq_len, d)}
    for i in range(spec.n_layers):
        shapes[f"blocks/{i}/attn_norm"] = (d,)
        shapes[f"blocks/{i}/attn_qkv"] = (d, 3 * d)
        shapes[f"blocks/{i}/attn_out"] = (d, d)
        shapes[f"blocks/{i}/mlp_norm"] = (d,)
        shapes[f"blocks/{i}/mlp_in"] = (d, f)
        shapes[f"blocks/{i}/mlp_out"] = (f, d)
    shapes["final_norm"] = (d,)
    if not spec.tied_embeddings:
        shapes["unembed"] = (d, v)
    return shapes


def count_params(spec: ModelSpec) -> int:
    """Total number of scalar parameters (multiply by 4 for float32 bytes)."""
    return sum(math.prod(s) for s in param_shapes(spec).values())


def _init_std(spec: ModelSpec, key: str) -> float | None:
    """Standard deviation for ``key``; None means 'ones' (norm scales).

    GPT-2 style: N(0, 0.02) everywhere, residual projections (attn_out, mlp_out) scaled by
    1/sqrt(2 * n_layers) so the residual stream's variance does not grow with depth.
    """
    leaf = key.rsplit("/", 1)[-1]
    if leaf.endswith("norm"):
        return None
    if leaf in ("attn_out", "mlp_out"):
        return INIT_STD / math.sqrt(2 * spec.n_layers)
    return INIT_STD


def init_params(spec: ModelSpec, seed: int) -> dict[str, np.ndarray]:
    """Deterministic float32 initial parameters, keyed like ``param_shapes``.

    Each tensor draws from its own ``np.random.Generator(PCG64)`` seeded by
    ``SeedSequence(seed, spawn_key=(crc32(key),))``, so a tensor's values depend only on
    (seed, key, shape), not on which other tensors exist. Normals are drawn in float64,
    scaled, then rounded to float32: the same seed gives bit-identical arrays on any machine
    with the same numpy bit-stream (numpy keeps Generator streams stable across releases
    except where it announces a change; the spec test pins a few values to catch that).
    """
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    params: dict[str, np.ndarray] = {}
    for key, shape in param_shapes(spec).items():
        std = _init_std(spec, key)
        if std is None:
            params[key] = np.ones(shape, dtype=np.float32)
            continue
        ss = np.random.SeedSequence(int(seed), spawn_key=(zlib.crc32(key.encode("utf-8")),))
        rng = np.random.Generator(np.random.PCG64(ss))
        params[key] = (rng.standard_normal(shape, dtype=np.float64) * std).astype(np.float32)
    return params


def spec_hash(spec: ModelSpec) -> str:
    """16 hex chars of sha256 over canonical JSON of the spec fields and ``ARCH_VERSION``.

    A learner whose hash differs from the run's must refuse to start: its parameters would not
    line up with the global fragments.
    """
    payload = {"arch_version": ARCH_VERSION, **spec.to_dict()}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()[:16]


def make_plan(spec: ModelSpec, num_fragments: int, max_imbalance: float) -> FragmentPlan:
    """The fragment plan of the built-in model."""
    return plan_fragments(param_shapes(spec), num_fragments, max_imbalance=max_imbalance)


def check_manifest(m: Manifest, spec: ModelSpec, plan: FragmentPlan) -> None:
    """Raise :class:`RunMismatch` saying what differs, or return quietly."""
    if m.model_hash != spec_hash(spec):
        raise RunMismatch(f"model spec hash {spec_hash(spec)} differs from run {m.run!r} ({m.model_hash}): "
                          f"run spec {m.spec}, ours {spec.to_dict()}")
    if m.plan_hash != plan.plan_hash() or m.num_fragments != plan.num_fragments:
        raise RunMismatch(f"fragment plan {plan.plan_hash()} (P={plan.num_fragments}) differs from run "
                          f"{m.run!r} ({m.plan_hash}, P={m.num_fragments}): check DILOCO_NUM_FRAGMENTS "
                          f"and DILOCO_MAX_IMBALANCE")
