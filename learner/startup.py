"""Joining a run, shared by the learner service, the evaluator, ``diloco export`` and islands.

Exit codes and ``StartupError``; connecting with retries; waiting for the run's manifest and
checking a model against it (``BuiltinModel``, ``check_geometry``); version 0 built locally
(``initial_blobs``); reading and checking global versions (``global_reader``, ``fetch_newest``).
"""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np

from bus import codec
from bus.config import CommonConfig
from bus.conn import ConnectFailed, connect
from bus.global_reader import GlobalReader
from bus.transport import Head
from learner import loop as lp
from learner.config import LearnerConfig, ModelConfig
from bus.fragments import FragmentPlan, gather
from learner.spec import ModelSpec, count_params, spec_hash

#: 4 (EXIT_TIMEOUT): the server, the manifest or a global version did not come in time
EXIT_OK, EXIT_ERROR, EXIT_CONFIG, EXIT_MISMATCH, EXIT_TIMEOUT = 0, 1, 2, 3, 4

#: Seconds between polls of every fragment's head, a safety net next to the watch (which may
#: miss heads while a reconnect re-creates its consumer).
HEAD_POLL_INTERVAL = 5.0


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




async def connect_until(common: CommonConfig, name: str, deadline: float, log, **extra):
    """Connect, trying for DILOCO_CONNECT_TIMEOUT seconds (not beyond ``deadline``, monotonic), so a
    learner may start a little before its server; then StartupError(4) with the one line of
    :class:`bus.conn.ConnectFailed` (the URL and what to check). ``log`` is unused: nothing is
    logged while it tries. ``extra``: :func:`bus.conn.connect`'s callbacks."""
    window = max(0.1, min(common.connect_timeout, deadline - time.monotonic()))
    try:
        return await connect(common, name=name, timeout=window, **extra)
    except ConnectFailed as e:
        raise StartupError(EXIT_TIMEOUT, str(e)) from None


async def join_run(js, common: CommonConfig, spec: ModelSpec, plan: FragmentPlan, deadline: float, log=None):
    """Wait for the manifest and check it: StartupError(3) on mismatch, (4) on timeout.

    Learners and the evaluator never create streams (their least-privilege users may not): the
    aggregator, or ``diloco run create``, provisions the run."""
    from bus.runs import RunMismatch, wait_manifest
    from learner.spec import check_manifest

    try:
        m = await wait_manifest(js, common.run, timeout=max(0.0, deadline - time.monotonic()), log=log)
    except TimeoutError as e:
        raise StartupError(EXIT_TIMEOUT, str(e)) from None
    try:
        check_manifest(m, spec, plan)
    except RunMismatch as e:
        raise StartupError(EXIT_MISMATCH, f"refusing to start: {e}") from None
    return m


async def join_run_model(js, common: CommonConfig, run_model, deadline: float, log=None):
    """Wait for the manifest and check ``run_model`` against it: StartupError(3) naming the
    difference, (4) on timeout."""
    from bus.runs import wait_manifest

    try:
        m = await wait_manifest(js, common.run, timeout=max(0.0, deadline - time.monotonic()), log=log)
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


class FetchRetries:
    """The downloads of global versions that failed for the link or the server (a learner's or the
    evaluator's): counted (``failures``), said once per version (``global_fetch_failed``), each
    tried again for ``timeout`` seconds (DILOCO_SYNC_TIMEOUT) from its first failure."""

    def __init__(self, timeout: float, log, hint: str):
        self.timeout, self.log, self.hint = timeout, log, hint
        self.failures = 0
        self._since: dict[int, tuple[int, float]] = {}  # fragment -> (version, first failure)

    def failed(self, head: Head, e: BaseException) -> bool:
        """A download of ``head`` failed so: True while it is to be tried again."""
        self.failures += 1
        first, again = lp.retry_window(self._since, head.fragment, head.version, time.monotonic(), self.timeout)
        if first:
            self.log.warning("global_fetch_failed", fragment=head.fragment, version=head.version, error=repr(e),
                             hint=self.hint)
        return again


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
