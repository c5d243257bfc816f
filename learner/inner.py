"""Inner optimisation: optax AdamW (or Muon, ``kind="muon"``) with warm-up + cosine decay and
global-norm clipping.

One inner step is

    g      = grad loss(theta; batch)
    g      = g * min(1, clip_norm / ||g||_2)                     (global norm over all tensors)
    theta  = theta - lr_t * (adam(g) + weight_decay * theta)     (decay on matrices only)
    lr_t   = lr * t / warmup                     for t < warmup
           = end + (lr - end) * (1 + cos(pi * (t - warmup) / (total - warmup))) / 2   after

(t counts optimizer updates from 0; after ``total_steps`` the rate stays at ``end``).
Published DiLoCo inner settings: lr 4e-4, 1,000 warm-up steps, weight decay 0.1.

``kind="muon"`` (DILOCO_INNER_OPTIMIZER=muon): the hidden matrices (every 2-D leaf but the
embeddings) take ``optax.contrib.muon``'s orthogonalised momentum, scaled to AdamW's update RMS
(``consistent_rms=0.2``, Liu et al. 2025), so the same rate, schedule and weight decay apply; the
embeddings and norm scales keep AdamW. MuLoCo (DESIGN.md section 9) found a Muon inner optimizer
roughly halves DiLoCo's gap at small sizes; what it buys here is measured in docs/BENCHMARKS.md.

The jitted step holds a CPU for its whole duration: call it from a worker thread
(``asyncio.to_thread``) so heartbeats and NATS I/O stay live. Inner optimizer state is never
exchanged between learners; when a global fragment overwrites local parameters the state is
kept as is (as in DiLoCo).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from learner.config import INNER_OPTIMIZERS
from learner.model import loss_fn
from learner.spec import ModelSpec

TrainStep = Callable[[dict, optax.OptState, jax.Array], tuple[dict, optax.OptState, jax.Array]]
EvalFn = Callable[[dict, jax.Array], jax.Array]


def make_schedule(
    lr: float, warmup_steps: int, total_steps: int, end_lr_fraction: float = 0.1, start_step: int = 0,
    rewarm_steps: int = 0,
) -> optax.Schedule:
    """Linear warm-up 0 -> lr over ``warmup_steps``, then cosine lr -> end_lr_fraction * lr
    reaching the end value at ``total_steps`` (which counts the warm-up).

    ``start_step``: the schedule of a learner resumed at that step (``bus.progress``): update t of
    its fresh optimizer gets the rate of step ``start_step + t``. ``rewarm_steps``: the resumed
    rate is further scaled by ``min(1, (t + 1) / rewarm_steps)`` (a short warm-up for the fresh
    AdamW moments; 0: none)."""
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")
    if warmup_steps >= total_steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be < total_steps ({total_steps})")
    if not 0.0 <= end_lr_fraction <= 1.0:
        raise ValueError(f"end_lr_fraction must be in [0, 1], got {end_lr_fraction}")
    if start_step < 0 or rewarm_steps < 0:
        raise ValueError(f"need start_step >= 0 and rewarm_steps >= 0, got {start_step}, {rewarm_steps}")
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup_steps,
        decay_steps=total_steps,
        end_value=lr * end_lr_fraction,
    )
    if start_step == 0 and rewarm_steps == 0:
        return base

    def resumed(count):
        rate = base(count + start_step)
        if rewarm_steps > 0:
            rate = rate * jnp.minimum(1.0, (count + 1) / rewarm_steps)
        return rate

    return resumed


def _decay_mask(params: dict) -> dict:
    """Weight decay only on matrices (ndim >= 2): not on norm scales."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


#: Muon's update scaled to this RMS per matrix: AdamW's typical update RMS (Liu et al. 2025)
MUON_RMS = 0.2
#: leaves whose path holds one of these stay with AdamW under Muon (lookup tables, not linear maps)
EMBEDDING_NAMES = ("embed",)


def _muon_labels(params) -> dict:
    """"muon" for the hidden matrices (2-D, not an embedding), "adam" for the rest."""
    def label(path, p) -> str:
        name = jax.tree_util.keystr(path).lower()
        return "muon" if p.ndim == 2 and not any(e in name for e in EMBEDDING_NAMES) else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def make_optimizer(
    lr: float,
    warmup_steps: int,
    total_steps: int,
    weight_decay: float = 0.1,
    clip_norm: float | None = 1.0,
    b1: float = 0.9,
    b2: float = 0.95,
    end_lr_fraction: float = 0.1,
    start_step: int = 0,
    rewarm_steps: int = 0,
    kind: str = "adamw",
    muon_rms: float = MUON_RMS,
) -> optax.GradientTransformation:
    """clip_by_global_norm(clip_norm) then AdamW on ``make_schedule(...)`` (``start_step`` and
    ``rewarm_steps``: a resumed learner's schedule, see there); ``kind="muon"``: Muon on the
    hidden matrices, AdamW on the rest (module docstring), the same schedule and decay; its update's
    RMS per matrix is ``muon_rms`` x the rate (AdamW's typical 0.2 by default).

    ``clip_norm=None`` (or 0) disables clipping. Weight decay is decoupled (AdamW) and masked
    to tensors with ndim >= 2. If the loss spikes after a global merge, lower ``clip_norm``
    or lengthen the warm-up before touching the outer learning rate.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if clip_norm is not None and clip_norm < 0:
        raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm}")
    if kind not in INNER_OPTIMIZERS:
        raise ValueError(f"inner optimizer must be one of {INNER_OPTIMIZERS}, got {kind!r}")
    schedule = make_schedule(lr, warmup_steps, total_steps, end_lr_fraction, start_step, rewarm_steps)
    opt = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=_decay_mask)
    if kind == "muon":
        from optax.contrib import muon

        # every leaf Muon gets is a hidden matrix; AdamW keeps the embeddings and norm scales
        opt = optax.partition({"muon": muon(schedule, weight_decay=weight_decay, consistent_rms=muon_rms),
                               "adam": opt}, _muon_labels)
    if not clip_norm:
        return opt
    return optax.chain(optax.clip_by_global_norm(clip_norm), opt)


def make_train_step(
    spec: ModelSpec, optimizer: optax.GradientTransformation, donate: bool = False
) -> TrainStep:
    """Jitted ``(params, opt_state, batch) -> (params, opt_state, loss)``.

    ``loss`` is the pre-update loss of ``batch`` (int32 [B, seq_len + 1]). With
    ``donate=True`` the input params/opt_state buffers are reused for the outputs (less peak
    memory) and must not be read after the call: keep the base copy of the global parameters
    as numpy, never as an alias of the live params.
    """

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, spec)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1) if donate else ())


def make_eval_fn(spec: ModelSpec) -> EvalFn:
    """Jitted ``(params, batch) -> mean next-token cross-entropy`` (no gradients)."""
    return jax.jit(partial(loss_fn, spec=spec))

