"""Pure membership core of the monitor: heartbeats in, membership and transitions out.

No NATS, no asyncio, no clock reads (except `validate_heartbeat` when it is not given `now`):
the monitor service calls `validate_heartbeat` on every decoded heartbeat, then
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
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

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


class State(str, Enum):
    """Membership state of one learner. Use `.value` for the wire/JSON form."""

    JOINING = "joining"
    ACTIVE = "active"
    SUSPECT = "suspect"
    EVICTED = "evicted"
    REJOINING = "rejoining"
    LEFT = "left"


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

#: Versions held by a learner: ((fragment, version), ...) sorted by fragment, no duplicates.
Versions = tuple[tuple[int, int], ...]


def normalize_versions(
    versions: Mapping[int, int] | Iterable[tuple[int, int]] | None,
) -> Versions:
    """Canonical `Versions` from a mapping or pairs (fragment -> version); raises ValueError.

    Python callers may pass `{0: 3, 1: 4}`; wire input goes through `validate_heartbeat`.
    """
    if versions is None:
        return ()
    pairs = versions.items() if isinstance(versions, Mapping) else versions
    out: dict[int, int] = {}
    for pair in pairs:
        frag, ver = pair
        if not _is_int(frag) or not _is_int(ver) or frag < 0 or ver < 0:
            raise ValueError(f"versions need non-negative int fragment and version, got {pair!r}")
        if frag in out:
            raise ValueError(f"fragment {frag} listed twice in versions")
        out[int(frag)] = int(ver)
    return tuple(sorted(out.items()))


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
class Heartbeat:
    """One validated heartbeat. `versions` accepts a mapping and is stored as sorted pairs.

    `incarnation` identifies one process lifetime (e.g. a uuid4 drawn at start): a new value
    tells the monitor the learner restarted and lost its local state.
    """

    learner: str
    region: str
    incarnation: str
    step: int
    tokens_per_s: float
    versions: Versions
    sent_at: float
    leaving: bool = False  # the learner is done: its last heartbeat

    def __post_init__(self) -> None:
        object.__setattr__(self, "versions", normalize_versions(self.versions))


@dataclass(frozen=True)
class Member:
    """Membership record of one learner, as stored (JSON) in the membership KV bucket.

    `last_seen` is the monitor's receive time of the newest heartbeat, `since` the time of the
    last transition and `reason` its reason.
    """

    learner: str
    region: str
    state: State
    last_seen: float
    since: float
    reason: str
    incarnation: str
    versions: Versions = ()
    step: int = 0
    tokens_per_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", State(self.state))
        object.__setattr__(self, "versions", normalize_versions(self.versions))


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
) -> tuple[dict[str, Member], list[Transition]]:
    """Apply the passage of time at `now`; return (new members, transitions sorted by learner).

    Silence is `now - max(last_seen, monitor_started_at)`: members inherited from a previous
    monitor are not blamed for the time nobody was listening. Active members silent for
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
        silence = now - max(member.last_seen, monitor_started_at)
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

_SCHEMA = 1


def _versions_to_json(versions: Versions) -> dict[str, int]:
    return {str(frag): ver for frag, ver in versions}


def member_to_dict(member: Member) -> dict[str, Any]:
    """Plain JSON-able dict for the KV bucket (orjson.dumps it). Inverse: `member_from_dict`."""
    return {
        "schema": _SCHEMA,
        "learner": member.learner,
        "region": member.region,
        "state": member.state.value,
        "last_seen": member.last_seen,
        "since": member.since,
        "reason": member.reason,
        "incarnation": member.incarnation,
        "versions": _versions_to_json(member.versions),
        "step": member.step,
        "tokens_per_s": member.tokens_per_s,
    }


def member_from_dict(raw: Mapping[str, Any]) -> Member:
    """Member from `member_to_dict` output (after a JSON round trip); ValueError if malformed.

    A KV value that fails here was written by an incompatible or broken writer: log it and
    treat the learner as unknown (it will rejoin on its next heartbeat) rather than crash.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"member must be an object, got {type(raw).__name__}")
    if raw.get("schema", _SCHEMA) != _SCHEMA:
        raise ValueError(f"unsupported member schema {raw.get('schema')!r}")
    try:
        fields = {
            "learner": raw["learner"],
            "region": raw["region"],
            "state": raw["state"],
            "last_seen": raw["last_seen"],
            "since": raw["since"],
            "reason": raw["reason"],
            "incarnation": raw["incarnation"],
        }
    except KeyError as exc:
        raise ValueError(f"member is missing field {exc.args[0]!r}") from None
    for name in ("learner", "region", "reason", "incarnation"):
        if not isinstance(fields[name], str):
            raise ValueError(f"member field {name!r} must be a string")
    for name in ("last_seen", "since"):
        if not _is_number(fields[name]) or not math.isfinite(fields[name]):
            raise ValueError(f"member field {name!r} must be a finite number")
    try:
        state = State(fields["state"])
    except ValueError:
        raise ValueError(f"unknown member state {fields['state']!r}") from None
    step = raw.get("step", 0)
    tps = raw.get("tokens_per_s", 0.0)
    if not _is_int(step) or step < 0:
        raise ValueError("member field 'step' must be an int >= 0")
    if not _is_number(tps) or not math.isfinite(tps):
        raise ValueError("member field 'tokens_per_s' must be a finite number")
    versions = _parse_versions(raw.get("versions", {}), HeartbeatLimits())
    if isinstance(versions, str):
        raise ValueError(f"member field 'versions': {versions}")
    return Member(
        learner=fields["learner"],
        region=fields["region"],
        state=state,
        last_seen=float(fields["last_seen"]),
        since=float(fields["since"]),
        reason=fields["reason"],
        incarnation=fields["incarnation"],
        versions=versions,
        step=int(step),
        tokens_per_s=float(tps),
    )


def transition_to_dict(t: Transition) -> dict[str, Any]:
    """Plain JSON-able dict for the membership event subject."""
    return {
        "learner": t.learner,
        "old": None if t.old is None else t.old.value,
        "new": t.new.value,
        "reason": t.reason,
        "at": t.at,
    }


def heartbeat_to_dict(hb: Heartbeat) -> dict[str, Any]:
    """Wire form of a heartbeat (what learners publish); `validate_heartbeat` reads it back."""
    return {
        "learner": hb.learner,
        "region": hb.region,
        "incarnation": hb.incarnation,
        "step": hb.step,
        "tokens_per_s": hb.tokens_per_s,
        "versions": _versions_to_json(hb.versions),
        "sent_at": hb.sent_at,
        **({"leaving": True} if hb.leaving else {}),
    }


# --------------------------------------------------------------------------- validation


class InvalidHeartbeat(ValueError):
    """A heartbeat that must be dropped. `reason` is a short code fit for a metrics counter
    (e.g. "missing_field", "bad_step", "from_future"); `detail` says what was wrong."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class HeartbeatLimits:
    """Bounds beyond which a heartbeat is rejected as absurd.

    Ids are restricted to characters that are safe both as a NATS subject token and as a
    KV key (`[A-Za-z0-9_-]`). `max_clock_skew` rejects heartbeats stamped in the future:
    if learners are rejected with "from_future", fix NTP on their hosts rather than raising
    it. `max_age` drops heartbeats stamped too long ago (e.g. flushed from nats-py's reconnect
    buffer after a long outage); None disables the check.
    """

    max_id_len: int = 64
    max_incarnation_len: int = 128
    max_fragments: int = 4096
    max_version: int = 2**53
    max_step: int = 2**62
    max_tokens_per_s: float = 1e12
    max_clock_skew: float = 30.0
    max_age: float | None = 300.0


_ID_RE = re.compile(r"[A-Za-z0-9_-]+")
_INCARNATION_RE = re.compile(r"[A-Za-z0-9_.:-]+")
_DIGITS_RE = re.compile(r"[0-9]{1,9}")
_REQUIRED = ("learner", "region", "incarnation", "step", "tokens_per_s", "versions", "sent_at")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _parse_versions(raw: object, limits: HeartbeatLimits) -> Versions | str:
    """Versions from JSON ({"frag": ver} or [[frag, ver], ...]); an error string if malformed."""
    if isinstance(raw, Mapping):
        if len(raw) > limits.max_fragments:
            return f"more than {limits.max_fragments} fragments"
        items: list[tuple[object, object]] = []
        for key, ver in raw.items():
            if isinstance(key, str) and _DIGITS_RE.fullmatch(key):
                items.append((int(key), ver))
            elif _is_int(key):
                items.append((key, ver))
            else:
                return f"fragment key {str(key)[:20]!r} is not a decimal integer"
    elif isinstance(raw, (list, tuple)):
        items = []
        for pair in raw[: limits.max_fragments + 1]:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                return "list form must hold [fragment, version] pairs"
            items.append((pair[0], pair[1]))
    else:
        return f"must be an object or a list of pairs, got {type(raw).__name__}"
    if len(items) > limits.max_fragments:
        return f"more than {limits.max_fragments} fragments"
    seen: dict[int, int] = {}
    for frag, ver in items:
        if not _is_int(frag) or not 0 <= frag < limits.max_fragments:
            return f"fragment {str(frag)[:20]!r} out of range [0, {limits.max_fragments})"
        if not _is_int(ver) or not 0 <= ver <= limits.max_version:
            return f"version {str(ver)[:20]!r} of fragment {frag} is not an int in [0, {limits.max_version}]"
        if frag in seen:
            return f"fragment {frag} listed twice"
        seen[frag] = ver
    return tuple(sorted(seen.items()))


def validate_heartbeat(
    raw: object,
    *,
    now: float | None = None,
    limits: HeartbeatLimits = HeartbeatLimits(),
) -> Heartbeat:
    """Validate an orjson-decoded heartbeat; raise `InvalidHeartbeat` (a ValueError) if malformed.

    `now` is the receive time for the clock checks; None reads `time.time()`. Unknown extra
    fields are ignored so learners can add fields before the monitor knows them. Count the
    rejections by `exc.reason` in the monitor's metrics: a learner whose heartbeats are all
    rejected will be evicted as if it were dead.
    """
    if not isinstance(raw, Mapping):
        raise InvalidHeartbeat("not_an_object", f"heartbeat must be a JSON object, got {type(raw).__name__}")
    for name in _REQUIRED:
        if name not in raw:
            raise InvalidHeartbeat("missing_field", f"heartbeat has no {name!r}")

    for name in ("learner", "region"):
        value = raw[name]
        if not isinstance(value, str) or not 0 < len(value) <= limits.max_id_len or not _ID_RE.fullmatch(value):
            raise InvalidHeartbeat(
                "bad_id",
                f"{name} must be 1-{limits.max_id_len} characters of [A-Za-z0-9_-], got {str(value)[:40]!r}",
            )
    inc = raw["incarnation"]
    if not isinstance(inc, str) or not 0 < len(inc) <= limits.max_incarnation_len or not _INCARNATION_RE.fullmatch(inc):
        raise InvalidHeartbeat(
            "bad_incarnation",
            f"incarnation must be 1-{limits.max_incarnation_len} characters of [A-Za-z0-9_.:-], got {str(inc)[:40]!r}",
        )

    step = raw["step"]
    if not _is_int(step) or not 0 <= step <= limits.max_step:
        raise InvalidHeartbeat("bad_step", f"step must be an int in [0, {limits.max_step}], got {str(step)[:40]!r}")

    tps = raw["tokens_per_s"]
    if not _is_number(tps) or not math.isfinite(tps) or not 0 <= tps <= limits.max_tokens_per_s:
        raise InvalidHeartbeat(
            "bad_tokens_per_s",
            f"tokens_per_s must be a finite number in [0, {limits.max_tokens_per_s:g}], got {str(tps)[:40]!r}",
        )

    sent_at = raw["sent_at"]
    if not _is_number(sent_at) or not math.isfinite(sent_at) or sent_at < 0:
        raise InvalidHeartbeat("bad_sent_at", f"sent_at must be a finite number >= 0, got {str(sent_at)[:40]!r}")
    now = time.time() if now is None else now
    if sent_at > now + limits.max_clock_skew:
        raise InvalidHeartbeat(
            "from_future",
            f"sent_at is {sent_at - now:.1f}s ahead of the monitor's clock (max {limits.max_clock_skew:g}s): check NTP",
        )
    if limits.max_age is not None and sent_at < now - limits.max_age:
        raise InvalidHeartbeat(
            "too_old", f"sent_at is {now - sent_at:.1f}s old (max {limits.max_age:g}s)"
        )

    versions = _parse_versions(raw["versions"], limits)
    if isinstance(versions, str):
        raise InvalidHeartbeat("bad_versions", versions)
    leaving = raw.get("leaving", False)
    if not isinstance(leaving, bool):
        raise InvalidHeartbeat("bad_leaving", f"leaving must be true or false, got {str(leaving)[:40]!r}")

    return Heartbeat(
        learner=raw["learner"],
        region=raw["region"],
        incarnation=inc,
        step=int(step),
        tokens_per_s=float(tps),
        versions=versions,
        sent_at=float(sent_at),
        leaving=leaving,
    )
