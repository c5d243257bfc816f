"""``diloco aggregator`` as shard workers: one process per range of whole fragments, sized from the run.

With ``DILOCO_AGG_FRAGMENTS=all`` (the default) the aggregator reads the run's manifest and asks
:mod:`aggregator.shard_plan` how many shard workers the model needs on this machine
(``DILOCO_AGG_SHARDS=auto``: one per 50M parameters, at most the usable cores less one and the
fragments).
One: the aggregator runs in this process, as it always did. More: this process becomes their
supervisor. Each shard worker is ``python -m aggregator`` owning one contiguous range
(``DILOCO_AGG_FRAGMENTS``), with its own connection, durable consumer, merge log, checkpoints,
trust records and lock-step rounds, its id ``<DILOCO_AGGREGATOR_ID>-s<k>`` in its logs and
metrics: exactly what several aggregators started by hand with disjoint ranges were.

The supervisor:

* restarts a shard worker that dies (a crash, kill -9, an OOM kill), after 1 s doubling to 30 s
  while it keeps dying within a minute of its start; the new one recovers its fragments from their
  newest checkpoints and merge log, bit for bit, as a restarted aggregator does
  (``aggregator.durability``), and the other shards go on merging meanwhile;
* stops with the exit code of a worker that exits 2 or 3 (wrong configuration, a run that does not
  match: restarting cannot help), after stopping the others;
* forwards a stop (SIGTERM, SIGINT) to every worker, which stores its checkpoints and exits, and
  kills what has not exited after ``STOP_WAIT`` seconds;
* runs ``diloco aggregator``'s embedded monitor once, in its own process (the workers run none).

Its workers die with it, even when it is killed with SIGKILL (``bus.procs``): a restarted
supervisor never finds the previous one's workers still owning its fragments.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time

from aggregator.config import AggregatorConfig
from aggregator.shard_plan import fragments_text, shard_count, shard_id, split
from bus.config import CommonConfig
from bus.procs import acreate_subprocess_exec
from bus.runs import read_manifest, run_tree

#: exit codes of a worker that a restart cannot mend: wrong configuration (2), a run that does not
#: match (3)
FATAL = (2, 3)
#: seconds a stopped worker has to store its checkpoints and exit before it is killed (its own stop
#: waits up to 10 s for its publishers and 20 s for its checkpoints)
STOP_WAIT = 45.0
RESTART_FIRST, RESTART_MAX, RESTART_RESET = 1.0, 30.0, 60.0
#: a shard worker: the aggregator alone, for the range its environment names
WORKER_ARGV = (sys.executable, "-m", "aggregator")


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its CPU affinity, and a container's CPU quota (cgroup v2
    ``cpu.max``: ``--cpus=2`` on a 64-core host is 2), whichever is fewer."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        with open(cpu_max) as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return n


async def wait_for_manifest(js, run: str, stop: asyncio.Event, log):
    """The run's manifest, once its creator (a learner, an island, ``diloco run create``, ``diloco
    up``) has written it; None if ``stop`` is set first."""
    logged = False
    while not stop.is_set():
        try:
            m = await read_manifest(js, run)
        except Exception as e:  # the server restarting: try again
            log.warning("manifest_read_failed", error=repr(e))
            m = None
        if m is not None:
            return m
        if not logged:
            log.info("waiting_for_manifest", run=run,
                     hint="create the run: `diloco run create`, or start a learner or island")
            logged = True
        await asyncio.sleep(0.5)
    return None


async def plan_from_run(common: CommonConfig, cfg: AggregatorConfig, stop: asyncio.Event, log) -> list[range] | None:
    """The shard workers' fragment ranges for the run's model on this machine; None if stopped
    before the run had a manifest."""
    from bus.conn import connect

    nc = await connect(common, name=f"aggregator-{cfg.aggregator_id}-plan")
    try:
        m = await wait_for_manifest(nc.jetstream(timeout=5), common.run, stop, log)
    finally:
        await nc.close()
    if m is None:
        return None
    _, plan = run_tree(m)
    n = shard_count(plan.sizes, cfg.agg_shards, usable_cores())
    return split(plan.sizes, n)


class ShardWorker:
    """One shard worker process, started again whenever it dies until the supervisor stops."""

    def __init__(self, index: int, fragments: range, aggregator_id: str, log, argv: tuple[str, ...] = WORKER_ARGV):
        self.index, self.fragments, self.argv = index, fragments, argv
        self.id = shard_id(aggregator_id, index)
        self.log = log.bind(shard=self.id, fragments=fragments_text(fragments))
        self.proc: asyncio.subprocess.Process | None = None
        self.restarts = 0

    def env(self) -> dict[str, str]:
        return {**os.environ, "DILOCO_AGG_FRAGMENTS": fragments_text(self.fragments),
                "DILOCO_AGGREGATOR_ID": self.id, "DILOCO_AGG_SHARDS": "1", "DILOCO_EMBEDDED_MONITOR": "false"}

    async def run(self, stop: asyncio.Event) -> int | None:
        """Keep the worker running until ``stop``; returns the exit code of a worker that a restart
        cannot mend (``FATAL``), None once stopped."""
        delay = RESTART_FIRST
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.proc = await acreate_subprocess_exec(*self.argv, env=self.env())
            except OSError as e:  # no process now (EAGAIN, ENOMEM): as a worker that died at once
                self.proc, how = None, f"not started: {e!r}"
            else:
                self.log.info("shard_started", pid=self.proc.pid, restarts=self.restarts)
                waiter = asyncio.create_task(self.proc.wait())
                stopper = asyncio.create_task(stop.wait())
                try:
                    await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                except asyncio.CancelledError:  # the supervisor cancelled: the worker stops as at a stop
                    await asyncio.shield(self._stop(waiter))
                    raise
                finally:
                    stopper.cancel()
                if not waiter.done():  # stopping: the worker checkpoints and exits
                    await self._stop(waiter)
                    return None
                code = self.proc.returncode
                if code in FATAL:
                    self.log.error("shard_failed", exit_code=code,
                                   hint="its error is the line above; the aggregator stops")
                    return code
                how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            if stop.is_set():
                return None
            if time.monotonic() - started >= RESTART_RESET:
                delay = RESTART_FIRST
            self.restarts += 1
            self.log.error("shard_died", exit=how, restart_in_s=delay, restarts=self.restarts,
                           hint="the other shards go on; it recovers its fragments from their checkpoints and merge "
                                "log, and the learners' contributions wait for it in the GRAD stream")
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(RESTART_MAX, 2 * delay)
        return None

    async def _stop(self, waiter: asyncio.Task) -> None:
        assert self.proc is not None
        if waiter.done():
            return
        try:
            self.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            await asyncio.wait_for(asyncio.shield(waiter), STOP_WAIT)
        except asyncio.TimeoutError:
            self.log.warning("shard_stop_timed_out", waited_s=STOP_WAIT, hint="killed: its next start replays its log")
            try:
                self.proc.kill()
            except ProcessLookupError:
                pass
            await waiter


class Shards:
    """The shard workers of one aggregator: started together, each restarted alone, stopped together."""

    def __init__(self, cfg: AggregatorConfig, plan: list[range], log, argv: tuple[str, ...] = WORKER_ARGV):
        """``argv``: the worker's command (tests start stand-ins)."""
        self.log = log
        self.workers = [ShardWorker(i, r, cfg.aggregator_id, log, argv) for i, r in enumerate(plan)]

    async def run(self, stop: asyncio.Event) -> int:
        """Until ``stop`` (0), or until a worker fails beyond mending (its exit code)."""
        self.log.info("aggregator_sharded", shards=len(self.workers), cores=usable_cores(),
                      fragments=[fragments_text(w.fragments) for w in self.workers])
        codes: list[int] = []

        async def one(w: ShardWorker) -> None:
            code = await w.run(stop)
            if code is not None:
                codes.append(code)
                stop.set()  # the others stop too

        tasks = [asyncio.create_task(one(w)) for w in self.workers]
        try:
            await asyncio.gather(*tasks)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        return codes[0] if codes else 0
