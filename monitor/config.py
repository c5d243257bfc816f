"""Settings of the membership monitor (``diloco monitor``), from ``DILOCO_*`` environment variables.

The failure-detection timings live here because the monitor owns them; learners send heartbeats
every ``DILOCO_HEARTBEAT_INTERVAL`` seconds and the monitor decides from their silence:

* ``DILOCO_SUSPECT_AFTER``: an active learner silent this long is *suspect* (left out of quorum).
* ``DILOCO_EVICT_AFTER``: a learner silent this long is *evicted* and must rejoin.

Operational advice: on WAN links or through a leaf-node hop, heartbeats can arrive in bursts after
a reconnect; keep ``suspect_after`` at 3+ heartbeat intervals and ``evict_after`` above the longest
network hiccup you want to ride out (each eviction costs a learner a resynchronisation).
``DILOCO_LEASE_TTL`` bounds how long a run goes without a membership writer after the leading
monitor dies; it must exceed the clock skew between monitor hosts (the lease stores wall-clock
times).
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from bus.config import integer, number, register, var
from monitor.membership import MembershipConfig

_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")


def optional_token():
    """Parser: empty, or a NATS-subject-safe token (letters, digits, '-' and '_', at most 64)."""

    def parse(s: str) -> str:
        if s and not _TOKEN_RE.fullmatch(s):
            raise ValueError("expected empty or 1-64 letters, digits, '-' and '_'")
        return s

    return parse


def default_monitor_id() -> str:
    """``<hostname>-<pid>``, reduced to subject-safe characters and at most 64 of them."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname() or "host").strip("-") or "host"
    pid = str(os.getpid())
    return f"{host[: 63 - len(pid)]}-{pid}"


@register("monitor")
@dataclass(frozen=True)
class MonitorConfig:
    """Settings of the monitor role (failure detection, leader lease)."""

    heartbeat_interval: float = var(
        1.0, number(0.05, 60), "seconds between heartbeats (learners send them, the monitor ticks twice as often)"
    )
    suspect_after: float = var(
        3.0, number(0.01, 86400), "seconds of silence after which an active learner is suspect (out of quorum)"
    )
    evict_after: float = var(5.0, number(0.01, 86400), "seconds of silence after which a learner is evicted")
    monitor_id: str = var("", optional_token(), "id of this monitor process (empty: hostname-pid)")
    lease_ttl: float = var(
        3.0, number(0.05, 3600), "seconds a monitor's leader lease lasts unless renewed (renewed every ttl/3)"
    )
    max_version_lag: int = var(
        2, integer(0, 1_000_000), "a (re)joining learner turns active once it holds every fragment at >= current - lag"
    )
    max_members: int = var(10_000, integer(1, 10_000_000), "learners the monitor tracks at most (bounds a heartbeat flood)")
    forget_after: float = var(
        86400.0, number(0.0, 1e9), "seconds after its eviction that a silent learner is deleted from membership (0: never)"
    )
    kv_refresh: float = var(
        5.0, number(0.05, 86400), "seconds between KV rewrites of a member whose state did not change (last_seen, step)"
    )

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval", "suspect_after", "evict_after", "lease_ttl", "kv_refresh"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or v == float("inf"):
                raise ValueError(f"DILOCO_{name.upper()}={v!r}: expected a finite number > 0")
        if not self.heartbeat_interval < self.suspect_after:
            raise ValueError(
                f"DILOCO_HEARTBEAT_INTERVAL={self.heartbeat_interval:g} must be < DILOCO_SUSPECT_AFTER="
                f"{self.suspect_after:g} (otherwise every learner turns suspect between two heartbeats)"
            )
        if not self.suspect_after < self.evict_after:
            raise ValueError(
                f"DILOCO_SUSPECT_AFTER={self.suspect_after:g} must be < DILOCO_EVICT_AFTER={self.evict_after:g}"
            )
        if self.monitor_id and not _TOKEN_RE.fullmatch(self.monitor_id):
            raise ValueError(f"DILOCO_MONITOR_ID={self.monitor_id!r}: expected 1-64 letters, digits, '-' and '_'")

    @property
    def resolved_id(self) -> str:
        """``monitor_id``, or ``<hostname>-<pid>`` when it is empty."""
        return self.monitor_id or default_monitor_id()

    def membership_config(self) -> MembershipConfig:
        """The pure core's timing config (startup grace = ``evict_after``)."""
        return MembershipConfig(
            heartbeat_interval=float(self.heartbeat_interval),
            suspect_after=float(self.suspect_after),
            evict_after=float(self.evict_after),
            startup_grace=None,
            max_version_lag=int(self.max_version_lag),
        )
