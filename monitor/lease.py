"""Leader lease of the monitor (pure): who may write the membership.

Several monitors may run for one run (a hot standby, or an old one that was not stopped). Only
the holder of the lease writes membership and publishes transitions; the others follow the
heartbeats in memory. The lease is one key, ``leader``, in the run's ``lease`` KV bucket, whose
value is ``{"id": holder, "until": wall-clock expiry, "ttl": seconds}``. Every change of the key is
a compare-and-set on its KV revision, so two monitors can never both succeed:

* no lease (missing or deleted key): **acquire** it with ``kv.create``;
* our own lease: **renew** it with ``kv.update(last=revision)`` every ``ttl / 3``;
* someone else's lease past its ``until``: **take over** with ``kv.update(last=revision)``;
* someone else's valid lease: **stand by**.

A holder stops writing slightly *before* its lease ends on its own clock (:func:`may_write`), and
a standby takes over only *after* it ends on the standby's clock, so with clocks closer than that
margin there is no window with two writers. Keep ``ttl`` well above the clock skew between monitor
hosts (NTP keeps it to milliseconds; a VM resumed from suspend does not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import orjson

LEASE_KEY = "leader"
#: A holder stops writing this share of ``ttl`` before its lease ends (its own clock).
SAFETY_SHARE = 0.1


class Action(str, Enum):
    ACQUIRE = "acquire"
    RENEW = "renew"
    TAKEOVER = "takeover"
    STANDBY = "standby"


@dataclass(frozen=True)
class Lease:
    """The current lease as read from KV. ``revision`` is the KV revision to compare-and-set on."""

    holder: str
    until: float
    revision: int


def lease_value(my_id: str, now: float, ttl: float) -> bytes:
    """The KV value written by ``my_id`` at ``now`` for a lease of ``ttl`` seconds."""
    return orjson.dumps({"id": my_id, "until": now + ttl, "ttl": ttl})


def parse_lease(data: bytes | None, revision: int) -> Lease:
    """The lease in a KV value. A malformed value reads as an expired lease of nobody (``""``),
    so it gets taken over (by compare-and-set) instead of blocking leadership forever."""
    try:
        d = orjson.loads(data or b"")
        holder, until = d["id"], d["until"]
        if not isinstance(holder, str) or isinstance(until, bool) or not isinstance(until, (int, float)):
            raise TypeError
        if not math.isfinite(until):
            raise ValueError
        return Lease(holder, float(until), int(revision))
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return Lease("", 0.0, int(revision))


def lease_decision(now: float, current: Lease | None, my_id: str, ttl: float) -> tuple[Action, str]:
    """What ``my_id`` should do with the lease at wall-clock ``now``: (action, reason for the log)."""
    if not ttl > 0:
        raise ValueError(f"lease ttl must be > 0, got {ttl!r}")
    if current is None:
        return Action.ACQUIRE, "no leader lease"
    if current.holder == my_id:
        if now >= current.until:
            return Action.RENEW, f"own lease expired {now - current.until:.2f}s ago, renewing"
        return Action.RENEW, "own lease"
    if now >= current.until:
        who = current.holder or "(malformed lease)"
        return Action.TAKEOVER, f"lease of {who} expired {now - current.until:.2f}s ago"
    return Action.STANDBY, f"{current.holder} holds the lease for {current.until - now:.2f}s more"


def may_write(now: float, held_until: float | None, ttl: float) -> bool:
    """True while a holder whose lease runs until ``held_until`` may still write membership."""
    return held_until is not None and now < held_until - SAFETY_SHARE * ttl
