"""The learner's presence in the run: membership followed, heartbeats and metrics published.

A mixin of ``learner.service.Learner``: the watch on this learner's membership key (a resync when
evicted), DILOCO_START_WITH (wait for peers), DILOCO_DYNAMIC_H (the period from every active
learner's tokens/s); heartbeats (the last one says ``leaving``) and the metrics message.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import TYPE_CHECKING, Any

import orjson

from bus import codec
from bus.members import State
from bus.signals import cancel_all
from learner import loop as lp
from learner.fate import reject_hint
from learner.startup import HEAD_POLL_INTERVAL, peak_rss_mib


#: rounds per fragment sent, and seconds, without one of them merged before ``work_not_merged``
UNMERGED_ROUNDS, UNMERGED_SECONDS = 4, 60.0
#: membership states the leaving heartbeat moves to ``left``; a finishing learner waits at most
#: LEAVE_BEATS heartbeat intervals for its monitor to record it left (resending the leaving heartbeat)
STAYING = tuple(s.value for s in (State.JOINING, State.ACTIVE, State.SUSPECT, State.REJOINING))
LEAVE_BEATS = 5


class Presence:
    """Membership, heartbeats and metrics of a ``Learner``."""

    if TYPE_CHECKING:  # the state is the Learner's (set in its __init__)
        def __getattr__(self, name: str) -> Any: ...
        member_state: str | None
        admitted: bool
        blocked_s: float
        held_s: float
        _resync_requested: bool

    # -- membership ---------------------------------------------------------------------------------

    def _on_member(self, value: bytes | None) -> None:
        from bus.members import member_from_dict

        if not value:
            return
        try:
            rec = member_from_dict(orjson.loads(value))
        except Exception as e:
            self.log.warning("bad_member_record", error=repr(e))
            return
        self.member_state = rec.state.value
        # admitted: this process (not an earlier one of its id) is active; the aggregator merges its work
        self.admitted = rec.state.value == "active" and rec.incarnation == self.incarnation
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
        first round, instead of whoever the monitor admitted first merging alone. A resumed learner
        (issue 38) does not wait: it rejoins a run under way, whose other learners may have finished."""
        n = self.cfg.start_with
        if n <= 1:
            return
        if self.book.start_step > 0:  # a resumed learner rejoins a run under way: its peers may be done
            self.log.info("peers_not_awaited", start_with=n, start_step=self.book.start_step)
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

    async def _follow_paces(self) -> None:
        """DILOCO_DYNAMIC_H: follow the active learners' paces in the members bucket (the monitor
        writes each heartbeat's there, every DILOCO_KV_REFRESH at least) and set the period."""
        peers: dict[str, tuple[float, bool]] = {}

        async def on_entry(kv, e) -> None:
            if e is not None and e.key != self.id:
                try:
                    rec = orjson.loads(e.value) if e.value and e.operation not in ("DEL", "PURGE") else {}
                    speed = lp.peer_speed(rec) if isinstance(rec, dict) else (0.0, False)
                except ValueError:
                    speed = (0.0, False)
                if speed[0] > 0:
                    peers[e.key] = speed
                else:
                    peers.pop(e.key, None)
            self._update_period(peers)

        await self._watch_members(None, on_entry, "paces_watch_error", 1.0)

    def _update_period(self, peers: dict[str, tuple[float, bool]]) -> None:
        now = time.monotonic()
        # like with like: where the monitor is of an older version (records without a pace), rates
        paces = all(is_pace for _, is_pace in peers.values())
        mine = self.pace.pace(now) if paces else self.rate.rate(now)
        speeds = [v for v, _ in peers.values()]
        h = lp.dynamic_period(self.cfg.sync_every, mine, speeds, current=self.book.period)
        if self.book.set_period(h):
            # a real period follows the paces closely (1%): said at info when it moved 10% from
            # the one said last, at debug otherwise
            said = self._period_said
            big = abs(h - said) > 0.1 * said
            if big:
                self._period_said = h
            (self.log.info if big else self.log.debug)(
                "period_changed", period=round(h, 3), H=self.cfg.sync_every, speed=round(mine, 1),
                fastest=round(max(speeds, default=mine), 1), compared="pace" if paces else "rate")

    # -- what became of our work (learner.fate) ----------------------------------------------------

    async def _follow_feedback(self) -> None:
        """Subscribe to our feedback subject: the aggregator's notices of our work rejected or held."""
        try:
            await self.nc.subscribe(self.s.feedback(self.id), cb=self._on_feedback)
        except Exception as e:  # an older server or permissions without it: merges are still counted
            self.log.warning("feedback_unavailable", error=repr(e))

    async def _on_feedback(self, msg) -> None:
        try:
            m = orjson.loads(msg.data)
            if not isinstance(m, dict) or m.get("incarnation") not in (self.incarnation, ""):
                return
            rejected = m.get("rejected") or {}
            rounds = m.get("rounds") or {}
            for reason, n in rejected.items():
                named = [(int(p), int(r)) for p, r in (rounds.get(reason) or [])][:1024]
                for fp, fr in named:  # a rejected round is resolved: the sync window opens
                    self.book.on_rejected(fp, fr)
                if self.fate.on_rejected(str(reason)[:64], named, int(n)):
                    self.log.warning("work_rejected", reason=reason, count=int(n), hint=reject_hint(str(reason)))
            held = int(m.get("held") or 0)
            if held:
                if not self.fate.held:
                    self.log.info("work_held", count=held, member_state=self.member_state,
                                  hint="the aggregator holds it until the monitor admits this learner")
                self.fate.on_held(held)
        except (ValueError, TypeError, AttributeError) as e:
            self.log.debug("bad_feedback", error=repr(e))

    def _advise(self) -> None:
        for a in self.fate.advice(time.monotonic(), admitted=self.member_state in ("active", "left"),
                                  member_state=self.member_state, num_fragments=self.P,
                                  admit_after=self.cfg.warn_unadmitted_after, unmerged_rounds=UNMERGED_ROUNDS,
                                  unmerged_seconds=UNMERGED_SECONDS):
            self.log.warning(a.event, message=a.message, **a.fields)

    async def _advise_loop(self) -> None:
        while not self._halt.is_set():
            self._advise()
            await self._sleep(1.0)

    async def _await_fate(self) -> None:
        """Done: wait (at most ``final_wait`` s) until every round sent is merged or rejected, then
        say what became of the work: info when all of it was merged, a warning otherwise."""
        t0 = t_beat = time.monotonic()
        # a monitor that records us (membership seen) is also given a few heartbeats to mark us left,
        # so the stats and the summary say so (it was still "active" when the merges came back first)
        leave_by = t0 + LEAVE_BEATS * self.cfg.heartbeat_interval
        while ((self.fate.outstanding or (self.member_state in STAYING and time.monotonic() < leave_by))
               and time.monotonic() - t0 < self.final_wait and not self._halt.is_set()):
            if time.monotonic() - t_beat >= self.cfg.heartbeat_interval:
                # the leaving heartbeat again: a monitor that never heard of us (it started after our
                # last step) records us as left, and the aggregator merges what it held of ours
                t_beat = time.monotonic()
                await self._send_leaving()
            await self._sleep(0.1)
        st = self.fate
        level = self.log.info if st.merged == st.sent else self.log.warning
        level("work_summary", summary=st.summary(), waited_s=round(time.monotonic() - t0, 3),
              member_state=self.member_state, **st.stats())

    # -- liveness and metrics -----------------------------------------------------------------------

    def heartbeat(self) -> dict:
        from bus.heartbeat import Heartbeat, HeartbeatLimits, heartbeat_to_dict

        hb = Heartbeat(learner=self.id, region=self.common.region, incarnation=self.incarnation,
                       step=self.book.step, tokens_per_s=self.rate.rate(time.monotonic()),
                       versions=self.book.versions(), sent_at=time.time(),
                       pace=min(self.pace.pace(time.monotonic()), HeartbeatLimits.max_tokens_per_s))
        return heartbeat_to_dict(hb)

    async def _leave(self, beats: asyncio.Task) -> None:
        """Done (the step budget, an island closed, a stop), with every publish settled: the last
        heartbeat says ``leaving``, so the monitor marks us ``left`` rather than evicting us for the
        silence, and the aggregator still merges what we sent (tests/test_system_membership.py)."""
        await cancel_all([beats])
        if await self._send_leaving():
            self.log.info("left", step=self.book.step)

    async def _send_leaving(self) -> bool:
        hb = self.heartbeat()
        hb["leaving"] = True
        try:
            await self.nc.publish(self.s.heartbeat(self.id), orjson.dumps(hb))
            await self.nc.flush(timeout=5)
            return True
        except Exception as e:  # the monitor then evicts us for the silence, as before
            self.log.warning("leave_failed", error=repr(e))
            return False

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
            "tokens_per_s": self.rate.rate(time.monotonic()), "pace": self.pace.pace(time.monotonic()),
            "bytes_sent": self.publisher.bytes_sent if self.publisher else 0,
            "bytes_received": self.store.bytes_received if self.store else 0,
            "staleness": self.book.staleness(), "blocked_s": round(self.blocked_s, 6),
            "quant_error": self.quant_error, "contributions": self.book.contributions,
            "steps_sent": self.book.steps_sent, "period": round(self.book.period, 3),
            "phase_shifted": round(self.book.phase_shifted, 3),
            "skipped_syncs": c["skipped"], "deferred_syncs": c["deferred"], "window_valve": c["valve"], "holds": c["holds"], "held_s": round(self.held_s, 3), "failed_syncs": c["failed"], "sync_timeouts": self.sync_timeouts,
            "resyncs": self.book.resyncs, "step_seconds_total": round(self.book.step_seconds_total, 6),
            "step_cv": round(self.book.step_spread()[1], 4),
            "start_step": self.book.start_step, "sent_step": self.book.sent_step, "restarts": self.resume.restarts,
            "progress_writes": self.progress.writes if self.progress else 0,
            "fetch_failures": self.fetch_retries.failures,
            "rejected_globals": {**self.rejected_globals,
                                 **({"bad_head": self.store.bad_heads} if self.store and self.store.bad_heads else {})},
            "versions": {str(p): v for p, v in self.book.versions().items()},
            "work": self.fate.stats(), **self.store_watch.metrics(),
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
