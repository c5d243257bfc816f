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
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from bus.signals import install_stop
from bus.codec import CodecError, dumps_json, loads_json
from bus.config import CommonConfig, ConfigError, from_env
from bus.conn import connect
from bus.log import get_logger, setup
from bus.streams import Limits, ensure_run
from nats.js.errors import BucketNotFoundError
from bus.subjects import GLOBAL, Subjects
from bus.transport import VersionedStore
from monitor.config import MonitorConfig
from monitor.lease import LEASE_KEY, Action, lease_decision, lease_value, may_write, parse_lease
from monitor.membership import (
    Heartbeat,
    HeartbeatLimits,
    InvalidHeartbeat,
    Member,
    Transition,
    count_states,
    forgettable,
    member_from_dict,
    member_to_dict,
    on_heartbeat,
    on_tick,
    transition_to_dict,
    validate_heartbeat,
)

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

#: Heartbeats larger than this are dropped before parsing (4096 fragments fit in ~70 KB).
MAX_HEARTBEAT_BYTES = 256 * 1024
_WRITE_PARALLEL = 64
_EVENT_BATCH = 256
_MAX_PENDING_EVENTS = 100_000
_KV_DEL_OPS = ("DEL", "PURGE")


# --------------------------------------------------------------------------- pure helpers


def parse_heartbeat(subject: str, data: bytes, now: float, limits: HeartbeatLimits = HeartbeatLimits()) -> Heartbeat:
    """Decode and validate one heartbeat message; raises :class:`InvalidHeartbeat` with a reason.

    Reasons beyond :func:`validate_heartbeat`'s: ``oversized`` (more than MAX_HEARTBEAT_BYTES),
    ``not_json`` (includes NaN/Infinity literals, which are not JSON) and ``subject_mismatch``
    (the learner id in the payload is not the last token of ``hb.<learner>``: a learner may only
    speak for itself).
    """
    if len(data) > MAX_HEARTBEAT_BYTES:
        raise InvalidHeartbeat("oversized", f"{len(data)} bytes > {MAX_HEARTBEAT_BYTES}")
    try:
        raw = loads_json(data)
    except CodecError as e:
        raise InvalidHeartbeat("not_json", str(e)[:120]) from None
    hb = validate_heartbeat(raw, now=now, limits=limits)
    token = subject.rsplit(".", 1)[-1]
    if token != hb.learner:
        raise InvalidHeartbeat("subject_mismatch", f"learner {hb.learner!r} sent on subject {subject[:120]!r}")
    return hb


def needs_write(written: Member | None, new: Member, written_at: float | None, now: float, refresh: float) -> bool:
    """Whether ``new`` must be written to KV, given what we last wrote (``written`` at ``written_at``).

    At once when the member is new to KV or its state, reason, incarnation or region changed;
    otherwise (liveness and progress fields only) at most every ``refresh`` seconds.
    """
    if written is None or written_at is None:
        return True
    if new == written:
        return False
    significant = ("state", "since", "reason", "incarnation", "region")
    if any(getattr(new, f) != getattr(written, f) for f in significant):
        return True
    return now - written_at >= refresh


def adopt_members(kv_members: Mapping[str, Member], local: Mapping[str, Member]) -> dict[str, Member]:
    """Membership a monitor takes over when it becomes leader.

    The KV records are authoritative (state, reason, incarnation): they are what everyone has
    seen. Our own observation only contributes liveness: ``last_seen`` is the newer of both.
    Learners we heard but KV does not know are left out: their next heartbeat makes them join
    properly, with their transitions published.
    """
    out: dict[str, Member] = {}
    for name, m in kv_members.items():
        mine = local.get(name)
        if mine is not None and mine.last_seen > m.last_seen:
            m = replace(m, last_seen=mine.last_seen)
        out[name] = m
    return out


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


def event_msg_id(run: str, t: Transition) -> str:
    """Deduplication id of a transition event (a retried publish is stored once)."""
    old = "none" if t.old is None else t.old.value
    return f"{run}.{t.learner}.{old}.{t.new.value}.{t.at!r}"


# --------------------------------------------------------------------------- KV / stream reads


async def load_members(kv, timeout: float = 10.0) -> tuple[dict[str, Member], dict[str, int], dict[str, str]]:
    """All members of a members bucket: (members, KV revision per key, {key: why unreadable}).

    A record that does not parse is reported in the third dict, not raised: the learner is
    treated as unknown and rejoins on its next heartbeat (its revision is kept for the CAS).
    """
    members: dict[str, Member] = {}
    revs: dict[str, int] = {}
    bad: dict[str, str] = {}
    watcher = await kv.watchall()
    try:
        while True:
            entry = await watcher.updates(timeout=timeout)
            if entry is None:
                break
            key = entry.key
            if entry.operation in _KV_DEL_OPS:
                members.pop(key, None)
                revs.pop(key, None)
                bad.pop(key, None)
                continue
            revs[key] = entry.revision
            try:
                m = member_from_dict(loads_json(entry.value or b""))  # type: ignore[arg-type]
                if m.learner != key:
                    raise ValueError(f"record of {m.learner!r} stored under key {key!r}")
            except (ValueError, CodecError) as e:
                bad[key] = str(e)[:200]
                members.pop(key, None)
                continue
            bad.pop(key, None)
            members[key] = m
    finally:
        try:
            await watcher.stop()
        except Exception:
            pass
    return members, revs, bad


async def current_heads(js, run: str, fragments: Iterable[int] | None = None) -> dict[int, int]:
    """Newest global version per fragment: of ``fragments``, or of every fragment with a head."""
    store = VersionedStore(js, run, GLOBAL)
    if fragments is None:
        s = Subjects(run)
        try:
            info = await js.stream_info(s.stream(GLOBAL), subjects_filter=s.versioned_heads(GLOBAL))
        except NotFoundError:
            return {}
        frags = set()
        for subj in (info.state.subjects or {}):
            try:
                frags.add(int(subj.split(".")[-2]))
            except (ValueError, IndexError):
                continue
        fragments = sorted(frags)
    out: dict[int, int] = {}
    for f in fragments:
        try:
            h = await store.head(f)
        except ValueError:
            continue
        if h is not None:
            out[int(f)] = h.version
    return out


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


class MonitorService:
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

    # -- leadership ---------------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this monitor holds a lease it may still write under (its own clock)."""
        return self._leader and may_write(time.time(), self._leader_until, self.cfg.lease_ttl)

    async def _lease_step(self) -> None:
        kv = self._lease_kv
        now = time.time()
        try:
            entry = await kv.get(LEASE_KEY)
            current = parse_lease(entry.value, entry.revision)
        except KeyNotFoundError:
            current = None
        action, reason = lease_decision(now, current, self.id, self.cfg.lease_ttl)
        if action is Action.STANDBY:
            self._step_down(reason)
            return
        value = lease_value(self.id, now, self.cfg.lease_ttl)
        try:
            if action is Action.ACQUIRE:
                rev = await kv.create(LEASE_KEY, value)
            else:
                assert current is not None
                rev = await kv.update(LEASE_KEY, value, last=current.revision)
        except KeyWrongLastSequenceError:
            self._step_down(f"lost the lease race ({action.value})")
            return
        continuing = (
            self._leader and action is Action.RENEW and current is not None and current.revision == self._lease_rev
        )
        self._lease_rev = rev
        self._leader_until = now + self.cfg.lease_ttl
        if not continuing:
            await self._become_leader(reason)

    async def _become_leader(self, reason: str) -> None:
        """Reload the members from KV (a previous leader may have written since), then lead."""
        kv_members, revs, bad = await load_members(self._members_kv)
        for key, why in bad.items():
            self.log.warning("member_record_unreadable", learner=key, error=why)
        now = time.time()
        self.members = adopt_members(kv_members, self.members)
        self._revs = revs
        self._written = {k: (m, now) for k, m in kv_members.items()}
        self._dirty = set(self.members)
        self._events.clear()
        self._leader = True
        self.stats["leader_changes"] += 1
        self.log.info("leader", reason=reason, members=len(self.members), until=self._leader_until)
        self._wake.set()

    def _step_down(self, reason: str) -> None:
        if self._leader:
            self.stats["leader_changes"] += 1
            dropped = len(self._events)
            self.log.warning("leader_lost", reason=reason, unpublished_events=dropped)
            self.stats["events_dropped"] += dropped
            self._events.clear()
        self._leader = False
        self._leader_until = None

    async def _release_lease(self) -> None:
        if not self._leader or self._lease_rev is None:
            return
        try:
            await self._lease_kv.delete(LEASE_KEY, last=self._lease_rev)
            self.log.info("lease_released")
        except Exception as e:
            self.log.warning("lease_release_failed", error=repr(e))
        self._leader = False

    # -- heartbeats and ticks (synchronous state changes) ---------------------------------------

    def _reject(self, reason: str, detail: str, subject: str) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        ok, suppressed = self._throttle.allow(reason, time.monotonic())
        if ok:
            self.log.warning("heartbeat_rejected", reason=reason, detail=detail[:200], subject=subject[:120],
                             suppressed_since_last=suppressed)
        else:
            self.log.debug("heartbeat_rejected", reason=reason, detail=detail[:200])

    def _apply_heartbeat(self, hb: Heartbeat, now: float, subject: str) -> None:
        old = self.members.get(hb.learner)
        if old is None and len(self.members) >= self.cfg.max_members:
            self._reject("too_many_members", f"already tracking {len(self.members)} learners", subject)
            return
        # on_heartbeat only reads the heartbeat's own learner: pass just that entry (O(1))
        new, transitions = on_heartbeat({} if old is None else {hb.learner: old}, hb, now,
                                        self.current_versions or None, self.mcfg)
        self.members[hb.learner] = new[hb.learner]
        self.stats["heartbeats"] += 1
        self._changed((hb.learner,), transitions)

    def _changed(self, names: Iterable[str], transitions: list[Transition]) -> None:
        self._dirty.update(names)
        if not transitions:
            return
        self.stats["transitions"] += len(transitions)
        leader = self._leader
        for t in transitions:
            (self.log.info if leader else self.log.debug)(
                "transition", learner=t.learner, old=None if t.old is None else t.old.value, new=t.new.value,
                reason=t.reason, leader=leader)
        if leader:
            self._events.extend(transitions)
            while len(self._events) > _MAX_PENDING_EVENTS:
                self._events.popleft()
                self.stats["events_dropped"] += 1
        self._wake.set()

    async def _on_heartbeat_msg(self, msg) -> None:
        now = time.time()
        try:
            hb = parse_heartbeat(msg.subject, msg.data or b"", now, self.limits)
        except InvalidHeartbeat as e:
            self._reject(e.reason, e.detail, msg.subject)
        except Exception as e:  # noqa: BLE001 - a heartbeat must never take the monitor down
            self._reject("unreadable", repr(e), msg.subject)
        else:
            try:
                self._apply_heartbeat(hb, now, msg.subject)
            except Exception as e:  # noqa: BLE001
                self._reject("apply_failed", repr(e), msg.subject)
        self._since_yield += 1
        if self._since_yield >= 64:  # a burst must not starve the lease renewal
            self._since_yield = 0
            await asyncio.sleep(0)

    def tick(self, now: float) -> list[Transition]:
        """Apply the passage of time (exposed for tests); returns the transitions."""
        assert self.started_at is not None
        new, transitions = on_tick(self.members, now, self.started_at, self.mcfg)
        if transitions:
            self.members = new
            self._changed([t.learner for t in transitions], transitions)
        return transitions

    # -- writing ----------------------------------------------------------------------------------

    async def _write_member(self, name: str) -> None:
        m = self.members.get(name)
        if m is None:
            self._dirty.discard(name)
            return
        kv = self._members_kv
        value = dumps_json(member_to_dict(m))
        rev = self._revs.get(name)
        try:
            new_rev = await (kv.create(name, value) if rev is None else kv.update(name, value, last=rev))
        except KeyWrongLastSequenceError:
            # someone else wrote this key (an old leader that has not noticed yet, or a human):
            # learn its revision; our next flush rewrites it if we still hold the lease.
            self.stats["kv_conflicts"] += 1
            self.log.warning("member_write_conflict", learner=name)
            try:
                entry = await kv.get(name)
                self._revs[name] = entry.revision
            except KeyNotFoundError:
                self._revs.pop(name, None)
            except Exception:
                pass
            self._lease_kick.set()
            return
        except Exception as e:  # noqa: BLE001 - timeouts, disconnects: retried on the next flush
            self.stats["kv_errors"] += 1
            ok, suppressed = self._throttle.allow("kv_error", time.monotonic())
            if ok:
                self.log.warning("member_write_failed", learner=name, error=repr(e), suppressed_since_last=suppressed)
            return
        self.stats["kv_writes"] += 1
        self._revs[name] = new_rev
        self._written[name] = (m, time.time())
        if self.members.get(name) == m:
            self._dirty.discard(name)

    async def _publish_events(self) -> None:
        subject = self.subjects.event("membership")
        while self._events and self.is_leader:
            batch = [self._events[i] for i in range(min(_EVENT_BATCH, len(self._events)))]
            try:
                futs = []
                for t in batch:
                    body = {**transition_to_dict(t), "run": self.common.run, "monitor": self.id}
                    futs.append(await self.js.publish_async(
                        subject, dumps_json(body), headers={"Nats-Msg-Id": event_msg_id(self.common.run, t)},
                        wait_stall=5.0))
                await asyncio.wait_for(asyncio.gather(*futs), timeout=10.0)
            except Exception as e:  # noqa: BLE001 - republished next time (deduplicated by Msg-Id)
                ok, suppressed = self._throttle.allow("event_error", time.monotonic())
                if ok:
                    self.log.warning("event_publish_failed", error=repr(e), pending=len(self._events),
                                     suppressed_since_last=suppressed)
                return
            for _ in batch:
                if self._events:
                    self._events.popleft()
            self.stats["events_published"] += len(batch)

    async def flush(self, force: bool = False) -> None:
        """Write the members that need it (CAS), then publish pending transitions. Leader only.

        ``force`` writes every member that differs from KV (the final flush of a graceful stop)."""
        now = time.time()
        todo = []
        refresh = 0.0 if force else self.cfg.kv_refresh
        for name in list(self._dirty):
            m = self.members.get(name)
            if m is None:
                self._dirty.discard(name)
                continue
            written = self._written.get(name)
            if needs_write(written and written[0], m, written and written[1], now, refresh):
                todo.append(name)
            elif written is not None and written[0] == m:
                self._dirty.discard(name)  # KV holds exactly this (e.g. loaded at takeover)
        for i in range(0, len(todo), _WRITE_PARALLEL):
            if not self.is_leader:
                return
            await asyncio.gather(*(self._write_member(n) for n in todo[i : i + _WRITE_PARALLEL]))
        if self.is_leader:
            await self._publish_events()
        if self.is_leader:
            await self._forget(now)

    async def _forget(self, now: float) -> None:
        """Delete members evicted ``forget_after`` ago from KV (CAS on the revision we wrote)."""
        for name in forgettable(self.members, now, self.cfg.forget_after):
            m = self.members[name]
            written = self._written.get(name)
            rev = self._revs.get(name)
            if not self.is_leader or rev is None or written is None or written[0].state is not m.state \
                    or written[0].since != m.since:
                continue  # its eviction is not in KV yet (or we do not know its revision): next flush
            try:
                await self._members_kv.delete(name, last=rev)
            except Exception as e:  # noqa: BLE001 - a conflict or timeout: tried again next flush
                self.stats["kv_errors"] += 1
                self.log.warning("member_forget_failed", learner=name, error=repr(e))
                continue
            if self.members.get(name) is not m:
                # a heartbeat arrived during the delete (or a takeover reloaded the members): it
                # is back, and its next write re-creates the record (the stale revision conflicts)
                self._revs.pop(name, None)
                continue
            self.members.pop(name)
            self._revs.pop(name, None)
            self._written.pop(name, None)
            self.stats["forgotten"] += 1
            self.log.info("member_forgotten", learner=name, evicted_at=m.since, last_seen=m.last_seen)

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
                if ok:
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
        self.tick(time.time())

    async def _flush_body(self) -> None:
        if self.is_leader:
            await self.flush()

    async def _metrics_body(self) -> None:
        msg = monitor_metrics(self.common.run, self.id, time.time(), self.members, self.rejected,
                              self.is_leader, {**self.stats, "events_pending": len(self._events)})
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
        """Open the buckets (creating the run only if it does not exist yet and our user may), load
        members, read current versions; retried until stop."""
        delay = 0.2
        while True:
            try:
                s = self.subjects
                try:
                    self._members_kv = await self.js.key_value(s.bucket("members"))
                except BucketNotFoundError:
                    # no run yet: create it if our user may (a least-privilege monitor user may not,
                    # and then waits here for the aggregator to create it)
                    await ensure_run(self.js, self.common.run, Limits.from_config(self.common))
                    self._members_kv = await self.js.key_value(s.bucket("members"))
                self._lease_kv = await self.js.key_value(s.bucket("lease"))
                members, revs, bad = await load_members(self._members_kv)
                for key, why in bad.items():
                    self.log.warning("member_record_unreadable", learner=key, error=why)
                self.members, self._revs = members, revs
                self.current_versions = await current_heads(self.js, self.common.run)
                return
            except Exception as e:  # noqa: BLE001
                if stop.is_set():
                    raise
                self.log.warning("setup_failed", error=repr(e), retry_in=delay)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                except asyncio.TimeoutError:
                    pass
                if stop.is_set():
                    raise
                delay = min(delay * 2, 5.0)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set. On a graceful stop the leader flushes and releases its lease
        (a standby takes over at once); if the task is cancelled instead (a crash, for tests) the
        lease simply expires after ``lease_ttl``."""
        connecting = asyncio.ensure_future(connect(self.common, name=f"monitor-{self.id}"))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            if not connecting.done():
                connecting.cancel()
        if connecting.cancelled():
            return
        self.nc = connecting.result()
        tasks: list[asyncio.Task] = []
        sub = None
        try:
            self.js = self.nc.jetstream(timeout=5.0)
            try:
                await self._setup(stop)
            except Exception:
                if stop.is_set():
                    return
                raise
            self.log.info("monitor_starting", members=len(self.members), versions=len(self.current_versions))
            sub = await self.nc.subscribe(self.subjects.heartbeat_all, cb=self._on_heartbeat_msg,
                                          pending_msgs_limit=1_000_000, pending_bytes_limit=256 * 1024 * 1024)
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
            if self.is_leader:
                try:
                    await asyncio.wait_for(self.flush(force=True), timeout=5.0)
                except Exception as e:  # noqa: BLE001
                    self.log.warning("final_flush_failed", error=repr(e))
                await self._release_lease()
            self.log.info("monitor_stopped")
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                try:
                    await t
                except BaseException:  # noqa: BLE001
                    pass
            try:
                await self.nc.close()
            except Exception:
                pass
            self._leader = False


# --------------------------------------------------------------------------- entry point


async def _amain(common: CommonConfig, cfg: MonitorConfig) -> int:
    stop = asyncio.Event()
    install_stop(stop)
    svc = MonitorService(common, cfg)
    try:
        await svc.run(stop)
    except Exception as e:  # noqa: BLE001
        get_logger(component="monitor").error("monitor_failed", error=repr(e))
        print(f"diloco monitor: {e!r}", file=sys.stderr)
        return 1
    return 0


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
        return 2
    setup(common.log_level, run=common.run, role="monitor", island=common.region)
    return asyncio.run(_amain(common, cfg))
