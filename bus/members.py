"""The member record: one learner's membership as the monitor stores it (JSON) in the run's
``members`` KV bucket, and as learners and operators read it back. Part of the run contract: the
monitor writes it, the learner (``DILOCO_DYNAMIC_H``, peers' paces) and ``diloco status`` read it.
The state machine that decides it is :mod:`monitor.membership`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any

import msgspec

from bus.heartbeat import HeartbeatLimits, Versions, normalize_versions, parse_versions, versions_to_json

__all__ = ["Member", "State", "member_from_dict", "member_to_dict"]


class State(str, Enum):
    """Membership state of one learner. Use `.value` for the wire/JSON form."""

    JOINING = "joining"
    ACTIVE = "active"
    SUSPECT = "suspect"
    EVICTED = "evicted"
    REJOINING = "rejoining"
    LEFT = "left"


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
    pace: float = 0.0  # tokens/s of its inner steps alone (heartbeat ``pace``; 0: not reported)

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", State(self.state))
        object.__setattr__(self, "versions", normalize_versions(self.versions))


_SCHEMA = 1


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
        "versions": versions_to_json(member.versions),
        "step": member.step,
        "tokens_per_s": member.tokens_per_s,
        "pace": member.pace,
    }


_FINITE = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # no NaN, no inf


class _MemberRecord(msgspec.Struct, frozen=True, gc=False):
    """A member record as stored in KV (the schema of `member_to_dict`); unknown fields ignored."""

    learner: str
    region: str
    state: State
    last_seen: _FINITE
    since: _FINITE
    reason: str
    incarnation: str
    versions: Any = msgspec.field(default_factory=dict)  # parse_versions: decimal-string keys
    step: Annotated[int, msgspec.Meta(ge=0)] = 0
    tokens_per_s: _FINITE = 0.0
    pace: _FINITE = 0.0
    schema: Any = _SCHEMA  # compared below, as before: 1 == 1.0 == True


def member_from_dict(raw: Mapping[str, Any]) -> Member:
    """Member from `member_to_dict` output (after a JSON round trip); ValueError if malformed.

    A KV value that fails here was written by an incompatible or broken writer: log it and
    treat the learner as unknown (it will rejoin on its next heartbeat) rather than crash.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"member must be an object, got {type(raw).__name__}")
    try:
        rec = msgspec.convert(dict(raw), _MemberRecord)
    except msgspec.ValidationError as e:
        raise ValueError(f"malformed member: {e}") from None
    if rec.schema != _SCHEMA:
        raise ValueError(f"unsupported member schema {rec.schema!r}")
    versions = parse_versions(rec.versions, HeartbeatLimits())
    if isinstance(versions, str):
        raise ValueError(f"member field 'versions': {versions}")
    return Member(rec.learner, rec.region, rec.state, rec.last_seen, rec.since, rec.reason, rec.incarnation,
                  versions, rec.step, rec.tokens_per_s, rec.pace)
