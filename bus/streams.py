"""Idempotent provisioning, inspection, listing and deletion of a run's streams and KV buckets.

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
* EVENTS: membership transitions and run events (a merge event per version), 10k messages per
  subject, 7 days, ``EVENTS_MAX_BYTES`` (64 MiB: 10k merge events of a few hundred bytes on each
  of a handful of subjects) whatever the model, or an explicit ``DILOCO_STREAM_MAX_BYTES`` if smaller.
* KV buckets: ``members`` 64 MiB (a bucket refuses new writes when full: a record per learner
  with its versions per fragment, 5 revisions each), ``lease`` 1 MiB, ``run`` twice the
  connection's ``max_payload`` (the manifest is one message of at most that), 16 MiB by default;
  ``progress`` 2 MiB (a record of ~300 bytes with its overhead per learner id: some 7,000 ids).

**What a run reserves.** nats-server *reserves* every stream's ``max_bytes`` against its
``max_file_store`` when the stream is created, however little it holds; a stream it cannot
reserve is refused (:class:`StorageUnavailable`, one line naming ``diloco run list`` /
``diloco run delete`` and what the account's streams reserve). So the limits are as small as the
run allows: a 10k-parameter run reserves 339 MiB (the floors; 4.3 GiB before), a 1M-parameter
one 377 MiB, so some 55 such runs fit a default ``diloco nats`` (20 GiB; 4 did before).
``diloco run list`` shows each run's stored and reserved bytes; ``diloco run delete`` frees a
finished run's reservation.

**Sized from the run.** A stream that reaches ``max_bytes`` drops its *oldest* messages, and in
GLOBAL and STATE those can be the committed version of a fragment that has not changed for a
while: a version would be reported as written and be gone. So the byte limits come from the
run's parameter bytes (:func:`footprint`: what the per-subject limits can ever hold, with margin),
never below it: ``DILOCO_STREAM_MAX_BYTES`` = 0 (default) sizes every stream from the run, and an
explicit value that cannot hold the run is refused at start (:class:`LimitsTooSmall`, one line
with the bytes needed), by whichever process provisions (the aggregator, ``diloco run create``, an
island creating its run). Each sized stream is ``max(MIN_STREAM_BYTES, 1.25 x need + 16 MiB)``:

* GLOBAL: ``need = footprint["global"]`` (two slots of versions of every fragment, twice over for
  the keyframes of a quantised downlink); STATE: ``footprint["state"]`` (three arrays per fragment
  and version, plus ``STATE_EXTRA`` for its applied set and merge-log records).
* GRAD: ``need = GRAD_REPLAY_COPIES (16) x`` the run's fp32 parameter bytes (chunk headers
  included), the sized stream capped at ``GRAD_REPLAY_MAX_BYTES`` (2 GiB), but never below
  ``GRAD_COPIES`` (4) outer gradients of every fragment (the learners' work not merged yet; an
  explicit limit below that is refused). Why 16 copies: GRAD also holds what a restarted
  aggregator replays, every contribution merged since the newest checkpoint of a fragment (up to
  ``2 x DILOCO_CHECKPOINT_EVERY`` versions x the contributions of a version). For a small model the
  floor holds all of it (64 MiB = 64 versions x 16 learners x 16k fp32 parameters); for a big one
  no sane size could (64 x 4 learners x 25M parameters = 25 GiB), and none needs to: the
  aggregator checkpoints a fragment as soon as GRAD is about to drop what its log points to
  (``aggregator.mlog.stream_overtaking``: 75% full), after about ``0.75 x 16 = 12`` of its
  contributions at worst. A checkpoint writes 3x a fragment's bytes, so the extra STATE traffic is
  then at most 3 / 12 = 25% of GRAD's (less in practice: ``DILOCO_CHECKPOINT_SECONDS`` or
  ``DILOCO_CHECKPOINT_EVERY`` usually come first). The cap keeps a big run's GRAD at the 2 GiB
  every run reserved before (16 copies of 25M parameters is 1.9 GiB): no run reserves more than it
  did, and a small one reserves 64 MiB instead of 2 GiB.

A process that does not know the run's model (the monitor, which may start before the run exists,
``Limits()``, ``Limits.from_config``) creates missing streams at ``MIN_STREAM_BYTES`` (or the
explicit ``DILOCO_STREAM_MAX_BYTES``) and never re-sizes an existing one; the run's creator and the
aggregator (limits from :meth:`Limits.for_run`, ``ensure_run(update=True)``) then set every stream
to the run's size, up or down (a run created by an older version with 2 GiB streams shrinks to its
size at its aggregator's next start).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError

from bus.server import DEFAULT_MAX_FILE_STORE
from bus.subjects import GLOBAL, STATE, Subjects

KV_KINDS = ("members", "lease", "run", "progress")
MIB = 1024 * 1024
#: the smallest byte limit of a run's data stream (GLOBAL, STATE, GRAD), and what one gets from a
#: process that does not know the run's size (``Limits()``, ``Limits.from_config``: the monitor)
MIN_STREAM_BYTES = 64 * MIB
#: bytes a stream of a run holds when nothing sizes it (kept under this name for callers)
DEFAULT_MAX_BYTES = MIN_STREAM_BYTES
#: the EVENTS stream, whatever the model (small JSON events; 10k messages per subject)
EVENTS_MAX_BYTES = 64 * MIB
#: KV buckets. A KV bucket discards *new* writes when full, so ``members`` keeps its 64 MiB (a
#: record per learner with its versions per fragment, 5 revisions each); ``run`` is at least
#: twice the connection's max_payload (the manifest is one message); ``progress`` a ~250-byte record
#: per learner id, one revision (``bus.progress``)
KV_MAX_BYTES = {"members": 64 * MIB, "lease": 1 * MIB, "run": 16 * MIB, "progress": 2 * MIB}
#: per fragment and version, beyond its float32 values: codec and chunk headers, the head
PER_VERSION_OVERHEAD = 64 * 1024
#: the aggregator's state of a fragment: parameters and up to two optimizer arrays of the same
#: size (delayed Nesterov: momentum and buffer), plus its applied set and norm history
STATE_ARRAYS = 3
STATE_EXTRA = 256 * 1024
#: outer gradients the GRAD stream holds at least: one of every fragment from this many learners
GRAD_COPIES = 4
#: outer gradients of the whole model a GRAD stream sized from the run holds (the module docstring:
#: the merge log's replay window, bounded by early checkpoints)
GRAD_REPLAY_COPIES = 16
#: ... up to this many bytes (what GRAD reserved for every run before it was sized from the run)
GRAD_REPLAY_MAX_BYTES = 2 * 1024**3
MARGIN = 1.25
SLACK = 16 * MIB


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
    frag = _blobs(fragment_sizes, max_chunk)
    return {
        "global": versions * 2 * sum(frag),
        "state": versions * sum(STATE_ARRAYS * f + STATE_EXTRA for f in frag),
        "grad": GRAD_COPIES * sum(frag),
    }


def _blobs(fragment_sizes: Sequence[int], max_chunk: int) -> list[int]:
    """Bytes of one fp32 version of each fragment, with its codec and chunk headers."""
    def blob(values: int) -> int:
        b = 4 * int(values)
        return b + PER_VERSION_OVERHEAD + 512 * math.ceil(max(b, 1) / max_chunk)

    return [blob(n) for n in fragment_sizes]


def sized_bytes(fragment_sizes: Sequence[int], global_history: int, max_chunk: int = MIB) -> dict[str, int]:
    """``max_bytes`` of each data stream of a run sized from its parameters (pure; the module
    docstring): ``max(MIN_STREAM_BYTES, MARGIN x need + SLACK)``; GRAD holds
    ``GRAD_REPLAY_COPIES`` fp32 copies of the model up to ``GRAD_REPLAY_MAX_BYTES``, and never fewer
    than ``GRAD_COPIES``."""
    def grown(n: int) -> int:
        return max(int(n * MARGIN) + SLACK, MIN_STREAM_BYTES)

    need = footprint(fragment_sizes, global_history, max_chunk)
    out = {k: grown(v) for k, v in need.items()}
    replay = grown(GRAD_REPLAY_COPIES * sum(_blobs(fragment_sizes, max_chunk)))
    out["grad"] = max(out["grad"], min(replay, GRAD_REPLAY_MAX_BYTES))
    return out


@dataclass(frozen=True)
class Limits:
    max_age: float = 3600.0
    #: bytes of GLOBAL, STATE and GRAD when not sized from the run (an explicit
    #: DILOCO_STREAM_MAX_BYTES, or the floor)
    max_bytes: int = DEFAULT_MAX_BYTES
    global_history: int = 2
    max_msg_size: int = 8 * 1024 * 1024 + 64 * 1024
    # per stream kind ("global", "state", "grad"): bytes sized from the run (``for_run``); a kind
    # not in here gets ``max_bytes``
    sized: tuple[tuple[str, int], ...] = ()
    #: the limits of the run (``for_run``): ``ensure_run(update=True)`` applies their byte limits to
    #: existing streams; other limits (a process that does not know the model) never re-size one
    from_run: bool = False
    events_bytes: int = EVENTS_MAX_BYTES

    @classmethod
    def from_config(cls, cfg) -> "Limits":  # CommonConfig
        """Limits of a process that does not know the run's model (the monitor): missing streams at
        the explicit DILOCO_STREAM_MAX_BYTES or the floor; existing ones are never re-sized."""
        explicit = cfg.stream_max_bytes
        return cls(cfg.stream_max_age, explicit or DEFAULT_MAX_BYTES, cfg.global_history,
                   events_bytes=min(explicit or EVENTS_MAX_BYTES, EVENTS_MAX_BYTES))

    @classmethod
    def for_run(cls, cfg, fragment_sizes: Sequence[int], run: str = "") -> "Limits":
        """The limits of a run of ``fragment_sizes`` under ``cfg`` (CommonConfig): each stream sized
        by :func:`sized_bytes` when ``DILOCO_STREAM_MAX_BYTES`` is 0, else that value, refused
        (:class:`LimitsTooSmall`) if a stream could not hold the run."""
        need = footprint(fragment_sizes, cfg.global_history, cfg.max_chunk_bytes)
        if cfg.stream_max_bytes:
            for kind, n in need.items():
                if n > cfg.stream_max_bytes:
                    total = 4 * sum(fragment_sizes)
                    raise LimitsTooSmall(
                        f"DILOCO_STREAM_MAX_BYTES={cfg.stream_max_bytes} cannot hold run {run!r}: its {kind} stream "
                        f"needs {n} bytes ({total} bytes of float32 parameters); set at least "
                        f"{max(need.values())}, or 0 to size every stream from the run")
            return cls(cfg.stream_max_age, cfg.stream_max_bytes, cfg.global_history, from_run=True,
                       events_bytes=min(cfg.stream_max_bytes, EVENTS_MAX_BYTES))
        sized = sized_bytes(fragment_sizes, cfg.global_history, cfg.max_chunk_bytes)
        return cls(cfg.stream_max_age, DEFAULT_MAX_BYTES, cfg.global_history, sized=tuple(sorted(sized.items())),
                   from_run=True)

    def bytes_of(self, kind: str) -> int:
        if kind == "events":
            return self.events_bytes
        return dict(self.sized).get(kind, self.max_bytes)

    def reserved(self) -> dict[str, int]:
        """Bytes the run's streams and buckets reserve on the server under these limits, by kind
        ("grad", "global", "state", "events", "kv_members", ...): what ``ensure_run`` creates."""
        out = {k: self.bytes_of(k) for k in ("grad", GLOBAL, STATE, "events")}
        out.update({f"kv_{k}": v for k, v in KV_MAX_BYTES.items()})
        return out

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
            max_bytes=lim.bytes_of("events"),
            subjects=[s.events_all],
            retention=RetentionPolicy.LIMITS,
            max_msgs_per_subject=10_000,
            max_age=7 * 86400.0,
            **common,
        ),
    ]


#: the stream settings ``stream_configs`` sets (what :func:`needs_update` compares)
_MANAGED = ("subjects", "max_bytes", "max_age", "max_msgs_per_subject", "discard", "duplicate_window",
            "allow_direct", "retention", "storage", "num_replicas")


def needs_update(have: StreamConfig, want: StreamConfig) -> bool:
    """Whether an existing stream's config differs from ``want`` in a setting we manage (pure).
    An update that changes nothing is not sent: nats-server rewrites the stream's metadata file on
    every update, which fails on a full disk (an aggregator restarted then could not start)."""
    for name in _MANAGED:
        w = getattr(want, name, None)
        if name == "duplicate_window" and not w:
            w = 120.0  # 0: the server's default, two minutes
        if w is None:
            continue
        h = getattr(have, name, None)
        if name == "subjects":
            if sorted(h or []) != sorted(w):
                return True
        elif isinstance(w, float) or isinstance(h, float):
            if h is None or abs(float(h) - float(w)) > 1e-3:
                return True
        elif h != w:
            return True
    return False


async def ensure_run(js: JetStreamContext, run: str, lim: Limits = Limits(), update: bool = False) -> None:
    """Create every missing stream and bucket of ``run``; with ``update`` also apply ``lim`` to
    existing streams (only the processes that own the run's limits, its creator and the aggregator,
    should). Byte limits of existing streams change only with limits from :meth:`Limits.for_run`:
    a process that does not know the model never re-sizes a run's stream. Safe to call
    concurrently and repeatedly. :class:`StorageUnavailable` if the server cannot reserve a
    stream's or bucket's bytes."""
    s = Subjects(run)
    for cfg in stream_configs(s, lim):
        try:
            info = await js.stream_info(cfg.name)
            if update:
                have = info.config.max_msgs_per_subject or -1
                if cfg.max_msgs_per_subject and have > cfg.max_msgs_per_subject:
                    cfg.max_msgs_per_subject = have  # never trim an existing run's history
                if not lim.from_run:
                    cfg.max_bytes = info.config.max_bytes  # not sized from the run: leave its size
                if not needs_update(info.config, cfg):
                    continue
                try:
                    await js.update_stream(cfg)
                except APIError as e:
                    await _raise_storage(js, e, cfg.name, cfg.max_bytes or 0, run)
                    raise
        except NotFoundError:
            try:
                await js.add_stream(cfg)
            except APIError as e:
                await _raise_storage(js, e, cfg.name, cfg.max_bytes or 0, run)
                # another process created it first: make sure it now exists
                try:
                    await js.stream_info(cfg.name)
                except NotFoundError:
                    raise e from None
    payload = getattr(getattr(js, "_nc", None), "max_payload", None) or 0
    for kind in KV_KINDS:
        bucket = s.bucket(kind)
        try:
            await js.key_value(bucket)
        except BucketNotFoundError:
            size = KV_MAX_BYTES[kind] if kind != "run" else max(KV_MAX_BYTES[kind], 2 * int(payload))
            try:
                await js.create_key_value(
                    KeyValueConfig(bucket=bucket, history=1 if kind != "members" else 5, storage=StorageType.FILE,
                                   max_bytes=size, direct=True)
                )
            except APIError as e:
                await _raise_storage(js, e, f"KV_{bucket}", size, run)
                try:  # another process created it first
                    await js.key_value(bucket)
                except BucketNotFoundError:
                    raise e from None


class StorageUnavailable(RuntimeError):
    """The server cannot reserve a stream's bytes (its JetStream storage or disk is too small)."""


async def _raise_storage(js: JetStreamContext, e: Exception, name: str, nbytes: int, run: str) -> None:
    """Raise :class:`StorageUnavailable` if ``e`` is the server refusing to reserve ``nbytes`` for
    stream ``name``: one line that says what the account's streams reserve (best effort: a user
    without the rights to list streams gets the line without it) and how to free storage."""
    if not (getattr(e, "err_code", None) == 10047 or "insufficient storage" in str(e).lower()):
        return
    where = ""
    try:
        listing = await asyncio.wait_for(list_runs(js), timeout=5)
        runs = listing["runs"]
        where = (f"; this account's streams reserve {_gib(listing['reserved_bytes'])} "
                 f"({len(runs)} runs: " + ", ".join(f"{r} {_gib(v['reserved_bytes'])}"
                                                     for r, v in list(runs.items())[:8])
                 + (", ..." if len(runs) > 8 else "") + ")")
        lim = await asyncio.wait_for(js.account_info(), timeout=5)
        max_storage = getattr(getattr(lim, "limits", None), "max_storage", -1) or -1
        if max_storage > 0:
            where += f" of the account's {_gib(max_storage)}"
    except Exception:  # noqa: BLE001 - no rights to list or a slow server: the line without it
        pass
    raise StorageUnavailable(
        f"nats-server cannot reserve {nbytes} bytes ({_gib(nbytes)}) for stream {name} of run {run!r} "
        f"(insufficient storage: the server reserves every stream's max_bytes against its jetstream "
        f"max_file_store, {_gib(DEFAULT_MAX_FILE_STORE)} with `diloco nats`, or the free disk){where}: see what "
        "each run reserves with `diloco run list`, and free a finished run's storage with "
        "`DILOCO_RUN=<run> diloco run delete`; or give the server more storage, or set DILOCO_STREAM_MAX_BYTES / "
        "DILOCO_GLOBAL_HISTORY lower (not below what the run needs)") from None


def _gib(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / MIB:.0f} MiB"


def _stream_entry(info) -> dict:
    return {"messages": info.state.messages, "bytes": info.state.bytes,
            "reserved_bytes": max(int(info.config.max_bytes or 0), 0)}


async def inspect_run(js: JetStreamContext, run: str) -> dict:
    """Sizes of a run's streams and buckets: {name: {"messages", "bytes", "reserved_bytes"
    (its max_bytes: what the server reserves for it)} or None if missing}."""
    s = Subjects(run)
    out: dict[str, dict | None] = {}
    for cfg in stream_configs(s, Limits()):
        try:
            info = await js.stream_info(cfg.name)
            out[cfg.name] = {**_stream_entry(info),
                             "subjects": getattr(info.state, "subjects", None) and len(info.state.subjects) or 0}
        except NotFoundError:
            out[cfg.name] = None
    for kind in KV_KINDS:
        name = f"KV_{s.bucket(kind)}"
        try:
            out[name] = _stream_entry(await js.stream_info(name))
        except NotFoundError:
            out[name] = None
    return out


def reserved_total(inspected: dict) -> int:
    """Bytes reserved by the streams and buckets of an :func:`inspect_run` result."""
    return sum(v.get("reserved_bytes", 0) for v in inspected.values() if isinstance(v, dict))


STREAM_KINDS = ("GRAD", "GLOBAL", "STATE", "EVENTS")


def run_of_stream(name: str) -> str | None:
    """The run whose stream or KV bucket ``name`` is (``DILOCO_<run>_<KIND>``,
    ``KV_diloco_<run>_<kind>``), or None for a stream of no run."""
    for prefix, kinds in (("DILOCO_", STREAM_KINDS), ("KV_diloco_", KV_KINDS)):
        if name.startswith(prefix):
            for kind in kinds:
                if name.endswith("_" + kind) and len(name) > len(prefix) + len(kind) + 1:
                    return name[len(prefix):-len(kind) - 1]
    return None


async def list_runs(js: JetStreamContext) -> dict:
    """Every run on the server, found by its stream and bucket names: {"runs": {run: {"streams":
    {name: {"messages", "bytes", "reserved_bytes"}}, "bytes", "reserved_bytes", "complete"}},
    "bytes", "reserved_bytes" (all runs), "other_reserved_bytes" (streams of no run)}. Needs the
    right to list streams ($JS.API.STREAM.LIST)."""
    runs: dict[str, dict] = {}
    other = 0
    offset = 0
    while True:
        page = await js.streams_info(offset)
        if not page:
            break
        offset += len(page)
        for info in page:
            name = info.config.name
            run = run_of_stream(name)
            if run is None:
                other += max(int(info.config.max_bytes or 0), 0)
                continue
            r = runs.setdefault(run, {"streams": {}})
            r["streams"][name] = _stream_entry(info)
    for run, r in runs.items():
        r["bytes"] = sum(v["bytes"] for v in r["streams"].values())
        r["reserved_bytes"] = sum(v["reserved_bytes"] for v in r["streams"].values())
        r["complete"] = len(r["streams"]) == len(STREAM_KINDS) + len(KV_KINDS)
    ordered = dict(sorted(runs.items(), key=lambda kv: -kv[1]["reserved_bytes"]))
    return {"runs": ordered, "bytes": sum(r["bytes"] for r in runs.values()),
            "reserved_bytes": sum(r["reserved_bytes"] for r in runs.values()), "other_reserved_bytes": other}


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
