"""The evaluator (``diloco eval``): held-out loss of the newest global model, the quality figure of a run.

It follows the global heads (a watch plus a slow poll), keeps the newest version of every
fragment, and every ``DILOCO_EVAL_INTERVAL`` seconds, if any version changed since the last
evaluation, computes the mean next-token loss of the global model on fixed held-out batches
(``Corpus.heldout_batches``: the split no learner trains on) and publishes

    {"role": "evaluator", "run", "ts", "eval_id", "eval_loss", "merges", "version", "version_min",
     "versions", "tokens", "eval_seconds"}

on ``diloco.<run>.metrics.evaluator.<eval_id>``. A *version* is always one fragment's (``versions``:
fragment -> version; ``version_min``: the oldest fragment's); ``merges`` is their sum, the merges of
every fragment the evaluated model holds (``version`` is the same number under its old name, kept
for dashboards that read it).

``diloco eval --once`` evaluates the current global model once, prints that JSON as one line on
stdout and exits. The corpus settings (``DILOCO_DATA``, ``DILOCO_DATA_MAX_BYTES``) must be the
learners', or the held-out split is a different one. Exit codes as for the learner (3: model or
plan mismatch, 4: timed out waiting for the run).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import sys
import time

import numpy as np
import orjson
from nats.js.errors import NotFoundError

from bus import codec
from bus.signals import cancel_all, install_stop
from bus.config import CommonConfig, from_env
from bus.log import get_logger, setup
from bus.subjects import Subjects
from bus.global_reader import GlobalReader
from bus.transport import Head, follow_heads, transient
from learner import loop as lp
from learner.config import EvalConfig, LearnerConfig, ModelConfig
from learner.startup import (EXIT_ERROR, EXIT_OK, HEAD_POLL_INTERVAL, FetchRetries, close_quietly, connect_until,
                             fetch_newest, global_reader, initial_blobs, join_run, peak_rss_mib,
                             start_unless_halted)
from learner.spec import spec_hash


class Evaluator:
    """Follows a run's global versions and evaluates them. ``await run(stop, once=...)`` -> exit code."""

    def __init__(self, common: CommonConfig, model: ModelConfig, lcfg: LearnerConfig, ecfg: EvalConfig):
        from learner.spec import make_plan

        self.common, self.lcfg, self.ecfg = common, lcfg, ecfg
        self.spec = model.spec()
        self.model_hash = spec_hash(self.spec)
        self.plan = make_plan(self.spec, model.num_fragments, model.max_imbalance)
        self.s = Subjects(common.run)
        self.log = get_logger(component="evaluator")
        self.fetch_retries = FetchRetries(lcfg.sync_timeout, self.log,
                                          "fetched again in a moment (the server or the link is down?)")
        self.vectors: list[np.ndarray] = []
        self.versions: dict[int, int] = {}
        self.evaluated: dict[int, int] | None = None
        self.last: dict | None = None
        self.evaluations = 0
        self.rejected_globals: dict[str, int] = {}  # versions not taken, by reason
        self._retry: dict[int, Head] = {}  # fragment -> the head whose download failed so
        self.nc = None
        self.store: GlobalReader | None = None
        self._halt = asyncio.Event()
        self._lock = asyncio.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="eval")
        self._eval_fn = None
        self._batches = None

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _prepare(self) -> None:
        """Worker thread: load the held-out batches and jit the loss (imports JAX)."""
        from learner.data import load_corpus
        from learner.inner import make_eval_fn

        corpus = load_corpus(self.lcfg.data or None, max_bytes=self.lcfg.data_max_bytes)
        self._batches = corpus.heldout_batches(self.spec.seq_len, self.ecfg.eval_batch_size, self.ecfg.eval_batches)
        self._eval_fn = make_eval_fn(self.spec)
        self.log.info("heldout", source=corpus.source, fingerprint=corpus.fingerprint(),
                      heldout_tokens=int(corpus.n_heldout),
                      batches=self.ecfg.eval_batches, batch_size=self.ecfg.eval_batch_size)

    def _evaluate(self, vectors: list[np.ndarray]) -> float:
        """Worker thread: mean held-out loss of the model made of ``vectors``."""
        from learner.model import to_jax

        params = to_jax(lp.params_from_fragments(self.plan, vectors))
        losses = [float(self._eval_fn(params, b)) for b in self._batches]
        return float(np.mean(losses))

    def _heldout_tokens(self) -> int:
        return int(self._batches.shape[0] * self._batches.shape[1] * self.spec.seq_len)

    async def _republish(self) -> None:
        """The last record again every DILOCO_METRICS_INTERVAL (with the time it was evaluated),
        evaluations or not: a `diloco metrics --once` window of 3 s missed an evaluator that evaluates
        every 10 s, and one of 1.25 intervals missed one whose back-to-back evaluations (versions
        changing all the time) took longer than that on a loaded machine (test_compose)."""
        every = self.common.metrics_interval
        due = time.monotonic()
        while not self._halt.is_set():
            # on a fixed cadence: sleeping a whole interval after each send spaced the records
            # by the interval plus the send and the loop's lateness (0.5 s apart became up to 0.64 s
            # with five JAX processes on 2 cores, beyond `diloco metrics --once`'s window)
            due += every
            await self._sleep(due - time.monotonic())
            if time.monotonic() - due > every:  # fell a whole interval behind: start the cadence again
                due = time.monotonic()
            if self.last is not None and not self._halt.is_set():
                # (the counters as they are now: a version refused since is not evaluated)
                await self._publish({**self.last, "ts": time.time(), "evaluated_at": self.last["ts"],
                                     **self._counters()})

    def _counters(self) -> dict:
        """The versions not taken, by reason, and the downloads tried again, as they are now."""
        return {"rejected_globals": dict(self.rejected_globals), "fetch_failures": self.fetch_retries.failures}

    async def evaluate_now(self) -> dict:
        """Evaluate the versions held now; returns (and remembers) the metrics record."""
        versions = dict(self.versions)
        vectors = list(self.vectors)
        t0 = time.monotonic()
        loss = await self._in_worker(self._evaluate, vectors)
        self.evaluated = versions
        self.evaluations += 1
        self.last = {
            "role": "evaluator", "run": self.common.run, "ts": time.time(), "eval_id": self.ecfg.eval_id,
            "eval_loss": loss, "merges": sum(versions.values()), "version": sum(versions.values()),
            "version_min": min(versions.values()),
            "versions": {str(p): v for p, v in sorted(versions.items())},
            "tokens": self._heldout_tokens(),
            "eval_seconds": round(time.monotonic() - t0, 4), "rss_mib": peak_rss_mib(),
            **self._counters(),
        }
        self.log.info("evaluated", eval_loss=loss, merges=self.last["merges"], versions=versions)
        return self.last

    async def _start(self) -> None:
        deadline = time.monotonic() + self.lcfg.manifest_timeout
        prep = asyncio.create_task(self._in_worker(self._prepare))  # JAX import and corpus load overlap I/O
        try:
            self.nc = await connect_until(self.common, f"eval-{self.ecfg.eval_id}", deadline, self.log)
            js = self.nc.jetstream(timeout=10)
            self.store = global_reader(js, self.common.run, self.plan, self.model_hash)
            manifest = await join_run(js, self.common, self.spec, self.plan, deadline, log=self.log)
            self.store.local = initial_blobs(self.spec, self.plan, manifest.seed)
            self.vectors, self.versions = await fetch_newest(self.store, self.plan, deadline, self.log)
            self.store.local = None
        finally:
            await prep

    async def _on_head(self, head: Head) -> None:
        p = head.fragment
        async with self._lock:
            if not 0 <= p < self.plan.num_fragments or head.version <= self.versions.get(p, -1):
                return
            try:
                vec = await self.store.read(head)
            except NotFoundError:  # replaced meanwhile (its successor follows), or a forged head
                self._forget_retry(head)
                self._reject("unreadable", head)
                return
            except Exception as e:
                if transient(e) and self.fetch_retries.failed(head, e):
                    # the link or the server, not the version: tried again (_retry_failed)
                    if p not in self._retry or self._retry[p].version <= head.version:
                        self._retry[p] = head
                    return
                # does not decode or fit the run; or no server answered for it in DILOCO_SYNC_TIMEOUT s
                self._forget_retry(head)
                self._reject("unfetchable" if transient(e) else "bad_blob", head, error=repr(e))
                return
            self.vectors[p] = vec
            self.versions[p] = head.version
            if p in self._retry and self._retry[p].version <= head.version:
                del self._retry[p]

    def _forget_retry(self, head: Head) -> None:
        if self._retry.get(head.fragment) == head:
            del self._retry[head.fragment]

    async def _retry_failed(self) -> None:
        """The downloads that failed for the link or the server, again (before, a timed-out read was
        refused as ``bad_blob`` and the version skipped until the fragment's next head)."""
        for p, head in list(self._retry.items()):
            if self._halt.is_set():  # (each read may wait out a timeout while the server is away)
                return
            if head.version <= self.versions.get(p, -1):  # a newer version came meanwhile
                del self._retry[p]
            else:
                await self._on_head(head)

    def _reject(self, reason: str, head: Head, **kw) -> None:
        self.rejected_globals[reason] = self.rejected_globals.get(reason, 0) + 1
        self.log.warning("global_version_rejected", reason=reason, fragment=head.fragment, version=head.version, **kw)

    async def _follow(self) -> None:
        await follow_heads(self.store.store, self._halt, self._on_head, lambda p: self.versions.get(p, -1),
                           self.plan.num_fragments, self.log, poll_interval=HEAD_POLL_INTERVAL)

    async def _sleep(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._halt.wait(), max(0.0, seconds))
        except asyncio.TimeoutError:
            pass

    async def _publish(self, record: dict) -> None:
        try:
            await self.nc.publish(self.s.metrics("evaluator", self.ecfg.eval_id), codec.dumps_json(record))
        except Exception as e:
            self.log.debug("metrics_failed", error=repr(e))

    async def run(self, stop: asyncio.Event | None = None, once: bool = False) -> int:
        tasks: list[asyncio.Task] = []
        if stop is not None:
            async def relay() -> None:
                await stop.wait()
                self._halt.set()
            tasks.append(asyncio.create_task(relay()))
        try:
            code = await start_unless_halted(self._start(), self._halt, self.log, "diloco eval")
            if code is not None:
                return code
            if once:
                record = await self.evaluate_now()
                await self._publish(record)
                print(orjson.dumps(record).decode(), flush=True)
                return EXIT_OK
            tasks += [asyncio.create_task(self._follow()), asyncio.create_task(self._republish())]
            # evaluate when the versions changed, at most every DILOCO_EVAL_INTERVAL; the last record
            # goes out again every DILOCO_METRICS_INTERVAL meanwhile (_republish)
            next_eval = 0.0
            while not self._halt.is_set():
                await self._retry_failed()
                if self.versions != self.evaluated and time.monotonic() >= next_eval:
                    await self._publish(await self.evaluate_now())
                    next_eval = time.monotonic() + self.ecfg.eval_interval
                await self._sleep(min(self.ecfg.eval_interval, self.common.metrics_interval))
            return EXIT_OK
        except Exception as e:
            self.log.exception("evaluator_failed")
            print(f"diloco eval: failed: {e!r}", file=sys.stderr, flush=True)
            return EXIT_ERROR
        finally:
            self._halt.set()
            await cancel_all(tasks)
            await close_quietly(self.nc)
            self._executor.shutdown(wait=False)


async def _amain(once: bool) -> int:

    common = from_env(CommonConfig)
    ev = Evaluator(common, from_env(ModelConfig), from_env(LearnerConfig), from_env(EvalConfig))
    stop = asyncio.Event()
    install_stop(stop)
    return await ev.run(stop, once=once)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="diloco eval",
        description="Follow a run's global versions and publish the held-out loss of the global model. "
                    "Configured by DILOCO_* variables (see `diloco config eval`).")
    p.add_argument("--once", action="store_true", help="evaluate the current global model once, print JSON, exit")
    a = p.parse_args(argv if argv is not None else sys.argv[1:])
    common = from_env(CommonConfig)
    from_env(ModelConfig), from_env(LearnerConfig), from_env(EvalConfig)  # fail on bad variables before logging
    setup(common.log_level, run=common.run, role="evaluator", island=common.region)
    return asyncio.run(_amain(a.once))


if __name__ == "__main__":
    from bus.entry import run_command

    sys.exit(run_command("eval", main, sys.argv[1:]))
