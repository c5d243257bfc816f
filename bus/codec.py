"""Arrays to bytes and back: a small msgpack header and the raw buffers, no per-element encoding.

Wire layout of one encoded array (a "blob")::

    u32 little-endian header length | msgpack header | part 0 bytes | part 1 bytes | ...

The header is ``{"v": 1, "q": quantiser, "b": block, "dt": original dtype, "sh": shape}``; the
parts are the quantiser's arrays (see :mod:`bus.quant`), whose sizes follow from shape, quantiser
and block. Encoding makes one copy (into a preallocated buffer); decoding is zero-copy for fp32
(a read-only view on the received buffer).

Heartbeats and metrics are JSON via orjson (:func:`dumps_json`, :func:`loads_json`).
"""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import orjson

from bus import quant

VERSION = 1
MAX_HEADER = 4096
MAX_ELEMENTS = 2**34  # 64 GiB of float32: anything larger in a header is garbage


class CodecError(ValueError):
    """A blob is malformed: the message names what is wrong."""


def encode_array(arr: np.ndarray, q: str = "fp32", block: int = quant.DEFAULT_BLOCK) -> bytearray:
    """Blob of ``arr`` (any float dtype; sent as float32 under quantiser ``q``)."""
    a = np.asarray(arr)
    if a.dtype.kind != "f":
        raise CodecError(f"dtype {a.dtype}: expected a floating-point array")
    parts = quant.quantise(a.reshape(-1), q, block)
    header = msgpack.packb({"v": VERSION, "q": q, "b": block, "dt": a.dtype.str, "sh": list(a.shape)})
    total = 4 + len(header) + sum(p.nbytes for p in parts)
    out = bytearray(total)
    struct.pack_into("<I", out, 0, len(header))
    out[4 : 4 + len(header)] = header
    off = 4 + len(header)
    for p in parts:
        np.frombuffer(out, dtype=np.uint8, count=p.nbytes, offset=off)[:] = p.reshape(-1).view(np.uint8)
        off += p.nbytes
    return out


def decode_header(buf: bytes | bytearray | memoryview) -> tuple[dict, int]:
    """(header, offset of the first part). Raises :class:`CodecError` on anything malformed."""
    mv = memoryview(buf)
    if mv.nbytes < 4:
        raise CodecError(f"blob of {mv.nbytes} bytes: too short for a header")
    (hl,) = struct.unpack_from("<I", mv, 0)
    if hl == 0 or hl > MAX_HEADER or 4 + hl > mv.nbytes:
        raise CodecError(f"header length {hl}: expected 1..{MAX_HEADER} within a {mv.nbytes}-byte blob")
    try:
        h = msgpack.unpackb(mv[4 : 4 + hl], raw=False, strict_map_key=True)
    except Exception as e:
        raise CodecError(f"header is not msgpack: {e}") from None
    if not isinstance(h, dict) or h.get("v") != VERSION:
        raise CodecError(f"header {h!r:.80}: expected a version-{VERSION} map")
    qn, block, shape, dt = h.get("q"), h.get("b"), h.get("sh"), h.get("dt")
    if qn not in quant.QUANTISERS:
        raise CodecError(f"quantiser {qn!r}: expected one of {', '.join(quant.QUANTISERS)}")
    if not isinstance(block, int) or block < 2 or block % 2 or block > 1 << 20:
        raise CodecError(f"block {block!r}: expected an even integer in 2..{1 << 20}")
    if not isinstance(shape, list) or len(shape) > 8 or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise CodecError(f"shape {shape!r}: expected a list of at most 8 non-negative integers")
    if math.prod(shape) > MAX_ELEMENTS:
        raise CodecError(f"shape {shape!r}: too many elements")
    try:
        if not isinstance(dt, str) or np.dtype(dt).kind != "f":
            raise TypeError
    except TypeError:
        raise CodecError(f"dtype {dt!r}: expected a floating-point dtype string") from None
    return h, 4 + hl


def decode_array(buf: bytes | bytearray | memoryview) -> np.ndarray:
    """The float32 array of a blob, with its shape. fp32 blobs decode to a view on ``buf``."""
    h, off = decode_header(buf)
    shape = tuple(h["sh"])
    n = math.prod(shape)
    specs = quant.part_specs(h["q"], n, h["b"])
    need = off + sum(d.itemsize * c for d, c in specs)
    mv = memoryview(buf)
    if mv.nbytes != need:
        raise CodecError(f"blob of {mv.nbytes} bytes: header {h['q']} {list(shape)} needs exactly {need}")
    parts = []
    for d, c in specs:
        parts.append(np.frombuffer(mv, dtype=d, count=c, offset=off))
        off += d.itemsize * c
    return quant.dequantise(parts, h["q"], n, h["b"]).reshape(shape)


def dumps_json(obj: object) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


def loads_json(data: bytes | bytearray | memoryview | str) -> object:
    """Parse JSON; raises :class:`CodecError` (never anything else) on garbage."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise CodecError(f"not JSON: {e}") from None
