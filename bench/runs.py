"""Shared helpers of the evidence benchmarks (issue 7): launch a real run and read what happened.

``Cluster`` is an embedded ``nats-server`` plus role processes (``python -m aggregator``,
``python -m monitor``, ``python -m learner``) started with a clean ``DILOCO_*`` environment, a
metrics tap, a sampler of the server's own ``/connz`` byte counters per connection, and
``eval_once`` (``python -m learner.evaluator --once``: the held-out loss of the global model).

Every process is killed at the end, whatever happens, and dies with the benchmark if that is killed
(even with SIGKILL: :mod:`bus.procs`). Logs go to a temporary directory that is
printed on stderr when a process fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import orjson

from bench.common import progress
from bus.config import CommonConfig
from bus.conn import connect
from bus.procs import acreate_subprocess_exec, popen
from bus.server import EmbeddedServer
from bus.signals import terminate_all
from bus.subjects import Subjects

PY = sys.executable

#: Monitor and aggregator settings that notice failures quickly (as in tests/system.py).
FAST_MONITOR = {"DILOCO_HEARTBEAT_INTERVAL": "0.2", "DILOCO_SUSPECT_AFTER": "0.6", "DILOCO_EVICT_AFTER": "1.0",
                "DILOCO_LEASE_TTL": "1.5"}

#: A small JAX model for sweeps (bandwidth; quick runs): ~0.1M parameters.
SMALL_MODEL = {"DILOCO_D_MODEL": "64", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "4", "DILOCO_D_FF": "256",
               "DILOCO_SEQ_LEN": "64"}


def clean_env(**extra: str) -> dict:
    """os.environ without any DILOCO_* variable, plus ``extra``."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    e.update({k: str(v) for k, v in extra.items()})
    return e


def model_config(env: dict):
    """ModelConfig of a DILOCO_* dict (the values the processes will see)."""
    from learner.config import ModelConfig

    kw = {}
    for f, var in (("d_model", "DILOCO_D_MODEL"), ("n_layers", "DILOCO_N_LAYERS"), ("n_heads", "DILOCO_N_HEADS"),
                   ("d_ff", "DILOCO_D_FF"), ("seq_len", "DILOCO_SEQ_LEN"), ("seed", "DILOCO_SEED"),
                   ("num_fragments", "DILOCO_NUM_FRAGMENTS")):
        if var in env:
            kw[f] = int(env[var])
    return ModelConfig(**kw)


def hwm_mib(pid: int | None) -> float | None:
    """VmHWM (peak RSS) of a process, MiB (None if gone)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Cluster:
    """One run on its own embedded server. ``async with Cluster(run, env) as c: ...``.

    ``env`` holds the DILOCO_* settings shared by every process (model, data, ...); ``start``
    adds per-process ones.
    """

    def __init__(self, run: str = "bench", env: dict | None = None, metrics_interval: float = 0.5,
                 keep_logs: str | None = None, max_file_store: int | None = None):
        self.run = run
        self.max_file_store = max_file_store  # the server's JetStream storage (None: EmbeddedServer's default)
        self.keep_logs = keep_logs  # a folder the processes' logs are copied to at the end
        self.shared = {"DILOCO_METRICS_INTERVAL": str(metrics_interval), "DILOCO_LOG_LEVEL": "warning",
                       **(env or {})}
        self.procs: dict[str, subprocess.Popen] = {}
        self.latest: dict[tuple[str, str], dict] = {}
        self.samples: list[tuple[float, dict[str, tuple[int, int]]]] = []
        self._sampler: asyncio.Task | None = None

    async def __aenter__(self) -> "Cluster":
        self._tmp = tempfile.TemporaryDirectory(prefix="diloco-bench-")
        self.dir = self._tmp.name
        self.srv = EmbeddedServer(store_dir=os.path.join(self.dir, "nats"),
                                  **({"max_file_store": self.max_file_store} if self.max_file_store else {})).start()
        self.url = self.srv.url
        await self.open_tap(CommonConfig(nats_url=self.url, run=self.run))
        return self

    async def open_tap(self, cfg: CommonConfig) -> None:
        """Connect as ``cfg`` and keep every role's newest metrics message in ``latest``."""
        self.nc = await connect(cfg, "bench-tap")
        self.s = Subjects(self.run)

        async def on_metrics(m):
            try:
                d = orjson.loads(m.data)
                self.latest[(d.get("role"), m.subject.rsplit(".", 1)[-1])] = d
            except Exception:
                pass

        await self.nc.subscribe(self.s.metrics_all, cb=on_metrics)

    async def __aexit__(self, *exc) -> None:
        await self.stop_sampler()
        self.close_procs()
        try:
            await self.nc.close()
        except Exception:
            pass
        self.close_servers()
        if self.keep_logs:
            import shutil

            os.makedirs(self.keep_logs, exist_ok=True)
            for f in os.listdir(self.dir):
                if f.endswith(".log"):
                    shutil.copy(os.path.join(self.dir, f), os.path.join(self.keep_logs, f))
        self._tmp.cleanup()

    def close_servers(self) -> None:
        self.srv.close()

    # -- processes ---------------------------------------------------------------------------------

    def env(self, **extra: str) -> dict:
        return clean_env(**{"DILOCO_NATS_URL": self.url, "DILOCO_RUN": self.run, **self.shared, **extra})

    def start(self, name: str, module: str, **extra: str) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        argv = ["diloco.cli", "aggregator"] if module == "aggregator" else [module]  # `diloco aggregator`
        if module == "aggregator":  # a bench run starts its own monitor
            extra = {"DILOCO_EMBEDDED_MONITOR": "false", **extra}
        p = popen([PY, "-m", *argv], env=self.env(**extra), stdout=log, stderr=log)
        log.close()
        self.procs[name] = p
        return p

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs.get(name)
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def alive(self, name: str) -> bool:
        p = self.procs.get(name)
        return p is not None and p.poll() is None

    def log_tail(self, name: str, n: int = 20) -> str:
        try:
            with open(os.path.join(self.dir, f"{name}.log"), "rb") as f:
                return b"".join(f.readlines()[-n:]).decode(errors="replace")
        except OSError:
            return ""

    async def wait_exit(self, names, timeout: float, poll: float = 0.5, report=None) -> bool:
        """Wait until every process in ``names`` exited; False on timeout. ``report()`` every 5 s."""
        t0 = last = time.monotonic()
        while any(self.alive(n) for n in names):
            if time.monotonic() - t0 > timeout:
                return False
            await asyncio.sleep(poll)
            if report and time.monotonic() - last > 5:
                last = time.monotonic()
                report()
        for n in names:
            rc = self.procs[n].returncode
            if rc not in (0, -signal.SIGKILL, -signal.SIGTERM):
                progress(f"{n} exited {rc}:\n{self.log_tail(n)}")
        return True

    def close_procs(self) -> None:
        terminate_all(self.procs.values(), 10)

    def pid_hwm_mib(self, name: str) -> float | None:
        """VmHWM (peak RSS) of a running process, MiB."""
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return None
        return hwm_mib(p.pid)

    # -- metrics -----------------------------------------------------------------------------------

    def metrics(self, role: str, ident: str) -> dict:
        return self.latest.get((role, ident), {})

    def role_metrics(self, role: str) -> dict[str, dict]:
        return {i: d for (r, i), d in self.latest.items() if r == role}

    async def wait_for(self, pred, timeout: float, poll: float = 0.2) -> bool:
        t0 = time.monotonic()
        while not pred():
            if time.monotonic() - t0 > timeout:
                return False
            await asyncio.sleep(poll)
        return True

    # -- the server's own byte counters ---------------------------------------------------------------

    def connz(self) -> dict[str, tuple[int, int]]:
        """{connection name: (in_bytes, out_bytes)}, open and closed connections (server view:
        ``in`` = bytes the client sent to the server, ``out`` = bytes the server sent to it)."""
        d = self.srv.connz(state="all", limit="4096")
        out: dict[str, tuple[int, int]] = {}
        for c in d.get("connections", []):
            name = c.get("name") or f"cid{c.get('cid')}"
            i, o = out.get(name, (0, 0))
            out[name] = (i + int(c.get("in_bytes", 0)), o + int(c.get("out_bytes", 0)))
        return out

    def start_sampler(self, interval: float = 0.25) -> None:
        async def loop():
            while True:
                try:
                    snap = await asyncio.to_thread(self.connz)
                    self.samples.append((time.monotonic(), snap))
                except Exception:
                    pass
                await asyncio.sleep(interval)

        self._sampler = asyncio.create_task(loop())

    async def stop_sampler(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            await asyncio.gather(self._sampler, return_exceptions=True)
            self._sampler = None

    def peak_rate(self, name: str, window: float = 1.0) -> float:
        """Max bytes/s (in + out) of connection ``name`` over any ``window`` seconds of the samples."""
        series = [(t, sum(s[name])) for t, s in self.samples if name in s]
        best, j = 0.0, 0
        for i in range(len(series)):
            while j < len(series) and series[j][0] - series[i][0] < window:
                j += 1
            if j >= len(series):
                break
            dt = series[j][0] - series[i][0]
            best = max(best, (series[j][1] - series[i][1]) / dt)
        return best

    def bytes_at(self, name: str, t: float | None) -> tuple[int, int] | None:
        """(in, out) bytes of ``name`` at the last sample taken at or before monotonic time ``t``."""
        if t is None:
            return None
        best = None
        for ts, snap in self.samples:
            if ts > t:
                break
            if name in snap:
                best = snap[name]
        return best

    # -- evaluation --------------------------------------------------------------------------------

    async def eval_once(self, timeout: float = 180.0, **extra: str) -> dict:
        """Held-out loss of the current global model (``python -m learner.evaluator --once``)."""
        p = await acreate_subprocess_exec(PY, "-m", "learner.evaluator", "--once", env=self.env(**extra),
                                          stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            out, err = await asyncio.wait_for(p.communicate(), timeout)
        except BaseException:  # timed out or cancelled: the evaluator would run on, unread
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            raise
        if p.returncode != 0:
            raise RuntimeError(f"evaluator exited {p.returncode}: {err.decode()[-2000:]}")
        return orjson.loads(out.decode().strip().splitlines()[-1])


# -- a whole decoupled run of JAX (or synthetic) learners ------------------------------------------


#: Aggregator variants of the end-to-end benchmarks: ``defaults`` (the aggregator's own: rounds that
#: close on time, ``DILOCO_QUORUM=auto``), ``quorum`` (K = M, given explicitly: every active learner,
#: the default until the seventh round), ``auto`` (the on-time quorum, given explicitly), ``k1`` (K = 1:
#: a merge per arrival, the grace window for more), ``k1dn`` (K = 1 with Delayed Nesterov, N = M, no
#: participation scale), ``lean`` (``diloco up --preset lean``)
AGG_VARIANTS = ("defaults", "quorum", "auto", "k1", "k1dn", "lean")


def aggregator_settings(variant: str, M: int) -> dict:
    if variant == "defaults":
        return {}
    if variant == "quorum":
        return {"DILOCO_QUORUM": str(M)}
    if variant == "auto":  # rounds that close on time (aggregator.quorum.AUTO)
        return {"DILOCO_QUORUM": "auto"}
    if variant == "k1":
        return {"DILOCO_QUORUM": "1"}
    if variant == "lean":  # diloco up --preset lean (its learners' half: learner_settings)
        from diloco.up.plan import BANDWIDTH_PRESETS

        return dict(BANDWIDTH_PRESETS["lean"])
    if variant == "k1dn":
        return {"DILOCO_QUORUM": "1", "DILOCO_OUTER_OPTIMIZER": "delayed", "DILOCO_DELAY_N": str(M),
                "DILOCO_SCALE_BY_PARTICIPATION": "false"}
    raise ValueError(f"unknown aggregator variant {variant!r}, expected one of {AGG_VARIANTS}")


def learner_settings(variant: str) -> dict:
    """The learners' settings a variant needs besides the aggregator's (the lean preset's codecs)."""
    if variant == "lean":
        from diloco.up.plan import BANDWIDTH_PRESETS

        return dict(BANDWIDTH_PRESETS["lean"])
    return {}


async def run_learners(env: dict, M: int, steps: int, *, run: str = "bench", agg: dict | None = None,
                       learner: dict | None = None, per_learner: dict[int, dict] | None = None,
                       sample_connz: bool = False, evaluate: bool = True, timeout: float = 900.0,
                       label: str = "", monitor: bool = False, keep_logs: str | None = None) -> dict:
    """An aggregator (its defaults unless ``agg`` says otherwise) and M learners
    ``learner-<i>`` that each run ``steps`` inner steps and exit; then the held-out loss of the
    global model. No monitor (DILOCO_REQUIRE_MEMBERSHIP=false) unless ``monitor``: then one with
    heartbeats every 0.5 s and KV refreshes every second (what DILOCO_DYNAMIC_H reads).

    Returns per-learner metrics (last message), /connz bytes per learner connection (total and
    peak 1 s rate when ``sample_connz``), the aggregator's last metrics and the evaluation.
    """
    per_learner = per_learner or {}
    names = [f"learner-{i}" for i in range(M)]
    agg = dict(agg or {})  # the aggregator's defaults unless told
    hb = {"DILOCO_HEARTBEAT_INTERVAL": "0.5"} if monitor else {}
    async with Cluster(run, env, keep_logs=keep_logs) as c:
        c.start("aggregator", "aggregator", DILOCO_REQUIRE_MEMBERSHIP="true" if monitor else "false", **agg)
        if monitor:
            c.start("monitor", "monitor", DILOCO_SUSPECT_AFTER="5", DILOCO_EVICT_AFTER="10", DILOCO_KV_REFRESH="1", **hb)
        if sample_connz:
            c.start_sampler()
        t0 = time.monotonic()
        for i, n in enumerate(names):
            c.start(n, "learner", DILOCO_LEARNER_ID=n, DILOCO_MAX_STEPS=str(steps), DILOCO_NUM_LEARNERS=str(M),
                    **hb, **(learner or {}), **per_learner.get(i, {}))

        def report():
            steps_now = [c.metrics("learner", n).get("step") for n in names]
            progress(f"{label} steps {steps_now} versions {sum(c.metrics('aggregator', 'agg-0').get('versions', {}).values())}")

        # first-step and last-step times per learner, from the metrics stream
        first: dict[str, float] = {}

        async def watch_first():
            while True:
                for n in names:
                    if n not in first and (c.metrics("learner", n).get("step") or 0) > 0:
                        first[n] = time.monotonic()
                await asyncio.sleep(0.1)

        wf = asyncio.create_task(watch_first())
        ok = await c.wait_exit(names, timeout, report=report)
        wf.cancel()
        wall = time.monotonic() - t0
        # let the aggregator merge what the learners sent last
        await c.wait_for(lambda: not c.metrics("aggregator", "agg-0").get("buffered"), 10.0)
        await asyncio.sleep(1.0)
        await c.stop_sampler()
        conn = c.connz()
        out = {"ok": ok, "wall_s": round(wall, 2), "learners": {}, "aggregator": c.metrics("aggregator", "agg-0")}
        for n in names:
            m = c.metrics("learner", n)
            i_b, o_b = conn.get(f"learner-{n}", (0, 0))
            out["learners"][n] = {
                "step": m.get("step"), "loss": m.get("loss"), "step_seconds_total": m.get("step_seconds_total"),
                "step_cv": m.get("step_cv"),
                "bytes_sent": m.get("bytes_sent"), "bytes_received": m.get("bytes_received"),
                "contributions": m.get("contributions"), "skipped_syncs": m.get("skipped_syncs"),
                "deferred_syncs": m.get("deferred_syncs"),
                "period": m.get("period"),
                "blocked_s": m.get("blocked_s"), "connz_in": i_b, "connz_out": o_b,
                "peak_Bps": round(c.peak_rate(f"learner-{n}"), 1) if sample_connz else None,
                "exit": c.procs[n].returncode, "first_step_t": first.get(n), "incarnation": m.get("incarnation"),
                "connz_at_first_step": c.bytes_at(f"learner-{n}", first.get(n))}
        if evaluate:
            out["eval"] = await c.eval_once()
        return out
