"""Splitting a blob into chunk messages and assembling them back (pure: time is passed in).

A chunk message carries two headers:

* ``Nats-Msg-Id``: ``<object id>.<i>``, so JetStream stores a retried chunk once;
* ``Diloco-Chunk``: compact JSON ``{"o": object id, "i": index, "n": count, "s": blob size,
  "c": crc32 of the whole blob, "m": {metadata}}``. Every chunk carries the metadata, so any chunk
  alone says what it belongs to.

:class:`Assembler` delivers an object only when all ``n`` chunks of the same object id arrived,
their headers agree, the sizes add up and the crc32 matches. A partial object (sender killed
mid-publish) expires after ``max_age`` seconds and is reported, never delivered. Recently completed
or rejected object ids are remembered so late duplicates (redeliveries) do not start new partials.
Every problem is reported as a :class:`Dropped` with a reason; nothing here raises on bad input.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
import orjson

CHUNK_HEADER = "Diloco-Chunk"
MSG_ID = "Nats-Msg-Id"
MAX_CHUNKS = 65_536
MAX_OBJECT_BYTES = 8 * 1024**3


class Gather:
    """A blob made of several buffers laid end to end, published without joining them: a chunk that
    lies within one buffer is a view on it, one that spans two is copied (at most ``max_chunk``
    bytes). The aggregator's checkpoint is one: a small header and its fragment's live arrays, which
    must not change until the blob is stored (the checkpoint held a copy of 8 bytes per value of
    its fragment while it was stored; issue 41)."""

    def __init__(self, parts):
        self.parts = tuple(memoryview(x).cast("B") for x in parts)
        self.nbytes = sum(x.nbytes for x in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def tobytes(self) -> bytes:
        return b"".join(self.parts)


Blob = bytes | bytearray | memoryview | Gather


def blob_size(blob: Blob) -> int:
    return blob.nbytes if isinstance(blob, Gather) else memoryview(blob).nbytes


def checksum(blob: Blob) -> int:
    if isinstance(blob, Gather):
        crc = 0
        for x in blob.parts:
            crc = zlib.crc32(x, crc)
        return crc & 0xFFFFFFFF
    return zlib.crc32(blob) & 0xFFFFFFFF


def split(blob: Blob, max_chunk: int) -> list[memoryview]:
    """Byte-format memoryviews of at most ``max_chunk`` bytes (at least one, even for an empty blob)."""
    if max_chunk < 1:
        raise ValueError(f"max_chunk={max_chunk}: expected >= 1")
    if isinstance(blob, Gather):
        return _split_gather(blob, max_chunk)
    mv = memoryview(blob).cast("B")
    if mv.nbytes == 0:
        return [mv]
    return [mv[i : i + max_chunk] for i in range(0, mv.nbytes, max_chunk)]


def _split_gather(blob: Gather, max_chunk: int) -> list[memoryview]:
    out: list[memoryview] = []
    pending: list[memoryview] = []  # the pieces of a chunk that spans buffers
    room = max_chunk
    for x in blob.parts:
        i = 0
        while i < x.nbytes:
            take = min(room, x.nbytes - i)
            piece = x[i:i + take]
            i += take
            room -= take
            if room == 0:
                out.append(piece if not pending else memoryview(b"".join([*pending, piece])))
                pending, room = [], max_chunk
            else:
                pending.append(piece)
    if pending or not out:
        out.append(memoryview(b"".join(pending)))
    return out


def chunk_headers(obj_id: str, index: int, count: int, size: int, crc: int, meta: dict) -> dict[str, str]:
    h = orjson.dumps({"o": obj_id, "i": index, "n": count, "s": size, "c": crc, "m": meta}).decode()
    return {MSG_ID: f"{obj_id}.{index}", CHUNK_HEADER: h}


@dataclass(frozen=True)
class Chunk:
    obj_id: str
    index: int
    count: int
    size: int
    crc: int
    meta: dict
    data: bytes
    token: Any = None  # the message handle, so the caller can ack once the object is consumed


class ChunkHeader(msgspec.Struct, frozen=True, gc=False):
    """Schema of the ``Diloco-Chunk`` header (unknown fields ignored); ``i < n`` is checked after."""

    o: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    i: Annotated[int, msgspec.Meta(ge=0)]
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNKS)]
    s: Annotated[int, msgspec.Meta(ge=0, le=MAX_OBJECT_BYTES)]
    c: Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
    m: dict


_decode_header = msgspec.json.Decoder(ChunkHeader).decode


def parse_chunk(headers: dict | None, data: bytes, token: Any = None) -> Chunk:
    """A :class:`Chunk` from a message, or ``ValueError(reason)`` with reason ``bad_header``."""
    raw = (headers or {}).get(CHUNK_HEADER)
    if raw is None:
        raise ValueError("bad_header: no Diloco-Chunk header")
    try:
        h = _decode_header(raw)
    except msgspec.ValidationError:
        raise ValueError(f"bad_header: out-of-range fields in {raw[:120]!r}") from None
    except Exception:
        raise ValueError("bad_header: Diloco-Chunk is not the expected JSON") from None
    if h.i >= h.n:
        raise ValueError(f"bad_header: out-of-range fields in {raw[:120]!r}")
    return Chunk(h.o, h.i, h.n, h.s, h.c, h.m, data, token)


@dataclass(frozen=True)
class Assembled:
    obj_id: str
    meta: dict
    blob: bytes
    tokens: list  # every message handle of the object, duplicates included


@dataclass(frozen=True)
class Dropped:
    obj_id: str
    reason: str  # bad_header | mismatch | size | checksum | expired | duplicate | too_large
    detail: str
    tokens: list


@dataclass
class _Partial:
    first: Chunk
    first_seen: float
    parts: dict[int, bytes] = field(default_factory=dict)
    tokens: list = field(default_factory=list)
    nbytes: int = 0


class Assembler:
    """Collects chunks into objects. ``add`` returns an :class:`Assembled`, a :class:`Dropped` or None."""

    def __init__(self, max_age: float = 60.0, max_pending_bytes: int = 2 * 1024**3, remember: int = 4096):
        self.max_age = max_age
        self.max_pending_bytes = max_pending_bytes
        self._partials: dict[str, _Partial] = {}
        self._done: OrderedDict[str, None] = OrderedDict()
        self._remember = remember
        self.pending_bytes = 0

    def _finish(self, obj_id: str) -> None:
        p = self._partials.pop(obj_id, None)
        if p is not None:
            self.pending_bytes -= p.nbytes
        self._done[obj_id] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)

    def add(self, c: Chunk, now: float) -> Assembled | Dropped | None:
        if c.obj_id in self._done:
            return Dropped(c.obj_id, "duplicate", f"chunk {c.index} of a finished object", [c.token])
        p = self._partials.get(c.obj_id)
        if p is None:
            if c.size + self.pending_bytes > self.max_pending_bytes:
                return Dropped(c.obj_id, "too_large", f"{c.size} bytes would exceed the pending limit", [c.token])
            p = self._partials[c.obj_id] = _Partial(c, now)
        f = p.first
        if (c.count, c.size, c.crc, c.meta) != (f.count, f.size, f.crc, f.meta):
            tokens = p.tokens + [c.token]
            self._finish(c.obj_id)
            return Dropped(c.obj_id, "mismatch", f"chunk {c.index} disagrees with chunk {f.index}", tokens)
        p.tokens.append(c.token)
        if c.index in p.parts:
            return None  # duplicate chunk of a pending object: keep its token, store once
        p.parts[c.index] = c.data
        p.nbytes += len(c.data)
        self.pending_bytes += len(c.data)
        if p.nbytes > f.size:
            self._finish(c.obj_id)
            return Dropped(c.obj_id, "size", f"chunks hold more than the {f.size} bytes announced", p.tokens)
        if len(p.parts) < f.count:
            return None
        blob = b"".join(p.parts[i] for i in range(f.count))
        self._finish(c.obj_id)
        if len(blob) != f.size:
            return Dropped(c.obj_id, "size", f"{len(blob)} bytes, {f.size} announced", p.tokens)
        if checksum(blob) != f.crc:
            return Dropped(c.obj_id, "checksum", "crc32 of the assembled blob does not match", p.tokens)
        return Assembled(c.obj_id, f.meta, blob, p.tokens)

    def expire(self, now: float) -> list[Dropped]:
        """Drop partial objects older than ``max_age``; their tokens should be acked (terminated)."""
        out = []
        for obj_id, p in list(self._partials.items()):
            if now - p.first_seen > self.max_age:
                self._finish(obj_id)
                out.append(Dropped(obj_id, "expired", f"{len(p.parts)}/{p.first.count} chunks after {self.max_age}s",
                                   p.tokens))
        return out

    @property
    def pending(self) -> int:
        return len(self._partials)
