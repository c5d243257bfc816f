"""Arrays to bytes and back: a small msgpack header and the raw buffers, no per-element encoding.

Wire layout of one encoded array (a "blob")::

    u32 little-endian header length | msgpack header | part 0 bytes | part 1 bytes | ...

The header is ``{"v": 1, "q": quantiser, "b": block, "dt": original dtype, "sh": shape}`` (a
sparse codec adds ``"k"``, its values per chunk of ``b``); the parts are the quantiser's arrays
(see :mod:`bus.quant` and :mod:`bus.sparse`), whose sizes follow from shape, codec, block and k. Encoding makes one copy (into a preallocated buffer); decoding is zero-copy for fp32
(a read-only view on the received buffer).

Heartbeats and metrics are JSON via orjson (:func:`dumps_json`, :func:`loads_json`).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import msgpack
import numpy as np
import orjson

from bus import quant, sparse

VERSION = 1
#: every outer-gradient codec: the dense quantisers and the sparse top-k ones (``bus.sparse``)
CODECS = quant.QUANTISERS + sparse.SPARSE
MAX_HEADER = 4096
MAX_ELEMENTS = 2**34  # 64 GiB of float32: anything larger in a header is garbage
#: a sparse blob's size does not grow with its length (a header of a few bytes declares it), so its
#: decoding is bounded tighter: 8 GiB of float32 (a receiver bounds it by its own fragments too)
MAX_SPARSE_ELEMENTS = 2**31


def codec_args(q: str, chunk: int, k: int) -> dict:
    """The keyword arguments of a codec's encode: a sparse codec's chunk (``block``) and ``k``; none
    for a dense quantiser (its default block)."""
    return {"block": chunk, "k": k} if q in sparse.SPARSE else {}


class CodecError(ValueError):
    """A blob is malformed: the message names what is wrong."""


#: the dtypes a float32 vector's state may be stored in: an error-feedback residual (learner) or
#: the ``rounds`` optimizer's momentum (aggregator)
STORAGE_DTYPES = ("float32", "bfloat16")


def storage_dtype(name: str, what: str = "storage dtype") -> np.dtype:
    """The numpy dtype of a name of ``STORAGE_DTYPES`` (bfloat16 is ``ml_dtypes``', which JAX
    installs, imported only here); ``what`` names the setting in the error."""
    if name == "float32":
        return np.dtype(np.float32)
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    raise CodecError(f"{what} {name!r}: expected one of {', '.join(STORAGE_DTYPES)}")


def residual_dtype_for(setting: str, q: str, sizes: Sequence[int] = ()) -> str:
    """The dtype a learner keeps its residual in under codec ``q`` (``DILOCO_RESIDUAL_DTYPE``) for
    fragments of ``sizes``: ``auto`` is bfloat16 for a dense quantiser, whose residual is at most
    half a quantisation step of its block, and float32 for a sparse codec, whose residual holds the
    values not sent yet (rounding them round after round would erode them), and where the largest
    fragment holds half the model or more (1 or 2 fragments): a bfloat16 residual's syncs fold into
    a float32 scratch of the largest fragment, which would then cost what the residual saves."""
    if setting == "auto":
        if q in sparse.SPARSE or q == "fp32" or (sizes and 2 * max(sizes) >= sum(sizes)):
            return "float32"
        return "bfloat16"
    storage_dtype(setting, "residual dtype")  # (a name it knows)
    return setting


def encode_array(arr: np.ndarray, q: str = "fp32", block: int | None = None, k: int | None = None) -> bytearray:
    """Blob of ``arr`` (any float dtype; sent as float32 under codec ``q``). ``block``: the dense
    quantisers' block (``quant.DEFAULT_BLOCK``) or a sparse codec's chunk (``sparse.DEFAULT_CHUNK``);
    ``k``: a sparse codec's values per chunk (``sparse.DEFAULT_K``)."""
    a = np.asarray(arr)
    if a.dtype.kind != "f":
        raise CodecError(f"dtype {a.dtype}: expected a floating-point array")
    head = {"v": VERSION, "q": q, "b": block, "dt": a.dtype.str, "sh": list(a.shape)}
    if q in sparse.SPARSE:
        head["b"], head["k"] = block or sparse.DEFAULT_CHUNK, k or sparse.DEFAULT_K
        parts = sparse.encode_parts(a.reshape(-1), q, head["b"], head["k"])[0]
    else:
        head["b"] = block or quant.DEFAULT_BLOCK
        parts = quant.quantise(a.reshape(-1), q, head["b"])
    return _write_blob(head, parts)


def _write_blob(head: dict, parts: list[np.ndarray]) -> bytearray:
    header = msgpack.packb(head)
    total = 4 + len(header) + sum(p.nbytes for p in parts)
    out = bytearray(total)
    struct.pack_into("<I", out, 0, len(header))
    out[4 : 4 + len(header)] = header
    off = 4 + len(header)
    for p in parts:
        np.frombuffer(out, dtype=np.uint8, count=p.nbytes, offset=off)[:] = p.reshape(-1).view(np.uint8)
        off += p.nbytes
    return out


def encode_with_feedback(delta: np.ndarray, residual: np.ndarray | None, q: str, *, keep_residual: bool,
                         block: int | None = None, chunk: int = 1 << 16, want_sent: bool = True,
                         in_place: bool = False, k: int | None = None, decay: float = 1.0,
                         residual_dtype: str = "float32") -> tuple[bytearray, np.ndarray | None, np.ndarray | None, float]:
    """One error-feedback round, fused: (blob, sent, new residual, relative error).

    ``want_sent=False`` returns None for ``sent`` and allocates no array of the fragment's size for
    it (``decode_array(blob)`` gives it bitwise, should it be needed later). ``in_place`` (with
    ``residual=None`` and ``keep_residual``): ``delta`` already holds the corrected vector, and the
    new residual is written over it, chunk by chunk (a learner accumulates its outer gradient into
    its residual's memory: no array of the fragment's size at all).

    ``corrected = delta + residual`` (in ``delta``'s memory: the caller hands it over), the blob
    of ``corrected`` under ``q``, ``sent`` = what a receiver decodes from it, and with
    ``keep_residual`` the new residual ``corrected - sent`` (written into ``residual`` when given,
    else a new array); relative error ``||corrected - sent|| / ||corrected||``. Bitwise what
    ``encode_array`` / ``decode_array`` / ``learner.outer.feedback_step`` give (quantiser blocks
    are independent, and chunks are whole blocks), but in chunks of ``chunk`` values written
    straight into the blob: no temporary of the fragment's size, and the chunk's temporaries stay
    in cache (2-3x faster for a fragment of millions of values).

    ``decay`` (error-feedback decay, SparseLoCo's beta): ``corrected = delta + decay x residual``
    (with ``in_place`` the caller has folded the residual in already, decayed or not). A sparse
    codec (``bus.sparse``; ``block`` its chunk, ``k`` its values per chunk) keeps everything it does
    not send in the residual: the new residual is ``corrected`` with the sent values taken off.

    The residual may be kept in bfloat16 (``residual`` of that dtype, or ``residual_dtype`` for a
    new one): half its memory, each value rounded to 8 significant bits (by at most 2^-8 of itself)
    where it is stored. The
    corrected vector, the blob and the relative error are computed in float32 as before; only the
    carried residual is rounded (``learner.config``'s ``DILOCO_RESIDUAL_DTYPE``)."""
    x = np.asarray(delta)
    if x.dtype != np.float32 or x.ndim != 1 or not x.flags.c_contiguous or not x.flags.writeable:
        raise CodecError("encode_with_feedback: delta must be a writeable contiguous 1-D float32 array")
    n = x.size
    if residual is not None:
        if residual.shape != x.shape or residual.dtype.name not in STORAGE_DTYPES:
            raise CodecError(f"residual {residual.shape} {residual.dtype} does not match delta {x.shape} float32 "
                             "(or bfloat16)")
        if keep_residual and not residual.flags.writeable:
            residual = residual.copy()
    res_dt = storage_dtype(residual_dtype, "residual dtype") if residual is None else residual.dtype
    if in_place and (residual is not None or not keep_residual or res_dt != np.float32):
        raise CodecError("encode_with_feedback: in_place wants residual=None, keep_residual=True and a float32 residual")
    if not (0.0 <= decay <= 1.0):
        raise CodecError(f"decay {decay!r}: expected a number in 0..1")
    if q in sparse.SPARSE:
        return _sparse_feedback(x, residual, q, keep_residual, block or sparse.DEFAULT_CHUNK, k or sparse.DEFAULT_K,
                                want_sent, in_place, decay, chunk, res_dt)
    block = block or quant.DEFAULT_BLOCK
    out, views = _blob_for(n, q, block)
    sent = np.empty(n, dtype=np.float32) if want_sent else None
    unit = _unit(q, block)
    if in_place:
        new_res = x
    else:
        new_res = (residual if residual is not None else np.empty(n, dtype=res_dt)) if keep_residual else None
    rounded = new_res is not None and new_res.dtype != np.float32  # a bfloat16 residual: rounded where stored
    step = max(unit, chunk - chunk % unit)
    num = den = 0.0
    for s in range(0, n, step):
        e = min(n, s + step)
        c = x[s:e]
        if residual is not None:
            if decay == 1.0:
                c += residual[s:e]
            else:
                c += np.float32(decay) * residual[s:e].astype(np.float32, copy=False)
        parts = quant.quantise(c, q, block)
        _place(views, parts, q, s, block)
        sc = quant.dequantise(parts, q, e - s, block)
        if sent is not None:
            sent[s:e] = sc
        den += float(np.dot(c, c))
        if rounded:
            d = c - sc
            new_res[s:e] = d
            num += float(np.dot(d, d))
        elif new_res is not None:
            r = new_res[s:e]
            np.subtract(c, sc, out=r)
            num += float(np.dot(r, r))
        else:
            d = c - sc
            num += float(np.dot(d, d))
    if den == 0.0:
        err = 0.0 if num == 0.0 else float("inf")
    else:
        err = math.sqrt(num / den)
    return out, sent, new_res, err


def _sparse_feedback(x: np.ndarray, residual: np.ndarray | None, q: str, keep_residual: bool, block: int, k: int,
                     want_sent: bool, in_place: bool, decay: float, step: int,
                     res_dt=np.float32) -> tuple[bytearray, np.ndarray | None, np.ndarray | None, float]:
    """encode_with_feedback for a sparse codec: corrected in ``x``'s memory, the top-k of each chunk
    sent, the rest (and each sent value's quantisation error) kept."""
    try:
        sparse.check_settings(q, block, k)
    except sparse.SparseError as e:
        raise CodecError(str(e)) from None
    n = x.size
    if residual is not None:
        for s in range(0, n, step):
            if decay == 1.0:
                x[s:s + step] += residual[s:s + step]
            else:
                x[s:s + step] += np.float32(decay) * residual[s:s + step].astype(np.float32, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):
        den = float(np.dot(x, x))
    parts, idx, vals = sparse.encode_parts(x, q, block, k, sumsq=den)
    head = {"v": VERSION, "q": q, "b": block, "dt": np.dtype(np.float32).str, "sh": [n], "k": k}
    out = _write_blob(head, parts)
    picked = x[idx]
    err = picked - vals
    num = max(0.0, den - float(np.dot(picked, picked)) + float(np.dot(err, err)))
    sent = None
    if want_sent:
        sent = np.zeros(n, dtype=np.float32)
        sent[idx] = vals
    new_res = None
    if in_place:
        new_res = x
    elif keep_residual:
        new_res = residual if residual is not None else np.empty(n, dtype=res_dt)
        for s in range(0, n, step):  # (chunk by chunk: a cast to bfloat16 makes no temporary of n)
            new_res[s:s + step] = x[s:s + step]
    if new_res is not None:
        new_res[idx] = err
    rel = (0.0 if num == 0.0 else float("inf")) if den == 0.0 else math.sqrt(num / den)
    return out, sent, new_res, rel


def encode_delta(x: np.ndarray, ref: np.ndarray, q: str, block: int = quant.DEFAULT_BLOCK,
                 chunk: int = 1 << 16) -> bytearray:
    """``encode_array(x - ref, q)``, bitwise, without a temporary of the vectors' size: the
    difference is taken and quantised chunk by chunk (whole quantiser blocks) straight into the
    blob, so it stays in cache (a quantised downlink delta against its keyframe)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    ref = np.asarray(ref, dtype=np.float32).reshape(-1)
    if x.shape != ref.shape:
        raise CodecError(f"delta of {x.size} values against a reference of {ref.size}")
    n = x.size
    out, views = _blob_for(n, q, block)
    unit = _unit(q, block)
    step = max(unit, chunk - chunk % unit)
    scratch = np.empty((2, min(step, max(n, 1))), dtype=np.float32)
    for s in range(0, n, step):
        e = min(n, s + step)
        d = scratch[0, : e - s]
        np.subtract(x[s:e], ref[s:e], out=d)
        if q == "int8" and (e - s) % block == 0:  # the fast path: straight into the blob's parts
            quant.quantise_int8_into(d, views[0][s // block:e // block], views[1][s:e], scratch[1], block)
        else:
            _place(views, quant.quantise(d, q, block), q, s, block)
    return out


def _unit(q: str, block: int) -> int:
    """Values a chunk of a chunked encode must be a multiple of: whole blocks, and for int2 also
    whole bytes of its codes (four a byte), so no two chunks write the same byte."""
    return math.lcm(block, 4) if q == "int2" else block


def _blob_for(n: int, q: str, block: int) -> tuple[bytearray, list[np.ndarray]]:
    """An empty blob of n float32 values under ``q`` (its header written) and views of its parts."""
    header = msgpack.packb({"v": VERSION, "q": q, "b": block, "dt": np.dtype(np.float32).str, "sh": [n]})
    specs = quant.part_specs(q, n, block)
    out = bytearray(4 + len(header) + sum(d.itemsize * c for d, c in specs))
    struct.pack_into("<I", out, 0, len(header))
    out[4:4 + len(header)] = header
    views, off = [], 4 + len(header)
    for d, c in specs:
        views.append(np.frombuffer(out, dtype=d, count=c, offset=off))
        off += d.itemsize * c
    return out, views


def _place(views: list[np.ndarray], parts: list[np.ndarray], q: str, start: int, block: int) -> None:
    """Write a chunk's wire parts (the chunk starts at value ``start``, a multiple of ``block``)."""
    if q in ("fp32", "bf16"):
        views[0][start:start + parts[0].size] = parts[0]
        return
    b0 = start // block
    views[0][b0:b0 + parts[0].size] = parts[0]  # one scale per block
    per = {"int8": 1, "int2": 4}.get(q, 2)  # values per byte of the codes part
    views[1][start // per:start // per + parts[1].size] = parts[1]


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
    if qn not in CODECS:
        raise CodecError(f"quantiser {qn!r}: expected one of {', '.join(CODECS)}")
    if qn in sparse.SPARSE:
        try:
            sparse.check_settings(qn, block, h.get("k"))
        except sparse.SparseError as e:
            raise CodecError(str(e)) from None
        if isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape) \
                and math.prod(shape) > MAX_SPARSE_ELEMENTS:
            raise CodecError(f"shape {shape!r}: too many elements for a sparse blob (at most {MAX_SPARSE_ELEMENTS})")
    elif not isinstance(block, int) or block < 2 or block % 2 or block > 1 << 20:
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


def decode_parts(buf: bytes | bytearray | memoryview) -> tuple[dict, tuple[int, ...], list[np.ndarray]]:
    """(header, shape, the wire parts as read-only views on ``buf``): a blob checked, not decoded.
    Raises :class:`CodecError` on anything malformed."""
    h, off = decode_header(buf)
    shape = tuple(h["sh"])
    n = math.prod(shape)
    sparse_codec = h["q"] in sparse.SPARSE
    specs = sparse.part_sizes(h["q"], n, h["b"], h["k"]) if sparse_codec else quant.part_specs(h["q"], n, h["b"])
    need = off + sum(d.itemsize * c for d, c in specs)
    mv = memoryview(buf)
    if mv.nbytes != need:
        raise CodecError(f"blob of {mv.nbytes} bytes: header {h['q']} {list(shape)} needs exactly {need}")
    parts = []
    for d, c in specs:
        parts.append(np.frombuffer(mv, dtype=d, count=c, offset=off))
        off += d.itemsize * c
    return h, shape, parts


def decode_array(buf: bytes | bytearray | memoryview, out=None) -> np.ndarray:
    """The float32 array of a blob, with its shape. fp32 blobs decode to a view on ``buf``.

    ``out(n)``: a callable giving a float32 buffer of n values to decode an int8 or sparse blob into (or
    None): the aggregator reuses its buffers, since a fresh array of a fragment's size costs page
    faults that took longer than the decode itself."""
    h, shape, parts = decode_parts(buf)
    n = math.prod(shape)
    if h["q"] in sparse.SPARSE:
        try:
            idx, vals = sparse.decode_parts(parts, h["q"], n, h["b"], h["k"])
        except sparse.SparseError as e:
            raise CodecError(str(e)) from None
        dst = out(n) if out is not None else None
        if dst is None:
            dst = np.zeros(n, dtype=np.float32)
        else:
            dst[...] = 0.0
        dst[idx] = vals
        return dst.reshape(shape)
    if out is not None and h["q"] == "int8" and n % h["b"] == 0:
        dst = out(n)
        if dst is not None:
            return quant.dequantise_int8_into(parts, dst, h["b"]).reshape(shape)
    return quant.dequantise(parts, h["q"], n, h["b"]).reshape(shape)


def dumps_json(obj: object) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


def loads_json(data: bytes | bytearray | memoryview | str) -> object:
    """Parse JSON; raises :class:`CodecError` (never anything else) on garbage."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise CodecError(f"not JSON: {e}") from None
