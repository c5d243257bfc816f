"""Who takes part in the run, as the aggregator sees it (:class:`Membership`): the monitor's members
bucket, watched (and watched anew after a reconnect), or without a monitor the learners whose work
arrived and those whose final sync came. Read by the intake (validation, the admission hold) and
the merge stage (the quorum, the participation scale, the staleness rounds)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from aggregator.step import FragmentState, run_participants
from bus.subjects import Subjects


class Membership:
    """The learners of a run: active, left, known, recently heard from."""

    def __init__(self, cfg: Any, run: str, log: Any, states: dict[int, FragmentState]):
        self.cfg, self.run, self.s, self.log = cfg, run, Subjects(run), log
        self.states = states  # the merge stage's (which leavers have work merged here), read only
        self.members: dict[str, str] = {}  # learner -> membership state (the monitor's bucket)
        self.seen: set[str] = set()  # without a monitor: learners whose work arrived
        # without a monitor: learner -> incarnation whose final sync came (it sends nothing more, and
        # rounds stop waiting for it; what it sent is still merged, as a monitor's "left")
        self.finished: dict[str, str] = {}
        self.recent: dict[str, float] = {}  # learner -> monotonic time of its newest accepted contribution
        self.loaded = asyncio.Event()  # the members bucket's initial values arrived
        self.rewatch = asyncio.Event()  # the connection came back: watch the bucket anew

    def active(self) -> set[str]:
        if not self.cfg.require_membership:
            return set(self.seen) - set(self.finished)
        return {k for k, st in self.members.items() if st == "active"}

    def leavers(self) -> set[str]:
        """Learners that left (done, not failed): what they sent before leaving is still merged."""
        return {k for k, st in self.members.items() if st == "left"} if self.cfg.require_membership else set(self.finished)

    def participants(self, now: float) -> set[str]:
        """Learners taking part in the run for the participation scale and the staleness rounds
        (:func:`aggregator.step.run_participants`): the active ones, the leavers with work merged
        here, and those whose contributions arrived within DILOCO_PARTICIPATION_WINDOW seconds.
        Without a monitor the leavers are the final syncs this process has seen: a restart forgets
        them (the monitor's members bucket keeps its ``left``).

        The active set alone swings with membership: a server restart or a short cut gets learners
        evicted for a moment, and a merge in that moment would scale its one learner's outer
        gradient as if it were the whole run (the chaos run's divergence; docs/RELIABILITY.md)."""
        leavers = self.leavers()  # (a few; checked per contribution and per merge)
        merged = {x for x in leavers if any(st.applied.holds(x) for st in self.states.values())}
        return run_participants(self.active(), leavers, self.recent, now, self.cfg.participation_window, merged)

    def known(self) -> set[str]:
        return set(self.seen) if not self.cfg.require_membership else set(self.members)

    def state(self, learner: str) -> str | None:
        """The monitor's state of ``learner`` (None: not in the bucket)."""
        return self.members.get(learner)

    def saw(self, learner: str, incarnation: str, final: bool) -> None:
        """Without a monitor: a contribution of this run arrived from ``learner`` (``final``: its
        final sync, after which no round waits for it)."""
        if self.cfg.require_membership:
            return
        self.seen.add(learner)
        if final:
            self.finished[learner] = incarnation
        elif self.finished.get(learner, incarnation) != incarnation and not any(
                incarnation in st.applied.incarnations(learner) for st in self.states.values()):
            del self.finished[learner]  # a new process of that learner id (not an earlier one's late work)

    def heard(self, learner: str, now: float) -> None:
        """A contribution of ``learner`` was accepted at ``now`` (monotonic)."""
        self.recent[learner] = now

    async def reconnected(self) -> None:
        """The connection came back: the watch is made anew (the old one may be silent for seconds)."""
        self.rewatch.set()

    async def follow(self, js: Any, stop: asyncio.Event) -> None:
        """The members bucket, watched; watched anew whenever the connection comes back. A watch
        that outlives a server restart went on silently for 5-14 s (nats-py's ordered consumer
        notices its lost consumer only after two missed heartbeats): learners the monitor had
        readmitted meanwhile still counted as evicted here, and their work was rejected as
        ``inactive_learner`` (bench.soak: 571 contributions in one 6-minute run)."""
        while not stop.is_set():
            reader = w = None
            try:
                self.rewatch.clear()  # before the watch: a reconnect during its set-up counts
                kv = await js.key_value(self.s.bucket("members"))
                w = await kv.watchall()
                reader = asyncio.create_task(self._read(w, stop))
                rewatch = asyncio.create_task(self.rewatch.wait())
                try:
                    await asyncio.wait({reader, rewatch}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    rewatch.cancel()
                if reader.done():
                    reader.result()  # what ended the watch (raises its error)
                    continue
                self.log.info("membership_rewatch", members=len(self.members))
                reader.cancel()
                try:
                    await w.stop()
                except Exception:  # noqa: BLE001 - the old consumer may be gone with the old server
                    pass
            except asyncio.CancelledError:
                if reader is not None:
                    reader.cancel()
                raise
            except Exception as e:
                self.log.warning("membership_watch_error", error=repr(e))
                if w is not None:
                    try:
                        await w.stop()
                    except Exception:  # noqa: BLE001
                        pass
                await asyncio.sleep(1.0)

    async def _read(self, w: Any, stop: asyncio.Event) -> None:
        fresh: dict[str, str] | None = {}  # the initial values, until they are all in
        async for e in w:
            if stop.is_set():
                break
            if e is None:  # the initial values are all in: they replace what was known
                if fresh is not None:
                    self.members.clear()
                    self.members.update(fresh)
                    fresh = None
                self.loaded.set()
                continue
            into = self.members if fresh is None else fresh
            if e.operation in ("DEL", "PURGE") or e.value is None:
                into.pop(e.key, None)
                continue
            try:
                into[e.key] = str(orjson.loads(e.value).get("state", ""))
            except Exception:
                self.log.warning("bad_member_record", key=e.key)
