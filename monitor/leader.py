"""What the leading monitor does: hold the lease (:mod:`monitor.lease` decides), write changed
members to the KV bucket with compare-and-set, publish transitions as events, forget members
evicted long ago. A mixin of ``monitor.service.MonitorService``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from bus.codec import dumps_json
from monitor.lease import LEASE_KEY, Action, lease_decision, lease_value, may_write, parse_lease
from monitor.membership import Member, forgettable, member_to_dict, transition_to_dict
from monitor.store import adopt_members, event_msg_id, load_members, needs_write

_WRITE_PARALLEL = 64
_EVENT_BATCH = 256


class Leadership:
    """The lease, KV writes and event publishing of a ``MonitorService``."""

    if TYPE_CHECKING:  # the state is the MonitorService's (set in its __init__)
        def __getattr__(self, name: str) -> Any: ...
        members: dict[str, Member]
        _leader: bool
        _leader_until: float | None
        _lease_rev: int | None
        _revs: dict[str, int]
        _written: dict[str, tuple[Member, float]]
        _dirty: set[str]

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
        self.store_watch.stored()
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
        rev = self._lease_rev
        for attempt in range(3):
            try:
                await self._lease_kv.delete(LEASE_KEY, last=rev)
                self.log.info("lease_released")
                break
            except Exception as e:  # noqa: BLE001
                # the revision moved (a renew of ours whose reply never came, e.g. cancelled): delete
                # at the current one while the lease is still ours, never someone else's
                try:
                    entry = await self._lease_kv.get(LEASE_KEY)
                    current = parse_lease(entry.value, entry.revision)
                except KeyNotFoundError:
                    break
                except Exception:  # noqa: BLE001
                    current = None
                if current is None or current.holder != self.id or current.revision == rev or attempt == 2:
                    self.log.warning("lease_release_failed", error=repr(e))
                    break
                rev = current.revision
        self._leader = False
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
            if ok and not await self.store_watch.failed(e):  # a full store is said once (store_full)
                self.log.warning("member_write_failed", learner=name, error=repr(e), suppressed_since_last=suppressed)
            return
        self.stats["kv_writes"] += 1
        self.store_watch.stored()
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
                if ok and not await self.store_watch.failed(e):  # a full store is said once (store_full)
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
