"""Sparse low-bit outer gradients: top-k per chunk, 2- or 4-bit values, packed indices (pure).

SparseLoCo's codec (arXiv 2508.15706): a flat float32 vector is cut into chunks of ``C`` values;
each chunk sends its ``k`` values of largest magnitude (the tail chunk ``min(k, its length)``),
each as a ``bits``-bit code against one scale per chunk, and their positions in the chunk as
``ceil(log2 C)``-bit indices. Everything not sent stays in the sender's error-feedback residual
(``encode_with_feedback``): decode(encode(x)) + residual == x, exactly where nothing was sent and
to one float32 rounding of the residual where a value was (``tests/test_bus_sparse.py``).

Codecs (``SPARSE``): ``topk2`` (codes 0..3 -> (2c - 3) / 3 x s, so ``|x - q| <= s / 3``) and
``topk4`` (codes 0..14 -> (c - 7) / 7 x s, ``|x - q| <= s / 14``), with ``s`` the chunk's absmax.
At C = 4096, k = 64 (Covenant-72B's setting, 1.56% of the values) ``topk2`` costs
(2 + 12) x 64 / 4096 + 32 / 4096 = 0.227 bits per value, against 8.125 for int8.

Wire parts, in order (sizes follow from n, C and k alone; a decoder checks each exactly):
``scales`` float32 x chunks | ``codes`` packed little-endian bitstream, ``bits`` per selected value |
``index`` packed bitstream, ``ceil(log2 C)`` bits per selected value. Within a chunk the indices
are strictly increasing: a duplicate, an index past the chunk's end, a code out of range or padding
bits that are not zero is rejected with a named reason (:class:`SparseError`). A vector holding a
non-finite value is sent with NaN scales, so it decodes to NaN and the aggregator refuses it as
``non_finite``, as with the dense codecs.

Selection is exact top-k (ties between equal magnitudes broken arbitrarily but deterministically):
a sample of every 8th magnitude gives a threshold a little under the k-th, ``|x| >= threshold``
gives candidates (about 2k a chunk), and the top k of the candidates are taken; a chunk with fewer
than k candidates falls back to a full partition: 2.7 ns a value here against 9 for a partition of
every chunk (docs/BENCHMARKS.md, "Codec speed").
"""

from __future__ import annotations

import math

import numpy as np

SPARSE = ("topk2", "topk4")
BITS = {"topk2": 2, "topk4": 4}
LEVELS = {"topk2": 3, "topk4": 14}  # the largest code
DEFAULT_CHUNK = 4096
DEFAULT_K = 64
MAX_CHUNK = 1 << 16
_BLOCK_VALUES = 1 << 18  # values selected at a time (64 chunks of 4096: the temporaries stay in cache)
_SAMPLE = 8


class SparseError(ValueError):
    """A sparse encoding is malformed or the settings are wrong: the message names what."""


def index_bits(chunk: int) -> int:
    return max(1, int(chunk - 1).bit_length())


def check_settings(name: str, chunk: int, k: int) -> None:
    if name not in SPARSE:
        raise SparseError(f"codec {name!r}: expected one of {', '.join(SPARSE)}")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 2 <= chunk <= MAX_CHUNK:
        raise SparseError(f"chunk {chunk!r}: expected an integer in 2..{MAX_CHUNK}")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= chunk:
        raise SparseError(f"k {k!r}: expected an integer in 1..chunk ({chunk})")


def layout(n: int, chunk: int, k: int) -> tuple[int, int, int]:
    """(chunks, selected values, values of the last chunk) for n values."""
    nc = -(-n // chunk)
    tail = n - (nc - 1) * chunk if nc else 0
    m = (nc - 1) * k + min(k, tail) if nc else 0
    return nc, m, tail


def part_sizes(name: str, n: int, chunk: int, k: int) -> list[tuple[np.dtype, int]]:
    """(dtype, count) of each wire part: scales, codes, index."""
    nc, m, _ = layout(n, chunk, k)
    return [(np.dtype(np.float32), nc), (np.dtype(np.uint8), -(-m * BITS[name] // 8)),
            (np.dtype(np.uint8), -(-m * index_bits(chunk) // 8))]


def bits_per_value(name: str, chunk: int = DEFAULT_CHUNK, k: int = DEFAULT_K) -> float:
    """Wire bits per value of a long vector (scales and indices included)."""
    return (BITS[name] + index_bits(chunk)) * k / chunk + 32 / chunk


def pack_bits(values: np.ndarray, width: int) -> np.ndarray:
    """Unsigned integers < 2**width as a little-endian bitstream (uint8)."""
    v = np.asarray(values, dtype=np.uint32).reshape(-1)
    if width == 8:
        return v.astype(np.uint8)
    if width in (2, 4):
        per = 8 // width
        pad = -v.size % per
        if pad:
            v = np.concatenate([v, np.zeros(pad, np.uint32)])
        w = v.reshape(-1, per)
        out = np.zeros(w.shape[0], np.uint32)
        for j in range(per):
            out |= w[:, j] << (j * width)
        return out.astype(np.uint8)
    if width == 16:
        return v.astype("<u2").view(np.uint8)
    if width == 12:  # two indices in three bytes
        count = v.size
        if v.size % 2:
            v = np.concatenate([v, np.zeros(1, np.uint32)])
        a, b = v[0::2], v[1::2]
        out = np.empty((a.size, 3), np.uint8)
        out[:, 0] = a & 0xFF
        out[:, 1] = (a >> 8) | ((b & 0xF) << 4)
        out[:, 2] = b >> 4
        return out.reshape(-1)[: -(-count * 12 // 8)]
    bits = ((v[:, None] >> np.arange(width, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(packed: np.ndarray, count: int, width: int) -> np.ndarray:
    """The first ``count`` unsigned integers of a bitstream from :func:`pack_bits` (int64)."""
    p = np.asarray(packed, dtype=np.uint8).reshape(-1)
    if width == 8:
        return p[:count].astype(np.int64)
    if width in (2, 4):
        per = 8 // width
        mask = (1 << width) - 1
        out = np.empty((p.size, per), np.int64)
        for j in range(per):
            out[:, j] = (p >> (j * width)) & mask
        return out.reshape(-1)[:count]
    if width == 16 and p.size == 2 * count:
        return p.view("<u2").astype(np.int64)
    if width == 12 and p.size == -(-count * 12 // 8):
        q = p if count % 2 == 0 else np.concatenate([p, np.zeros(1, np.uint8)])
        t = q.reshape(-1, 3).astype(np.int64)
        out = np.empty((t.shape[0], 2), np.int64)
        out[:, 0] = t[:, 0] | ((t[:, 1] & 0xF) << 8)
        out[:, 1] = (t[:, 1] >> 4) | (t[:, 2] << 4)
        return out.reshape(-1)[:count]
    bits = np.unpackbits(p, count=count * width, bitorder="little").reshape(count, width)
    return bits.astype(np.int64) @ (np.int64(1) << np.arange(width, dtype=np.int64))


def _top_rows(a: np.ndarray, k: int) -> np.ndarray:
    """Column indices (sorted) of the k largest values of each row of ``a`` (non-negative)."""
    r, c = a.shape
    if k >= c:
        return np.broadcast_to(np.arange(c), (r, c)).copy()
    if c < 64 * _SAMPLE or k * 4 * _SAMPLE > c:  # small chunks or dense: a plain partition
        return np.sort(np.argpartition(a, c - k, axis=1)[:, c - k:], axis=1)
    s = a[:, ::_SAMPLE]
    rank = s.shape[1] - 2 * (-(-k // _SAMPLE)) - 1  # about 2k values of a row at or above it
    th = np.partition(s, rank, axis=1)[:, rank]
    mask = a >= th[:, None]
    cnt = np.count_nonzero(mask, axis=1)
    flat = np.flatnonzero(mask)
    rows, cols = np.divmod(flat, c)
    width = int(cnt.max())
    start = np.zeros(r, np.int64)
    np.cumsum(cnt[:-1], out=start[1:])
    pos = np.arange(flat.size) - start[rows]
    vals = np.full((r, width), -1.0, np.float32)  # -1 never beats a magnitude
    idx = np.zeros((r, width), np.int64)
    at = rows * width + pos
    vals.reshape(-1)[at] = a.reshape(-1)[flat]
    idx.reshape(-1)[at] = cols
    sel = np.empty((r, k), np.int64)
    if width >= k:  # rows with fewer than k candidates hold pads here: taken again below
        pick = np.argpartition(vals, width - k, axis=1)[:, width - k:] if width > k else np.broadcast_to(
            np.arange(width), (r, width))
        sel[:] = np.take_along_axis(idx, pick, 1)
    short = np.flatnonzero(cnt < k)
    if short.size:
        sel[short] = np.argpartition(a[short], c - k, axis=1)[:, c - k:]
    sel.sort(axis=1)
    return sel


def select(x: np.ndarray, chunk: int, k: int) -> np.ndarray:
    """Global indices (int64, increasing) of each chunk's k largest magnitudes of flat ``x``."""
    n = x.size
    nc, m, tail = layout(n, chunk, k)
    out = np.empty(m, np.int64)
    if n == 0:
        return out
    full = nc - 1 if tail < chunk else nc
    pos = 0
    rows = max(1, _BLOCK_VALUES // chunk)  # chunks at a time: their temporaries stay in cache
    scratch = np.empty(min(full, rows) * chunk, np.float32)
    for r0 in range(0, full, rows):
        r1 = min(full, r0 + rows)
        a = np.abs(x[r0 * chunk:r1 * chunk], out=scratch[:(r1 - r0) * chunk]).reshape(r1 - r0, chunk)
        sel = _top_rows(a, k) + (np.arange(r0, r1, dtype=np.int64) * chunk)[:, None]
        out[pos:pos + sel.size] = sel.reshape(-1)
        pos += sel.size
    if full < nc:  # a short last chunk
        kt = min(k, tail)
        a = np.abs(x[full * chunk:]).reshape(1, tail)
        out[pos:] = _top_rows(a, kt).reshape(-1) + full * chunk
    return out


def quantise_selected(name: str, vals: np.ndarray, chunk_of: np.ndarray, n: int, chunk: int,
                      k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales per chunk, codes) of the selected values ``vals`` (k per chunk, in chunk order;
    ``chunk_of``: the chunk of each)."""
    nc, m, _ = layout(n, chunk, k)
    mag = np.abs(vals)
    scales = np.zeros(nc, np.float32)
    full = (nc - 1) * k
    if nc > 1:
        mag[:full].reshape(nc - 1, k).max(axis=1, out=scales[:nc - 1])
    if nc and m > full:
        scales[nc - 1] = mag[full:].max()
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # non-finite input: see encode_parts
        s = scales[chunk_of]
        inv = np.divide(np.float32(1.0), s, out=np.zeros_like(s), where=s > 0)
        u = vals * inv  # in [-1, 1]
        codes = np.rint((u * 3 + 3) * 0.5) if name == "topk2" else np.rint(u * 7) + 7
        np.clip(codes, 0, LEVELS[name], out=codes)
        if not np.isfinite(codes).all():  # a non-finite value sent (its scales are NaN: encode_parts)
            codes = np.nan_to_num(codes, nan=0.0)
    return scales, codes.astype(np.uint8)


def dequantise_codes(name: str, codes: np.ndarray, scale_of: np.ndarray) -> np.ndarray:
    c = codes.astype(np.float32)
    if name == "topk2":
        return ((2 * c - 3) * np.float32(1 / 3)) * scale_of
    return ((c - 7) * np.float32(1 / 7)) * scale_of


def all_finite(x: np.ndarray, sumsq: float | None = None) -> bool:
    """No NaN or infinity in ``x``: the sum of squares (``sumsq``, or a BLAS dot, the cheapest pass)
    is finite, or, when it overflowed, an exact check says so."""
    if sumsq is None:
        with np.errstate(over="ignore", invalid="ignore"):
            sumsq = float(np.dot(x, x))
    return math.isfinite(sumsq) or bool(np.isfinite(x).all())


def encode_parts(x: np.ndarray, name: str, chunk: int, k: int,
                 sumsq: float | None = None) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """(wire parts, selected global indices, their decoded values) of flat float32 ``x``."""
    check_settings(name, chunk, k)
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    idx = select(x, chunk, k)
    chunk_of = idx // chunk
    vals = x[idx]
    scales, codes = quantise_selected(name, vals, chunk_of, x.size, chunk, k)
    if not all_finite(x, sumsq):
        # a non-finite value (a diverged learner) may not be among the k sent: every scale is made
        # NaN so that the receiver's finiteness check refuses the whole vector, as a dense codec's would
        scales[:] = np.nan
    sent = dequantise_codes(name, codes, scales[chunk_of])
    local = idx - chunk_of * chunk
    parts = [scales, pack_bits(codes, BITS[name]), pack_bits(local, index_bits(chunk))]
    return parts, idx, sent


def decode_parts(parts: list[np.ndarray], name: str, n: int, chunk: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(global indices, values) of wire parts, every part checked; raises :class:`SparseError`."""
    check_settings(name, chunk, k)
    specs = part_sizes(name, n, chunk, k)
    if len(parts) != 3 or any(p.dtype != d or p.size != c for p, (d, c) in zip(parts, specs)):
        raise SparseError(f"{name}: wire parts do not match {n} values with chunk {chunk}, k {k}")
    nc, m, tail = layout(n, chunk, k)
    scales = parts[0]  # a non-finite scale decodes to non-finite values: the receiver's check refuses them
    w = index_bits(chunk)
    if m * w % 8:  # the padding bits of the last byte must be zero: one encoding per vector
        if int(parts[2][-1]) >> (m * w % 8):
            raise SparseError(f"{name}: index padding bits are not zero")
    if m * BITS[name] % 8 and int(parts[1][-1]) >> (m * BITS[name] % 8):
        raise SparseError(f"{name}: code padding bits are not zero")
    codes = unpack_bits(parts[1], m, BITS[name])
    if m and int(codes.max()) > LEVELS[name]:
        raise SparseError(f"{name}: code {int(codes.max())} out of range 0..{LEVELS[name]}")
    local = unpack_bits(parts[2], m, w)
    chunk_of = np.empty(m, np.int64)
    full = (nc - 1) * k
    chunk_of[:full] = np.repeat(np.arange(nc - 1, dtype=np.int64), k) if nc > 1 else chunk_of[:0]
    chunk_of[full:] = nc - 1
    if m:
        lim = np.where(chunk_of == nc - 1, tail, chunk)
        if (local >= lim).any():
            raise SparseError(f"{name}: an index lies past the end of its chunk")
        same = chunk_of[1:] == chunk_of[:-1]
        if (np.diff(local)[same] <= 0).any():
            raise SparseError(f"{name}: indices within a chunk are not strictly increasing")
    idx = local + chunk_of * chunk
    return idx, dequantise_codes(name, codes, scales[chunk_of])
