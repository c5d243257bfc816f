"""Idempotent provisioning, inspection and deletion of a run's streams and KV buckets.

Every stream is bounded (``max_bytes``, and ``max_age`` or messages per subject) so a long run
cannot fill the disk:

* GRAD: outer-gradient chunks, limits retention, ``max_age`` = ``DILOCO_STREAM_MAX_AGE``, dedupe
  window 2 min (a retried chunk with the same ``Nats-Msg-Id`` is stored once).
* GLOBAL and STATE: versioned objects. Chunks alternate between two slots (sets of subjects), each
  keeping ``ceil(global_history / 2)`` messages: at least the committed version and the one being
  written are held, so a reader of v is not raced by the writer of v+1, and no write that dies
  before its head can evict the committed chunks (``VersionedStore.put``). An update never lowers
  the messages per subject of an existing stream (runs created before the slots kept 2 on one
  set of subjects, the committed version possibly behind a dead write). Direct get enabled.
* EVENTS: membership transitions and run events, 10k messages per subject.

``ensure_run`` may be called by every process of a run at start; existing streams are updated in
place to the configured limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BucketNotFoundError, NotFoundError

from bus.subjects import GLOBAL, STATE, Subjects

KV_KINDS = ("members", "lease", "run")


@dataclass(frozen=True)
class Limits:
    max_age: float = 3600.0
    max_bytes: int = 2 * 1024**3
    global_history: int = 2
    max_msg_size: int = 8 * 1024 * 1024 + 64 * 1024

    @classmethod
    def from_config(cls, cfg) -> "Limits":  # CommonConfig
        return cls(cfg.stream_max_age, cfg.stream_max_bytes, cfg.global_history)

    @property
    def per_slot(self) -> int:
        """Messages per subject of GLOBAL and STATE: versions alternate between two chunk subjects."""
        return (self.global_history + 1) // 2


def stream_configs(s: Subjects, lim: Limits) -> list[StreamConfig]:
    """The stream configs of a run (pure)."""
    common = dict(storage=StorageType.FILE, max_bytes=lim.max_bytes, num_replicas=1)
    return [
        StreamConfig(
            name=s.stream("grad"),
            subjects=[s.grad_all],
            retention=RetentionPolicy.LIMITS,
            max_age=lim.max_age,
            duplicate_window=120.0,
            discard=DiscardPolicy.OLD,
            **common,
        ),
        StreamConfig(
            name=s.stream(GLOBAL),
            subjects=[s.versioned_all(GLOBAL)],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=lim.per_slot,
            allow_direct=True,
            duplicate_window=120.0,
            **common,
        ),
        StreamConfig(
            name=s.stream(STATE),
            subjects=[s.versioned_all(STATE)],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=lim.per_slot,
            allow_direct=True,
            duplicate_window=120.0,
            **common,
        ),
        StreamConfig(
            name=s.stream("events"),
            subjects=[s.events_all],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=10_000,
            max_age=7 * 86400.0,
            **common,
        ),
    ]


async def ensure_run(js: JetStreamContext, run: str, lim: Limits = Limits(), update: bool = False) -> None:
    """Create every missing stream and bucket of ``run``; with ``update`` also apply ``lim`` to
    existing streams (only the process that owns the run's limits, the aggregator, should).
    Safe to call concurrently and repeatedly."""
    s = Subjects(run)
    for cfg in stream_configs(s, lim):
        try:
            info = await js.stream_info(cfg.name)
            if update:
                have = info.config.max_msgs_per_subject or -1
                if cfg.max_msgs_per_subject and have > cfg.max_msgs_per_subject:
                    cfg.max_msgs_per_subject = have  # never trim an existing run's history
                await js.update_stream(cfg)
        except NotFoundError:
            try:
                await js.add_stream(cfg)
            except Exception:
                # another process created it first: make sure it now exists
                await js.stream_info(cfg.name)
    for kind in KV_KINDS:
        bucket = s.bucket(kind)
        try:
            await js.key_value(bucket)
        except BucketNotFoundError:
            await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1 if kind != "members" else 5, storage=StorageType.FILE,
                               max_bytes=64 * 1024 * 1024)
            )


async def inspect_run(js: JetStreamContext, run: str) -> dict:
    """Sizes of a run's streams and buckets: {name: {"messages", "bytes"} or None if missing}."""
    s = Subjects(run)
    out: dict[str, dict | None] = {}
    for cfg in stream_configs(s, Limits()):
        try:
            info = await js.stream_info(cfg.name)
            out[cfg.name] = {"messages": info.state.messages, "bytes": info.state.bytes,
                             "subjects": getattr(info.state, "subjects", None) and len(info.state.subjects) or 0}
        except NotFoundError:
            out[cfg.name] = None
    for kind in KV_KINDS:
        name = f"KV_{s.bucket(kind)}"
        try:
            info = await js.stream_info(name)
            out[name] = {"messages": info.state.messages, "bytes": info.state.bytes}
        except NotFoundError:
            out[name] = None
    return out


async def missing_parts(js: JetStreamContext, run: str) -> list[str]:
    """Streams and buckets of ``run`` that do not exist (stream info only: no create rights needed)."""
    return sorted(name for name, info in (await inspect_run(js, run)).items() if info is None)


async def delete_run(js: JetStreamContext, run: str) -> list[str]:
    """Delete every stream and bucket of ``run``; returns what was deleted."""
    s = Subjects(run)
    deleted = []
    for cfg in stream_configs(s, Limits()):
        try:
            await js.delete_stream(cfg.name)
            deleted.append(cfg.name)
        except NotFoundError:
            pass
    for kind in KV_KINDS:
        try:
            await js.delete_key_value(s.bucket(kind))
            deleted.append(s.bucket(kind))
        except (NotFoundError, BucketNotFoundError):
            pass
    return deleted
