"""Helpers for system tests: real role processes (aggregator, monitor, learners) on a real server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time

import orjson

from bus.procs import popen
from bus.signals import terminate_all
from bus.subjects import Subjects
from tests.agg_helpers import PY, env

FAST_MONITOR = {"DILOCO_HEARTBEAT_INTERVAL": "0.2", "DILOCO_SUSPECT_AFTER": "0.6", "DILOCO_EVICT_AFTER": "1.0",
                "DILOCO_LEASE_TTL": "1.5"}
FAST_AGG = {"DILOCO_QUORUM": "1", "DILOCO_GRACE": "fixed", "DILOCO_GRACE_SECONDS": "0.1",
            "DILOCO_MAX_STALENESS": "100000", "DILOCO_NORM_OUTLIER_FACTOR": "1000"}
SYNTH_LEARNER = {"DILOCO_COMPUTE": "synthetic", "DILOCO_STEP_TIME": "0.05", "DILOCO_SYNC_EVERY": "4",
                 "DILOCO_HEARTBEAT_INTERVAL": "0.2", "DILOCO_TOTAL_STEPS": "1000000", "DILOCO_WARMUP_STEPS": "0",
                 "DILOCO_QUANTISER": "int8"}


class Procs:
    """Role processes of one run; every one is killed at the end, whatever happens (and dies with
    the test process if that is killed: :func:`bus.procs.popen`)."""

    def __init__(self, url: str, run: str, logdir):
        self.url, self.run, self.logdir = url, run, logdir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, module: str, url: str | None = None, **extra: str) -> subprocess.Popen:
        log = open(os.path.join(self.logdir, f"{name}.log"), "ab")
        argv = ["diloco.cli", "aggregator"] if module == "aggregator" else [module]  # `diloco aggregator`
        if module == "aggregator":  # these runs start their own monitor (or test without one)
            extra = {"DILOCO_EMBEDDED_MONITOR": "false", **extra}
        p = popen([PY, "-m", *argv], env=env(url or self.url, self.run, **extra), stdout=log, stderr=log)
        log.close()
        self.procs[name] = p
        return p

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        if p.poll() is None:
            p.send_signal(sig)
        p.wait(30)

    def close(self) -> None:
        terminate_all(self.procs.values(), 10)


async def member_states(js, run: str) -> dict[str, str]:
    out = {}
    try:
        kv = await js.key_value(Subjects(run).bucket("members"))
        keys = await kv.keys()
    except Exception:
        return out
    for k in keys:
        try:
            e = await kv.get(k)
            out[k] = orjson.loads(e.value)["state"]
        except Exception:
            pass
    return out


async def wait_for(pred, timeout: float, interval: float = 0.1):
    """Await ``pred()`` (a coroutine function) until truthy; returns (value, seconds waited)."""
    t0 = time.monotonic()
    while True:
        v = await pred()
        if v:
            return v, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return v, time.monotonic() - t0
        await asyncio.sleep(interval)


class MetricsTap:
    """Keeps the newest metrics message of every (role, id) of a run."""

    def __init__(self):
        self.latest: dict[tuple[str, str], dict] = {}

    async def start(self, nc, run: str) -> None:
        async def cb(m):
            try:
                d = orjson.loads(m.data)
                self.latest[(d.get("role"), m.subject.rsplit(".", 1)[-1])] = d
            except Exception:
                pass
        await nc.subscribe(Subjects(run).metrics_all, cb=cb)

    def get(self, role: str, ident: str) -> dict:
        return self.latest.get((role, ident), {})
