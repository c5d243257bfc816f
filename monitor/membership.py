"""Pure membership core of the monitor: heartbeats in, membership and transitions out.

No NATS, no asyncio, no clock reads: the monitor service calls `validate_heartbeat` (the wire
schema of a heartbeat, in :mod:`bus.heartbeat`, re-exported here) on every decoded heartbeat, then
`on_heartbeat`, and calls `on_tick` periodically (every `heartbeat_interval / 2` is plenty).
Both return the complete new membership plus the list of transitions to publish as events; the
service writes changed members to the KV bucket with `member_to_dict`.

State machine (every edge is listed in `ALLOWED_EDGES`)::

    (new) --first heartbeat--> joining --holds current versions--> active
    active --silent suspect_after--> suspect --heartbeat--> active
    active | suspect --silent evict_after--> evicted
    joining | rejoining --silent evict_after--> evicted
    evicted --heartbeat--> rejoining --holds current versions--> active
    active | suspect --heartbeat with a new incarnation--> rejoining
    joining | active | suspect | rejoining --leaving heartbeat--> left
    left --heartbeat--> rejoining

A learner that is done (its step budget reached, an island closed, a stop) sends one last
heartbeat with ``leaving: true`` after its last outer gradients were stored: it is then ``left``,
never suspected or evicted for its silence, and the aggregator still merges what it sent.

Only `active` members count in the aggregator's quorum (`is_counted_in_quorum`).

Times (`now`, `last_seen`, `since`, `sent_at`) are wall-clock seconds (`time.time()`), because
members are stored in KV and read back by another monitor process, possibly on another host.
A forward clock step on the monitor host (NTP slew is fine, a step is not; so is a suspended VM)
looks like silence from everyone and evicts them all: run the monitor on a host with a steady
clock. A backward step is harmless: nobody is evicted until the clock catches up, and
transition times are clamped so they never go backwards for a learner.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any


from bus.members import Member, State, member_from_dict, member_to_dict
from bus.heartbeat import (
    Heartbeat,
    HeartbeatLimits,
    InvalidHeartbeat,
    Versions,
    _is_int,
    _is_number,
    heartbeat_to_dict,
    normalize_versions,
    validate_heartbeat,
)

__all__ = [
    "ALLOWED_EDGES",
    "Heartbeat",
    "HeartbeatLimits",
    "InvalidHeartbeat",
    "Member",
    "MembershipConfig",
    "State",
    "Transition",
    "Versions",
    "count_states",
    "heartbeat_to_dict",
    "holds_current",
    "is_counted_in_quorum",
    "lagging_fragments",
    "member_from_dict",
    "member_to_dict",
    "normalize_versions",
    "on_heartbeat",
    "on_tick",
    "transition_to_dict",
    "validate_heartbeat",
]


#: Every (old, new) pair a transition may have; `None` means "not a member yet".
ALLOWED_EDGES: frozenset[tuple[State | None, State]] = frozenset(
    {
        (None, State.JOINING),
        (State.JOINING, State.ACTIVE),
        (State.JOINING, State.EVICTED),
        (State.ACTIVE, State.SUSPECT),
        (State.ACTIVE, State.EVICTED),
        (State.ACTIVE, State.REJOINING),
        (State.SUSPECT, State.ACTIVE),
        (State.SUSPECT, State.EVICTED),
        (State.SUSPECT, State.REJOINING),
        (State.EVICTED, State.REJOINING),
        (State.REJOINING, State.ACTIVE),
        (State.REJOINING, State.EVICTED),
        (State.JOINING, State.LEFT),
        (State.ACTIVE, State.LEFT),
        (State.SUSPECT, State.LEFT),
        (State.REJOINING, State.LEFT),
        (State.LEFT, State.REJOINING),
    }
)

@dataclass(frozen=True)
class MembershipConfig:
    """Timing of failure detection. All times in seconds.

    - `heartbeat_interval`: how often learners send heartbeats (learners read it from here too).
    - `suspect_after`: silence after which an active learner becomes suspect (left out of
      quorum but not yet evicted). Keep it at least 2-3 heartbeat intervals so one lost or late
      heartbeat does not drop a learner from quorum.
    - `evict_after`: silence after which a learner is evicted and must rejoin. Raise it on lossy
      WAN links or across a leaf-node hop where heartbeats arrive in bursts after a reconnect,
      and when learners run long blocking steps that starve their event loop (the learner
      should heartbeat from its own thread); lower it for faster goodput recovery after crashes.
    - `startup_grace`: a (re)started monitor evicts nobody before `started_at + startup_grace`
      (default `None` = `evict_after`), so live learners inherited from the KV bucket get a full
      timeout to be heard by the new monitor. Silence of inherited members is also counted from
      the monitor's start at the earliest. Raise it if a NATS server restart usually accompanies
      a monitor restart and clients take longer to reconnect (nats-py waits 2 s per attempt).
    - `max_version_lag`: a joining/rejoining learner becomes active once, for every fragment,
      the version it holds is >= current version - `max_version_lag`. Global versions keep
      moving while a learner downloads them, so 0 may never be reached on a busy run; raise it
      if rejoining learners stay in `rejoining` while their heartbeats keep arriving.
    """

    heartbeat_interval: float = 1.0
    suspect_after: float = 3.0
    evict_after: float = 5.0
    startup_grace: float | None = None
    max_version_lag: int = 2

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "suspect_after", "evict_after"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"MembershipConfig.{name} must be a positive finite number, got {value!r}")
        if self.startup_grace is not None and (
            not _is_number(self.startup_grace)
            or not math.isfinite(self.startup_grace)
            or self.startup_grace < 0
        ):
            raise ValueError(
                f"MembershipConfig.startup_grace must be None or a finite number >= 0, got {self.startup_grace!r}"
            )
        if not self.heartbeat_interval < self.suspect_after:
            raise ValueError(
                f"MembershipConfig: heartbeat_interval ({self.heartbeat_interval}) must be < suspect_after "
                f"({self.suspect_after}), otherwise every learner turns suspect between two heartbeats"
            )
        if not self.suspect_after < self.evict_after:
            raise ValueError(
                f"MembershipConfig: suspect_after ({self.suspect_after}) must be < evict_after ({self.evict_after})"
            )
        if not _is_int(self.max_version_lag) or self.max_version_lag < 0:
            raise ValueError(f"MembershipConfig.max_version_lag must be an int >= 0, got {self.max_version_lag!r}")

    @property
    def effective_startup_grace(self) -> float:
        """`startup_grace`, or `evict_after` when it is None."""
        return self.evict_after if self.startup_grace is None else float(self.startup_grace)


@dataclass(frozen=True)
class Transition:
    """One membership change, published as an event. `old` is None for a new learner."""

    learner: str
    old: State | None
    new: State
    reason: str
    at: float


# --------------------------------------------------------------------------- versions


def lagging_fragments(
    held: Versions | Mapping[int, int],
    current: Mapping[int, int] | None,
    max_lag: int,
) -> tuple[int, ...]:
    """Fragments whose held version is below `current - max_lag` (or missing), sorted."""
    if not current:
        return ()
    held_map = dict(held) if not isinstance(held, Mapping) else held
    return tuple(
        sorted(
            frag
            for frag, ver in current.items()
            if frag not in held_map or held_map[frag] < ver - max_lag
        )
    )


def holds_current(
    held: Versions | Mapping[int, int],
    current: Mapping[int, int] | None,
    max_lag: int,
) -> bool:
    """True when every fragment is held at >= current version - `max_lag`.

    With no global versions yet (`current` None or empty) every learner holds them.
    A fragment missing from `held` counts as not held.
    """
    return not lagging_fragments(held, current, max_lag)


# --------------------------------------------------------------------------- transitions


def _move(member: Member, new: State, reason: str, now: float) -> tuple[Member, Transition]:
    at = max(now, member.since)  # never backwards for one learner, even if the clock steps back
    return (
        replace(member, state=new, since=at, reason=reason),
        Transition(member.learner, member.state, new, reason, at),
    )


def on_heartbeat(
    members: Mapping[str, Member],
    hb: Heartbeat,
    now: float,
    current_versions: Mapping[int, int] | None,
    cfg: MembershipConfig,
) -> tuple[dict[str, Member], list[Transition]]:
    """Apply one validated heartbeat received at `now`; return (new members, transitions).

    `current_versions` is the newest global version per fragment (None before the first
    merge). A learner may go through two transitions in one call (e.g. joining then active)
    when its first heartbeat already shows current versions. Liveness is measured with the
    monitor's `now`, never with the learner's `sent_at`, so learner clock skew cannot evict.
    """
    out = dict(members)
    transitions: list[Transition] = []
    old = members.get(hb.learner)
    if old is None:
        reason = f"first heartbeat (incarnation {hb.incarnation})"
        member = Member(
            learner=hb.learner,
            region=hb.region,
            state=State.JOINING,
            last_seen=now,
            since=now,
            reason=reason,
            incarnation=hb.incarnation,
            versions=hb.versions,
            step=hb.step,
            tokens_per_s=hb.tokens_per_s,
            pace=hb.pace,
        )
        transitions.append(Transition(hb.learner, None, State.JOINING, reason, now))
    else:
        member = replace(
            old,
            region=hb.region,
            last_seen=max(old.last_seen, now),
            incarnation=hb.incarnation,
            versions=hb.versions,
            step=hb.step,
            tokens_per_s=hb.tokens_per_s,
            pace=hb.pace,
        )
        restarted = hb.incarnation != old.incarnation
        if old.state is State.LEFT and hb.leaving and not restarted:
            pass  # the leaving heartbeat again (sent twice, or redelivered)
        elif old.state in (State.EVICTED, State.LEFT):
            reason = f"heartbeat after {'eviction' if old.state is State.EVICTED else 'leaving'}"
            if restarted:
                reason += f" from new incarnation {hb.incarnation}"
            member, t = _move(member, State.REJOINING, reason, now)
            transitions.append(t)
        elif restarted and old.state in (State.ACTIVE, State.SUSPECT):
            reason = f"process restarted: new incarnation {hb.incarnation} (was {old.incarnation})"
            member, t = _move(member, State.REJOINING, reason, now)
            transitions.append(t)
        elif old.state is State.SUSPECT:
            reason = f"heartbeat resumed after {max(0.0, now - old.last_seen):.1f}s of silence"
            member, t = _move(member, State.ACTIVE, reason, now)
            transitions.append(t)

    if hb.leaving and member.state is not State.LEFT:
        member, t = _move(member, State.LEFT, f"left at step {hb.step} (its last outer gradients sent)", now)
        transitions.append(t)
    elif member.state in (State.JOINING, State.REJOINING) and not hb.leaving and holds_current(
        hb.versions, current_versions, cfg.max_version_lag
    ):
        if current_versions:
            reason = f"holds current global versions (lag <= {cfg.max_version_lag})"
        else:
            reason = "no global versions yet"
        member, t = _move(member, State.ACTIVE, reason, now)
        transitions.append(t)

    out[hb.learner] = member
    return out, transitions


def on_tick(
    members: Mapping[str, Member],
    now: float,
    monitor_started_at: float,
    cfg: MembershipConfig,
    heard_until: float | None = None,
) -> tuple[dict[str, Member], list[Transition]]:
    """Apply the passage of time at `now`; return (new members, transitions sorted by learner).

    Silence is `heard_until - max(last_seen, monitor_started_at)`: members inherited from a previous
    monitor are not blamed for the time nobody was listening, nor any member for heartbeats the
    monitor received and has not read yet (`heard_until`: when its intake was last empty; None:
    `now`). Active members silent for
    `suspect_after` become suspect; any non-evicted member silent for `evict_after` is evicted,
    but never before `monitor_started_at + cfg.effective_startup_grace`. Joining and rejoining
    members are not counted in quorum, so they skip `suspect` and go straight to `evicted`.
    """
    out = dict(members)
    transitions: list[Transition] = []
    may_evict = now >= monitor_started_at + cfg.effective_startup_grace
    for name in sorted(members):
        member = members[name]
        if member.state in (State.EVICTED, State.LEFT):
            continue  # a learner that left is silent on purpose
        silence = (now if heard_until is None else min(now, heard_until)) - max(member.last_seen, monitor_started_at)
        if may_evict and silence >= cfg.evict_after:
            reason = (
                f"no heartbeat for {now - member.last_seen:.1f}s (evict_after={cfg.evict_after:g}s)"
            )
            out[name], t = _move(member, State.EVICTED, reason, now)
            transitions.append(t)
        elif member.state is State.ACTIVE and silence >= cfg.suspect_after:
            reason = (
                f"no heartbeat for {now - member.last_seen:.1f}s (suspect_after={cfg.suspect_after:g}s)"
            )
            out[name], t = _move(member, State.SUSPECT, reason, now)
            transitions.append(t)
    return out, transitions


def forgettable(members: Mapping[str, Member], now: float, forget_after: float) -> list[str]:
    """Evicted members silent for ``forget_after`` seconds since their eviction (0: never), sorted.

    The leader deletes them from membership, so a run with churn (spot machines, new learner ids)
    does not list dead learners for ever. A forgotten learner that comes back joins as new.
    """
    if forget_after <= 0:
        return []
    return sorted(n for n, m in members.items()
                  if m.state in (State.EVICTED, State.LEFT) and now - max(m.since, m.last_seen) >= forget_after)


def is_counted_in_quorum(member: Member) -> bool:
    """Only active members count towards the aggregator's quorum (suspects are waited on by no one)."""
    return member.state is State.ACTIVE


def count_states(members: Mapping[str, Member]) -> dict[str, int]:
    """Number of members per state, every state present (for the monitor's metrics)."""
    counts = {s.value: 0 for s in State}
    for member in members.values():
        counts[member.state.value] += 1
    return counts


# --------------------------------------------------------------------------- serialisation

def transition_to_dict(t: Transition) -> dict[str, Any]:
    """Plain JSON-able dict for the membership event subject."""
    return {
        "learner": t.learner,
        "old": None if t.old is None else t.old.value,
        "new": t.new.value,
        "reason": t.reason,
        "at": t.at,
    }
