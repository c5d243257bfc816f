"""What every mode of a reference run (``simulation.reference``) shares: the model, its fragment plan,
version 0, data shards, held-out batches and the inner optimizer, for the built-in transformer
(``Setup``) or a user's JAX model (``TreeSetup``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from simulation.reference_config import RefConfig


def inner_rate(cfg) -> float:
    """The peak inner rate of a reference run: ``cfg.lr``, or (0) the learner's default for the model's
    width, the inner optimizer and M learners (``learner.config.auto_inner_lr``)."""
    from learner.config import ModelConfig, auto_inner_lr

    d_model = int(cfg.model.get("d_model", ModelConfig.__dataclass_fields__["d_model"].default))
    return float(cfg.lr or auto_inner_lr(d_model, cfg.inner_optimizer, cfg.M))


class Setup:
    """What every mode shares: model, plan, version 0, data shards, held-out batches, optimizer."""

    def __init__(self, cfg: RefConfig):
        from learner.config import ModelConfig
        from learner.data import load_corpus
        from learner.inner import make_eval_fn
        from learner.spec import count_params, init_params, make_plan

        self.cfg = cfg
        self.lr = inner_rate(cfg)
        # the run declares its peak inner learning rate (the norm bound of early contributions): the
        # manifest's default, as the runs of bench.runs (its aggregator creates the run), or the rate
        self.model = ModelConfig(**{"max_inner_lr": max(ModelConfig().max_inner_lr, self.lr), **cfg.model,
                                    "num_fragments": cfg.P, "seed": cfg.seed})
        self.spec = self.model.spec()
        self.plan = make_plan(self.spec, cfg.P, self.model.max_imbalance)
        self.params = count_params(self.spec)
        self.v0 = init_params(self.spec, cfg.seed)
        # learner groups with their own corpora (cfg.corpora: non-IID runs, bench.noniid), or one corpus
        self.corpora = [load_corpus(c or None) for c in (cfg.corpora or (cfg.corpus,))]
        self.corpus = self.corpora[0]
        self._schedules: dict[int, tuple] = {}  # schedule length -> (optimizer, train step)
        self.optimizer, self.train_step = self.schedule()
        # the held-out loss weighs every group's corpus alike (the same number of batches of each)
        self.heldout = np.concatenate([c.heldout_batches(self.spec.seq_len, cfg.eval_batch_size, cfg.eval_batches)
                                       for c in self.corpora])
        self._eval = make_eval_fn(self.spec)
        self.tokens_per_step = cfg.batch * self.spec.seq_len

    def shard(self, m: int, incarnation: str | None = None):
        """Learner m's sampler: bench.dp's (so dp and the learners see the same data), or with an
        ``incarnation`` the one ``diloco learner`` process ``learner-<m>`` of it uses (resuming, as
        by default, its seed is the learner id's: ``learner.loop.sampler_seed``)."""
        from learner.loop import sampler_seed

        seed = (self.cfg.data_seed * 1_000_003 + m if incarnation is None
                else sampler_seed(self.cfg.data_seed, f"learner-{m}", incarnation, resume=True))
        g = group_of(m, self.cfg.M, len(self.corpora))
        members = [j for j in range(self.cfg.M) if group_of(j, self.cfg.M, len(self.corpora)) == g]
        return self.corpora[g].shard(members.index(m), len(members), self.spec.seq_len, seed)

    def learner_batches(self, m: int, incarnation: str | None = None):
        """bench.dp's stream, or (an ``incarnation``: a system run replayed) the learner's, by step."""
        if incarnation is not None:
            return _by_step(self.shard(m, incarnation), self.cfg.batch)
        return _forever(self.shard(m, incarnation), self.cfg.batch)

    def dp_batches(self):
        return _dp_batches([self.shard(m) for m in range(self.cfg.M)], self.cfg.batch)

    def evaluate(self, tree: Any) -> float:
        return float(np.mean([float(self._eval(tree, hb)) for hb in self.heldout]))

    def evaluate_fragments(self, vectors: list[np.ndarray]) -> float:
        from learner.loop import params_from_fragments
        from learner.model import to_jax

        return self.evaluate(to_jax(params_from_fragments(self.plan, vectors)))

    def schedule(self, total: int | None = None) -> tuple:
        """(optimizer, train step) of an inner schedule spanning ``total`` steps, its warm-up the
        learner's share of it (None: the run's schedule)."""
        from learner.inner import make_optimizer, make_train_step

        cfg = self.cfg
        total = total or cfg.total_steps or cfg.steps
        if total not in self._schedules:
            opt = make_optimizer(self.lr, min(warmup_of(cfg, total), total - 1), total, weight_decay=cfg.weight_decay,
                                 clip_norm=cfg.clip_norm or None, kind=cfg.inner_optimizer, muon_rms=cfg.muon_rms)
            self._schedules[total] = (opt, make_train_step(self.spec, opt, donate=True))
        return self._schedules[total]

    def backend(self, batches, total: int | None = None):
        """A learner's backend; ``total``: its own schedule's length (None: the run's)."""
        import jax

        from learner.builtin import builtin_tree
        from learner.backends import TrainBackend
        from learner.loop import params_from_fragments
        from learner.model import to_jax

        # parameters and optimizer state committed to the device from the start, as the step's outputs
        # and set_fragment's leaves are: a step called on a mix of committed and uncommitted leaves
        # compiles again for each new mix (3 compiles instead of 1 for 2 learners of the tiny model)
        device = jax.devices()[0]
        optimizer, train_step = self.schedule(total)
        return TrainBackend(train_step, batches, builtin_tree(self.spec), self.plan,
                            build=lambda vectors: jax.device_put(to_jax(params_from_fragments(self.plan, vectors)), device),
                            init_opt=lambda params: jax.device_put(optimizer.init(params), device))

    def v0_fragments(self) -> list[np.ndarray]:
        out = []
        for frag in self.plan.fragments:
            out.append(np.concatenate([self.v0[s.path].reshape(-1)[s.start:s.stop] for s in frag.slices])
                       .astype(np.float32))
        return out


def group_of(m: int, M: int, groups: int) -> int:
    """The corpus group of learner ``m`` of ``M`` (contiguous: 8 learners in 2 groups are 0-3 and 4-7)."""
    return m * groups // M


def warmup_of(cfg: RefConfig, total: int) -> int:
    """The warm-up of a schedule of ``total`` steps: ``cfg.warmup``, or the learner's default share."""
    from learner.config import LearnerConfig, warmup_for

    fraction = LearnerConfig.__dataclass_fields__["warmup_fraction"].default
    return warmup_for(cfg.warmup, total, float(fraction))  # type: ignore[arg-type]


class TreeSetup:
    """A user's JAX model, as islands train it (``learner.island``): the reference then runs any
    model, not only the built-in one (``run_reference(cfg, TreeSetup(...))``; the inner settings of
    ``cfg`` are the user's business then, its outer settings and timing apply).

    ``params``: version 0 (any pytree; its floating-point leaves are synchronised, the others stay
    each learner's); ``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` (it may
    donate its inputs); ``init_opt(params)``; ``batches(m)``: learner m's batch iterator (data
    parallel concatenates one batch of each learner, leaf by leaf); ``eval_fn(params) -> float``:
    the held-out loss; ``tokens_per_step``: what one learner step counts for the token weights."""

    def __init__(self, cfg: RefConfig, params: Any, train_step: Callable, init_opt: Callable,
                 batches: Callable[[int], Any], eval_fn: Callable[[Any], float], tokens_per_step: int,
                 max_inner_lr: float | None = None, max_imbalance: float = 1.1):
        from types import SimpleNamespace

        from bus.fragments import gather_all
        from bus.runs import plan_for
        from learner.pytree import named_float_arrays, tree_spec

        self.cfg = cfg
        self.tree = tree_spec(params)
        self.plan = plan_for(self.tree, cfg.P, max_imbalance)
        self._v0 = gather_all(self.plan, named_float_arrays(params))
        self._params0 = params
        self.params = self.tree.num_params
        self.train_step, self.init_opt, self._batches, self.eval_fn = train_step, init_opt, batches, eval_fn
        self.tokens_per_step = int(tokens_per_step)
        self.model = SimpleNamespace(max_inner_lr=max_inner_lr, max_tokens_per_step=None)

    def _copy(self) -> Any:
        import jax
        import jax.numpy as jnp

        return jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), self._params0)

    def learner_batches(self, m: int, incarnation: str | None = None):
        return iter(self._batches(m))

    def dp_batches(self):
        import jax

        its = [iter(self._batches(m)) for m in range(self.cfg.M)]
        while True:
            yield jax.tree_util.tree_map(lambda *xs: np.concatenate(xs), *[next(it) for it in its])

    def v0_fragments(self) -> list[np.ndarray]:
        return [v.copy() for v in self._v0]

    def backend(self, batches, total: int | None = None):
        from learner.backends import TrainBackend

        if total is not None:
            raise ValueError("learner_steps needs the built-in model: a user's train step brings its own schedule")
        return TrainBackend(self.train_step, batches, self.tree, self.plan, params=self._copy(),
                            init_opt=self.init_opt)

    def evaluate(self, tree: Any) -> float:
        return float(self.eval_fn(tree))

    def evaluate_fragments(self, vectors: list[np.ndarray]) -> float:
        from learner.pytree import TreeParams

        tp = TreeParams(self._copy(), self.tree, self.plan)
        for p, v in enumerate(vectors):
            tp.set_fragment(p, v)
        return self.evaluate(tp.tree())


def _forever(shard, b: int):
    while True:
        yield shard.batch(b)


def _by_step(shard, b: int):
    step = 0
    while True:
        yield shard.batch_at(step, b)
        step += 1


def _dp_batches(shards, b: int):
    while True:
        yield np.concatenate([s.batch(b) for s in shards])
