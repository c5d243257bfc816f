"""Rules of the msgspec message schemas the other tests leave unchecked: bounds of the chunk header
and of gradient metadata, the reason of a heartbeat with several faults (never the order of its
JSON keys), limits that change the schema, and non-finite times in a member record."""

from __future__ import annotations

import math

import orjson
import pytest

from bus.chunks import MAX_CHUNKS, MAX_OBJECT_BYTES, parse_chunk
from bus.protocol import grad_meta, parse_grad_meta
from bus.heartbeat import (
    Heartbeat,
    HeartbeatLimits,
    InvalidHeartbeat,
    heartbeat_to_dict,
    validate_heartbeat,
)
from monitor.membership import (
    MembershipConfig,
    member_from_dict,
    member_to_dict,
    on_heartbeat,
)

T0 = 1_700_000_000.0


def _header(**patch) -> dict:
    h = {"o": "a", "i": 0, "n": 1, "s": 1, "c": 0, "m": {}, **patch}
    return {"Diloco-Chunk": orjson.dumps({k: v for k, v in h.items() if v is not ...}).decode()}


def test_a_good_chunk_header_is_read_and_unknown_fields_are_ignored():
    c = parse_chunk(_header(i=2, n=3, s=7, c=0xFFFFFFFF, m={"k": [1]}, extra=1), b"xy", token="t")
    assert (c.obj_id, c.index, c.count, c.size, c.crc, c.meta, c.data, c.token) == (
        "a", 2, 3, 7, 0xFFFFFFFF, {"k": [1]}, b"xy", "t")


@pytest.mark.parametrize("patch", [
    {"n": MAX_CHUNKS + 1}, {"s": MAX_OBJECT_BYTES + 1}, {"c": 2**32}, {"c": -1}, {"o": "x" * 257},
    {"m": []}, {"m": None}, {"i": 0.0}, {"i": -1}, {"o": 5}, {"c": ...}, {"m": ...},
])
def test_chunk_header_bounds(patch):
    with pytest.raises(ValueError, match="^bad_header"):
        parse_chunk(_header(**patch), b"")


def _meta(**patch) -> dict:
    m = grad_meta(run="r", model="h", learner="l-0", incarnation="i", fragment=1, round_=2, base_version=3,
                  inner_steps=24, tokens=1536, region="eu", period=24)
    return {**m, **patch}


@pytest.mark.parametrize("field, bad", [
    ("run", ""), ("model", "m" * 129), ("inc", 7), ("region", None),
    ("frag", -1), ("round", True), ("base", 1.0), ("steps", 2**62 + 1), ("tokens", "5"),
])
def test_grad_meta_bounds(field, bad):
    with pytest.raises(ValueError, match=f"^malformed: field '{field}'"):
        parse_grad_meta(_meta(**{field: bad}))


def test_grad_meta_learner_must_be_a_subject_token_and_meta_an_object():
    with pytest.raises(ValueError, match="^malformed: .*learner"):
        parse_grad_meta(_meta(learner="a.b"))
    with pytest.raises(ValueError, match="^malformed: expected fields"):
        parse_grad_meta([1, 2])  # type: ignore[arg-type]
    m = _meta(steps=2**62, frag=0)
    assert parse_grad_meta(m) is m


def _hb(**patch) -> dict:
    raw = heartbeat_to_dict(Heartbeat("l0", "eu", "inc-a", 5, 10.0, {0: 1}, T0))
    raw.update(patch)
    return raw


@pytest.mark.parametrize("faults, reason", [
    ({"step": -1, "learner": "a.b"}, "bad_id"),
    ({"leaving": "yes", "incarnation": ""}, "bad_incarnation"),
    ({"versions": "v", "tokens_per_s": -1}, "bad_tokens_per_s"),
    ({"leaving": 1, "sent_at": T0 + 3600}, "from_future"),
    ({"leaving": 1, "versions": {"x": 1}}, "bad_versions"),
    ({"pace": -1.0, "leaving": "no"}, "bad_leaving"),
])
def test_a_heartbeat_with_several_faults_gets_the_same_reason_whatever_its_key_order(faults, reason):
    for raw in (_hb(**faults), {**faults, **_hb(**faults)}, dict(reversed(list(_hb(**faults).items())))):
        with pytest.raises(InvalidHeartbeat) as e:
            validate_heartbeat(raw, now=T0)
        assert e.value.reason == reason, raw


def test_a_missing_field_comes_before_any_bad_one():
    raw = _hb(step=-1, learner="")
    del raw["sent_at"]
    with pytest.raises(InvalidHeartbeat) as e:
        validate_heartbeat(raw, now=T0)
    assert e.value.reason == "missing_field"


def test_heartbeat_limits_change_the_schema_and_odd_keys_are_ignored():
    limits = HeartbeatLimits(max_id_len=3, max_step=10)
    assert validate_heartbeat(_hb(learner="abc", step=10), now=T0, limits=limits).learner == "abc"
    for patch, reason in (({"learner": "abcd"}, "bad_id"), ({"step": 11}, "bad_step")):
        with pytest.raises(InvalidHeartbeat) as e:
            validate_heartbeat(_hb(**patch), now=T0, limits=limits)
        assert e.value.reason == reason
    assert validate_heartbeat(_hb(learner="abcd"), now=T0).learner == "abcd"  # the default limits again
    odd = {**_hb(), 7: "a key that is not a string", None: 1}
    assert validate_heartbeat(odd, now=T0) == validate_heartbeat(_hb(), now=T0)


@pytest.mark.parametrize("patch", [
    {"last_seen": math.inf}, {"since": math.nan}, {"tokens_per_s": -math.inf}, {"step": True}, {"reason": None},
])
def test_member_record_times_and_counters_must_be_finite_numbers(patch):
    members, _ = on_heartbeat({}, Heartbeat("l0", "eu", "inc-a", 5, 10.0, {0: 1}, T0), T0, None, MembershipConfig())
    raw = member_to_dict(members["l0"])
    assert member_from_dict(raw) == members["l0"]
    with pytest.raises(ValueError):
        member_from_dict({**raw, **patch})


def test_a_heartbeats_pace_is_optional_bounded_and_reaches_the_member_record():
    from bus.heartbeat import decode_heartbeat

    raw = heartbeat_to_dict(Heartbeat("l0", "eu", "inc-a", 5, 10.0, {0: 1}, T0, pace=250.0))
    for hb in (validate_heartbeat(raw, now=T0), decode_heartbeat(orjson.dumps(raw), now=T0)):
        assert hb.pace == 250.0
    assert "pace" not in _hb() and validate_heartbeat(_hb(), now=T0).pace == 0.0  # an older learner's
    for bad in (-1.0, math.inf, "fast", True, 2e12):
        for read in (lambda r: validate_heartbeat(r, now=T0), lambda r: decode_heartbeat(orjson.dumps(r), now=T0)):
            with pytest.raises(InvalidHeartbeat) as e:
                read(_hb(pace=bad) if bad is not math.inf else {**_hb(), "pace": math.inf})
            assert e.value.reason == "bad_pace", (bad, e.value.reason)
    members, _ = on_heartbeat({}, validate_heartbeat(raw, now=T0), T0, None, MembershipConfig())
    assert members["l0"].pace == 250.0
    back = member_from_dict(orjson.loads(orjson.dumps(member_to_dict(members["l0"]))))
    assert back == members["l0"]
    old = {k: v for k, v in member_to_dict(members["l0"]).items() if k != "pace"}  # an older monitor's record
    assert member_from_dict(old).pace == 0.0
    with pytest.raises(ValueError):
        member_from_dict({**member_to_dict(members["l0"]), "pace": math.nan})
