"""Pure bookkeeping of a learner: what is due, what to send, what to mix in, what to report.

No NATS, no asyncio, no JAX and no clock reads: the service (``learner.service``) calls these
functions and methods with the times and values it observed, so every decision here is a plain
function of its arguments and unit-tested without a server (``tests/test_learner_loop.py``).

* :class:`Bookkeeper` tracks, per fragment, the global version the learner last took (its
  *base*), the counters since the fragment's last sync (inner steps, tokens), the next round
  number and whether a publish of it is still in flight. A fragment whose previous outer
  gradient is still being published when it is due again is *skipped*: its counters keep
  running, and because ``Delta = base - theta`` is measured against the base (not the last
  send), the next send carries that work anyway. This bounds the in-flight buffers to at most
  one per fragment.
* Global versions: :meth:`Bookkeeper.wants` says whether a head is worth downloading (newer than
  the base and than what is already queued); :meth:`Bookkeeper.on_merged` records the merge.
* Synchronous mode: :func:`applied_rounds` reads the aggregator's ``applied`` list in a head's
  metadata; :meth:`Bookkeeper.sync_satisfied` says when the learner may go on.
* Rejoin: :func:`should_resync` decides from the learner's membership record.
* Synthetic compute: :func:`synthetic_step` is a deterministic pseudo-gradient step on numpy
  fragments (noisy descent on ``0.5 * mean(theta^2)``), cheap enough for 16 learners on 2 cores.
* Helpers: data shard and seed derivation, fragment-to-tensor assembly, throughput, the memory
  formula.
"""

from __future__ import annotations

import math
import re
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from bus.fragments import FragmentPlan, sync_offsets

# -- identity, data shard and seeds ---------------------------------------------------------------

_TRAILING_NUMBER = re.compile(r"(\d+)$")


def derive_shard(learner_id: str, num_shards: int, configured: int = -1) -> int:
    """Data shard of ``learner_id`` among ``num_shards``.

    ``configured >= 0`` wins (taken modulo ``num_shards``). Otherwise the id's trailing number
    (``learner-3`` -> 3, ``eu-12`` -> 12) modulo ``num_shards``, or crc32 of the id when it has
    none. Learners numbered 0..M-1 with ``num_shards = M`` thus get disjoint shards.
    """
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    if configured >= 0:
        return configured % num_shards
    m = _TRAILING_NUMBER.search(learner_id)
    if m:
        return int(m.group(1)) % num_shards
    return zlib.crc32(learner_id.encode()) % num_shards


def batch_seed(data_seed: int, learner_id: str, incarnation: str = "") -> int:
    """Seed of a learner's batch sampler: differs per learner (and per process start when an
    ``incarnation`` is mixed in). 31-bit non-negative."""
    h = zlib.crc32(f"{int(data_seed)}/{learner_id}/{incarnation}".encode())
    return (int(data_seed) * 1_000_003 + h) % (2**31 - 1)


def sampler_seed(data_seed: int, learner_id: str, incarnation: str, resume: bool) -> int:
    """The seed ``diloco learner`` samples its batches with (``TokenShard.batch_at``, by step).

    Resuming (DILOCO_RESUME, the default): the learner id's alone, so a process restarted at step S
    draws the batches of steps S, S+1, ... that the one before it would have drawn, and never those
    it trained on. Not resuming, the incarnation is mixed in: a restart starts its steps at 0
    again, and must not replay the batches of its previous life."""
    return batch_seed(data_seed, learner_id, "" if resume else incarnation)


# -- per-fragment counters and versions -----------------------------------------------------------

#: a deferred sync goes out anyway after this many periods without the merge it waits for (a head
#: lost to a reconnect must not silence a learner; no work is lost meanwhile: it stays in theta)
VALVE_PERIODS = 16


@dataclass
class FragmentBook:
    """Bookkeeping of one fragment."""

    base_version: int = -1  # global version last taken (-1: none yet)
    next_round: int = 0  # round number of the next contribution
    steps: int = 0  # inner steps since the last sync
    tokens: int = 0  # tokens since the last sync
    seconds: float = 0.0  # seconds of those inner steps (the learner's pace, holds excluded)
    inflight: bool = False  # a publish of this fragment is running
    pending_version: int = -1  # newest downloaded version not yet mixed in (-1: none)
    known_version: int = -1  # newest global version seen (head), downloaded or not
    last_contrib_base: int | None = None  # base version of the last contribution sent
    armed: bool = False  # fetch policy "round": one download is due since the last sync
    merged_round: int = -1  # highest round of ours a global head listed as merged
    merged_version: int = -1  # the version whose merge held it
    rejected_round: int = -1  # highest round of ours the aggregator said it rejected
    deferred_at: int = -1  # the step a due sync was deferred at (sync window closed; -1: none deferred)
    deferred: int = 0  # syncs deferred so far
    hold_off: bool = False  # a hold for the deferred sync timed out: no more holds until it goes out
    sent: int = 0
    skipped: int = 0
    failed: int = 0


@dataclass(frozen=True)
class Contribution:
    """What to send for one fragment: the metadata counters of ``grad_meta``."""

    fragment: int
    round: int
    base_version: int
    steps: int
    tokens: int
    period: int = 0  # the learner's sync period H when it was due (0: unknown): steps / period is
    # the share of a round of work the contribution holds (the outer optimizer ``rounds``)
    seconds: float = 0.0  # the seconds of its inner steps (step_s = seconds / steps: the pace)

    @property
    def step_s(self) -> float:
        """Mean seconds per inner step of this contribution (0 when it holds none)."""
        return self.seconds / self.steps if self.steps > 0 else 0.0


def _due_after(first: float, H: float, step: int) -> float:
    """The first of ``first, first + H, first + 2H, ...`` that is after ``step`` (each a real number
    of steps with Dynamic Local Updates: a sync falls due at the first step not before it)."""
    return first if step < first else first + ((step - first) // H + 1) * H


class Bookkeeper:
    """Counters, rounds, versions and the sync schedule of one learner (see module docstring)."""

    def __init__(self, num_fragments: int, H: int, tokens_per_step: int, staggered: bool = True, window: int = 0,
                 start_step: int = 0, hold: int = 0):
        """``start_step``: steps of this learner id the run holds already (a restarted learner resumes
        there, ``bus.progress``): the step counter, tokens and sync schedule continue from it."""
        if tokens_per_step < 0:
            raise ValueError(f"tokens_per_step must be >= 0, got {tokens_per_step}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        self.start_step = int(start_step)
        self.H = int(H)
        # staggered (Streaming DiLoCo): offset_p = floor(p H / P). Not staggered (synchronous
        # DiLoCo): every fragment every H steps. Synchronous learners must not stagger: two learners
        # out of phase would each wait for a merge that needs the other's *different* fragment.
        self.offsets = sync_offsets(num_fragments, self.H) if staggered else (0,) * num_fragments
        # the schedule as the next step each fragment is due (first: offset_p, or H for offset 0),
        # so the period can change while running (Dynamic Local Updates, :meth:`set_period`): then a
        # real number of steps, each due at the first step not before it, so that rounds of
        # floor(T) and ceil(T) steps average T
        self.period: float = float(self.H)
        self._anchor = 0.0  # the step the staggered schedule's cycles count from (moved by set_period)
        # (resumed: the first due step after start_step in the same phase, as if it never stopped)
        self._next_due: list[float] = [
            _due_after(off if off >= 1 else self.H, self.H, self.start_step) for off in self.offsets]
        self.tokens_per_step = int(tokens_per_step)
        # the sync window (issue 37): at most ``window`` rounds of a fragment sent and not yet merged
        # into this learner's base; a sync due while more are out is deferred (0: never)
        self.window = max(0, int(window))
        self.valve_opened = 0
        # the hold: a deferred sync that waited ``hold`` periods holds the learner's steps until its
        # round is merged (``holding``; 0: never hold)
        self.hold = int(hold)
        self.holds = 0  # holds begun (counted by the core's ``_hold``)
        self.holds_expired = 0  # holds that waited DILOCO_SYNC_TIMEOUT in vain (``give_up_hold``)
        self.deferrals = 0  # syncs deferred so far, all fragments  # deferrals ended by the valve (no merge seen for VALVE_PERIODS periods)
        self.frags = [FragmentBook() for _ in range(num_fragments)]
        self.step = self.start_step  # inner steps of this learner id (this process's and those resumed)
        self.tokens = self.start_step * self.tokens_per_step  # tokens of those steps
        self.sent_step = self.start_step  # the step of the newest outer gradient published (its work is the run's)
        self._sync_steps: dict[tuple[int, int], int] = {}  # (fragment, round) in flight -> step it was taken at
        self.step_seconds_total = 0.0  # seconds spent in inner steps (slowdown included)
        # this process's steps' seconds, their mean and sum of squared deviations (Welford's, for
        # ``step_spread``)
        self.steps_timed, self._step_mean, self._step_m2 = 0, 0.0, 0.0
        self.contributions = 0  # outer gradients published successfully
        self.steps_sent = 0  # inner steps carried by those contributions
        self.resyncs = 0
        self.last_contribution: int | None = None  # fragment of the newest contribution
        self.phase_shifted = 0.0  # steps the phase lock moved the schedule, in all (later: positive)

    @property
    def num_fragments(self) -> int:
        return len(self.frags)

    # steps and syncs
    def on_step(self, seconds: float = 0.0) -> list[int]:
        """Count one finished inner step; returns the fragments due now."""
        self.step += 1
        self.tokens += self.tokens_per_step
        seconds = max(0.0, float(seconds))
        self.step_seconds_total += seconds
        self.steps_timed += 1
        d = seconds - self._step_mean
        self._step_mean += d / self.steps_timed
        self._step_m2 += d * (seconds - self._step_mean)
        for f in self.frags:
            f.steps += 1
            f.tokens += self.tokens_per_step
            f.seconds += seconds
        due = []
        for p, n in enumerate(self._next_due):
            f = self.frags[p]
            if n > self.step and f.deferred_at < 0:
                continue
            if self.window_open(p):  # on schedule, or a deferred sync whose window opened
                if f.deferred_at >= 0 and not self._merged_in(p):
                    self.valve_opened += 1
                # on schedule (due at this step): a period from its due point (a real number of
                # steps keeps its fraction, so rounds average the period); deferred, or due long
                # ago (a resync ended its deferral): a whole period from this sync, not a sync at
                # every step until the schedule catches up
                on_time = f.deferred_at < 0 and self.step - n < 1
                self._next_due[p] = (n if on_time else self.step) + self.period
                f.deferred_at = -1
                f.hold_off = False
                due.append(p)
            elif f.deferred_at < 0:  # due, but the previous round is still out: defer
                f.deferred_at = self.step
                f.deferred += 1
                self.deferrals += 1
                f.armed = True  # download the version that merges the round out (fetch_due)
        return due

    def _merged_in(self, p: int) -> bool:
        """Every round of p sent but the newest ``window - 1`` is resolved: merged into a version
        this learner has taken as its base, or rejected."""
        f = self.frags[p]
        last = f.next_round - 1  # the newest round sent
        need = last - self.window + 1  # rounds up to this one must be resolved
        if need < 0:
            return True
        if f.rejected_round >= need:
            return True
        return f.merged_round >= need and f.base_version >= f.merged_version

    def window_open(self, p: int) -> bool:
        """May fragment p sync now? Always without a window (0) and while nothing of p is out;
        else once its rounds but the newest ``window - 1`` are merged into the base (the learner's
        next outer gradient is then computed from a version that holds its own earlier work, so
        its staleness stays bounded however slow the aggregator is), or rejected. A learner whose
        merges are never seen (a lost head) syncs anyway after VALVE_PERIODS periods."""
        if self.window <= 0:
            return True
        f = self.frags[p]
        if f.deferred_at >= 0 and self.step - f.deferred_at >= VALVE_PERIODS * self.period:
            return True
        return self._merged_in(p)

    def holding(self) -> list[int]:
        """Fragments whose deferred sync has waited ``hold`` periods for the merge of the learner's
        previous round (and no hold for it timed out): the learner holds its next inner step until
        that round is merged into its base (or rejected). Without the hold, a learner whose steps are
        far shorter than the aggregator's round trip trains on alone for many periods and its outer
        gradients hold hundreds of steps each: two islands of a 1-2 ms model ended 3-6x worse than
        one alone (docs/BENCHMARKS.md). A lagging aggregator then costs speed, not the model."""
        if self.window <= 0 or self.hold <= 0:
            return []
        return [p for p, f in enumerate(self.frags)
                if f.deferred_at >= 0 and not f.hold_off and self.step - f.deferred_at >= self.hold * self.period
                and not self._merged_in(p)]

    def hold_state(self, p: int) -> dict[str, int]:
        """What a hold of p waits on (logged when it expires): the rounds sent and resolved, and
        the versions seen, downloaded and based on."""
        f = self.frags[p]
        return {"step": self.step, "deferred_at": f.deferred_at, "next_round": f.next_round,
                "merged_round": f.merged_round, "merged_version": f.merged_version,
                "rejected_round": f.rejected_round, "base_version": f.base_version,
                "pending_version": f.pending_version, "known_version": f.known_version, "armed": int(f.armed)}

    def give_up_hold(self, p: int) -> None:
        """A hold for p timed out (the aggregator is down, say): train on until its deferred sync
        goes out (the valve, or the merge), holding no more for it meanwhile."""
        if not self.frags[p].hold_off:
            self.holds_expired += 1
        self.frags[p].hold_off = True

    def merged_any(self) -> bool:
        """A global head listed a round of this process as merged (its work reaches the model)."""
        return any(f.merged_round >= 0 for f in self.frags)

    def deferred(self) -> list[int]:
        """Fragments whose due sync waits for its window."""
        return [p for p, f in enumerate(self.frags) if f.deferred_at >= 0]

    def on_rejected(self, p: int, round_: int) -> None:
        """The aggregator rejected our round ``round_`` of p: it is resolved (the window opens)."""
        if 0 <= p < len(self.frags):
            f = self.frags[p]
            f.rejected_round = max(f.rejected_round, int(round_))

    def set_period(self, period: float) -> bool:
        """Sync every ``period`` inner steps from now on (Dynamic Local Updates); True if it changed.

        ``period`` is a real number: each fragment's syncs fall ``period`` apart, each at the first
        step not before it, so its rounds last floor and ceil of it and average it. (Rounded down
        to whole steps, the rounds of learners whose speeds are not in whole-step ratios lasted
        unequal times, 10.9 to 12 step times at M=8 with the speed spread, and their rounds drifted
        out of phase: docs/BENCHMARKS.md, nineteenth round.)

        The schedule keeps its phase: the share of the current cycle gone by is the same in the new
        period, and each fragment is due at its staggered offset p x period / P in it, so its next
        sync comes about ``left x new / old`` steps from now and the fragments stay evenly spread
        over the period, on distinct steps while the period is at least their number. (Scaling each
        fragment's steps left on its own and rounding them, as once, put two onto the same step now
        and then, and they stayed together: a few dozen changes put 8 fragments on 3 steps.)"""
        period = max(1.0, float(period))
        if not math.isfinite(period) or abs(period - self.period) <= 1e-9:
            return False
        phase = ((self.step - self._anchor) % self.period) / self.period
        self._anchor = self.step - phase * period
        P = self.num_fragments
        offsets = [p * period / P for p in range(P)] if any(self.offsets) else [0.0] * P
        due = [_due_after(self._anchor + off, period, self.step) for off in offsets]
        # a fragment whose last sync was off the phase (deferred for its window, then sent) comes
        # back to it, but not sooner than about half a period after that sync: an outer gradient of
        # a step or two is a whole upload for next to no work. (Less a step: a sync on the phase is
        # up to a step after its real due point, and must stay where it is at short periods.)
        self._next_due = [d + period if f.next_round > 0 and d - (self.step - f.steps) < period / 2 - 1 else d
                          for d, f in zip(due, self.frags)]
        self.period = period
        return True

    def shift_phase(self, steps: float) -> None:
        """Move this learner's syncs ``steps`` later (earlier when negative): every fragment's next
        sync, and the anchor :meth:`set_period` keeps the phase from (the phase lock,
        :func:`phase_shift`). A fragment moved to a step already gone by syncs at the next one."""
        steps = float(steps)
        if not math.isfinite(steps) or steps == 0.0:
            return
        self._anchor += steps
        self._next_due = [n + steps for n in self._next_due]
        self.phase_shifted += steps

    @property
    def declared_period(self) -> int:
        """The period a contribution declares (whole steps: floor of a real period, so a round of
        floor or ceil of it holds a whole round of work)."""
        return max(1, int(self.period + 1e-9))

    def begin_sync(self, p: int) -> Contribution | None:
        """Take fragment p's counters for a contribution, or None to skip (publish in flight).

        On success the counters restart from zero, the round advances and p is marked in flight.
        """
        f = self.frags[p]
        if f.inflight:
            f.skipped += 1
            return None
        c = Contribution(p, f.next_round, f.base_version, f.steps, f.tokens, self.declared_period, f.seconds)
        self._sync_steps[(p, c.round)] = self.step
        f.next_round += 1
        f.steps = f.tokens = 0
        f.seconds = 0.0
        f.inflight = True
        f.armed = True
        return c

    def unsent_fragments(self) -> list[int]:
        """Fragments holding inner steps not yet sent (for the final sync when the run ends)."""
        return [p for p, f in enumerate(self.frags) if f.steps > 0]

    def end_sync(self, c: Contribution, ok: bool) -> None:
        """A publish finished. A failed one gives its counters back (the work is still in theta)."""
        f = self.frags[c.fragment]
        f.inflight = False
        at = self._sync_steps.pop((c.fragment, c.round), None)
        if ok:
            if at is not None:
                self.sent_step = max(self.sent_step, at)
            f.sent += 1
            f.last_contrib_base = c.base_version
            self.contributions += 1
            self.steps_sent += c.steps
            self.last_contribution = c.fragment
        else:
            f.failed += 1
            f.steps += c.steps
            f.tokens += c.tokens
            f.seconds += c.seconds

    def inflight(self) -> list[int]:
        return [p for p, f in enumerate(self.frags) if f.inflight]

    # global versions
    def on_head(self, p: int, version: int) -> None:
        f = self.frags[p]
        f.known_version = max(f.known_version, int(version))

    def wants(self, p: int, version: int) -> bool:
        """Download version ``version`` of p? Only if newer than the base and anything queued."""
        f = self.frags[p]
        return version > f.base_version and version > f.pending_version

    def fetch_due(self, p: int, version: int, delay: int, merging: bool = True) -> bool:
        """Fetch policy ``round``: download version ``version`` of p now?

        At most one download per fragment per round of this learner: ``delay`` inner steps after a
        sync of p (armed), the newest version there is, once it holds this learner's own round
        just sent (a head listed it: :meth:`on_applied`): that wait, not the delay, lets the other
        learners' outer gradients of the round be merged first (the delay, 1 by default since the
        fourteenth round, was H/4 and only added overlap); the local steps meanwhile are kept
        (rebase) and sent with the next outer gradient (Streaming DiLoCo's overlap tau). Waiting for the own
        round (issue 24): a learner ahead of the others by more than the delay took the version
        before its round's merge and so ran a whole round behind the merges; now it waits for
        that merge, until the step before its next sync, when it takes the newest version anyway
        (its round was rejected, or the merges lag by a round). A learner whose work is not
        ``merging`` (:func:`merges_reach`: not admitted yet, a restart rejoining; or, without a
        monitor, none of its rounds merged yet) takes the newest version of a deferred fragment the
        same way: its round is held by the aggregator until the monitor admits it, which needs
        current versions.
        """
        f = self.frags[p]
        # a merging learner's deferred fragment is always armed: its one download of the round may
        # have gone to the newest version while its work was not merging yet, and it must still
        # take the version that merged its round (a hold waited for it in vain, 120 s)
        waits = f.deferred_at >= 0 and merging
        if not ((f.armed or waits) and self.wants(p, version) and f.steps >= max(0, int(delay))):
            return False
        mine = f.next_round - 1  # the round sent at the last sync
        holds_mine = f.merged_round >= mine and version >= f.merged_version
        if waits:  # a deferred sync waits for exactly that version (window_open)
            return holds_mine
        # (the step before the next sync: of a period of whole steps, or of this round when a real
        # period makes it floor(period) steps long)
        return holds_mine or f.steps >= max(int(delay), self.period - 1) or (
            f.steps >= int(delay) and self.step + 1 >= math.ceil(self._next_due[p]))

    def on_applied(self, p: int, rounds: list[int], version: int) -> None:
        """A global head of p lists our ``rounds`` as merged into ``version``.

        A deferred fragment is armed again while a version known to merge its round is newer than
        its base and than what it downloaded: its sync waits for exactly that version
        (:meth:`window_open`), and its one download of the round may have gone to an earlier one (a
        learner whose work is not merging yet, :func:`merges_reach`, takes the newest version at the
        end of its period). Without this it waited for the valve, 16 periods (docs/BENCHMARKS.md, "Seventh
        round")."""
        f = self.frags[p]
        for r in rounds:
            if r > f.merged_round:
                f.merged_round, f.merged_version = int(r), int(version)
        if f.deferred_at >= 0 and f.merged_version > max(f.base_version, f.pending_version):
            f.armed = True

    def on_downloaded(self, p: int, version: int) -> None:
        f = self.frags[p]
        f.armed = False
        f.pending_version = max(f.pending_version, int(version))
        f.known_version = max(f.known_version, int(version))

    def on_merged(self, p: int, version: int) -> None:
        """Version ``version`` of p was mixed in and is the new base."""
        f = self.frags[p]
        f.base_version = int(version)
        if f.pending_version <= version:
            f.pending_version = -1
        f.known_version = max(f.known_version, int(version))

    def on_resync(self, versions: Mapping[int, int]) -> None:
        """Every fragment was overwritten by a fresh global version: work since the syncs is gone."""
        self.resyncs += 1
        for p, v in versions.items():
            f = self.frags[p]
            f.base_version = int(v)
            f.known_version = max(f.known_version, int(v))
            if f.pending_version <= v:
                f.pending_version = -1
            f.steps = f.tokens = 0
            f.armed = False
            f.rejected_round = max(f.rejected_round, f.next_round - 1)  # the rounds out are dropped too
            f.deferred_at = -1
            f.hold_off = False

    def versions(self) -> dict[int, int]:
        """{fragment: base version} for heartbeats (fragments without a version are left out)."""
        return {p: f.base_version for p, f in enumerate(self.frags) if f.base_version >= 0}

    def staleness(self) -> int:
        """Known global version minus the base of the newest contribution, for its fragment (0 if none)."""
        p = self.last_contribution
        if p is None:
            return 0
        f = self.frags[p]
        if f.last_contrib_base is None:
            return 0
        return max(0, f.known_version - f.last_contrib_base)

    def step_spread(self) -> tuple[float, float]:
        """(mean, coefficient of variation) of this process's inner steps' seconds: how steady its
        pace was (the reference's exact steps are 0; ``RefConfig.step_jitter`` is this CV)."""
        n, mean = self.steps_timed, self._step_mean
        if n == 0 or mean <= 0:
            return mean, 0.0
        return mean, math.sqrt(max(0.0, self._step_m2 / n)) / mean

    def counters(self) -> dict[str, int]:
        return {
            "sent": sum(f.sent for f in self.frags),
            "skipped": sum(f.skipped for f in self.frags),
            "deferred": sum(f.deferred for f in self.frags),
            "valve": self.valve_opened,
            "holds": self.holds,
            "holds_expired": self.holds_expired,
            "failed": sum(f.failed for f in self.frags),
        }


# -- synchronous mode and rejoin ------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def applied_rounds(meta: Mapping, learner: str, incarnation: str, fragment: int) -> list[int]:
    """Rounds of ``(learner, incarnation)`` for ``fragment`` that a global head's metadata lists.

    The aggregator writes ``"applied"`` into the head of every version it publishes, one entry per
    contribution the merge used: ``[learner, incarnation, fragment, round]`` (as
    ``aggregator.contribution.ContributionKey``) or the short form ``[learner, incarnation, round]``
    (the head is per fragment). Anything malformed is ignored.
    """
    applied = meta.get("applied") if isinstance(meta, Mapping) else None
    if not isinstance(applied, (list, tuple)):
        return []
    out = []
    for a in applied:
        if not isinstance(a, (list, tuple)) or len(a) not in (3, 4) or a[0] != learner or a[1] != incarnation:
            continue
        if len(a) == 4 and not (_is_int(a[2]) and a[2] == fragment):
            continue
        if _is_int(a[-1]):
            out.append(a[-1])
    return out


def lead_of(meta: Mapping, learner: str, incarnation: str) -> float | None:
    """How many seconds before the merge's median arrival this learner's contribution came, as a
    global head's metadata states it (``"lead"``: ``aggregator.quorum.arrival_leads``); None when
    the head states none for it (a merge of one learner, an older aggregator, anything malformed)."""
    leads = meta.get("lead") if isinstance(meta, Mapping) else None
    if not isinstance(leads, (list, tuple)):
        return None
    for a in leads:
        if (isinstance(a, (list, tuple)) and len(a) == 3 and a[0] == learner and a[1] == incarnation
                and isinstance(a[2], (int, float)) and not isinstance(a[2], bool) and math.isfinite(a[2])):
            return float(a[2])
    return None


def phase_shift(lead_s: float, step_s: float, period: float, fragments: int, gain: float) -> float:
    """The phase lock: steps to move this learner's syncs (later: positive), from one merge's
    ``lead_of`` (pure). ``gain`` of the lead per round, a ``1 / fragments`` share of it per merge
    (each fragment's merge states it once a round); the lead is clamped to half a round either way
    (the aggregator states it the short way round a round where it knows the round:
    ``aggregator.quorum.arrival_leads``). 0 without a pace (``step_s``) or with ``gain`` 0."""
    if not (gain > 0 and step_s > 0 and period > 0 and fragments > 0 and math.isfinite(lead_s)
            and math.isfinite(step_s)):
        return 0.0
    half = period * step_s / 2
    lead = max(-half, min(half, lead_s))
    return gain * lead / step_s / fragments


def merged_upto(meta: Mapping, learner: str, incarnation: str) -> int | None:
    """The highest round of ``(learner, incarnation)`` a global head states as merged into its
    version or an earlier one (its ``"merged"`` list, ``[learner, incarnation, round]`` per learner:
    ``aggregator.validate.AppliedSet.newest_rounds``); None when it states none (or a head of an
    aggregator before the eighth round). A learner that missed the head listing its round (the watch
    skips a head older than a version already fetched, a re-created watch starts at the newest)
    learns it from any later head: before, its sync window stayed shut until the valve (16 periods)
    and it never held (one learner of two sent 32 outer gradients in 480 steps, the other 169)."""
    merged = meta.get("merged") if isinstance(meta, Mapping) else None
    if not isinstance(merged, (list, tuple)):
        return None
    for a in merged:
        if (isinstance(a, (list, tuple)) and len(a) == 3 and a[0] == learner and a[1] == incarnation
                and _is_int(a[2])):
            return int(a[2])
    return None


def sync_satisfied(applied_in: int | None, have_version: int) -> bool:
    """Synchronous mode: may the learner go on? ``applied_in`` is the version whose head listed
    our contribution (None: not seen yet); ``have_version`` the newest version of the fragment
    downloaded or merged. A newer version than the one that applied us includes it too."""
    return applied_in is not None and have_version >= applied_in


def merges_reach(admitted: bool, member_state: str | None, merged_any: bool) -> bool:
    """Does the aggregator merge this learner's work now, so that a hold for a merge will end and a
    deferred fragment may wait for exactly the version holding its round? When the monitor admitted
    this process; and in a run without a monitor (no membership record: the aggregator merges every
    learner, DILOCO_REQUIRE_MEMBERSHIP=false) once a head listed one of its rounds. Not for a learner
    the monitor has not admitted yet: its work is held at the aggregator until it is, and admission
    needs current versions, which a held learner would not take. Before the eighth round a run
    without a monitor never held: a lagging aggregator let its learners train on alone for up to
    16 periods (the guard test with a lagging aggregator, +22.0% in one suite run; docs/learner.md)."""
    return admitted or (member_state is None and merged_any)


def should_resync(state: str, record_incarnation: str, my_incarnation: str) -> bool:
    """Resynchronise when the monitor evicted *this* process (same incarnation) while it lives.

    A record of an earlier incarnation describes a previous life: this process started from
    fresh global versions anyway, and its first heartbeat makes the monitor readmit it.
    """
    return state == "evicted" and record_incarnation == my_incarnation


# -- synthetic compute ----------------------------------------------------------------------------

SYNTHETIC_NOISE = 0.02


def synthetic_directions(sizes: Sequence[int], seed: int) -> list[np.ndarray]:
    """One fixed unit-variance float32 direction per fragment (the noise bank of a learner)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(int(seed), spawn_key=(7,))))
    return [rng.standard_normal(int(n), dtype=np.float32) for n in sizes]


def synthetic_step(frags: Sequence[np.ndarray], directions: Sequence[np.ndarray], lr: float,
                   scales: Sequence[float], noise: float = SYNTHETIC_NOISE) -> float:
    """In place: theta_p -= lr * (theta_p + noise * scale_p * d_p) for every fragment p.

    A noisy gradient step on ``0.5 * mean(theta^2)`` with a fixed direction per fragment and a
    per-step scale (draw ``scales`` from the learner's seeded Generator: deterministic). Returns
    the pre-update loss ``0.5 * mean(theta^2)``. Costs two passes over the parameters.
    """
    sq = 0.0
    n = 0
    lr32 = np.float32(lr)
    for theta, d, s in zip(frags, directions, scales):
        sq += float(np.dot(theta, theta))
        n += theta.size
        # theta <- (1 - lr) theta - lr * noise * s * d
        theta *= np.float32(1.0) - lr32
        theta -= np.float32(lr * noise * s) * d
    return 0.5 * sq / max(n, 1)


# -- fragments <-> tensors -------------------------------------------------------------------------


def params_from_fragments(plan: FragmentPlan, vectors: Sequence[np.ndarray]) -> dict[str, np.ndarray]:
    """Fresh float32 tensors (keyed by the plan's paths) filled from every fragment vector."""
    if len(vectors) != plan.num_fragments:
        raise ValueError(f"{len(vectors)} vectors for {plan.num_fragments} fragments")
    params = {path: np.zeros(shape, dtype=np.float32) for path, shape in plan.shapes}
    for p, frag in enumerate(plan.fragments):
        write_fragment(plan, params, p, vectors[p])
    return params


def write_fragment(plan: FragmentPlan, params: Mapping[str, np.ndarray], p: int, vector: np.ndarray) -> None:
    """In place: fragment p of the (writable, contiguous numpy) ``params`` := ``vector``."""
    frag = plan.fragments[p]
    vector = np.asarray(vector, dtype=np.float32).reshape(-1)
    if vector.size != frag.size:
        raise ValueError(f"fragment {p} needs {frag.size} values, got {vector.size}")
    pos = 0
    for s in frag.slices:
        params[s.path].reshape(-1)[s.start : s.stop] = vector[pos : pos + s.size]
        pos += s.size


def fragment_paths(plan: FragmentPlan, p: int) -> list[str]:
    """The tensors fragment p touches, in plan order (no duplicates)."""
    return list(dict.fromkeys(s.path for s in plan.fragments[p].slices))


# -- timing and throughput ------------------------------------------------------------------------


def extra_sleep(measured: float, slowdown: float, min_step: float = 0.0) -> float:
    """Seconds to sleep after a step of ``measured`` seconds to emulate slower hardware: the step
    takes ``slowdown`` times what it measured (the machine's scheduling noise stretched with it),
    and at least ``min_step`` seconds (one steady pace: what a step shorter than it measured is
    waited out)."""
    m = max(0.0, float(measured))
    return max(0.0, max((float(slowdown) - 1.0) * m, float(min_step) - m))


@dataclass
class RateMeter:
    """Tokens per second over a sliding window of ``window`` seconds (times passed in)."""

    window: float = 10.0
    _events: deque = field(default_factory=deque)

    def add(self, t: float, tokens: int) -> None:
        self._events.append((float(t), int(tokens)))
        while len(self._events) > 2 and self._events[0][0] < t - self.window:
            self._events.popleft()

    def rate(self, now: float) -> float:
        ev = [e for e in self._events if e[0] >= now - self.window]
        if len(ev) < 2:
            return 0.0
        dt = ev[-1][0] - ev[0][0]
        if dt <= 0:
            return 0.0
        return sum(n for _, n in ev[1:]) / dt


@dataclass
class PaceMeter:
    """Tokens per second of the inner steps alone over a sliding window of ``window`` seconds:
    the tokens of the steps ended in it over the seconds those steps took (times passed in). Unlike
    :class:`RateMeter` it leaves out what happens between steps (holds for the aggregator, applying
    arrivals, preparing syncs): the hardware's pace, which Dynamic Local Updates compare. A learner
    held for a lagging aggregator keeps its pace; its rate falls with every hold, and periods set
    from rates fed that back (a shorter period, an earlier hold, a lower rate: 7-9 steps instead of
    10 for a learner 1.15x slower, docs/BENCHMARKS.md)."""

    window: float = 10.0
    skip: int = 1  # the first steps measured are left out: the first compiles the step function
    _events: deque = field(default_factory=deque)
    _since: float | None = None  # when the first step counted ended

    def add(self, t: float, tokens: int, seconds: float) -> None:
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        if self.skip > 0:
            self.skip -= 1
            return
        if self._since is None:
            self._since = float(t)
        self._events.append((float(t), int(tokens), float(seconds)))
        while len(self._events) > 1 and self._events[0][0] < t - self.window:
            self._events.popleft()

    def pace(self, now: float) -> float:
        """Over the steps ended in the window, once a whole window has passed since the first step
        counted (0 before: unknown; learners starting together share the machine with each other's
        compilations, and their first seconds' paces moved every period at M=4 on two cores); no
        step in the window (a hold longer than it), the newest step's: a held learner keeps its pace."""
        if self._since is None or now - self._since < self.window:
            return 0.0
        recent = [e for e in self._events if e[0] >= now - self.window] or list(self._events)[-1:]
        seconds = sum(dt for _, _, dt in recent)
        return sum(n for _, n, _ in recent) / seconds if seconds > 0 else 0.0


# -- memory ---------------------------------------------------------------------------------------


def memory_bytes(n_params: int, fragment_sizes: Sequence[int], *, error_feedback: bool, synthetic: bool = False,
                 inflight_fragments: int = 1, pending_fragments: int = 1, keyframe_params: int = 0,
                 residual_dtype: str = "float32", scratch: bool = True) -> dict[str, int]:
    """Expected resident bytes of a learner's training state (float32), by part.

    params + 2 AdamW moments (JAX mode; synthetic mode has a noise bank of one model instead)
    + one base copy + the error-feedback residual (if on; 2 bytes a value in bfloat16, with a
    float32 scratch of the largest fragment its syncs fold into where the backend folds its
    parameters, ``scratch``: not the synthetic one) + in-flight buffers: outgoing blobs
    (at most ``inflight_fragments`` of the largest fragment, counted at fp32 for a bound) and
    downloaded versions queued for mixing (``pending_fragments``) + the keyframes the global
    reader holds for a quantised downlink (``keyframe_params``, up to N).
    """
    b = 4
    big = max(fragment_sizes) if fragment_sizes else 0
    parts = {
        "params": n_params * b,
        "optimizer": (n_params * b) if synthetic else 2 * n_params * b,
        "base": n_params * b,
        "residual": (n_params * (2 if residual_dtype == "bfloat16" else b)
                     + (big * b if residual_dtype == "bfloat16" and scratch else 0)) if error_feedback else 0,
        "inflight": (inflight_fragments + pending_fragments) * big * b,
        "keyframes": keyframe_params * b,
    }
    parts["total"] = sum(parts.values())
    return parts


def retry_window(failing: dict[int, tuple[int, float]], fragment: int, version: int, now: float,
                 timeout: float) -> tuple[bool, bool]:
    """A download of ``version`` of ``fragment`` failed for the link or the server: (its first
    failure, to be said; still to be tried again: for ``timeout`` seconds from that first failure).
    ``failing`` (fragment -> (version, first failure)) is updated in place."""
    seen = failing.get(fragment)
    if seen is None or seen[0] != version:
        failing[fragment] = (version, now)
        return True, True
    return False, now - seen[1] < timeout


#: Dynamic Local Updates shorten a period to H / 4 at the most: a learner more than 4x slower than
#: the fastest syncs every ceil(H / 4) steps, and a learner that claims a pace it does not have can
#: at most quadruple the run's syncs (docs/security.md)
MAX_PERIOD_CUT = 4


#: a period within this share of the one in use is kept (pace noise does not move the schedule at
#: every update); small, because a period off by it makes the learner's rounds that much longer or
#: shorter than the others', and the rounds drift apart by a whole one every 1 / PERIOD_HYSTERESIS
PERIOD_HYSTERESIS = 0.01


def dynamic_period(H: int, mine: float, others: Sequence[float], current: float | None = None,
                   hysteresis: float = PERIOD_HYSTERESIS) -> float:
    """Dynamic Local Updates (Liu et al., Async Local-SGD): ``H_w = v_w / v_max * H`` steps.

    ``mine`` is this learner's pace and ``others`` the active learners' (tokens per second of their
    inner steps, from their heartbeats, so equal tokens per step are assumed: then a slow learner's
    round lasts as long as the fastest's). A real number (:meth:`Bookkeeper.set_period`: rounds of
    floor and ceil of it average it; Liu et al. round down, and at M=8 with the speed spread the
    rounds then drifted out of phase: docs/BENCHMARKS.md, nineteenth round). At least
    ceil(H / MAX_PERIOD_CUT), at most H; H while this learner's pace is unknown (0). ``current``:
    the period in use, kept while the new one is within ``hysteresis`` of it.
    """
    speeds = [r for r in others if r > 0 and math.isfinite(r)]
    if not (mine > 0 and math.isfinite(mine)):
        return float(H) if current is None else current
    exact = mine / max([mine, *speeds]) * H
    exact = float(max(-(-H // MAX_PERIOD_CUT), min(H, exact)))
    if current is not None and abs(exact - current) <= hysteresis * current:
        return current
    return exact


def peer_speed(record: Mapping[str, object]) -> tuple[float, bool]:
    """A member record's speed for Dynamic Local Updates and whether it is a pace: its ``pace``
    (tokens/s of its inner steps; 0 while its learner does not know it yet, or a learner of an older
    version: left out), or, in the record of a monitor of an older version (no ``pace`` at all), its
    ``tokens_per_s`` (waits included: the caller then compares its own rate, not its pace). 0 if the
    member is not active or the value is not a finite positive number."""
    if record.get("state") != "active":
        return 0.0, False
    key = "pace" if "pace" in record else "tokens_per_s"
    v = record.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
        return float(v), key == "pace"
    return 0.0, False


def rss_mib(maxrss_kib: int) -> float:
    """Linux ``ru_maxrss`` (KiB) in MiB."""
    return round(maxrss_kib / 1024.0, 1)


def peak_rss_mib() -> float:
    """Peak RSS of this process in MiB: /proc VmHWM (reset by exec), else ``ru_maxrss``.

    Not ``ru_maxrss`` first: a child started with fork+exec inherits its parent's peak on Linux.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return rss_mib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)

