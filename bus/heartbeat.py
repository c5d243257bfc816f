"""The heartbeat on the wire (learner -> monitor, ``hb.<learner>``): its schema and its validation (pure).

A heartbeat is a JSON object; :func:`validate_heartbeat` turns the decoded object into a
:class:`Heartbeat` or raises :class:`InvalidHeartbeat` with a reason fit for a metrics counter.
The types and bounds of the fields are ``msgspec.Struct`` fields (built per :class:`HeartbeatLimits`,
since the bounds are configurable) that msgspec validates in C; what a schema cannot say
stays written out here: the clock checks (they depend on the receive time) and the versions map
(decimal-string or int fragment keys, unique once read as ints, or a list of pairs).

Rejection reasons, in the order they are decided when a heartbeat has several faults:
``not_an_object``, ``missing_field``, ``bad_id`` (learner, region), ``bad_incarnation``,
``bad_step``, ``bad_tokens_per_s``, ``bad_sent_at``, ``from_future``, ``too_old``,
``bad_versions``, ``bad_leaving``, ``bad_pace``. The fields checked before the clock go to msgspec as one array
in that order (an ``array_like`` Struct), so msgspec names the first bad one and the reason never
depends on the order of the JSON keys. :func:`decode_heartbeat` validates straight from the JSON
bytes with the object form of the same schema, and takes the path above for anything it refuses.
"""

from __future__ import annotations

import functools
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import orjson

#: Versions held by a learner: ((fragment, version), ...) sorted by fragment, no duplicates.
Versions = tuple[tuple[int, int], ...]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


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
    pace: float = 0.0  # tokens/s of its inner steps alone, waits left out (0: not reported, an older learner)

    def __post_init__(self) -> None:
        object.__setattr__(self, "versions", normalize_versions(self.versions))


def versions_to_json(versions: Versions) -> dict[str, int]:
    return {str(frag): ver for frag, ver in versions}


def heartbeat_to_dict(hb: Heartbeat) -> dict[str, Any]:
    """Wire form of a heartbeat (what learners publish); `validate_heartbeat` reads it back."""
    return {
        "learner": hb.learner,
        "region": hb.region,
        "incarnation": hb.incarnation,
        "step": hb.step,
        "tokens_per_s": hb.tokens_per_s,
        "versions": versions_to_json(hb.versions),
        "sent_at": hb.sent_at,
        **({"leaving": True} if hb.leaving else {}),
        **({"pace": hb.pace} if hb.pace > 0 else {}),
    }


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


_REQUIRED = ("learner", "region", "incarnation", "step", "tokens_per_s", "versions", "sent_at")


def parse_versions(raw: object, limits: HeartbeatLimits) -> Versions | str:
    """Versions from JSON ({"frag": ver} or [[frag, ver], ...]); an error string if malformed.

    A fragment key is 1-9 ASCII digits or an int, a fragment in [0, max_fragments), a version an int
    in [0, max_version], no fragment twice (once read as an int: "1" and "01" are the same).
    """
    max_frag, max_ver = limits.max_fragments, limits.max_version
    if isinstance(raw, Mapping):
        if len(raw) > max_frag:
            return f"more than {max_frag} fragments"
        for key in raw:
            if not (isinstance(key, str) and 0 < len(key) <= 9 and key.isascii() and key.isdigit() or _is_int(key)):
                return f"fragment key {str(key)[:20]!r} is not a decimal integer"
        pairs: Iterable[tuple[Any, Any]] = raw.items()
    elif isinstance(raw, (list, tuple)):
        if len(raw) > max_frag:
            return f"more than {max_frag} fragments"
        for pair in raw:
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                return "list form must hold [fragment, version] pairs"
        pairs = raw
    else:
        return f"must be an object or a list of pairs, got {type(raw).__name__}"
    seen: dict[int, int] = {}
    for key, ver in pairs:
        frag = int(key) if isinstance(key, str) else key
        if not _is_int(frag) or not 0 <= frag < max_frag:
            return f"fragment {str(frag)[:20]!r} out of range [0, {max_frag})"
        if not _is_int(ver) or not 0 <= ver <= max_ver:
            return f"version {str(ver)[:20]!r} of fragment {frag} is not an int in [0, {max_ver}]"
        if frag in seen:
            return f"fragment {frag} listed twice"
        seen[frag] = ver
    return tuple(sorted(seen.items()))


# --------------------------------------------------------------------------- the schema

_FINITE_MAX = sys.float_info.max  # `le` this: rejects inf (NaN fails every bound)


def _field_types(limits: HeartbeatLimits) -> dict[str, Any]:
    """Type and bounds of every field msgspec checks, in the order a fault is reported."""
    ident = Annotated[str, msgspec.Meta(min_length=1, max_length=limits.max_id_len, pattern=r"^[A-Za-z0-9_-]+\Z")]
    return {
        "learner": ident,
        "region": ident,
        "incarnation": Annotated[
            str, msgspec.Meta(min_length=1, max_length=limits.max_incarnation_len, pattern=r"^[A-Za-z0-9_.:-]+\Z")
        ],
        "step": Annotated[int, msgspec.Meta(ge=0, le=limits.max_step)],
        "tokens_per_s": Annotated[float, msgspec.Meta(ge=0, le=float(limits.max_tokens_per_s))],
        "sent_at": Annotated[float, msgspec.Meta(ge=0, le=_FINITE_MAX)],
        "versions": Any,  # parse_versions: keys are decimal strings or ints, unique once read
        "leaving": bool,
        "pace": Annotated[float, msgspec.Meta(ge=0, le=float(limits.max_tokens_per_s))],
    }


_DETAIL = {
    "learner": ("bad_id", "learner must be 1-{l.max_id_len} characters of [A-Za-z0-9_-]"),
    "region": ("bad_id", "region must be 1-{l.max_id_len} characters of [A-Za-z0-9_-]"),
    "incarnation": ("bad_incarnation", "incarnation must be 1-{l.max_incarnation_len} characters of [A-Za-z0-9_.:-]"),
    "step": ("bad_step", "step must be an int in [0, {l.max_step}]"),
    "tokens_per_s": ("bad_tokens_per_s", "tokens_per_s must be a finite number in [0, {l.max_tokens_per_s:g}]"),
    "sent_at": ("bad_sent_at", "sent_at must be a finite number >= 0"),
    "leaving": ("bad_leaving", "leaving must be true or false"),
    "pace": ("bad_pace", "pace must be a finite number in [0, {l.max_tokens_per_s:g}]"),
}


_ORDERED = ("learner", "region", "incarnation", "step", "tokens_per_s", "sent_at")  # checked before the clock
_AT_INDEX = re.compile(r"at `\$\[(\d+)\]`")


@functools.lru_cache(maxsize=16)
def _build_schema(limits: HeartbeatLimits) -> tuple[type[msgspec.Struct], type[msgspec.Struct]]:
    types = _field_types(limits)
    optional = {"leaving": False, "pace": 0.0}
    fields = ([(name, tp) for name, tp in types.items() if name not in optional]
              + [(name, types[name], default) for name, default in optional.items()])
    wire = msgspec.defstruct("HeartbeatWire", fields, frozen=True, gc=False)  # type: ignore[arg-type]
    # the same fields as an array, in the order a fault is reported: msgspec names the first bad index
    ordered = msgspec.defstruct("HeartbeatOrdered", [(n, types[n]) for n in _ORDERED], array_like=True, gc=False)
    return wire, ordered


_last_schema: tuple[HeartbeatLimits, tuple[type[msgspec.Struct], type[msgspec.Struct]]] | None = None


def heartbeat_schema(limits: HeartbeatLimits) -> tuple[type[msgspec.Struct], type[msgspec.Struct]]:
    """The wire schema for these limits (a Struct, unknown fields ignored), and its checked fields
    as an array-like Struct in the order a fault is reported (for the reason of a rejection)."""
    global _last_schema
    last = _last_schema
    if last is not None and last[0] is limits:  # the monitor passes the same limits every time
        return last[1]
    schema = _build_schema(limits)
    _last_schema = (limits, schema)
    return schema


def _check_clock(sent_at: float, now: float, limits: HeartbeatLimits) -> None:
    if sent_at > now + limits.max_clock_skew:
        raise InvalidHeartbeat(
            "from_future",
            f"sent_at is {sent_at - now:.1f}s ahead of the monitor's clock (max {limits.max_clock_skew:g}s): check NTP",
        )
    if limits.max_age is not None and sent_at < now - limits.max_age:
        raise InvalidHeartbeat("too_old", f"sent_at is {now - sent_at:.1f}s old (max {limits.max_age:g}s)")


def _bad_field(raw: Mapping[Any, Any], error: msgspec.ValidationError, limits: HeartbeatLimits) -> InvalidHeartbeat:
    at = _AT_INDEX.search(str(error))
    name = _ORDERED[int(at.group(1))] if at else "learner"  # msgspec always names the index
    reason, detail = _DETAIL[name]
    return InvalidHeartbeat(reason, detail.format(l=limits) + f", got {str(raw[name])[:40]!r}")


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
    _, ordered = heartbeat_schema(limits)
    try:
        f: Any = msgspec.convert((raw["learner"], raw["region"], raw["incarnation"], raw["step"],
                                  raw["tokens_per_s"], raw["sent_at"]), ordered)
    except msgspec.ValidationError as e:
        raise _bad_field(raw, e, limits) from None
    _check_clock(f.sent_at, time.time() if now is None else now, limits)
    versions = parse_versions(raw["versions"], limits)
    if isinstance(versions, str):
        raise InvalidHeartbeat("bad_versions", versions)
    leaving = raw.get("leaving", False)
    if not isinstance(leaving, bool):
        reason, detail = _DETAIL["leaving"]
        raise InvalidHeartbeat(reason, detail.format(l=limits) + f", got {str(leaving)[:40]!r}")
    pace = raw.get("pace", 0.0)
    if not (_is_number(pace) and 0 <= pace <= limits.max_tokens_per_s):  # (NaN fails the bounds)
        reason, detail = _DETAIL["pace"]
        raise InvalidHeartbeat(reason, detail.format(l=limits) + f", got {str(pace)[:40]!r}")
    return Heartbeat(f.learner, f.region, f.incarnation, f.step, f.tokens_per_s, versions, f.sent_at, leaving,
                     float(pace))


def decode_heartbeat(
    data: bytes,
    *,
    now: float | None = None,
    limits: HeartbeatLimits = HeartbeatLimits(),
) -> Heartbeat:
    """`validate_heartbeat(orjson.loads(data))` in one msgspec pass from the JSON bytes (no dict built).

    Anything the schema refuses takes the two-step path again, so every rejection has the same reason
    as there; JSON that orjson refuses raises ``InvalidHeartbeat("not_json")``.
    """
    now = time.time() if now is None else now
    schema, _ = heartbeat_schema(limits)
    try:
        wire: Any = msgspec.json.decode(data, type=schema)
    except msgspec.DecodeError:
        try:
            raw = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise InvalidHeartbeat("not_json", f"not JSON: {e}"[:120]) from None
        return validate_heartbeat(raw, now=now, limits=limits)
    _check_clock(wire.sent_at, now, limits)
    versions = parse_versions(wire.versions, limits)
    if isinstance(versions, str):
        raise InvalidHeartbeat("bad_versions", versions)
    return Heartbeat(wire.learner, wire.region, wire.incarnation, wire.step, wire.tokens_per_s, versions,
                     wire.sent_at, wire.leaving, wire.pace)
