"""Bring your own JAX model: one island of a Decoupled DiLoCo run, as a library.

Two ways to use it, over the same learner core (``learner.service.Learner``: schedule, outer
gradients with error feedback, rebase on arrival, heartbeats, eviction and resync, final sync)::

    # hook in my loop: one call per inner step, returns at once (async mode never waits on the network)
    island = Island(params, run="my-run", learner_id="us-east", nats_url="nats://hub:4222")
    params = island.params                     # the run's current global parameters
    for batch in batches:
        params, opt_state, loss = train_step(params, opt_state, batch)
        params = island.step(params, loss=loss)
    island.close()                             # sends the steps not yet sent, then leaves

    # run it for me: hand over the train step, the optimizer state and the batches
    island = Island(params, run="my-run", learner_id="eu-west")
    params, opt_state = island.train(train_step, opt_state, batches, steps=10_000)

The island reads the parameters it was handed while the next inner step runs: do not donate them
to your train step (``donate_argnums``).

``params`` is any JAX pytree (nested dicts, lists, tuples, an Equinox module, a Flax NNX state or
module). Float array leaves (float32, bfloat16, ...) are synchronised; outer gradients and the
aggregator's state are float32. Every other leaf (integer arrays, PRNG keys, functions, Python
scalars) stays on each island and is never sent; the island logs once which (``local_leaves``). Leaves may be ``jax.Array``s
sharded over the island's devices: only the leaves of a due fragment go to the host, and merged
versions are written back with each leaf's own dtype and sharding.

If the run does not exist yet, the first island to connect creates it with *its own* parameters as
version 0 (a compare-and-set claim, so two islands racing end with one version 0, both training
from it); the aggregator (``DILOCO_MODEL=run``) and the evaluator follow the run's manifest, which
describes the tree. Configuration not passed as arguments comes from the ``DILOCO_*`` variables of
``diloco learner`` (docs/learner.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import orjson

from bus import codec
from bus.config import CommonConfig, from_env
from bus.fragments import gather
from bus.log import get_logger
from bus.protocol import Manifest
from bus.tree import TreeSpec
from learner.config import LearnerConfig, ModelConfig
from bus.runs import create_tree_run, plan_for, tree_of_manifest
from learner.pytree import TreeParams, flatten, local_leaves_summary, named_float_arrays, tree_spec

from learner.backends import NO_STEP, HookBackend, IslandClosed, TrainBackend  # noqa: F401 (public names)


class TreeModel:
    """What the learner core needs of a model, for a user's tree (see ``learner.startup.BuiltinModel``)."""

    def __init__(self, spec: TreeSpec, num_fragments: int, max_imbalance: float, tokens_per_step: int,
                 make_backend: Callable[[Any], Any], init: dict[str, np.ndarray] | None = None,
                 max_inner_lr: float | None = None, max_tokens_per_step: int | None = None):
        self.tree = spec
        self.max_imbalance = max_imbalance
        self.plan = plan_for(spec, num_fragments, max_imbalance)
        self.model_hash = spec.tree_hash()
        self.tokens_per_step = int(tokens_per_step)
        self.num_params = spec.num_params
        self._make_backend = make_backend
        self.init = init
        self.max_inner_lr, self.max_tokens_per_step = max_inner_lr, max_tokens_per_step

    def check(self, m: Manifest) -> str | None:
        """None if this tree can join run ``m`` (a run of a user's tree, or of the built-in model
        when this tree is the built-in model's flat dict), else one line saying why not."""
        raw = m.tree if m.tree is not None else m.spec.get("tree")
        if raw is None:
            return f"run {m.run!r} describes no parameter tree (created by an older version): use another DILOCO_RUN"
        try:
            theirs = TreeSpec.from_dict(raw)
        except (ValueError, TypeError) as e:
            return f"run {m.run!r}: {e}"
        diff = self.tree.first_difference(theirs)
        if diff is not None and m.spec.get("kind") != "tree":
            return (f"run {m.run!r} holds the built-in model, not this island's tree ({diff}); an aggregator "
                    f"started without DILOCO_MODEL=run creates one: delete it with `DILOCO_RUN={m.run} diloco run "
                    "delete` and start the aggregator with DILOCO_MODEL=run (the first island then creates the "
                    "run from its own parameters)")
        if diff is not None:
            return f"this island's parameter tree differs from run {m.run!r}'s: {diff}"
        if m.plan_hash != self.plan.plan_hash() or m.num_fragments != self.plan.num_fragments:
            return (f"fragment plan {self.plan.plan_hash()} (P={self.plan.num_fragments}) differs from run "
                    f"{m.run!r}'s ({m.plan_hash}, P={m.num_fragments}): pass the run's num_fragments")
        return None

    @property
    def holds_version0(self) -> bool:
        return self.init is not None

    def initial_blob(self, m: Manifest):
        """``head -> blob`` of version 0 from our own parameters (the reader takes it only if its
        size and crc equal the head's: when we, or an island with identical parameters, created
        the run), so the creator downloads nothing and loads nothing at start."""
        init, plan = self.init, self.plan
        if init is None or m.model_hash != self.model_hash:
            return None

        def blob(head):
            if head.version != 0 or not 0 <= head.fragment < plan.num_fragments:
                return None
            return codec.encode_array(gather(plan, init, head.fragment))

        return blob

    def joined(self) -> None:
        self.init = None  # a host copy of every parameter: not needed once the run has started

    def adopt(self, m: Manifest) -> None:
        """The run's model hash is what its versions and our outer gradients carry (a built-in
        run's is the hash of the model spec, not of the tree)."""
        self.model_hash = m.model_hash

    def make_backend(self, learner) -> Any:
        return self._make_backend(learner)

    async def create_run_if_missing(self, js, common: CommonConfig, log) -> None:
        """Create the run with our own parameters as version 0, unless it exists or another island
        claimed it first (then wait for its manifest like any learner)."""
        if self.init is None:
            return
        await create_tree_run(js, common, self.tree, self.plan, self.init, self.max_imbalance,
                              max_inner_lr=self.max_inner_lr, max_tokens_per_step=self.max_tokens_per_step,
                              log=log)


# -- the island -------------------------------------------------------------------------------------


def _manifest_now(common: CommonConfig, environ: dict[str, str] | None = None,
                  timeout: float = 10.0) -> Manifest | None:
    """The run's manifest if it exists (None if not, or if it could not be read: the learner core
    then retries). First the island's share of a process's start-up: our loggers filter at
    DILOCO_LOG_LEVEL and render with the process's structlog configuration, or as JSON lines on
    stderr if it has none (``bus.log.setup_library``: nothing of the user's logging is changed), and
    one warning per unknown ``DILOCO_*`` variable of ``environ`` (ConfigError, one line, under
    DILOCO_STRICT_ENV). ``bus.conn.ConnectFailed`` (a ConnectionError: one line naming the URL and
    what to check) when the server cannot be reached within DILOCO_CONNECT_TIMEOUT. Runs its own
    loop in a thread: the caller may be inside one."""
    from bus.conn import ConnectFailed, connect
    from bus.log import setup_library
    from bus.runs import read_manifest

    setup_library(common.log_level, environ)
    out: list = [None]
    failed: list[ConnectFailed] = []

    async def go() -> None:
        nc = await connect(common, name="island-probe")
        try:
            out[0] = await asyncio.wait_for(read_manifest(nc.jetstream(timeout=timeout), common.run), timeout)
        finally:
            await nc.close()

    def main() -> None:
        try:
            asyncio.run(go())
        except ConnectFailed as e:
            failed.append(e)
        except Exception:
            pass

    t = threading.Thread(target=main, name="island-probe", daemon=True)
    t.start()
    t.join(common.connect_timeout + timeout + 5)
    if failed:
        raise ConnectFailed(str(failed[0]), failed[0].url, failed[0].cause) from None
    return out[0]


class Island:
    """One island of a run (see the module docstring). Thread-safe for one user thread."""

    def __init__(self, params: Any, *, run: str | None = None, learner_id: str | None = None,
                 nats_url: str | None = None, sync_every: int | None = None, num_fragments: int | None = None,
                 tokens_per_step: int = 1, max_inner_lr: float | None = None, create: bool = True,
                 join_timeout: float = 300.0, env: dict[str, str] | None = None):
        """Describe ``params``, connect, create the run from ``params`` if it has none (``create``),
        and join it: when this returns, ``self.params`` holds the run's current global parameters.

        ``tokens_per_step``: tokens (or examples) one inner step consumes, for the merge weights.
        ``max_inner_lr``: the peak learning rate of your inner optimizer (declared in the manifest
        by the island that creates the run; outer gradients larger than such steps can make are
        rejected). Anything else comes from ``env`` or the process's ``DILOCO_*`` variables."""
        import os

        e = {k: v for k, v in os.environ.items() if k.startswith("DILOCO_")}
        e.update(env or {})
        for key, val in (("DILOCO_RUN", run), ("DILOCO_LEARNER_ID", learner_id), ("DILOCO_NATS_URL", nats_url),
                         ("DILOCO_SYNC_EVERY", sync_every), ("DILOCO_NUM_FRAGMENTS", num_fragments),
                         ("DILOCO_INNER_LR", max_inner_lr)):
            if val is not None:
                e[key] = str(val)
        self.common = from_env(CommonConfig, e)
        model_cfg = from_env(ModelConfig, e)
        e.setdefault("DILOCO_MAX_STEPS", str(10**15))  # the user's loop decides when to stop
        self.cfg = from_env(LearnerConfig, {**e, "DILOCO_COMPUTE": "model", "DILOCO_FINAL_SYNC": "true"})
        self.spec = tree_spec(params)
        lr = max_inner_lr if max_inner_lr is not None else model_cfg.max_inner_lr
        # a run that exists decides the fragment plan (its creator chose the number of fragments)
        existing = _manifest_now(self.common, e)  # logging, variables checked; ConnectFailed if unreachable
        local = local_leaves_summary(self.spec)
        if local is not None:  # said once: which leaves each island keeps for itself
            get_logger(component="island", learner=self.cfg.learner_id).info("local_leaves", leaves=local)
        if existing is not None and (existing.tree is not None or existing.spec.get("kind") == "tree"):
            model_cfg = dataclasses.replace(model_cfg, num_fragments=existing.num_fragments,
                                            max_imbalance=float(existing.max_imbalance or 1.1))
        self._tree = TreeParams(params, self.spec, plan_for(self.spec, model_cfg.num_fragments,
                                                            model_cfg.max_imbalance))
        if create:
            from bus.streams import Limits

            Limits.for_run(self.common, self._tree.plan.sizes, self.common.run)  # LimitsTooSmall: one line
        self._cancel = threading.Event()
        self._backend = HookBackend(self._tree, self._cancel)
        self.model = TreeModel(self.spec, model_cfg.num_fragments, model_cfg.max_imbalance, tokens_per_step,
                               lambda learner: self._backend,
                               init=named_float_arrays(params) if create and self.cfg.create_run else None,
                               max_inner_lr=lr)
        self._closed = False
        self._start(join_timeout)

    # the learner core runs on its own asyncio loop in a background thread
    def _start(self, timeout: float) -> None:
        from learner.service import Learner

        self.learner = Learner(self.common, None, self.cfg, run_model=self.model)
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._code: int | None = None
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._loop)

            async def go() -> int:
                import structlog

                # the ids on the island's log lines, in its own thread's context (not the user's)
                structlog.contextvars.bind_contextvars(run=self.common.run, role="island", island=self.common.region,
                                                       learner=self.cfg.learner_id)
                self._stop = asyncio.Event()
                ready.set()
                return await self.learner.run(self._stop)

            try:
                self._code = self._loop.run_until_complete(go())
            finally:
                self._cancel.set()
                ready.set()
                self._loop.close()

        self._thread = threading.Thread(target=main, name=f"island-{self.cfg.learner_id}", daemon=True)
        self._thread.start()
        ready.wait()
        t_end = time.monotonic() + timeout
        hook = self._backend
        with hook._cv:  # joined: the learner asked for the first step
            while hook._served < 1:
                if not self._thread.is_alive():
                    from bus.conn import ConnectFailed, redact_url
                    from learner.startup import EXIT_TIMEOUT

                    why = self.learner.startup_error or f"exit {self._code}, see its log"
                    if self._code == EXIT_TIMEOUT and why.startswith(ConnectFailed.PREFIX):  # connect_until's
                        raise ConnectFailed(f"island {self.cfg.learner_id}: {why}", redact_url(self.common.nats_url))
                    raise RuntimeError(f"island {self.cfg.learner_id}: {why}")
                if time.monotonic() > t_end:
                    from bus.conn import redact_url

                    nc = self.learner.nc
                    where = ("" if nc is not None and nc.is_connected else
                             f" (not connected to {redact_url(self.common.nats_url)} now: is the server up?)")
                    self.close(final_sync=False)
                    raise TimeoutError(f"island {self.cfg.learner_id}: run {self.common.run!r} not joined "
                                       f"within {timeout}s{where}")
                hook._cv.wait(0.1)

    @property
    def params(self) -> Any:
        """The island's current parameters (after the latest global version it mixed in)."""
        return self._tree.tree()

    @property
    def start_step(self) -> int:
        """The run's step for this learner id when the island started: the inner steps an island of
        the same id trained before (the step of its newest published outer gradient, from the run's
        progress record), 0 for a new id or with ``DILOCO_RESUME=false``. Continue your schedule and
        data loader from it: ``lr = schedule(island.start_step + t)``."""
        return self.learner.book.start_step

    @property
    def step_count(self) -> int:
        """Inner steps of this learner id: ``start_step`` plus the ``island.step`` calls that returned
        (the core counts a step the user's thread served itself a moment later: ``metrics()["step"]``
        may lag by one)."""
        b = self.learner.book
        return max(b.step, b.start_step + self._backend._served - 1)

    def metrics(self) -> dict:
        """The learner metrics this island publishes (steps, contributions, bytes, staleness...)."""
        return self.learner.metrics()

    @property
    def stats(self) -> dict:
        """What became of this island's work so far: ``steps`` of this learner id (``start_step`` of
        them before this island started); rounds (one outer gradient of one
        fragment) ``sent``, ``merged`` into a global version, ``rejected`` by reason (and
        ``rejected_total``), ``unresolved`` (sent, fate not known yet); ``held``: contributions the
        aggregator held while this island was not admitted; ``member_state``: what the monitor calls
        it (None: not admitted, no monitor?); ``last_merged_version`` per fragment. After
        ``close()`` these are final (``close`` waits up to ``DILOCO_FINAL_WAIT`` s for the last
        rounds' fate)."""
        lr = self.learner
        for _ in range(5):  # the counts move in the island's thread: copy until a copy is whole
            try:
                return {"steps": self.step_count, "start_step": self.start_step, **lr.fate.stats(),
                        "member_state": lr.member_state}
            except RuntimeError:
                time.sleep(0.001)
        return {"steps": self.step_count, "start_step": self.start_step, "sent": lr.fate.sent,
                "merged": lr.fate.merged, "member_state": lr.member_state}

    def step(self, params: Any, loss: float | None = None) -> Any:
        """Count one inner step of ``params`` (the parameters after it); returns them with any
        arrived global version mixed in (rebase). Due fragments' outer gradients are computed here
        and sent in the background: in async mode this never waits on the network."""
        if self._closed:
            raise IslandClosed(f"island {self.cfg.learner_id} is closed: no more steps")
        # the loss is converted in the worker (float() of a JAX scalar waits for the device)
        return self._backend.exchange(params, float("nan") if loss is None else loss, self._thread.is_alive,
                                      lambda: self.learner.failure, self._quiet)

    def _quiet(self) -> bool:
        """Nothing for the core to mix into the next step: no arrival waiting, no resync, not a
        lock-step learner (whose steps wait for merges), not held by the sync window (the step waits
        for a merge then, ``learner.core._hold``), and the core is not failing."""
        lr = self.learner
        return (not lr.arrivals_ready() and not lr._resync_requested and self.cfg.mode != "sync"
                and lr.failure is None and not (lr.merges_reach and lr.book.holding()))

    def train(self, train_step: Callable, opt_state: Any, batches: Iterable, steps: int | None = None
              ) -> tuple[Any, Any]:
        """Run ``train_step(params, opt_state, batch) -> (params, opt_state, loss)`` over ``batches``
        (at most ``steps`` of them) from the run's current parameters, syncing as ``diloco learner``
        does (the step runs in this thread, the island's I/O in the background); then the final
        sync, and the island is closed. A stop (SIGTERM of the learner, or ``close()`` from another
        thread) ends the loop early. Returns (params, opt_state)."""
        params = self.params
        try:
            for i, batch in enumerate(batches):
                if steps is not None and i >= steps:
                    break
                params, opt_state, loss = train_step(params, opt_state, batch)
                params = self.step(params, loss=float(loss))
        except IslandClosed:
            pass
        self.close()
        return self.params, opt_state

    def close(self, final_sync: bool = True, wait: float | None = None) -> int | None:
        """Stop: with ``final_sync`` the steps not yet sent go out first, then the island waits up to
        ``wait`` seconds (default ``DILOCO_FINAL_WAIT``, 30) until the aggregator merged or rejected
        every round it sent, and logs what became of its work (``work_summary``: a warning unless
        all of it was merged; the counts stay in :attr:`stats`). Returns the learner's exit code."""
        if self._closed:
            return self._code
        self._closed = True
        if wait is not None:
            self.learner.final_wait = max(0.0, float(wait))
        if not final_sync and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._backend.close()
        self._thread.join(120 + self.learner.final_wait)
        return self._code

    def __enter__(self) -> "Island":
        return self

    def __exit__(self, *exc) -> None:
        self.close(final_sync=exc[0] is None)


def export_params(run_params: dict[str, np.ndarray], path: str, meta: dict) -> None:
    """Write named float32 leaves and a JSON record of the run to an .npz file."""
    arrays = {k: np.asarray(v) for k, v in run_params.items()}
    arrays["__diloco__"] = np.frombuffer(orjson.dumps(meta), dtype=np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def save_params(tree: Any, path: str) -> None:
    """Write the float leaves of ``tree`` (leaf paths as keys, float32) and their dtypes to an .npz:
    the file ``diloco run create --init`` makes version 0 from, and :func:`load_params` reads.
    ``tree`` is any tree an island takes (an Equinox module, an NNX state or module, a dict):
    its local leaves (PRNG keys, functions, integer counters) are not written."""
    spec = tree_spec(tree)
    export_params(named_float_arrays(tree), path,
                  {"kind": "tree", "dtypes": {leaf.path: leaf.dtype for leaf in spec.synced}, "ts": time.time()})


def load_params(path: str, like: Any) -> Any:
    """The parameters of an exported run (``diloco export``) in the structure of ``like``: float
    leaves from the file (cast to ``like``'s dtypes and put on its shardings), every other leaf
    kept from ``like`` as it is (the very object: an Equinox module's activation functions, an NNX
    state's or module's PRNG key and count, integer counters). So ``like`` is the model as you
    build it (``eqx.nn.MLP(...)``, ``nnx.split(model)[1]`` or the NNX module), and what comes back
    is of its type. ValueError naming the first leaf that is missing or of another shape."""
    import jax

    from learner.pytree import np_dtype

    paths, leaves, treedef = flatten(like)
    spec = tree_spec(like)
    with np.load(path) as f:
        out = []
        for leaf, x in zip(spec.leaves, leaves):
            if not leaf.synced:
                out.append(x)
                continue
            if leaf.path not in f.files:
                raise ValueError(f"{path}: no leaf {leaf.path} (the run's tree differs from this one)")
            a = f[leaf.path]
            if tuple(a.shape) != leaf.shape:
                raise ValueError(f"{path}: leaf {leaf.path} has shape {tuple(a.shape)}, yours {leaf.shape}")
            a = a.astype(np_dtype(leaf.dtype))
            out.append(jax.device_put(a, x.sharding) if isinstance(x, jax.Array) else a)
    return jax.tree_util.tree_unflatten(treedef, out)


# -- evaluating a user's model ----------------------------------------------------------------------


class _AnyPlan:
    """A tree model's check without the plan: a reader takes the run's own fragment plan."""

    def __init__(self, model: TreeModel):
        self.model = model

    def check(self, m: Manifest) -> str | None:
        why = self.model.check(m)
        return None if why is not None and why.startswith("fragment plan") else why


def _tree_evaluator_class():
    from learner.evaluator import Evaluator

    class TreeEvaluator(Evaluator):
        """``diloco eval`` for a user's tree: same following of global versions, same metrics
        record on ``metrics.evaluator.<id>``, the user's ``eval_fn(params, batch) -> loss``."""

        def __init__(self, common, lcfg, ecfg, like, eval_fn, batches, model: TreeModel):
            super().__init__(common, ModelConfig(), lcfg, ecfg)
            self.model, self.like = model, like
            self.model_hash, self.plan = model.model_hash, model.plan
            self._user_eval, self._user_batches = eval_fn, list(batches)
            if not self._user_batches:
                raise ValueError("evaluate_run needs at least one held-out batch")

        def _prepare(self) -> None:
            self._tree = TreeParams(self.like, self.model.tree, self.plan)

        def _heldout_tokens(self) -> int:
            return len(self._user_batches)  # batches; a tree run knows no tokens

        def _evaluate(self, vectors: list[np.ndarray]) -> float:
            for p, v in enumerate(vectors):
                self._tree.set_fragment(p, v)
            params = self._tree.tree()
            return float(np.mean([float(self._user_eval(params, b)) for b in self._user_batches]))

        async def _start(self) -> None:
            from learner.startup import (StartupError, connect_until, fetch_newest, global_reader,
                                         join_run_model)

            deadline = time.monotonic() + self.lcfg.manifest_timeout
            await self._in_worker(self._prepare)
            self.nc = await connect_until(self.common, f"eval-{self.ecfg.eval_id}", deadline, self.log)
            js = self.nc.jetstream(timeout=10)
            try:
                # the run's own plan (its creator chose the number of fragments), for our tree
                m = await join_run_model(js, self.common, _AnyPlan(self.model), deadline, log=self.log)
                self.plan = tree_of_manifest(m)[1]
                self._tree = TreeParams(self.like, self.model.tree, self.plan)
            except StartupError as e:
                self.startup_error = str(e)
                raise
            self.store = global_reader(js, self.common.run, self.plan, self.model_hash)
            self.vectors, self.versions = await fetch_newest(self.store, self.plan, deadline, self.log)

    return TreeEvaluator


def evaluate_run(like: Any, eval_fn: Callable[[Any, Any], float], batches: Iterable, *, run: str | None = None,
                 nats_url: str | None = None, eval_id: str = "eval-0", interval: float | None = None,
                 once: bool = False, stop: threading.Event | None = None, num_fragments: int | None = None,
                 env: dict[str, str] | None = None) -> dict | None:
    """Evaluate a user's model as ``diloco eval`` does the built-in one: follow the run's global
    versions, and whenever one changed (at most every ``interval`` s, DILOCO_EVAL_INTERVAL) publish
    ``{"role": "evaluator", "eval_loss": mean eval_fn(params, batch) over batches, "version",
    "versions", ...}`` on ``metrics.evaluator.<eval_id>``, so `diloco metrics` shows it.

    ``like``: a tree of the run's structure (for instance your initial params). ``once``: evaluate
    the current global model once and return the record. Otherwise runs until ``stop`` is set and
    returns None. Blocks the calling thread."""
    import os

    from learner.config import EvalConfig

    e = {k: v for k, v in os.environ.items() if k.startswith("DILOCO_")}
    e.update(env or {})
    for key, val in (("DILOCO_RUN", run), ("DILOCO_NATS_URL", nats_url), ("DILOCO_EVAL_ID", eval_id),
                     ("DILOCO_EVAL_INTERVAL", interval), ("DILOCO_NUM_FRAGMENTS", num_fragments)):
        if val is not None:
            e[key] = str(val)
    common = from_env(CommonConfig, e)
    from bus.log import setup_library

    setup_library(common.log_level, e)  # DILOCO_LOG_LEVEL, unknown variables warned about once
    model_cfg = from_env(ModelConfig, e)
    spec = tree_spec(like)
    model = TreeModel(spec, model_cfg.num_fragments, model_cfg.max_imbalance, 1, lambda _: None)
    ev = _tree_evaluator_class()(common, from_env(LearnerConfig, e), from_env(EvalConfig, e), like, eval_fn,
                                 batches, model)

    async def go() -> int:
        halt = asyncio.Event()
        if stop is not None:
            loop = asyncio.get_running_loop()
            threading.Thread(target=lambda: (stop.wait(), loop.call_soon_threadsafe(halt.set)),
                             daemon=True).start()
        return await ev.run(halt, once=once)

    code = asyncio.run(go())
    if code != 0:
        raise RuntimeError(f"evaluator {eval_id}: {getattr(ev, 'startup_error', None) or f'exit {code}'}")
    return ev.last if once else None
