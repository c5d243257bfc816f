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
newest version holding that round from DILOCO_FETCH_DELAY (1) steps after it, so a learner fetches
about N values per H steps, not one version per merge.

Background tasks on the event loop, alive during long steps: heartbeats, metrics, a watch on the
global heads (plus a slow poll as a safety net after reconnects), the watch on this learner's
membership key.

Exit codes: 0 done or stopped by a signal, 1 unexpected error, 3 run mismatch (model spec or
fragment plan differs from the run's manifest), 4 timed out waiting for the run (no manifest or no
global versions within DILOCO_MANIFEST_TIMEOUT).

Where the parts live: this module is the process shell (the ``Learner`` state, start-up, the task
set, ``main``); ``learner.core`` the island core (training loop, outer gradients, global-version
intake, rebase); ``learner.presence`` membership, heartbeats and metrics; ``learner.startup``
joining a run (shared with the evaluator, ``diloco export`` and islands).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import threading
import time
import uuid

import numpy as np

from bus import codec
from bus.signals import cancel_all, install_stop
from bus.config import CommonConfig, from_env
from bus.log import get_logger, setup
from bus.store_health import STORE_IDLE_PROBE, STORE_IDLE_PROBE_MAX, StoreWatch, probe_store, write_probe
from bus.subjects import Subjects
from bus.global_reader import GlobalReader
from bus.transport import ChunkPublisher, Head
from learner import loop as lp
from learner.backends import SyntheticBackend
from learner.config import LearnerConfig, ModelConfig
from learner.core import IslandCore
from learner.fate import WorkLedger
from learner.presence import Presence
from learner.progress import ProgressKeeper
from bus.progress import resume_from
from learner.startup import (EXIT_ERROR, EXIT_MISMATCH, EXIT_OK, BuiltinModel, FetchRetries, StartupError, check_geometry,
                             close_quietly, connect_until, fetch_newest, global_reader, join_run_model,
                             peak_rss_mib, start_unless_halted)


# -- the learner -----------------------------------------------------------------------------------


class Learner(IslandCore, Presence):
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
        # downloads of a global version that failed for the link or the server, tried again
        self.fetch_retries = FetchRetries(cfg.sync_timeout, self.log,
                                          "fetched again at the next step boundary (the server or the link is down?)")
        self.tokens_per_step = self.run_model.tokens_per_step
        self.book = self._new_book(0)
        self.num_shards = cfg.num_shards or cfg.num_learners
        self.shard_index = lp.derive_shard(self.id, self.num_shards, cfg.shard_index)
        self.seed = lp.sampler_seed(cfg.data_seed, self.id, self.incarnation, cfg.resume)
        # this learner id's progress in the run (bus.progress): read at start, written while training;
        # the step budget is ours for the built-in model, an island's loop decides its own
        self.budget = cfg.steps_to_run if isinstance(self.run_model, BuiltinModel) else None
        self.progress: ProgressKeeper | None = None
        self.resume = resume_from(None, self.budget)
        self.nothing_left = False  # resumed with the whole budget trained already
        self._progress_due = asyncio.Event()
        self.base: list[np.ndarray | None] = [None] * self.P
        self.residual: list[np.ndarray | None] = [None] * self.P
        self.unsent: list[np.ndarray | None] = [None] * self.P  # work of failed publishes
        # the dtype residuals are kept in (DILOCO_RESIDUAL_DTYPE for this codec and plan: bus.codec)
        self.residual_dtype = codec.residual_dtype_for(cfg.residual_dtype, cfg.quantiser, self.plan.sizes)
        self._acc: np.ndarray | None = None  # the float32 scratch a bfloat16 residual's sync folds into (core._scratch)
        self.pending: dict[int, tuple[int, np.ndarray]] = {}
        self.applied_in: dict[tuple[int, int], int] = {}  # sync mode: (p, round) -> version that applied it
        self._awaiting: set[tuple[int, int]] = set()
        self.loss = float("nan")
        self.quant_error = 0.0
        self.blocked_s = 0.0
        self.held_s = 0.0  # seconds held by the sync window's hold (learner.core._hold)
        self.sync_timeouts = 0
        self.member_state: str | None = None
        self.admitted = False  # the monitor's record says this incarnation is active (learner.presence)
        self.backend = None
        self.nc = None
        self.js = None
        self.store: GlobalReader | None = None
        self.publisher: ChunkPublisher | None = None
        self.rate = lp.RateMeter()
        self.pace = lp.PaceMeter()  # tokens/s of the inner steps alone (Dynamic Local Updates)
        self._period_said = float(cfg.sync_every)  # the period a period_changed line said at info last
        self._resync_requested = False
        self._told_behind = False  # aggregator_behind said (once per process)
        self._phase_seen: dict[int, int] = {}  # fragment -> the newest version the phase lock read
        self._finishing = False  # the final sync is under way: its outer gradients say ``final``
        self._behind = 0  # syncs deferred while admitted (or with no monitor): aggregator_behind at P
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
        self.fate = WorkLedger()  # what became of the rounds sent: merged, rejected, unresolved
        # a full store (bus.store_health): said once; publishes are retried, their work kept
        self.store_watch = StoreWatch(self.log, "training goes on: outer gradients not stored are retried, their "
                                                "work kept, until the store takes writes again")
        self.final_wait = cfg.final_wait  # an island's close(wait=...) overrides it
        self.startup_error: str | None = None
        self.failure: str | None = None  # why run() failed after start-up
        self._cancel = threading.Event()
        self._publishes: set[asyncio.Task] = set()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"inner-{self.id}")
        # an island's side thread (learner.core): outer gradients and arrivals prepared from
        # snapshots while the user's steps go on; every write to a base or residual runs there,
        # in the order submitted. None for the other backends (their worker thread does it all)
        self._side: concurrent.futures.ThreadPoolExecutor | None = None
        self._side_error: BaseException | None = None
        self._swaps: dict[int, concurrent.futures.Future] = {}  # fragment -> learner.swap.Swap being prepared
        # base-moving work queued in the side thread per fragment (counted in the asyncio thread):
        # a swap prepared before more was queued is prepared again (learner.core._swap_in)
        self._base_moves = [0] * self.P

    def _new_book(self, start_step: int) -> lp.Bookkeeper:
        cfg = self.cfg
        return lp.Bookkeeper(self.P, cfg.sync_every, self.tokens_per_step, staggered=cfg.mode != "sync",
                             window=cfg.sync_window if cfg.mode != "sync" else 0, start_step=start_step,
                             hold=cfg.sync_hold)

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
            if self.nothing_left:
                return EXIT_OK
            beats = asyncio.create_task(self._heartbeats())
            await self._follow_feedback()
            tasks += [beats] + [asyncio.create_task(c) for c in (
                self._metrics_loop(), self._follow_globals(), self._follow_membership(), self._advise_loop(),
                self._keep_progress(), self._watch_store())]
            if self.cfg.follows_pace:
                tasks.append(asyncio.create_task(self._follow_paces()))
            await self._wait_for_peers()
            await self._train()
            await self._drain()
            await self._save_progress()
            await self._leave(beats)
            await self._await_fate()
            await self._publish_metrics()
            self.log.info("stopped", step=self.book.step, contributions=self.book.contributions,
                          bytes_sent=self.publisher.bytes_sent, bytes_received=self.store.bytes_received,
                          rss_mib=peak_rss_mib(), **self.fate.stats())
            return EXIT_OK
        except Exception as e:
            self.failure = f"{type(e).__name__}: {e}"  # what an island raises to its user
            self.log.exception("learner_failed")
            print(f"diloco learner {self.id}: failed: {e!r}", file=sys.stderr, flush=True)
            return EXIT_ERROR
        finally:
            self._halt.set()
            self._cancel.set()
            await cancel_all(tasks + list(self._publishes) + list(self._fetches))
            await close_quietly(self.nc)
            self._executor.shutdown(wait=False)
            if self._side is not None:
                self._side.shutdown(wait=False)

    async def _start_noting_why(self) -> None:
        from bus.streams import LimitsTooSmall, StorageUnavailable

        try:
            await self._start()
        except StartupError as e:
            self.startup_error = str(e)  # the one line an island raises to its user
            raise
        except (StorageUnavailable, LimitsTooSmall) as e:  # an island creating its run: the server's storage
            self.startup_error = str(e)
            raise StartupError(EXIT_ERROR, str(e)) from None

    async def _relay_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.log.info("stop_requested")
        self._halt.set()
        self._cancel.set()

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _in_side(self, fn, *args):
        """Run ``fn`` where bases and residuals are written: the side thread of an island (after
        what it was given before), else the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._side or self._executor, fn, *args)

    async def _start(self) -> None:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.manifest_timeout
        data = {}
        if isinstance(self.run_model, BuiltinModel):  # the rate in force: DILOCO_INNER_LR, or by width, optimizer, learners
            data = dict(shard=self.shard_index, shards=self.num_shards, inner=cfg.inner_optimizer,
                        inner_lr=cfg.lr_for(self.run_model.spec.d_model), learners=cfg.num_learners)
        ef = cfg.error_feedback and cfg.quantiser != "fp32"
        residual = self.residual_dtype if ef else None
        self.log.info("starting", mode=cfg.mode, model=self.model_hash, plan=self.plan.plan_hash(),
                      fragments=self.P, sizes=list(self.plan.sizes), H=cfg.sync_every,
                      quantiser=cfg.quantiser, residual=residual, **data)
        if residual == "bfloat16" and cfg.quantiser in codec.sparse.SPARSE:
            self.log.warning("residual_rounded", quantiser=cfg.quantiser,
                             hint="DILOCO_RESIDUAL_DTYPE=bfloat16 with a topk codec rounds the values not sent yet "
                                  "at every sync, however long they wait; auto keeps them float32")
        self.nc = await connect_until(self.common, f"learner-{self.id}", deadline, self.log,
                                      after_reconnect=self.store_watch.reconnected)
        self.js = self.nc.jetstream(timeout=10)
        self.store_watch.probe = lambda: self.js.stream_info(self.s.stream("grad"))
        # a publish that timed out while a probe of its own is stored was lost (sent to a server that
        # restarted), not refused: without it a learner said store_full again after the full disk's
        # restart, in 13 of 20 runs of the full-disk test
        self.store_watch.write_probe = lambda: write_probe(self.js, self.s.grad_probe(self.id))
        self.publisher = ChunkPublisher(self.js, self.common.max_chunk_bytes, self.common.inflight_chunks,
                                        watch=self.store_watch)
        self.store = global_reader(self.js, self.common.run, self.plan, self.model_hash)
        await self.run_model.create_run_if_missing(self.js, self.common, self.log)
        manifest = await join_run_model(self.js, self.common, self.run_model, deadline, log=self.log)
        if hasattr(self.run_model, "adopt"):  # an island in a run whose hash is not its tree's
            self.run_model.adopt(manifest)
            if self.run_model.model_hash != self.model_hash:
                self.model_hash = self.run_model.model_hash
                self.store = global_reader(self.js, self.common.run, self.plan, self.model_hash)
        d_model = self.run_model.spec.d_model if isinstance(self.run_model, BuiltinModel) else None
        check_geometry(manifest, self.cfg.lr_for(d_model), self.tokens_per_step)
        await self._resume()
        if self.nothing_left:
            return
        self.store.local = self.run_model.initial_blob(manifest)
        try:
            vectors, versions = await fetch_newest(self.store, self.plan, deadline, self.log)
        finally:
            local_hits, self.store.local = self.store.local_hits, None
        if isinstance(self.run_model, BuiltinModel):  # a chained downlink's first delta is against v0
            self.store.v0_source = self.run_model.initial_blob(manifest)
        self.backend = await self._in_worker(self._make_backend)
        if getattr(self.backend, "serves_early", False):  # an island's hook (learner.backends.HookBackend)
            self._side = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"side-{self.id}")
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
            await self._catch_up(vectors, versions)
        self.base = vectors
        for p, v in versions.items():
            self.book.on_merged(p, v)
        self.log.info("joined", versions=versions, params=self.run_model.num_params,
                      memory_mib=round(self.memory()["total"] / 2**20, 2))

    async def _catch_up(self, vectors: list[np.ndarray], versions: dict[int, int]) -> None:
        """The versions merged while this learner compiled (seconds on a loaded machine, while the
        others train on): take the newest of each fragment that moved, so the first outer gradient is
        computed from it. Without this a learner that started late sent its first round of every
        fragment 4-7 versions stale (the guard test failed at staleness 7 in a loaded suite)."""
        moved = 0
        for p, v in list(versions.items()):
            try:
                head = await self.store.head(p)
                if head is None or head.version <= v:
                    continue
                got = await self.store.newest(p)
            except Exception as e:  # the version read at the start stands: the rounds' fetches catch up
                self.log.info("catch_up_failed", fragment=p, error=repr(e))
                continue
            if got is not None and got[0].version > v:
                vectors[p], versions[p] = got[1], got[0].version
                await self._in_worker(self.backend.set_fragment, p, got[1])
                moved += 1
        if moved:
            self.log.info("caught_up", fragments=moved, versions=versions)

    async def _resume(self) -> None:
        """Read this learner id's progress record and continue where the run holds its work: the
        step counter and sync schedule (the book), the learning-rate schedule and data position
        (the backend, made after this), the remaining budget. Told in one line, ``resumed``."""
        self.progress = ProgressKeeper(self.js, self.common.run, self.id, self.incarnation, self.budget, self.log)
        record = await self.progress.load()
        self.resume = r = resume_from(record, self.budget, self.cfg.resume)
        self.progress.adopt(r)
        if r.start_step:
            self.book = self._new_book(r.start_step)
        await self.progress.write(r.start_step, r.start_step, done=r.remaining == 0, force=True)
        if record is None:
            return
        where = dict(step=r.start_step, restarts=r.restarts, lost_steps=r.lost, lost_total=r.lost_total,
                     previous=r.previous, remaining=r.remaining, budget=self.budget, data_step=r.start_step,
                     **self._schedule_at(r.start_step))
        if not self.cfg.resume:
            self.log.warning("restarted_over", **where, message=f"learner id {self.id} trained to step {record.step} "
                             "in this run before; DILOCO_RESUME=false: this process starts its steps, schedule, budget "
                             "and data over at step 0")
            return
        if r.remaining == 0:
            self.nothing_left = True
            msg = (f"learner id {self.id} has trained its whole budget of {self.budget} steps in run "
                   f"{self.common.run} already: nothing left to train (DILOCO_RESUME=false trains it again)")
            self.log.warning("resumed", **where, message=msg)
            print(f"diloco learner {self.id}: {msg}", file=sys.stderr, flush=True)
            return
        self.log.warning("resumed", **where,
                         message=f"learner id {self.id} restarted (restart {r.restarts}): it continues at step "
                                 f"{r.start_step}, where the run holds its work ({r.lost} steps of the previous "
                                 "process were trained and never sent: lost)")

    def _schedule_at(self, step: int) -> dict:
        """The learning-rate schedule at ``step`` for the ``resumed`` line (built-in model only)."""
        if not isinstance(self.run_model, BuiltinModel) or self.cfg.synthetic:
            return {}
        from learner.inner import make_schedule

        cfg = self.cfg
        lr = cfg.lr_for(self.run_model.spec.d_model)
        rate = float(make_schedule(lr, cfg.warmup, cfg.total_steps)(step))
        return {"lr": round(rate, 8), "lr_peak": lr, "in_warmup": step < cfg.warmup,
                "rewarm_steps": cfg.resume_warmup if step else 0}

    def _progress_moved(self) -> None:
        """A publish succeeded: once the work sent is half a sync period ahead of the record, write it
        soon (not only at the next heartbeat interval), so a restart redoes less than a period of steps.
        At most one write per 0.1 s (``_keep_progress``): a model of milliseconds per step redoes at
        most 0.1 s of steps, and its learner's loop and the broker are not busy with a write per
        publish."""
        if self.progress is not None and self.progress.written is not None and \
                self.book.sent_step - self.progress.written[0] >= max(1, self.book.period // 2):
            self._progress_due.set()

    async def _keep_progress(self) -> None:
        """Write this learner id's progress record when the work sent moved half a period, and
        whatever changed every heartbeat interval, at most one per 0.1 s (one task: the writes never
        overlap)."""
        gap = min(0.1, self.cfg.heartbeat_interval / 2)
        last = time.monotonic()
        while not self._halt.is_set():
            try:
                await asyncio.wait_for(self._progress_due.wait(), self.cfg.heartbeat_interval)
            except asyncio.TimeoutError:
                pass
            wait = last + gap - time.monotonic()
            if wait > 0:
                try:  # (the halt ends the wait: the final write is run()'s)
                    await asyncio.wait_for(self._halt.wait(), wait)
                    return
                except asyncio.TimeoutError:
                    pass
            self._progress_due.clear()
            await self._save_progress()
            last = time.monotonic()

    async def _watch_store(self) -> None:
        """A learner whose syncs wait for the aggregator (deferred, its steps held, or in sync mode
        waiting for its round's merge) writes nothing, so a store that filled after its last stored
        write would go unsaid: the aggregator paused, this learner waiting for a merge that cannot
        come, its log saying only ``aggregator_behind`` (the CI run of the nineteenth round: one
        learner of the full-disk test said nothing in 40 s). While it waits, it writes a probe
        (``Subjects.grad_probe``) once no write was stored for ``STORE_IDLE_PROBE`` s, and every
        ``PROBE_EVERY`` s while the store is faulted: a full store is said once (``store_full``),
        and ``store_writable`` once a probe is stored again. The probes stay in GRAD until its limits
        drop them, so while they are stored and the learner still waits (an aggregator down for
        long) the wait before the next doubles, up to ``STORE_IDLE_PROBE_MAX`` s."""
        subject = self.s.grad_probe(self.id)
        idle = STORE_IDLE_PROBE
        while not self._halt.is_set():
            try:
                await asyncio.wait_for(self._halt.wait(), min(1.0, self.cfg.heartbeat_interval))
                return
            except asyncio.TimeoutError:
                pass
            if not (self.book.deferred() or self._awaiting):
                idle = STORE_IDLE_PROBE
                continue
            try:
                if await probe_store(self.js, subject, self.store_watch, idle):
                    idle = min(2 * idle, STORE_IDLE_PROBE_MAX)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a bug: said, and the next tick tries again
                self.log.warning("store_probe_failed", error=repr(e))

    async def _save_progress(self) -> None:
        if self.progress is not None:
            b = self.book
            await self.progress.write(b.sent_step, b.step,
                                      done=self.budget is not None and b.sent_step >= self.budget)

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

        return builtin_backend(spec, self.plan, self.cfg, shard, start_step=self.book.start_step)

    def memory(self) -> dict[str, int]:
        keys = list(self.store.keys.values()) + list(self.store.views.values()) if self.store is not None else []
        return lp.memory_bytes(self.run_model.num_params, self.plan.sizes,
                               error_feedback=self.cfg.error_feedback and self.cfg.quantiser != "fp32",
                               synthetic=self.cfg.synthetic, keyframe_params=sum(k.params.size for k in keys),
                               residual_dtype=self.residual_dtype,
                               scratch=hasattr(self.backend, "fold_progress"))


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
    from bus.entry import run_command

    sys.exit(run_command("learner", main, sys.argv[1:]))
