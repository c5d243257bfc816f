"""Idempotent provisioning, inspection and deletion of a run's streams and KV buckets.

Every stream is bounded (``max_bytes``, and ``max_age`` or messages per subject) so a long run
cannot fill the disk:

* GRAD: outer-gradient chunks, limits retention, ``max_age`` = ``DILOCO_STREAM_MAX_AGE``, dedupe
  window 2 min (a retried chunk with the same ``Nats-Msg-Id`` is stored once). Acknowledged chunks
  stay until their age or the byte limit: a restarted aggregator replays its merge log from them
  (direct get enabled; :mod:`aggregator.mlog`).
* GLOBAL and STATE: versioned objects. Chunks alternate between two slots (sets of subjects), each
  keeping ``ceil(global_history / 2)`` messages: at least the committed version and the one being
  written are held, so a reader of v is not raced by the writer of v+1, and no write that dies
  before its head can evict the committed chunks (``VersionedStore.put``). An update never lowers
  the messages per subject of an existing stream (runs created before the slots kept 2 on one
  set of subjects, the committed version possibly behind a dead write). Direct get enabled.
* EVENTS: membership transitions and run events, 10k messages per subject.

``ensure_run`` may be called by every process of a run at start; existing streams are updated in
place to the configured limits.

**Sized from the run.** A stream that reaches ``max_bytes`` drops its *oldest* messages, and in
GLOBAL and STATE those can be the committed version of a fragment that has not changed for a
while: a version would be reported as written and be gone. So the byte limits come from the
run's parameter bytes (:func:`footprint`: what the per-subject limits can ever hold, with margin),
never below it: ``DILOCO_STREAM_MAX_BYTES`` = 0 (default) sizes every stream from the run, and an
explicit value that cannot hold the run is refused at start (:class:`LimitsTooSmall`, one line
with the bytes needed), by whichever process provisions (the aggregator, ``diloco run create``, an
island creating its run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from bus.subjects import GLOBAL, STATE, Subjects

KV_KINDS = ("members", "lease", "run")
MIB = 1024 * 1024
#: bytes a stream of a run holds when nothing sizes it (the events stream; any stream of a run whose
#: size is not known yet, e.g. ``diloco run create`` without a model)
DEFAULT_MAX_BYTES = 2 * 1024**3
#: per fragment and version, beyond its float32 values: codec and chunk headers, the head
PER_VERSION_OVERHEAD = 64 * 1024
#: the aggregator's state of a fragment: parameters and up to two optimizer arrays of the same
#: size (delayed Nesterov: momentum and buffer), plus its applied set and norm history
STATE_ARRAYS = 3
STATE_EXTRA = 256 * 1024
#: outer gradients the GRAD stream holds at least: one of every fragment from this many learners
GRAD_COPIES = 4
MARGIN = 1.25


class LimitsTooSmall(ValueError):
    """A configured stream limit cannot hold the run (one line: variable, stream, bytes needed)."""


def footprint(fragment_sizes: Sequence[int], global_history: int, max_chunk: int = MIB) -> dict[str, int]:
    """Bytes GLOBAL, STATE and GRAD must be able to hold for a run whose fragments hold
    ``fragment_sizes`` float32 values (pure). GLOBAL and STATE: every chunk subject full (two slots of
    ``ceil(global_history / 2)`` versions each), GLOBAL twice over for the keyframes of a quantised
    downlink; GRAD: ``GRAD_COPIES`` fp32 outer gradients of every fragment (learners' work not yet
    merged). Chunk headers are counted per chunk of ``max_chunk`` bytes."""
    per_slot = (global_history + 1) // 2
    versions = 2 * per_slot

    def blob(values: int) -> int:
        b = 4 * int(values)
        return b + PER_VERSION_OVERHEAD + 512 * math.ceil(max(b, 1) / max_chunk)

    frag = [blob(n) for n in fragment_sizes]
    return {
        "global": versions * 2 * sum(frag),
        "state": versions * sum(STATE_ARRAYS * f + STATE_EXTRA for f in frag),
        "grad": GRAD_COPIES * sum(frag),
    }


@dataclass(frozen=True)
class Limits:
    max_age: float = 3600.0
    max_bytes: int = DEFAULT_MAX_BYTES
    global_history: int = 2
    max_msg_size: int = 8 * 1024 * 1024 + 64 * 1024
    # per stream kind ("global", "state", "grad"): bytes sized from the run (``for_run``); a kind
    # not in here gets ``max_bytes``
    sized: tuple[tuple[str, int], ...] = ()

    @classmethod
    def from_config(cls, cfg) -> "Limits":  # CommonConfig
        return cls(cfg.stream_max_age, cfg.stream_max_bytes or DEFAULT_MAX_BYTES, cfg.global_history)

    @classmethod
    def for_run(cls, cfg, fragment_sizes: Sequence[int], run: str = "") -> "Limits":
        """The limits of a run of ``fragment_sizes`` under ``cfg`` (CommonConfig): each stream sized
        from :func:`footprint` with margin when ``DILOCO_STREAM_MAX_BYTES`` is 0, else that value,
        refused (:class:`LimitsTooSmall`) if a stream could not hold the run."""
        need = footprint(fragment_sizes, cfg.global_history, cfg.max_chunk_bytes)
        if cfg.stream_max_bytes:
            for kind, n in need.items():
                if n > cfg.stream_max_bytes:
                    total = 4 * sum(fragment_sizes)
                    raise LimitsTooSmall(
                        f"DILOCO_STREAM_MAX_BYTES={cfg.stream_max_bytes} cannot hold run {run!r}: its {kind} stream "
                        f"needs {n} bytes ({total} bytes of float32 parameters); set at least "
                        f"{max(need.values())}, or 0 to size every stream from the run")
            return cls(cfg.stream_max_age, cfg.stream_max_bytes, cfg.global_history)
        sized = {k: max(int(v * MARGIN) + 16 * MIB, 64 * MIB) for k, v in need.items()}
        sized["grad"] = max(sized["grad"], DEFAULT_MAX_BYTES)  # as before: learners' backlog, by age
        return cls(cfg.stream_max_age, DEFAULT_MAX_BYTES, cfg.global_history, sized=tuple(sorted(sized.items())))

    def bytes_of(self, kind: str) -> int:
        return dict(self.sized).get(kind, self.max_bytes)

    @property
    def per_slot(self) -> int:
        """Messages per subject of GLOBAL and STATE: versions alternate between two chunk subjects."""
        return (self.global_history + 1) // 2


def stream_configs(s: Subjects, lim: Limits) -> list[StreamConfig]:
    """The stream configs of a run (pure)."""
    common = dict(storage=StorageType.FILE, num_replicas=1)
    return [
        StreamConfig(
            name=s.stream("grad"),
            max_bytes=lim.bytes_of("grad"),
            subjects=[s.grad_all],
            retention=RetentionPolicy.LIMITS,
            max_age=lim.max_age,
            duplicate_window=120.0,
            discard=DiscardPolicy.OLD,
            allow_direct=True,  # a restarted aggregator reads merged contributions back (aggregator.mlog)
            **common,
        ),
        StreamConfig(
            name=s.stream(GLOBAL),
            max_bytes=lim.bytes_of("global"),
            subjects=[s.versioned_all(GLOBAL)],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=lim.per_slot,
            allow_direct=True,
            duplicate_window=120.0,
            **common,
        ),
        StreamConfig(
            name=s.stream(STATE),
            max_bytes=lim.bytes_of("state"),
            subjects=[s.versioned_all(STATE)],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=lim.per_slot,
            allow_direct=True,
            duplicate_window=120.0,
            **common,
        ),
        StreamConfig(
            name=s.stream("events"),
            max_bytes=lim.max_bytes,
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
                try:
                    await js.update_stream(cfg)
                except APIError as e:
                    _raise_storage(e, cfg)
                    raise
        except NotFoundError:
            try:
                await js.add_stream(cfg)
            except APIError as e:
                _raise_storage(e, cfg)
                # another process created it first: make sure it now exists
                try:
                    await js.stream_info(cfg.name)
                except NotFoundError:
                    raise e from None
    for kind in KV_KINDS:
        bucket = s.bucket(kind)
        try:
            await js.key_value(bucket)
        except BucketNotFoundError:
            await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=1 if kind != "members" else 5, storage=StorageType.FILE,
                               max_bytes=64 * 1024 * 1024)
            )


class StorageUnavailable(RuntimeError):
    """The server cannot reserve a stream's bytes (its JetStream storage or disk is too small)."""


def _raise_storage(e: Exception, cfg: StreamConfig) -> None:
    if getattr(e, "err_code", None) == 10047 or "insufficient storage" in str(e).lower():
        raise StorageUnavailable(
            f"nats-server cannot reserve {cfg.max_bytes} bytes for stream {cfg.name} (insufficient storage: "
            "its jetstream max_file_store, or free disk): give the server more storage, or set "
            "DILOCO_STREAM_MAX_BYTES / DILOCO_GLOBAL_HISTORY lower (not below what the run needs)") from None


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
