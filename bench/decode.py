"""Decode cost of the wire messages: hand-written validation (before) against msgspec schemas (after).

Measured side by side in one process, interleaved repeat by repeat (the machine is shared and
noisy: compare the ratios), each figure the median over repeats of ``timeit`` of many calls, in µs
per message:

* ``heartbeat``: JSON bytes -> :class:`bus.heartbeat.Heartbeat`, as the monitor's
  ``parse_heartbeat`` does it (``loads_json`` then ``validate_heartbeat``), 8 fragments held;
  ``heartbeat_one_pass``: the same with ``decode_heartbeat`` (msgspec straight from the bytes, no
  dict: what the monitor's ``parse_heartbeat`` would do if it called it); ``heartbeat_reject``: the same for a heartbeat with a bad ``step`` (a garbage flood);
* ``chunk_header``: ``parse_chunk`` of a gradient chunk (the ``Diloco-Chunk`` JSON header);
* ``grad_meta``: ``parse_grad_meta`` of that chunk's metadata (once per assembled object);
* ``member``: ``member_from_dict`` of a KV member record (JSON bytes, as the learner reads it).

"Before" is the code as it was before the schemas, kept below verbatim (``_old_*``).

    python -m bench.decode --quick --out decode.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import math
import re
import statistics
import time
import timeit
from collections.abc import Mapping
from typing import Any

import orjson

from bench.common import finish, parser, progress
from bus.chunks import (
    CHUNK_HEADER,
    MAX_CHUNKS,
    MAX_OBJECT_BYTES,
    Chunk,
    chunk_headers,
    parse_chunk,
)
from bus.codec import loads_json
from bus.protocol import GRAD_FIELDS, GRAD_OPTIONAL, grad_meta, parse_grad_meta
from bus.subjects import check_token
from bus.heartbeat import (
    Heartbeat,
    HeartbeatLimits,
    InvalidHeartbeat,
    Versions,
    decode_heartbeat,
    heartbeat_to_dict,
    validate_heartbeat,
)
from monitor.membership import (
    Member,
    MembershipConfig,
    State,
    member_from_dict,
    member_to_dict,
    on_heartbeat,
)

_SCHEMA = 1

# --------------------------------------------------------------------------- before (verbatim copies)

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


def _old_validate_heartbeat(
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


def _old_member_from_dict(raw: Mapping[str, Any]) -> Member:
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


def _old_parse_grad_meta(meta: dict) -> dict:
    """Type-check the metadata of a gradient object; ``ValueError('malformed: ...')`` if wrong.

    Semantic checks (right run, active learner, staleness...) belong to the aggregator's validator.
    """
    if not isinstance(meta, dict) or not set(GRAD_FIELDS) <= set(meta) <= set(GRAD_FIELDS + GRAD_OPTIONAL):
        raise ValueError(f"malformed: expected fields {', '.join(GRAD_FIELDS)} (and optionally "
                         f"{', '.join(GRAD_OPTIONAL)})")
    for k in ("run", "model", "learner", "inc", "region"):
        if not isinstance(meta[k], str) or not meta[k] or len(meta[k]) > 128:
            raise ValueError(f"malformed: field {k!r} must be a non-empty string")
    if "period" in meta and (not isinstance(meta["period"], int) or isinstance(meta["period"], bool)
                             or not 1 <= meta["period"] <= 2**31):
        raise ValueError("malformed: field 'period' must be an integer in 1..2**31")
    if "lockstep" in meta and (type(meta["lockstep"]) is not int or meta["lockstep"] != 1):
        raise ValueError("malformed: field 'lockstep' must be 1 (or absent)")
    for k in ("frag", "round", "base", "steps", "tokens"):
        v = meta[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v > 2**62:
            raise ValueError(f"malformed: field {k!r} must be an integer in 0..2**62")
    try:
        check_token("learner", meta["learner"])
    except ValueError as e:
        raise ValueError(f"malformed: {e}") from None
    return meta


def _old_parse_chunk(headers: dict | None, data: bytes, token: Any = None) -> Chunk:
    """A :class:`Chunk` from a message, or ``ValueError(reason)`` with reason ``bad_header``."""
    raw = (headers or {}).get(CHUNK_HEADER)
    if raw is None:
        raise ValueError("bad_header: no Diloco-Chunk header")
    try:
        h = orjson.loads(raw)
        obj_id, i, n, s, c, m = h["o"], h["i"], h["n"], h["s"], h["c"], h["m"]
    except Exception:
        raise ValueError("bad_header: Diloco-Chunk is not the expected JSON") from None
    ok = (
        isinstance(obj_id, str) and 0 < len(obj_id) <= 256
        and all(isinstance(v, int) and not isinstance(v, bool) for v in (i, n, s, c))
        and 1 <= n <= MAX_CHUNKS and 0 <= i < n and 0 <= s <= MAX_OBJECT_BYTES and 0 <= c <= 0xFFFFFFFF
        and isinstance(m, dict)
    )
    if not ok:
        raise ValueError(f"bad_header: out-of-range fields in {raw[:120]!r}")
    return Chunk(obj_id, i, n, s, c, m, data, token)



# --------------------------------------------------------------------------- measurement


def _per_call_us(fn, arg, number: int) -> float:
    return timeit.Timer(lambda: fn(arg)).timeit(number) / number * 1e6


def _reject(fn):
    def call(arg):
        try:
            fn(arg)
        except ValueError:
            return
        raise AssertionError("expected a rejection")
    return call


def cases() -> dict[str, tuple[Any, Any, Any]]:
    """name -> (input, before, after); both must agree on every input."""
    T0 = 1_700_000_000.0
    hb = Heartbeat("learner-03", "eu-west", "3f2a9c1e-7d4b-4c1a-9e2f-0b1c2d3e4f5a", 12_345, 81_920.5,
                   {p: 40 + p for p in range(8)}, T0)
    hb_bytes = orjson.dumps(heartbeat_to_dict(hb))
    bad_bytes = orjson.dumps({**heartbeat_to_dict(hb), "step": -1})
    meta = grad_meta(run="run-1", model="0123456789abcdef", learner="learner-03", incarnation="3f2a9c1e",
                     fragment=5, round_=77, base_version=76, inner_steps=24, tokens=24 * 2048, region="eu-west",
                     period=24)
    headers = chunk_headers("run-1.learner-03.3f2a9c1e.5.77", 3, 12, 12 * 1_048_576, 0x1234ABCD, meta)
    members, _ = on_heartbeat({}, hb, T0, None, MembershipConfig())
    member_bytes = orjson.dumps(member_to_dict(members[hb.learner]))
    return {
        "heartbeat": (hb_bytes, lambda b: _old_validate_heartbeat(loads_json(b), now=T0),
                      lambda b: validate_heartbeat(loads_json(b), now=T0)),
        "heartbeat_one_pass": (hb_bytes, lambda b: _old_validate_heartbeat(loads_json(b), now=T0),
                               lambda b: decode_heartbeat(b, now=T0)),
        "heartbeat_reject": (bad_bytes, _reject(lambda b: _old_validate_heartbeat(loads_json(b), now=T0)),
                             _reject(lambda b: validate_heartbeat(loads_json(b), now=T0))),
        "chunk_header": (headers, lambda h: _old_parse_chunk(h, b""), lambda h: parse_chunk(h, b"")),
        "grad_meta": (meta, _old_parse_grad_meta, parse_grad_meta),
        "member": (member_bytes, lambda b: _old_member_from_dict(loads_json(b)),
                   lambda b: member_from_dict(loads_json(b))),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=None)
    a = p.parse_args()
    repeats = a.repeats or (7 if a.quick else 15)
    number = 20_000 if a.quick else 100_000
    out: dict[str, Any] = {"bench": "decode", "quick": a.quick, "repeats": repeats, "calls_per_repeat": number}
    for name, (arg, before, after) in cases().items():
        assert before(arg) == after(arg), name  # the same result (None for a rejection)
        times: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(repeats):  # interleaved, so a noisy neighbour hits both alike
            times["before"].append(_per_call_us(before, arg, number))
            times["after"].append(_per_call_us(after, arg, number))
        b, f = statistics.median(times["before"]), statistics.median(times["after"])
        out[f"{name}_decode_us_before"] = round(b, 3)
        out[f"{name}_decode_us_after"] = round(f, 3)
        out[f"{name}_speedup"] = round(b / f, 2)
        progress(f"{name}: before {b:.2f} us, after {f:.2f} us ({b / f:.2f}x)")
    finish(out, a.out)


if __name__ == "__main__":
    main()
