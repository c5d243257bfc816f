"""The monitor service (``diloco monitor``): heartbeats in, authoritative membership out.

A thin asyncio shell around the pure core in :mod:`monitor.membership` and :mod:`monitor.lease`:

* subscribes (core NATS) to ``diloco.<run>.hb.*``; every message is decoded and validated
  (:func:`parse_heartbeat`); a rejected one is counted by reason in the metrics and logged
  (rate-limited), never raised;
* follows the newest global version per fragment (``VersionedStore(js, run, GLOBAL).watch``), so a
  (re)joining learner turns active only once it holds current versions;
* applies ``on_heartbeat`` to each heartbeat and ``on_tick`` every ``heartbeat_interval / 2``;
* while it holds the leader lease (:mod:`monitor.lease`), writes every changed member to the KV
  bucket ``diloco_<run>_members`` (key = learner id, value = JSON of ``member_to_dict``) with
  compare-and-set on the key's revision, and publishes every transition as JSON on the JetStream
  subject ``diloco.<run>.events.membership``;
* publishes its metrics every ``DILOCO_METRICS_INTERVAL`` on ``diloco.<run>.metrics.monitor.<id>``.

A (re)started monitor loads the members from KV and evicts nobody during its first
``evict_after`` seconds (silence is counted from its start at the earliest), so a restart never
evicts a live learner. A standby monitor follows heartbeats in memory; when it takes the lease
over it reloads KV and keeps the newest ``last_seen`` of both views (:func:`adopt_members`).

Writes of a member whose state did not change (only ``last_seen``, ``step``, ``versions`` moved)
are coalesced to one every ``DILOCO_KV_REFRESH`` seconds (:func:`needs_write`); transitions are
written at once. So ``last_seen`` in KV may lag by that much: judge liveness by ``state``.

This module is the process shell (connection, set-up, the loops, metrics, ``main``); the parts:
:mod:`monitor.intake` (heartbeat intake), :mod:`monitor.leader` (lease, KV writes, events),
:mod:`monitor.store` (reading the members bucket and the global heads; the write rules).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from nats.js.errors import BucketNotFoundError

from bus.signals import cancel_all, install_stop
from bus.codec import dumps_json
from bus.config import CommonConfig, ConfigError, from_env
from bus.conn import ConnectFailed, connect
from bus.entry import EXIT_ERROR, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from bus.log import get_logger, setup
from bus.store_health import StoreWatch
from bus.streams import Limits, ensure_run
from bus.subjects import GLOBAL, Subjects
from bus.transport import VersionedStore
from monitor.config import MonitorConfig
from monitor.intake import MAX_HEARTBEAT_BYTES, HeartbeatIntake, parse_heartbeat
from monitor.leader import Leadership
from monitor.membership import HeartbeatLimits, Member, Transition, count_states
from monitor.store import adopt_members, current_heads, load_members, needs_write

__all__ = [
    "MAX_HEARTBEAT_BYTES",
    "MonitorService",
    "adopt_members",
    "current_heads",
    "load_members",
    "main",
    "monitor_metrics",
    "needs_write",
    "parse_heartbeat",
]


def monitor_metrics(run: str, monitor_id: str, ts: float, members: Mapping[str, Member],
                    rejected: Mapping[str, int], leader: bool, stats: Mapping[str, int]) -> dict[str, Any]:
    """The monitor's metrics message (``diloco metrics`` folds ``counts``)."""
    return {
        "role": "monitor",
        "run": run,
        "ts": ts,
        "monitor": monitor_id,
        "leader": bool(leader),
        "counts": count_states(members),
        "members": len(members),
        # the newest heartbeat of each learner as this monitor heard it: the members bucket is
        # rewritten only every DILOCO_KV_REFRESH, so `diloco status` takes the fresher of the two
        "seen": {name: m.last_seen for name, m in members.items()},
        "rejected_heartbeats": dict(rejected),
        **dict(stats),
    }


# --------------------------------------------------------------------------- the service


class _Throttle:
    """At most one log line per key every ``every`` seconds; counts what it suppressed."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def allow(self, key: str, now: float) -> tuple[bool, int]:
        last = self._last.get(key)
        if last is not None and now - last < self.every:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False, 0
        if len(self._last) > 1000:
            self._last.clear()
        self._last[key] = now
        return True, self._suppressed.pop(key, 0)


class MonitorService(Leadership, HeartbeatIntake):
    """One monitor process. ``await MonitorService(common, cfg).run(stop)`` until ``stop`` is set.

    Attributes for tests and embedding: ``members`` (current view), ``current_versions``,
    ``rejected`` (reason -> count), ``stats``, ``is_leader``, ``ready`` (set once it listens to
    heartbeats and has tried the lease once).
    """

    def __init__(self, common: CommonConfig, cfg: MonitorConfig, limits: HeartbeatLimits = HeartbeatLimits()):
        self.common = common
        self.cfg = cfg
        self.id = cfg.resolved_id
        self.mcfg = cfg.membership_config()
        self.limits = limits
        self.subjects = Subjects(common.run)
        self.log = get_logger(component="monitor", monitor=self.id)
        self.members: dict[str, Member] = {}
        self.current_versions: dict[int, int] = {}
        self.rejected: dict[str, int] = {}
        self.stats: dict[str, int] = {
            "heartbeats": 0,
            "transitions": 0,
            "kv_writes": 0,
            "kv_conflicts": 0,
            "kv_errors": 0,
            "events_published": 0,
            "events_dropped": 0,
            "leader_changes": 0,
            "forgotten": 0,
        }
        self.started_at: float | None = None
        self._drained_at: float | None = None  # when the heartbeat intake was last empty (tick)
        self._ticked_at: float | None = None  # the previous tick (a gap far longer than its period: a stall)
        self._hb_sub: Any = None  # the heartbeat subscription (its pending count: the intake's backlog)
        self.ready = asyncio.Event()
        self.nc = None
        self.js = None
        self._members_kv = None
        self._lease_kv = None
        self._leader = False
        self._leader_until: float | None = None
        self._lease_rev: int | None = None
        self._revs: dict[str, int] = {}
        self._written: dict[str, tuple[Member, float]] = {}
        self._dirty: set[str] = set()
        self._events: deque[Transition] = deque()
        self._wake = asyncio.Event()
        self._lease_kick = asyncio.Event()
        self._throttle = _Throttle()
        self._since_yield = 0
        # a full store (bus.store_health): said once; the lease and members are written once it writes again
        self.store_watch = StoreWatch(self.log, "membership goes on in memory (heartbeats, evictions); the lease, "
                                                "member records and events are written once the store takes writes")

    # -- loops ------------------------------------------------------------------------------------

    async def _loop(self, name: str, stop: asyncio.Event, period: float, body, kick: asyncio.Event | None = None):
        """Run ``body`` every ``period`` seconds (or when ``kick`` is set) until ``stop``; log failures."""
        while not stop.is_set():
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - a loop never dies; the next round retries
                ok, suppressed = self._throttle.allow(f"loop_{name}", time.monotonic())
                if ok and not await self.store_watch.failed(e):  # a full store is said once (store_full)
                    self.log.warning("loop_failed", loop=name, error=repr(e), suppressed_since_last=suppressed)
            waiters = [asyncio.ensure_future(stop.wait())]
            if kick is not None:
                waiters.append(asyncio.ensure_future(kick.wait()))
            try:
                await asyncio.wait(waiters, timeout=period, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
            if kick is not None:
                kick.clear()

    async def _tick_body(self) -> None:
        sub = self._hb_sub
        self.tick(time.time(), backlog=sub.pending_msgs if sub is not None else 0)

    async def _flush_body(self) -> None:
        if self.is_leader:
            await self.flush()

    async def _metrics_body(self) -> None:
        msg = monitor_metrics(self.common.run, self.id, time.time(), self.members, self.rejected,
                              self.is_leader, {**self.stats, "events_pending": len(self._events)})
        msg.update(self.store_watch.metrics())
        await self.nc.publish(self.subjects.metrics("monitor", self.id), dumps_json(msg))

    async def _follow_versions(self, stop: asyncio.Event) -> None:
        store = VersionedStore(self.js, self.common.run, GLOBAL)
        while not stop.is_set():
            try:
                async for h in store.watch(stop):
                    if h.version > self.current_versions.get(h.fragment, -1):
                        self.current_versions[h.fragment] = h.version
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001
                self.log.warning("versions_watch_failed", error=repr(e))
                await asyncio.sleep(1.0)

    async def _setup(self, stop: asyncio.Event) -> None:
        """Open the buckets, load members, read current versions; retried until stop.

        A run that does not exist yet is created only when :func:`may_create_run` (a server without
        auth); otherwise the monitor waits for the aggregator or ``diloco run create`` to create it
        (its least-privilege user may not: trying was a permissions violation and a timeout in every
        ``diloco up``'s log), quietly at first (``waiting_for_run``, info) and with one warning
        (``run_not_created``) after ``RUN_WAIT_WARN_S`` seconds."""
        delay = 0.2
        waiting_since: float | None = None
        warned = False
        while True:
            try:
                s = self.subjects
                try:
                    self._members_kv = await self.js.key_value(s.bucket("members"))
                except BucketNotFoundError:
                    if not may_create_run(self.common):
                        raise _NoRunYet() from None
                    await ensure_run(self.js, self.common.run, Limits.from_config(self.common))
                    self._members_kv = await self.js.key_value(s.bucket("members"))
                self._lease_kv = await self.js.key_value(s.bucket("lease"))
                members, revs, bad = await load_members(self._members_kv)
                for key, why in bad.items():
                    self.log.warning("member_record_unreadable", learner=key, error=why)
                self.members, self._revs = members, revs
                self.current_versions = await current_heads(self.js, self.common.run)
                if waiting_since is not None:
                    self.log.info("run_found", waited_s=round(time.monotonic() - waiting_since, 1))
                return
            except _NoRunYet:
                if stop.is_set():
                    raise
                now = time.monotonic()
                if waiting_since is None:
                    waiting_since = now
                    self.log.info("waiting_for_run", hint="the aggregator or `diloco run create` creates it")
                elif not warned and now - waiting_since >= RUN_WAIT_WARN_S:
                    warned = True
                    self.log.warning("run_not_created", waited_s=round(now - waiting_since, 1),
                                     hint=f"run {self.common.run!r} has no members bucket yet: is an aggregator "
                                          "running for it (it creates the run), or create it with `diloco run "
                                          "create`; is DILOCO_RUN the same everywhere?")
                delay = min(delay, 1.0)
            except Exception as e:  # noqa: BLE001
                if stop.is_set():
                    raise
                self.log.warning("setup_failed", error=repr(e), retry_in=delay)
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                raise _Stopped()
            delay = min(delay * 2, 5.0)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set. On a graceful stop the leader flushes and releases its lease
        (a standby takes over at once); if the task is cancelled instead (a crash, for tests) the
        lease simply expires after ``lease_ttl``."""
        connecting = asyncio.ensure_future(connect(self.common, name=f"monitor-{self.id}",
                                                   after_reconnect=self.store_watch.reconnected))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not connecting.done():
                connecting.cancel()
                await asyncio.gather(connecting, return_exceptions=True)
        if connecting.cancelled():
            return
        self.nc = connecting.result()
        tasks: list[asyncio.Task] = []
        sub = None
        try:
            self.js = self.nc.jetstream(timeout=5.0)
            self.store_watch.probe = lambda: self.js.stream_info(f"KV_{self.subjects.bucket('lease')}")
            try:
                await self._setup(stop)
            except Exception:
                if stop.is_set():
                    return
                raise
            self.log.info("monitor_starting", members=len(self.members), versions=len(self.current_versions))
            sub = self._hb_sub = await self.nc.subscribe(self.subjects.heartbeat_all, cb=self._on_heartbeat_msg,
                                                         pending_msgs_limit=1_000_000,
                                                         pending_bytes_limit=256 * 1024 * 1024)
            self.started_at = time.time()
            try:
                await self._lease_step()
            except Exception as e:  # noqa: BLE001 - the lease loop retries
                self.log.warning("lease_step_failed", error=repr(e))
            self.ready.set()
            hb = self.mcfg.heartbeat_interval
            tasks = [
                asyncio.create_task(self._loop("lease", stop, self.cfg.lease_ttl / 3, self._lease_step,
                                               self._lease_kick)),
                asyncio.create_task(self._loop("tick", stop, hb / 2, self._tick_body)),
                asyncio.create_task(self._loop("flush", stop, hb / 2, self._flush_body, self._wake)),
                asyncio.create_task(self._loop("metrics", stop, self.common.metrics_interval, self._metrics_body)),
                asyncio.create_task(self._follow_versions(stop)),
            ]
            self.log.info("monitor_running", monitor=self.id, leader=self.is_leader)
            await stop.wait()
            # graceful stop: hand over cleanly
            if sub is not None:
                await sub.unsubscribe()
                sub = None
            # the lease loop ends once its step in flight has (a renew racing the release below moved
            # the lease's revision, the delete then failed and a successor waited out the lease's ttl)
            await asyncio.wait(tasks[:1], timeout=5.0)
            if self.is_leader:
                try:
                    await asyncio.wait_for(self.flush(force=True), timeout=5.0)
                except Exception as e:  # noqa: BLE001
                    self.log.warning("final_flush_failed", error=repr(e))
                await self._release_lease()
            self.log.info("monitor_stopped")
        finally:
            try:
                await cancel_all(tasks)
            finally:
                try:
                    await self.nc.close()
                except Exception:
                    pass
                self._leader = False


#: Seconds a monitor waits quietly for its run to be created before one ``run_not_created`` warning.
RUN_WAIT_WARN_S = 30.0


class _NoRunYet(Exception):
    """The run's members bucket does not exist yet and this monitor does not create runs."""


class _Stopped(Exception):
    """Stopped while setting up."""


def may_create_run(common: CommonConfig) -> bool:
    """Whether a monitor creates a missing run itself: only on a server without auth (no user,
    credentials or nkey: tests, a throwaway local server). With credentials it is a least-privilege
    role user, which may not create streams: the aggregator or ``diloco run create`` does."""
    return not (common.nats_user or common.nats_creds or common.nats_nkey_seed)


# --------------------------------------------------------------------------- entry point


async def _amain(common: CommonConfig, cfg: MonitorConfig) -> int:
    stop = asyncio.Event()
    install_stop(stop)
    svc = MonitorService(common, cfg)
    try:
        await svc.run(stop)
    except Exception as e:  # noqa: BLE001
        get_logger(component="monitor").error("monitor_failed", error=repr(e))
        print(f"diloco monitor: {e if isinstance(e, ConnectFailed) else repr(e)}", file=sys.stderr)
        return EXIT_UNAVAILABLE if isinstance(e, ConnectFailed) else EXIT_ERROR
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """``diloco monitor``: run the membership monitor of ``DILOCO_RUN`` until SIGTERM/SIGINT."""
    p = argparse.ArgumentParser(
        prog="diloco monitor",
        description="Run the membership monitor. Configured by DILOCO_* variables (see `diloco config monitor`).",
    )
    p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        common = from_env(CommonConfig)
        cfg = from_env(MonitorConfig)
    except ConfigError as e:
        print(f"diloco monitor: {e}", file=sys.stderr)
        return EXIT_USAGE
    setup(common.log_level, run=common.run, role="monitor", island=common.region)
    return asyncio.run(_amain(common, cfg))
