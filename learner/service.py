"""The learner service (``diloco learner``, ``python -m learner``): one island of a run.

A thin asyncio shell around the pure core (``learner.loop``, ``learner.outer``,
``bus.fragments``, ``learner.inner``). Configured by environment only (``CommonConfig``,
``ModelConfig``, ``LearnerConfig``; see ``diloco config learner`` and docs/learner.md).

Life of a learner::

    connect -> wait for the manifest (the aggregator creates the run) -> check model and plan hashes (exit 3 if not)
    -> fetch the newest global version of every fragment (never its own init) -> train:

    loop until DILOCO_MAX_STEPS (or DILOCO_TOTAL_STEPS) or SIGTERM/SIGINT:
        resync if the monitor evicted this process          (fetch all, overwrite, drop residuals)
        take in downloaded global versions                   theta_p <- Theta_p + (theta_p - base_p); base_p <- Theta_p
        one inner step in the worker thread                  (AdamW, or synthetic)
        for every fragment p due: Delta_p = base_p - theta_p (+ error feedback), quantise, publish
                                  in the background; sync mode waits for the merged version
    at the step budget: a final sync of every fragment with unsent steps, then wait for the publishes

Downlink (async mode, DILOCO_FETCH=round): a fragment is downloaded at most once per own sync, the
newest version DILOCO_FETCH_DELAY (H/4) steps after it, so a learner fetches about N values per H
steps, not one version per merge.

Background tasks on the event loop, alive during long steps: heartbeats, metrics, a watch on the
global heads (plus a slow poll as a safety net after reconnects), the watch on this learner's
membership key.

Exit codes: 0 done or stopped by a signal, 1 unexpected error, 3 run mismatch (model spec or
fragment plan differs from the run's manifest), 4 timed out waiting for the run (no manifest or no
global versions within DILOCO_MANIFEST_TIMEOUT).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import math
import sys
import threading
import time
import uuid

import numpy as np
import orjson
from nats.js.errors import NotFoundError

from bus import codec
from bus.signals import install_stop
from bus.config import CommonConfig, from_env
from bus.conn import connect
from bus.log import get_logger, setup
from bus.protocol import grad_meta, grad_obj_id
from bus.subjects import Subjects
from bus.global_reader import GlobalReader
from bus.transport import ChunkPublisher, Head, follow_heads
from learner import loop as lp
from learner.config import LearnerConfig, ModelConfig
from bus.fragments import FragmentPlan, gather
from learner.outer import mix, outer_gradient, rebase
from learner.spec import ModelSpec, count_params, spec_hash

EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_MISMATCH, EXIT_TIMEOUT = 0, 1, 2, 3, 4

#: Seconds between polls of every fragment's head, a safety net next to the watch (which may
#: miss heads while a reconnect re-creates its consumer).
HEAD_POLL_INTERVAL = 5.0
#: Seconds a stopping learner waits for its in-flight outer gradients.
DRAIN_TIMEOUT = 10.0


async def start_unless_halted(start, halt: asyncio.Event, log, label: str) -> int | None:
    """Await the coroutine ``start`` unless ``halt`` is set first. None once started; otherwise
    the exit code: EXIT_OK when halted (stopped while waiting for the run), or a StartupError's
    code, logged and printed on stderr as ``label: message``."""
    started = asyncio.create_task(start)
    halted = asyncio.create_task(halt.wait())
    await asyncio.wait({started, halted}, return_when=asyncio.FIRST_COMPLETED)
    halted.cancel()
    if not started.done():
        started.cancel()
        await asyncio.gather(started, return_exceptions=True)
        return EXIT_OK
    try:
        started.result()
    except StartupError as e:
        log.error("startup_failed", reason=str(e), code=e.code)
        print(f"{label}: {e}", file=sys.stderr, flush=True)
        return e.code
    return None


class StartupError(Exception):
    """Start-up failed; ``code`` is the exit code, the message one line saying why."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


# -- shared with the evaluator ---------------------------------------------------------------------


async def connect_until(common: CommonConfig, name: str, deadline: float, log):
    """Connect, retrying until ``deadline`` (monotonic) so a learner may start before the server."""
    delay = 0.2
    while True:
        try:
            return await connect(common, name=name)
        except Exception as e:
            if time.monotonic() + delay > deadline:
                raise StartupError(EXIT_TIMEOUT, f"cannot connect to {common.nats_url}: {e!r}") from None
            log.warning("connect_retry", error=repr(e))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def join_run(js, common: CommonConfig, spec: ModelSpec, plan: FragmentPlan, deadline: float):
    """Wait for the manifest and check it: StartupError(3) on mismatch, (4) on timeout.

    Learners and the evaluator never create streams (their least-privilege users may not): the
    aggregator, or ``diloco run create``, provisions the run."""
    from bus.runs import RunMismatch, wait_manifest
    from learner.spec import check_manifest

    try:
        m = await wait_manifest(js, common.run, timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError as e:
        raise StartupError(EXIT_TIMEOUT, str(e)) from None
    try:
        check_manifest(m, spec, plan)
    except RunMismatch as e:
        raise StartupError(EXIT_MISMATCH, f"refusing to start: {e}") from None
    return m


async def join_run_model(js, common: CommonConfig, run_model, deadline: float):
    """Wait for the manifest and check ``run_model`` against it: StartupError(3) naming the
    difference, (4) on timeout."""
    from bus.runs import wait_manifest

    try:
        m = await wait_manifest(js, common.run, timeout=max(0.0, deadline - time.monotonic()))
    except TimeoutError as e:
        raise StartupError(EXIT_TIMEOUT, str(e)) from None
    why = run_model.check(m)
    if why is not None:
        raise StartupError(EXIT_MISMATCH, f"refusing to start: {why}")
    return m


class BuiltinModel:
    """The built-in byte-level transformer of ``ModelConfig``, for the learner core (the other
    kind is a user's tree, ``learner.island.TreeModel``)."""

    def __init__(self, model: ModelConfig, cfg: LearnerConfig):
        from learner.spec import make_plan

        self.model_cfg, self.create = model, cfg.create_run
        self.spec = model.spec()
        self.model_hash = spec_hash(self.spec)
        self.plan = make_plan(self.spec, model.num_fragments, model.max_imbalance)
        self.tokens_per_step = cfg.batch_size * self.spec.seq_len
        self.num_params = count_params(self.spec)

    def check(self, m) -> str | None:
        from bus.runs import RunMismatch
        from learner.spec import check_manifest

        try:
            check_manifest(m, self.spec, self.plan)
        except RunMismatch as e:
            return str(e)
        return None

    def initial_blob(self, m):
        return initial_blobs(self.spec, self.plan, m.seed)

    async def create_run_if_missing(self, js, common: CommonConfig, log) -> None:
        """Create the built-in run (version 0 from the seed) unless it exists or DILOCO_CREATE_RUN
        is false; several learners racing end with one version 0 (``bus.runs.create_run``)."""
        if not self.create:
            return
        from bus.streams import LimitsTooSmall
        from learner.builtin import create_builtin_run

        try:
            await create_builtin_run(js, common, self.model_cfg, log=log)
        except LimitsTooSmall as e:
            raise StartupError(EXIT_CONFIG, str(e)) from None
        except Exception as e:  # no right to create it, a server blip: wait for its creator
            log.warning("run_not_created", error=repr(e), hint="waiting for the run's manifest")


def check_geometry(m, inner_lr: float, tokens_per_step: int) -> None:
    """StartupError(3) if this learner would exceed the run's declared geometry: its outer
    gradients would then be rejected (norm_bound, bad_counters) and its work lost."""
    if m.max_inner_lr is not None and inner_lr > m.max_inner_lr:
        raise StartupError(EXIT_MISMATCH, f"refusing to start: DILOCO_INNER_LR={inner_lr} is above the run's "
                                          f"declared max_inner_lr {m.max_inner_lr} (DILOCO_MAX_INNER_LR of the run)")
    if m.max_tokens_per_step is not None and tokens_per_step > m.max_tokens_per_step:
        raise StartupError(EXIT_MISMATCH, f"refusing to start: {tokens_per_step} tokens per inner step is above the "
                                          f"run's declared {m.max_tokens_per_step} (DILOCO_MAX_BATCH_SIZE x "
                                          "DILOCO_SEQ_LEN of the run)")


def initial_blobs(spec: ModelSpec, plan: FragmentPlan, seed: int):
    """``head -> blob``: version 0 built here, as ``learner.builtin`` builds it (numpy init from
    the manifest's seed, bit-identical), so a fresh run starts without downloading its parameters
    (data-parallel workers do not download their init either). The reader takes it only when its
    size and crc32 equal the head's; anything else (a later version, another seed) is downloaded."""
    from learner.spec import init_params

    cache: dict = {}

    def blob(head: Head):
        if head.version != 0 or not 0 <= head.fragment < plan.num_fragments:
            return None
        if "params" not in cache:
            cache["params"] = init_params(spec, seed)
        return codec.encode_array(gather(plan, cache["params"], head.fragment))

    return blob


def check_fragment(plan: FragmentPlan, head: Head, vec: np.ndarray, model_hash: str) -> np.ndarray:
    """``vec`` (the decoded version ``head``) as a flat float32 vector; ValueError saying why it does
    not fit this run."""
    p = head.fragment
    if not 0 <= p < plan.num_fragments:
        raise ValueError(f"fragment {p} out of range [0, {plan.num_fragments})")
    model = head.meta.get("model")
    if model is not None and model != model_hash:
        raise ValueError(f"fragment {p} v{head.version} is of model {model}, ours is {model_hash}")
    vec = np.asarray(vec, dtype=np.float32).reshape(-1)
    if vec.size != plan.sizes[p]:
        raise ValueError(f"fragment {p} v{head.version} has {vec.size} values, the plan says {plan.sizes[p]}")
    if not np.isfinite(vec).all():
        raise ValueError(f"fragment {p} v{head.version} holds NaN or Inf")
    return vec


def global_reader(js, run: str, plan: FragmentPlan, model_hash: str) -> GlobalReader:
    """The reader of this run's global versions, checking each against the plan and the model."""
    return GlobalReader(js, run, lambda head, vec: check_fragment(plan, head, vec, model_hash))


async def fetch_newest(reader: GlobalReader, plan: FragmentPlan, deadline: float,
                       log) -> tuple[list[np.ndarray], dict[int, int]]:
    """The newest global version of every fragment, waiting (until ``deadline``) for missing ones."""
    vectors: list[np.ndarray] = []
    versions: dict[int, int] = {}
    for p in range(plan.num_fragments):
        logged = False
        while True:
            why = "no version yet"
            try:
                got = await reader.newest(p)
                if got is not None:
                    head, vec = got
                    vectors.append(vec)
                    versions[p] = head.version
                    break
            except Exception as e:  # connection trouble, a bad version: try again
                why = repr(e)
            if time.monotonic() > deadline:
                raise StartupError(EXIT_TIMEOUT, f"global fragment {p}: no usable version ({why})")
            if not logged:
                log.info("waiting_for_fragment", fragment=p, reason=why)
                logged = True
            await asyncio.sleep(0.5)
    return vectors, versions


async def close_quietly(nc, timeout: float = 5.0) -> None:
    if nc is None:
        return
    try:
        await asyncio.wait_for(nc.drain(), timeout)
    except Exception:
        try:
            await nc.close()
        except Exception:
            pass


peak_rss_mib = lp.peak_rss_mib


# -- compute backends: everything they do runs in the learner's single worker thread ---------------


class SyntheticBackend:
    """No JAX: numpy fragment vectors, a deterministic pseudo-gradient and a sleep per step."""

    slowdown_included = True  # the step sleeps step_time * slowdown itself

    def __init__(self, plan: FragmentPlan, cfg: LearnerConfig, seed: int, cancel: threading.Event):
        self.plan = plan
        self.lr = cfg.inner_lr
        self.step_seconds = cfg.step_time * cfg.slowdown
        self.cancel = cancel
        self.directions = lp.synthetic_directions(plan.sizes, seed)
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(seed, spawn_key=(11,))))
        self.frags: list[np.ndarray] = []

    def load(self, vectors: list[np.ndarray]) -> None:
        self.frags = [np.array(v, dtype=np.float32, copy=True).reshape(-1) for v in vectors]

    def step(self) -> float:
        t0 = time.monotonic()
        scales = self.rng.standard_normal(len(self.frags))
        loss = lp.synthetic_step(self.frags, self.directions, self.lr, scales)
        rest = self.step_seconds - (time.monotonic() - t0)
        if rest > 0:
            self.cancel.wait(rest)  # blocks this worker thread, as a long JAX step would
        return loss

    def get_fragment(self, p: int) -> np.ndarray:
        return self.frags[p].copy()

    def set_fragment(self, p: int, vector: np.ndarray) -> None:
        self.frags[p][:] = vector


def _owned(a) -> bool:
    """A float32 numpy vector the learner may write into (not a read-only view of a blob)."""
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 1 and a.flags.writeable


# -- the learner -----------------------------------------------------------------------------------


class Learner:
    """One learner process. ``await Learner(...).run(stop)`` returns the exit code.

    Attributes worth inspecting (tests, debugging): ``book`` (counters and versions),
    ``base`` / ``residual`` (per-fragment numpy vectors), ``backend``, ``incarnation``.
    """

    def __init__(self, common: CommonConfig, model: ModelConfig | None, cfg: LearnerConfig,
                 incarnation: str | None = None, run_model=None):
        """``run_model``: the model to train (``BuiltinModel`` of ``model`` by default; a user's
        tree through ``learner.island``): its hash, fragment plan, version 0 and compute backend."""
        self.common, self.model_cfg, self.cfg = common, model, cfg
        self.incarnation = incarnation or uuid.uuid4().hex[:12]
        self.id = cfg.learner_id
        self.run_model = run_model if run_model is not None else BuiltinModel(model, cfg)
        self.model_hash = self.run_model.model_hash
        self.plan = self.run_model.plan
        self.P = self.plan.num_fragments
        self.s = Subjects(common.run)
        self.log = get_logger(component="learner", incarnation=self.incarnation)
        self.tokens_per_step = self.run_model.tokens_per_step
        self.book = lp.Bookkeeper(self.P, cfg.sync_every, self.tokens_per_step, staggered=cfg.mode != "sync")
        self.num_shards = cfg.num_shards or cfg.num_learners
        self.shard_index = lp.derive_shard(self.id, self.num_shards, cfg.shard_index)
        self.seed = lp.batch_seed(cfg.data_seed, self.id, self.incarnation)
        self.base: list[np.ndarray | None] = [None] * self.P
        self.residual: list[np.ndarray | None] = [None] * self.P
        self.unsent: list[np.ndarray | None] = [None] * self.P  # work of failed publishes
        self.pending: dict[int, tuple[int, np.ndarray]] = {}
        self.applied_in: dict[tuple[int, int], int] = {}  # sync mode: (p, round) -> version that applied it
        self._awaiting: set[tuple[int, int]] = set()
        self.loss = float("nan")
        self.quant_error = 0.0
        self.blocked_s = 0.0
        self.sync_timeouts = 0
        self.member_state: str | None = None
        self.backend = None
        self.nc = None
        self.js = None
        self.store: GlobalReader | None = None
        self.publisher: ChunkPublisher | None = None
        self.rate = lp.RateMeter()
        self._resync_requested = False
        self._halt = asyncio.Event()
        self._news = asyncio.Event()
        self._head_lock = asyncio.Lock()
        self._verified: dict[int, int] = {}  # fragment -> newest version whose blob we checked
        self._candidate: dict[int, Head] = {}  # fetch=round: newest head seen, not downloaded yet
        self._refused: dict[int, Head] = {}  # fragment -> the newest head record we rejected
        self._fetch_all = cfg.fetch == "every" or cfg.mode == "sync"
        self._fetches: set[asyncio.Task] = set()
        # secret part of our message ids: the incarnation is public (membership records), so without it
        # another learner could publish chunks under our future ids and get ours dropped as duplicates
        self._nonce = uuid.uuid4().hex[:12]
        self._sent: dict[tuple[int, int], bytearray] = {}  # (fragment, round) -> blob of the outer gradient in flight
        self.rejected_globals: dict[str, int] = {}
        self.startup_error: str | None = None
        self.failure: str | None = None  # why run() failed after start-up
        self._cancel = threading.Event()
        self._publishes: set[asyncio.Task] = set()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"inner-{self.id}")

    # -- running ------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event | None = None) -> int:
        tasks: list[asyncio.Task] = []
        if stop is not None:
            tasks.append(asyncio.create_task(self._relay_stop(stop)))
        try:
            code = await start_unless_halted(self._start_noting_why(), self._halt, self.log,
                                             f"diloco learner {self.id}")
            if code is not None:
                return code
            beats = asyncio.create_task(self._heartbeats())
            tasks += [beats] + [asyncio.create_task(c) for c in (
                self._metrics_loop(), self._follow_globals(), self._follow_membership())]
            if self.cfg.dynamic_h:
                tasks.append(asyncio.create_task(self._follow_rates()))
            await self._wait_for_peers()
            await self._train()
            await self._drain()
            await self._leave(beats)
            await self._publish_metrics()
            self.log.info("stopped", step=self.book.step, contributions=self.book.contributions,
                          bytes_sent=self.publisher.bytes_sent, bytes_received=self.store.bytes_received,
                          rss_mib=peak_rss_mib())
            return EXIT_OK
        except Exception as e:
            self.failure = f"{type(e).__name__}: {e}"  # what an island raises to its user
            self.log.exception("learner_failed")
            print(f"diloco learner {self.id}: failed: {e!r}", file=sys.stderr, flush=True)
            return EXIT_ERROR
        finally:
            self._halt.set()
            self._cancel.set()
            for t in tasks + list(self._publishes) + list(self._fetches):
                t.cancel()
            await asyncio.gather(*tasks, *self._publishes, *self._fetches, return_exceptions=True)
            await close_quietly(self.nc)
            self._executor.shutdown(wait=False)

    async def _start_noting_why(self) -> None:
        try:
            await self._start()
        except StartupError as e:
            self.startup_error = str(e)  # the one line an island raises to its user
            raise

    async def _relay_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.log.info("stop_requested")
        self._halt.set()
        self._cancel.set()

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _start(self) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.manifest_timeout
        self.log.info("starting", mode=cfg.mode, model=self.model_hash, plan=self.plan.plan_hash(),
                      fragments=self.P, sizes=list(self.plan.sizes), H=cfg.sync_every,
                      quantiser=cfg.quantiser, shard=self.shard_index, shards=self.num_shards)
        self.nc = await connect_until(self.common, f"learner-{self.id}", deadline, self.log)
        self.js = self.nc.jetstream(timeout=10)
        self.publisher = ChunkPublisher(self.js, self.common.max_chunk_bytes, self.common.inflight_chunks)
        self.store = global_reader(self.js, self.common.run, self.plan, self.model_hash)
        await self.run_model.create_run_if_missing(self.js, self.common, self.log)
        manifest = await join_run_model(self.js, self.common, self.run_model, deadline)
        if hasattr(self.run_model, "adopt"):  # an island in a run whose hash is not its tree's
            self.run_model.adopt(manifest)
            if self.run_model.model_hash != self.model_hash:
                self.model_hash = self.run_model.model_hash
                self.store = global_reader(self.js, self.common.run, self.plan, self.model_hash)
        check_geometry(manifest, self.cfg.inner_lr, self.tokens_per_step)
        self.store.local = self.run_model.initial_blob(manifest)
        try:
            vectors, versions = await fetch_newest(self.store, self.plan, deadline, self.log)
        finally:
            local_hits, self.store.local = self.store.local_hits, None
        self.backend = await self._in_worker(self._make_backend)
        # an island whose own parameters are the run's version 0 (every fragment's bytes equal:
        # the reader took each from our local copy) has nothing to load
        ours = (getattr(self.run_model, "holds_version0", False) and local_hits == self.P
                and all(v == 0 for v in versions.values()))
        if not ours:
            await self._in_worker(self.backend.load, vectors)
        if hasattr(self.run_model, "joined"):
            self.run_model.joined()
        if hasattr(self.backend, "compile"):
            self.log.info("compiled", seconds=round(await self._in_worker(self.backend.compile), 3))
        self.base = vectors
        for p, v in versions.items():
            self.book.on_merged(p, v)
        self.log.info("joined", versions=versions, params=self.run_model.num_params,
                      memory_mib=round(self.memory()["total"] / 2**20, 2))

    def _make_backend(self):
        if not isinstance(self.run_model, BuiltinModel):
            return self.run_model.make_backend(self)
        spec = self.run_model.spec
        if self.cfg.synthetic:
            return SyntheticBackend(self.plan, self.cfg, self.seed, self._cancel)
        from learner.data import load_corpus

        corpus = load_corpus(self.cfg.data or None, max_bytes=self.cfg.data_max_bytes)
        if corpus.vocab_size > spec.vocab_size:
            raise StartupError(EXIT_MISMATCH, f"corpus vocabulary {corpus.vocab_size} exceeds the model's "
                                              f"{spec.vocab_size}")
        shard = corpus.shard(self.shard_index, self.num_shards, spec.seq_len, self.seed)
        self.log.info("data", source=corpus.source, tokens=len(corpus), fingerprint=corpus.fingerprint(),
                      shard=self.shard_index, shard_tokens=len(shard))
        from learner.builtin import builtin_backend

        return builtin_backend(spec, self.plan, self.cfg, shard)

    def memory(self) -> dict[str, int]:
        keys = self.store.keys.values() if self.store is not None else ()
        return lp.memory_bytes(self.run_model.num_params, self.plan.sizes,
                               error_feedback=self.cfg.error_feedback and self.cfg.quantiser != "fp32",
                               synthetic=self.cfg.synthetic, keyframe_params=sum(k.params.size for k in keys))

    # -- the training loop --------------------------------------------------------------------------

    async def _train(self) -> None:
        cfg = self.cfg
        total = cfg.steps_to_run
        hook = getattr(self.backend, "serves_early", False)
        while not self._halt.is_set() and self.book.step < total:
            # an island's hook (``hook``): the parameters held here were handed back to the user
            # already, and the next deposit replaces them; arrivals and a resync are applied to
            # that deposit instead (below), or they would be lost with the base moved on
            if self._resync_requested and not hook:
                await self._resync()
            if self.pending and not hook:
                await self._apply_pending()
            t0 = time.monotonic()
            loss = await self._in_worker(self.backend.step)
            if loss is None:  # the backend has no step to take: an island closing (learner.island)
                break
            if self._halt.is_set() and cfg.synthetic:
                break  # the synthetic sleep was cut short: do not count a partial step
            if not self.backend.slowdown_included and cfg.slowdown > 1.0:
                await self._sleep(lp.extra_sleep(time.monotonic() - t0, cfg.slowdown))
            due = self.book.on_step(time.monotonic() - t0)
            self.loss = loss
            self.rate.add(time.monotonic(), self.tokens_per_step)
            if hook:
                # mix arrivals (or a resync) into the parameters just taken and hand them back to
                # the user now; the outer gradients below are computed while the user's next inner
                # step runs (JAX arrays are immutable, so the taken tree stays as it was)
                if self._resync_requested:
                    await self._resync()
                    due = []  # the step's work is dropped with the rest: nothing to send
                if self.pending:
                    await self._apply_pending()
                await self._in_worker(self.backend.serve)
            waits = []
            for p in due:
                c = self.book.begin_sync(p)
                if c is None:
                    self.log.debug("sync_skipped", fragment=p, reason="previous publish in flight")
                    continue
                blob, meta = await self._in_worker(self._prepare, c)
                task = asyncio.create_task(self._publish(c, blob, meta))
                self._publishes.add(task)
                task.add_done_callback(self._publishes.discard)
                if cfg.mode == "sync":
                    self._awaiting.add((c.fragment, c.round))
                    waits.append((c, task))
            if cfg.mode == "sync" and waits:
                await self._sync_wait(waits)
            if not self._fetch_all:
                self._fetch_candidates()
        if cfg.final_sync and not self._halt.is_set():
            await self._final_sync()
        self.log.info("training_done", step=self.book.step, halted=self._halt.is_set())

    async def _final_sync(self) -> None:
        """The step budget is reached: send the steps every fragment holds since its last sync.

        Without it about H/2 inner steps per fragment of every learner never reach the global model.
        """
        await self._drain()  # a publish still in flight would make begin_sync skip its fragment
        tasks = []
        for p in self.book.unsent_fragments():
            c = self.book.begin_sync(p)
            if c is None:
                continue
            blob, meta = await self._in_worker(self._prepare, c)
            tasks.append(asyncio.create_task(self._publish(c, blob, meta)))
        if tasks:
            done = await asyncio.gather(*tasks, return_exceptions=True)
            self.log.info("final_sync", fragments=len(tasks), published=sum(1 for d in done if d is True))

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0:
            try:
                await asyncio.wait_for(self._halt.wait(), seconds)
            except asyncio.TimeoutError:
                pass

    def _prepare(self, c: lp.Contribution) -> tuple[bytearray, dict]:
        """Worker thread: Delta = base - theta (+ residual), quantised, and its metadata.

        The reference then moves to theta: base_p <- theta_p. The next outer gradient of p holds only
        progress made after this one, so work is never sent twice when no new global version arrives
        in between (the aggregator down, a slow merge, a network cut): without this, every later
        delta would repeat this one and the aggregator would apply it again and again.
        """
        p, q = c.fragment, self.cfg.quantiser
        ef = self.cfg.error_feedback and q != "fp32"
        base, res = self.base[p], self.residual[p]
        if ef and res is not None and hasattr(self.backend, "fold_progress") and _owned(base) and _owned(res):
            # residual += base - theta and base <- theta, chunk by chunk from the parameters; the
            # new residual is then written over the corrected vector: a sync allocates nothing of
            # the fragment's size but its blob (bench.island; bitwise the path below without unsent
            # work, since r + d == d + r)
            self.backend.fold_progress(p, base, res)
            if self.unsent[p] is not None:
                res += self.unsent[p]
                self.unsent[p] = None
            blob, _, _, self.quant_error = codec.encode_with_feedback(  # the new residual is in res
                res, None, q, keep_residual=True, want_sent=False, in_place=True)
            return self._finish_prepare(c, blob)
        theta = self.backend.get_fragment(p)  # a new float32 array (every backend's contract)
        # the base is ours alone (never an alias of the parameters or a keyframe) and replaced
        # below: the delta goes into its memory, one fragment-sized array less at the peak of a sync
        delta = outer_gradient(base, theta, out=base if _owned(base) and base.shape == theta.shape else None)
        if self.unsent[p] is not None:  # a publish that failed for good: its work goes out now
            delta += self.unsent[p]
            self.unsent[p] = None
        self.base[p] = theta
        # error feedback, quantisation and the decoded copy in one chunked pass (bitwise the
        # unfused encode / decode / feedback_step, tests/test_codec_feedback.py)
        blob, _, residual, self.quant_error = codec.encode_with_feedback(
            delta, self.residual[p] if ef else None, q, keep_residual=ef, want_sent=False)
        if ef:
            self.residual[p] = residual
        return self._finish_prepare(c, blob)

    def _finish_prepare(self, c: lp.Contribution, blob: bytearray) -> tuple[bytearray, dict]:
        p = c.fragment
        meta = grad_meta(run=self.common.run, model=self.model_hash, learner=self.id,
                         incarnation=self.incarnation, fragment=p, round_=c.round,
                         base_version=c.base_version, inner_steps=c.steps, tokens=c.tokens,
                         region=self.common.region, period=c.period)
        self._sent[(p, c.round)] = blob  # what was sent is decode(blob), rebuilt only if the publish fails
        return blob, meta

    async def _publish(self, c: lp.Contribution, blob, meta: dict) -> bool:
        ok = False
        try:
            await self.publisher.publish(self.s.grad(c.fragment, self.id),
                                         grad_obj_id(self.common.run, self.id, self.incarnation, c.fragment,
                                                     c.round) + "." + self._nonce,
                                         blob, meta)
            ok = True
            self.log.debug("contributed", fragment=c.fragment, round=c.round, base=c.base_version,
                           steps=c.steps, bytes=len(blob))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.warning("publish_failed", fragment=c.fragment, round=c.round, error=repr(e))
        finally:
            sent_blob = self._sent.pop((c.fragment, c.round), None)
            if not ok and sent_blob is not None:  # give the work back: it joins the next outer gradient
                p = c.fragment
                sent = np.array(codec.decode_array(sent_blob), dtype=np.float32).reshape(-1)
                self.unsent[p] = sent if self.unsent[p] is None else self.unsent[p] + sent
            self.book.end_sync(c, ok)
        return ok

    async def _sync_wait(self, waits: list) -> None:
        """Sync mode: wait until a merged global version includes each contribution (or timeout)."""
        t0 = time.monotonic()
        deadline = t0 + self.cfg.sync_timeout
        for c, task in waits:
            key = (c.fragment, c.round)
            try:
                done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - time.monotonic()))
                published = task in done and not task.cancelled() and task.result()
            except Exception:
                published = False
            while published and not self._halt.is_set():
                self._news.clear()
                f = self.book.frags[c.fragment]
                if lp.sync_satisfied(self.applied_in.get(key), max(f.base_version, f.pending_version)):
                    break
                rest = deadline - time.monotonic()
                if rest <= 0:
                    self.sync_timeouts += 1
                    self.log.warning("sync_timeout", fragment=c.fragment, round=c.round,
                                     waited=round(time.monotonic() - t0, 3))
                    break
                try:
                    await asyncio.wait_for(self._news.wait(), min(rest, 1.0))
                except asyncio.TimeoutError:
                    pass
            self.applied_in.pop(key, None)
            self._awaiting.discard(key)
        self.blocked_s += time.monotonic() - t0
        if self.pending:
            await self._apply_pending()

    async def _apply_pending(self) -> None:
        items, self.pending = self.pending, {}
        merged = await self._in_worker(self._apply, items)
        for p, v in merged:
            self.book.on_merged(p, v)
        if merged:
            self.log.debug("merged", versions=dict(merged))

    def _apply(self, items: dict[int, tuple[int, np.ndarray]]) -> list[tuple[int, int]]:
        """Worker thread, at a step boundary: theta_p <- Theta_p + (theta_p - base_p) (rebase) or
        mix(theta_p, Theta_p, alpha) (mix); then base_p <- Theta_p."""
        alpha = self.cfg.mix_alpha
        merged = []
        for p, (v, vec) in sorted(items.items()):
            if v <= self.book.frags[p].base_version:
                continue
            if self.cfg.on_arrival == "rebase":
                self.backend.set_fragment(p, rebase(self.backend.get_fragment(p), self.base[p], vec))
            elif alpha == 0.0:
                self.backend.set_fragment(p, vec)
            else:
                self.backend.set_fragment(p, mix(self.backend.get_fragment(p), vec, alpha))
            self.base[p] = vec
            merged.append((p, v))
        return merged

    async def _resync(self) -> None:
        """Evicted while alive: take the newest version of every fragment, drop local state."""
        self._resync_requested = False
        t0 = time.monotonic()
        try:
            vectors, versions = await fetch_newest(self.store, self.plan,
                                                   t0 + max(30.0, self.cfg.sync_timeout), self.log)
        except StartupError as e:
            self.log.warning("resync_failed", reason=str(e))
            self._resync_requested = True
            return
        finally:
            self.blocked_s += time.monotonic() - t0
        await self._in_worker(self.backend.load, vectors)
        self.base = vectors
        self.residual = [None] * self.P
        self.unsent = [None] * self.P
        self.pending = {p: pv for p, pv in self.pending.items() if pv[0] > versions[p]}
        self.book.on_resync(versions)
        self.log.warning("resynced", versions=versions, step=self.book.step)

    async def _drain(self) -> None:
        if self._publishes:
            await asyncio.wait(set(self._publishes), timeout=DRAIN_TIMEOUT)

    # -- global versions ----------------------------------------------------------------------------

    def _fetch_candidates(self) -> None:
        """fetch=round, at a step boundary: start the downloads that became due."""
        for p, head in list(self._candidate.items()):
            if self.book.fetch_due(p, head.version, self.cfg.fetch_delay_for(self.book.period)) and not any(
                    t.get_name() == f"fetch-{p}" for t in self._fetches):
                task = asyncio.create_task(self._on_head(head), name=f"fetch-{p}")
                self._fetches.add(task)
                task.add_done_callback(self._fetches.discard)

    async def _on_head(self, head: Head) -> None:
        p = head.fragment
        if not 0 <= p < self.P:
            self._reject_global("wrong_fragment", head)
            return
        async with self._head_lock:
            if self._refused.get(p) == head:
                # refused already: the watch and a step boundary's fetch of the same candidate can
                # both hand it here (test_hostile counted a forged head twice, about 1 run in 10)
                return
            if self._fetch_all:
                due = self.book.wants(p, head.version)
            else:
                # download later, once per own sync: remember the newest head (the latest received,
                # so a forged huge version is replaced by the next genuine one)
                if head.version > self.book.frags[p].base_version:
                    self._candidate[p] = head
                due = self.book.fetch_due(p, head.version, self.cfg.fetch_delay_for(self.book.period))
                if not due:
                    return
            if due:
                # fetch and check the blob before believing the head: a forged or broken head must
                # not advance what we think the newest version is
                try:
                    vec = await self.store.read(head)
                except NotFoundError:
                    # replaced by a newer version meanwhile (its head follows), or a head whose
                    # sequences hold something else (forged)
                    self._reject_global("unreadable", head)
                    self._drop_candidate(head)
                    self._news.set()
                    return
                except Exception as e:
                    self._reject_global("bad_blob", head, error=repr(e))
                    self._drop_candidate(head)
                    self._news.set()
                    return
                self.pending[p] = (head.version, vec)
                self.book.on_downloaded(p, head.version)
                self._drop_candidate(head)
            self._verified[p] = max(self._verified.get(p, -1), head.version)
            self.book.on_head(p, head.version)
            for r in lp.applied_rounds(head.meta, self.id, self.incarnation, p):
                key = (p, r)
                if key in self._awaiting:
                    self.applied_in[key] = min(self.applied_in.get(key, head.version), head.version)
            self._news.set()

    def _drop_candidate(self, head: Head) -> None:
        if self._candidate.get(head.fragment) is head:
            del self._candidate[head.fragment]

    def _reject_global(self, reason: str, head: Head, **kw) -> None:
        if 0 <= head.fragment < self.P:
            self._refused[head.fragment] = head
        self.rejected_globals[reason] = self.rejected_globals.get(reason, 0) + 1
        self.log.warning("global_version_rejected", reason=reason, fragment=head.fragment, version=head.version, **kw)

    async def _follow_globals(self) -> None:
        await follow_heads(self.store.store, self._halt, self._on_head, lambda p: self.book.frags[p].known_version,
                           self.P, self.log, self._verified, HEAD_POLL_INTERVAL)

    # -- membership ---------------------------------------------------------------------------------

    def _on_member(self, value: bytes | None) -> None:
        from monitor.membership import member_from_dict

        if not value:
            return
        try:
            rec = member_from_dict(orjson.loads(value))
        except Exception as e:
            self.log.warning("bad_member_record", error=repr(e))
            return
        self.member_state = rec.state.value
        if lp.should_resync(rec.state.value, rec.incarnation, self.incarnation):
            self.log.warning("evicted", reason=rec.reason)
            self._resync_requested = True

    async def _watch_members(self, key: str | None, on_entry, error_event: str, timeout: float) -> None:
        """Follow the members bucket (``key``, or every key) until halted, watching again after
        errors; ``await on_entry(kv, entry)`` for every update, and with None after ``timeout``
        seconds without one."""
        while not self._halt.is_set():
            watcher = None
            try:
                kv = await self.js.key_value(self.s.bucket("members"))
                watcher = await (kv.watch(key) if key else kv.watchall())
                while not self._halt.is_set():
                    try:
                        entry = await watcher.updates(timeout=timeout)
                    except asyncio.TimeoutError:
                        entry = None
                    await on_entry(kv, entry)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning(error_event, error=repr(e))
                await self._sleep(1.0)
            finally:
                if watcher is not None:
                    try:
                        await watcher.stop()
                    except Exception:
                        pass

    async def _wait_for_peers(self) -> None:
        """DILOCO_START_WITH=N: hold the first inner step until N learners (this one included) are
        active in the members bucket, or DILOCO_START_WAIT seconds passed (then start anyway, with a
        warning). Learners started together then train in step: a quorum of K = M is met from the
        first round, instead of whoever the monitor admitted first merging alone."""
        n = self.cfg.start_with
        if n <= 1:
            return
        t0 = time.monotonic()
        deadline = t0 + self.cfg.start_wait
        states: dict[str, str] = {}
        watcher = None
        try:
            kv = await self.js.key_value(self.s.bucket("members"))
            watcher = await kv.watchall()
            while not self._halt.is_set():
                active = sorted(k for k, st in states.items() if st == "active")
                if len(active) >= n:
                    self.log.info("peers_ready", active=active, waited=round(time.monotonic() - t0, 3))
                    return
                rest = deadline - time.monotonic()
                if rest <= 0:
                    self.log.warning("start_wait_expired", wanted=n, active=active, waited=round(self.cfg.start_wait, 3))
                    return
                try:
                    e = await watcher.updates(timeout=min(rest, 1.0))
                except asyncio.TimeoutError:
                    continue
                if e is None:  # the end of the bucket's current values
                    continue
                try:
                    rec = orjson.loads(e.value) if e.value and e.operation not in ("DEL", "PURGE") else {}
                    states[e.key] = rec.get("state") if isinstance(rec, dict) else None
                except ValueError:
                    states.pop(e.key, None)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.warning("start_wait_failed", error=repr(e))
        finally:
            self.blocked_s += time.monotonic() - t0
            if watcher is not None:
                try:
                    await watcher.stop()
                except Exception:
                    pass

    async def _follow_membership(self) -> None:
        last_rev = 0

        async def on_entry(kv, entry) -> None:
            nonlocal last_rev
            if entry is None:  # safety net: the watch may be re-creating its consumer
                try:
                    entry = await kv.get(self.id)
                except Exception:
                    entry = None
            if entry is None or entry.revision <= last_rev:
                return
            last_rev = entry.revision
            self._on_member(entry.value)

        await self._watch_members(self.id, on_entry, "membership_watch_error", HEAD_POLL_INTERVAL)

    async def _follow_rates(self) -> None:
        """DILOCO_DYNAMIC_H: follow the active learners' tokens/s in the members bucket (the monitor
        writes each heartbeat's rate there, every DILOCO_KV_REFRESH at least) and set the period."""
        peers: dict[str, float] = {}

        async def on_entry(kv, e) -> None:
            if e is not None and e.key != self.id:
                try:
                    rec = orjson.loads(e.value) if e.value and e.operation not in ("DEL", "PURGE") else {}
                    rate = float(rec.get("tokens_per_s") or 0.0) if rec.get("state") == "active" else 0.0
                except (ValueError, TypeError, AttributeError):
                    rate = 0.0
                if rate > 0:
                    peers[e.key] = rate
                else:
                    peers.pop(e.key, None)
            self._update_period(peers)

        await self._watch_members(None, on_entry, "rates_watch_error", 1.0)

    def _update_period(self, peers: dict[str, float]) -> None:
        mine = self.rate.rate(time.monotonic())
        h = lp.dynamic_period(self.cfg.sync_every, mine, list(peers.values()), current=self.book.period)
        if self.book.set_period(h):
            self.log.info("period_changed", period=h, H=self.cfg.sync_every, tokens_per_s=round(mine, 1),
                          fastest=round(max(peers.values(), default=mine), 1))

    # -- liveness and metrics -----------------------------------------------------------------------

    def heartbeat(self) -> dict:
        from monitor.membership import Heartbeat, heartbeat_to_dict

        hb = Heartbeat(learner=self.id, region=self.common.region, incarnation=self.incarnation,
                       step=self.book.step, tokens_per_s=self.rate.rate(time.monotonic()),
                       versions=self.book.versions(), sent_at=time.time())
        return heartbeat_to_dict(hb)

    async def _leave(self, beats: asyncio.Task) -> None:
        """Done (the step budget, an island closed, a stop), with every publish settled: the last
        heartbeat says ``leaving``, so the monitor marks us ``left`` rather than evicting us for the
        silence, and the aggregator still merges what we sent (tests/test_system_membership.py)."""
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
        hb = self.heartbeat()
        hb["leaving"] = True
        try:
            await self.nc.publish(self.s.heartbeat(self.id), orjson.dumps(hb))
            await self.nc.flush(timeout=5)
            self.log.info("left", step=self.book.step)
        except Exception as e:  # the monitor then evicts us for the silence, as before
            self.log.warning("leave_failed", error=repr(e))

    async def _heartbeats(self) -> None:
        interval = self.cfg.heartbeat_interval
        subject = self.s.heartbeat(self.id)
        t_next = time.monotonic()
        while not self._halt.is_set():
            try:
                await self.nc.publish(subject, orjson.dumps(self.heartbeat()))
            except Exception as e:
                self.log.debug("heartbeat_failed", error=repr(e))
            t_next += interval
            now = time.monotonic()
            if t_next < now:  # we fell behind (loop stalled): do not burst to catch up
                t_next = now
            await self._sleep(t_next - now)

    def metrics(self) -> dict:
        c = self.book.counters()
        m = {
            "role": "learner", "run": self.common.run, "ts": time.time(), "learner": self.id,
            "region": self.common.region, "incarnation": self.incarnation, "mode": self.cfg.mode,
            "compute": "synthetic" if self.cfg.synthetic else "model", "step": self.book.step, "tokens": self.book.tokens,
            "loss": self.loss if math.isfinite(self.loss) else None,
            "tokens_per_s": self.rate.rate(time.monotonic()),
            "bytes_sent": self.publisher.bytes_sent if self.publisher else 0,
            "bytes_received": self.store.bytes_received if self.store else 0,
            "staleness": self.book.staleness(), "blocked_s": round(self.blocked_s, 6),
            "quant_error": self.quant_error, "contributions": self.book.contributions,
            "steps_sent": self.book.steps_sent, "period": self.book.period,
            "skipped_syncs": c["skipped"], "failed_syncs": c["failed"], "sync_timeouts": self.sync_timeouts,
            "resyncs": self.book.resyncs, "step_seconds_total": round(self.book.step_seconds_total, 6),
            "rejected_globals": {**self.rejected_globals,
                                 **({"bad_head": self.store.bad_heads} if self.store and self.store.bad_heads else {})},
            "versions": {str(p): v for p, v in self.book.versions().items()},
            "rss_mib": peak_rss_mib(), "state_mib": round(self.memory()["total"] / 2**20, 3),
        }
        if self.member_state:
            m["state"] = self.member_state
        return m

    async def _publish_metrics(self) -> None:
        try:
            await self.nc.publish(self.s.metrics("learner", self.id), codec.dumps_json(self.metrics()))
        except Exception as e:
            self.log.debug("metrics_failed", error=repr(e))

    async def _metrics_loop(self) -> None:
        while not self._halt.is_set():
            await self._publish_metrics()
            await self._sleep(self.common.metrics_interval)


# -- entry point -----------------------------------------------------------------------------------


async def _amain(common: CommonConfig, model: ModelConfig, cfg: LearnerConfig) -> int:
    stop = asyncio.Event()
    install_stop(stop)
    return await Learner(common, model, cfg).run(stop)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="diloco learner",
        description="Run one learner (island). Configured by DILOCO_* variables: see `diloco config learner` "
                    "and docs/learner.md.")
    p.parse_args(argv if argv is not None else sys.argv[1:])
    common = from_env(CommonConfig)
    model = from_env(ModelConfig)
    cfg = from_env(LearnerConfig)
    setup(common.log_level, run=common.run, role="learner", island=common.region, learner=cfg.learner_id)
    return asyncio.run(_amain(common, model, cfg))


if __name__ == "__main__":
    from bus.cli import main as cli_main

    sys.exit(cli_main(["learner", *sys.argv[1:]]))
