"""The built-in byte-level transformer as a run: its parameter tree, manifest and version 0.

A built-in run is a run like any other (``bus.runs``): its manifest carries the tree (every
parameter float32, in ``learner.spec.param_shapes`` order) and how the fragment plan is made, so the
aggregator merges it without knowing the model. What is particular to it: version 0 is made from
the seed (``learner.spec.init_params``, numpy, bit-identical on every machine), so a learner can
build it locally instead of downloading it, and several creators racing write the same bytes.
"""

from __future__ import annotations

import time

from bus.config import CommonConfig
from bus.fragments import FragmentPlan
from bus.protocol import Manifest
from bus.runs import create_run
from bus.tree import Leaf, TreeSpec
from learner.config import ModelConfig
from learner.spec import ModelSpec, init_params, make_plan, param_shapes, spec_hash


def builtin_tree(spec: ModelSpec) -> TreeSpec:
    """The parameter tree of the built-in model: its flat dict of named float32 arrays, in the
    order JAX flattens a dict (sorted keys), so an island holding that dict (``learner.island``)
    has exactly this tree and can join a built-in run. (The fragment plan does not depend on the
    order: ``bus.fragments`` packs by size and path.)"""
    return TreeSpec(tuple(Leaf(path, tuple(shape), "float32") for path, shape in sorted(param_shapes(spec).items())))


def builtin_manifest(run: str, model: ModelConfig) -> tuple[Manifest, FragmentPlan]:
    """The manifest of a built-in run of ``model`` (and its plan), with the declared geometry."""
    spec = model.spec()
    plan = make_plan(spec, model.num_fragments, model.max_imbalance)
    m = Manifest(run=run, model_hash=spec_hash(spec), spec=spec.to_dict(), seed=model.seed,
                 num_fragments=plan.num_fragments, plan_hash=plan.plan_hash(), created_at=time.time(),
                 max_inner_lr=model.max_inner_lr, max_tokens_per_step=model.max_tokens_per_step,
                 tree=builtin_tree(spec).to_dict(), max_imbalance=model.max_imbalance)
    return m, plan


async def create_builtin_run(js, common: CommonConfig, model: ModelConfig, log=None, provision: bool = True) -> bool:
    """Create the run of the built-in model (``bus.runs.create_run``): True if we did."""
    m, plan = builtin_manifest(common.run, model)
    spec = model.spec()
    return await create_run(js, common, m, plan, lambda: init_params(spec, model.seed), log=log,
                            provision=provision)


def builtin_backend(spec: ModelSpec, plan: FragmentPlan, cfg, shard, start_step: int = 0):
    """``diloco learner``'s compute: the island library's run-it-for-me backend
    (``learner.backends.TrainBackend``) with the built-in transformer's jitted AdamW step (it
    donates its inputs), its optimizer (``learner.inner``) and batches of this learner's shard.

    ``start_step``: a learner resumed at that step (``bus.progress``) gets the schedule's rate of
    that step (a fresh AdamW, re-warmed over DILOCO_RESUME_WARMUP steps) and the batches a learner
    that never stopped would draw from there on (``TokenShard.batch_at``)."""
    from learner.backends import TrainBackend
    from learner.inner import make_optimizer, make_train_step
    from learner.loop import params_from_fragments
    from learner.model import to_jax

    optimizer = make_optimizer(cfg.lr_for(spec.d_model), cfg.warmup, cfg.total_steps,
                               weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm or None,
                               start_step=start_step, rewarm_steps=cfg.resume_warmup if start_step else 0,
                               kind=cfg.inner_optimizer, muon_rms=cfg.muon_rms)

    def batches():
        step = start_step
        while True:
            yield shard.batch_at(step, cfg.batch_size)
            step += 1

    return TrainBackend(make_train_step(spec, optimizer, donate=True), batches(), builtin_tree(spec), plan,
                        build=lambda vectors: to_jax(params_from_fragments(plan, vectors)), init_opt=optimizer.init)
