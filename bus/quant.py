"""Quantisers for outer gradients: fp32, bf16, int8 and int4 block-wise absmax, and 4-bit E3M0.

Each quantiser turns a flat float32 vector ``x`` into a list of numpy arrays (the wire parts) and
back. The error bounds below are per element and are checked by ``tests/test_bus_quant.py``:

* ``fp32``: exact.
* ``bf16`` (round to nearest even on the top 16 bits): ``|x - q| <= 2**-8 * |x|`` for normal x.
* ``int8`` (blocks of B values, scale s = absmax(block) / 127): ``|x - q| <= s / 2``.
* ``int4`` (blocks of B, s = absmax(block) / 7, codes -7..7): ``|x - q| <= s / 2``.
* ``int2`` (blocks of B, s = absmax(block), codes 0..3 -> (2c - 3) / 3 x s, four a byte):
  ``|x - q| <= s / 3``. Only with error feedback (uplink) or against a keyframe (downlink).
* ``e3m0`` (Streaming DiLoCo's 4-bit float: sign + 3 exponent bits, no mantissa; blocks of B with
  scale s = absmax(block); magnitudes {0} U {s * 2**-k, k = 0..6}, rounded to the nearest power of
  two in linear space): ``|x - q| <= max(|x| / 3, 0.75 * s * 2**-6)``.

Streaming DiLoCo reports no measurable loss with 4-bit outer gradients accumulated in fp32; the
Decoupled DiLoCo paper reports int4 costing +0.09% loss, 2-bit and 1-bit far worse. Use error
feedback in the learner (keep the residual locally) when you quantise hard.

Non-finite inputs are not rejected here (that costs a pass); the aggregator validates decoded
values. Blocks pad the tail with zeros, which never raises a block's absmax.
"""

from __future__ import annotations

import numpy as np

QUANTISERS = ("fp32", "bf16", "int8", "int4", "e3m0", "int2")
DEFAULT_BLOCK = 256
#: the smallest block scale whose reciprocal is finite in float32 (just above 2**-128): below it
#: 1/scale overflowed (inf, then nan codes cast to int8), and the block is sent as the codes of zero
#: instead (int2, without a zero level, as a third of its largest value); every block with a scale
#: at or above it is coded exactly as before
_INVERTIBLE = np.nextafter(np.float32(2.0**-128), np.float32(1.0))


class QuantError(ValueError):
    """Wrong quantiser name, block size or wire parts."""


def bits_per_value(name: str, block: int = DEFAULT_BLOCK) -> float:
    """Wire bits per element, scales included (what a bandwidth estimate should use)."""
    base = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "e3m0": 4, "int2": 2}[name]
    return base + (32 / block if name in ("int8", "int4", "e3m0", "int2") else 0)


def _blocks(x: np.ndarray, block: int) -> np.ndarray:
    """x as a (nblocks, block) view, zero-padded with one copy only when the length is not a multiple."""
    n = x.size
    nb = -(-n // block)
    if nb * block == n:
        return x.reshape(nb, block)
    out = np.zeros(nb * block, dtype=np.float32)
    out[:n] = x
    return out.reshape(nb, block)


def _absmax(xb: np.ndarray, rows: int = 256) -> np.ndarray:
    """max |x| of each row (block), ``rows`` rows at a time through one small scratch: one pass over
    the data (max and min separately were two, and slower row reductions)."""
    nb, b = xb.shape
    out = np.empty(nb, dtype=np.float32)
    scratch = np.empty((min(rows, max(nb, 1)), b), dtype=np.float32)
    for r in range(0, nb, rows):
        e = min(nb, r + rows)
        a = scratch[: e - r]
        np.abs(xb[r:e], out=a)
        a.max(axis=1, out=out[r:e])
    return out


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..15 (even length) -> bytes, two per byte (low nibble first)."""
    c = codes.reshape(-1, 2)
    return (c[:, 0] | (c[:, 1] << 4)).astype(np.uint8)


def _pack_crumbs(codes: np.ndarray) -> np.ndarray:
    """uint8 codes 0..3 -> bytes, four per byte (lowest bits first); the tail padded with zeros."""
    pad = -codes.size % 4
    c = np.concatenate([codes, np.zeros(pad, np.uint8)]) if pad else codes
    c = c.reshape(-1, 4)
    return (c[:, 0] | (c[:, 1] << 2) | (c[:, 2] << 4) | (c[:, 3] << 6)).astype(np.uint8)


def _unpack_crumbs(packed: np.ndarray, n: int) -> np.ndarray:
    out = np.empty((packed.size, 4), dtype=np.uint8)
    for j in range(4):
        out[:, j] = (packed >> (2 * j)) & 3
    return out.reshape(-1)[:n]


def _unpack_nibbles(packed: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(packed.size * 2, dtype=np.uint8)
    out[0::2] = packed & 0x0F
    out[1::2] = packed >> 4
    return out[:n]


def quantise(x: np.ndarray, name: str, block: int = DEFAULT_BLOCK) -> list[np.ndarray]:
    """Wire parts of ``x`` (flat float32) under quantiser ``name``."""
    if name not in QUANTISERS:
        raise QuantError(f"unknown quantiser {name!r}: expected one of {', '.join(QUANTISERS)}")
    if block < 2 or block % 2:
        raise QuantError(f"block={block}: expected an even integer >= 2")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    if name == "fp32":
        return [x]
    if name == "bf16":
        u = x.view(np.uint32)
        rounded = u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))
        return [(rounded >> 16).astype(np.uint16)]
    xb = _blocks(x, block)
    amax = _absmax(xb)
    if name == "int8" or name == "int4":
        levels = 127.0 if name == "int8" else 7.0
        scale = amax / np.float32(levels)
        inv = np.divide(np.float32(1.0), scale, out=np.zeros_like(scale), where=scale >= _INVERTIBLE)
        q = np.rint(xb * inv[:, None])
        if name == "int8":
            return [scale, q.astype(np.int8).reshape(-1)[: x.size]]
        codes = (q.astype(np.int8) + 8).astype(np.uint8).reshape(-1)
        return [scale, _pack_nibbles(codes)]
    if name == "int2":
        inv = np.divide(np.float32(1.0), amax, out=np.zeros_like(amax), where=amax >= _INVERTIBLE)
        c = np.rint((xb * inv[:, None] * 3 + 3) * 0.5)
        np.clip(c, 0, 3, out=c)
        return [amax, _pack_crumbs(c.astype(np.uint8).reshape(-1))]
    # e3m0: magnitude level k in 1..7 means s * 2**(k-7); k = 0 means zero. With y = |x| / s in
    # [0, 1] written as 1.m * 2**E, the nearest power of two in linear space is 2**(E+1) when the
    # top mantissa bit is set (1.m >= 1.5), else 2**E: pure integer work on the float bits.
    inv = np.divide(np.float32(1.0), amax, out=np.zeros_like(amax), where=amax >= _INVERTIBLE)
    y = np.abs(xb) * inv[:, None]
    bits = y.view(np.uint32)
    k = (bits >> 23).astype(np.int16) - np.int16(127 - 7) + ((bits >> 22) & 1).astype(np.int16)
    np.clip(k, 0, 7, out=k)
    k[bits == 0] = 0
    codes = (k.astype(np.uint8) | (np.signbit(xb).astype(np.uint8) << 3)).reshape(-1)
    return [amax, _pack_nibbles(codes)]


def quantise_int8_into(x: np.ndarray, scales: np.ndarray, codes: np.ndarray, scratch: np.ndarray,
                       block: int = DEFAULT_BLOCK) -> None:
    """``quantise(x, "int8", block)`` written into ``scales`` and ``codes`` (bitwise the same
    values), with ``scratch`` (float32, at least x.size) for the one temporary: for a chunk of whole
    blocks that stays in cache (``bus.codec.encode_delta``). ``x.size`` must be a multiple of
    ``block`` (the caller handles a short tail with :func:`quantise`)."""
    n = x.size
    nb = n // block
    xb = x.reshape(nb, block)
    amax = _absmax(xb)
    np.divide(amax, np.float32(127.0), out=scales)
    inv = np.divide(np.float32(1.0), scales, out=np.zeros_like(scales), where=scales >= _INVERTIBLE)
    t = scratch[:n].reshape(nb, block)
    np.multiply(xb, inv[:, None], out=t)
    np.rint(t, out=t)
    np.copyto(codes.reshape(nb, block), t, casting="unsafe")


_E3M0_LUT = np.array(
    [0.0] + [2.0 ** (k - 7) for k in range(1, 8)] + [-0.0] + [-(2.0 ** (k - 7)) for k in range(1, 8)],
    dtype=np.float32,
)


def part_specs(name: str, n: int, block: int = DEFAULT_BLOCK) -> list[tuple[np.dtype, int]]:
    """(dtype, element count) of each wire part for ``n`` values: what the decoder expects."""
    nb = -(-n // block)
    if name == "fp32":
        return [(np.dtype(np.float32), n)]
    if name == "bf16":
        return [(np.dtype(np.uint16), n)]
    if name == "int8":
        return [(np.dtype(np.float32), nb), (np.dtype(np.int8), n)]
    if name in ("int4", "e3m0"):
        return [(np.dtype(np.float32), nb), (np.dtype(np.uint8), nb * block // 2)]
    if name == "int2":
        return [(np.dtype(np.float32), nb), (np.dtype(np.uint8), -(-nb * block // 4))]
    raise QuantError(f"unknown quantiser {name!r}: expected one of {', '.join(QUANTISERS)}")


def dequantise(parts: list[np.ndarray], name: str, n: int, block: int = DEFAULT_BLOCK) -> np.ndarray:
    """Float32 vector of length ``n`` from wire parts (as produced by :func:`quantise`)."""
    specs = part_specs(name, n, block)
    if len(parts) != len(specs) or any(p.dtype != d or p.size != c for p, (d, c) in zip(parts, specs)):
        raise QuantError(f"{name}: wire parts do not match {n} values with block {block}")
    if name == "fp32":
        return parts[0]
    if name == "bf16":
        return (parts[0].astype(np.uint32) << 16).view(np.float32)
    scale = parts[0]
    nb = scale.size
    if name == "int8":
        q = parts[1]
        full = nb * block
        if full == n:
            return (q.reshape(nb, block) * scale[:, None]).reshape(-1)
        padded = np.zeros(full, dtype=np.int8)
        padded[:n] = q
        return (padded.reshape(nb, block) * scale[:, None]).reshape(-1)[:n]
    if name == "int2":
        c2 = _unpack_crumbs(parts[1], nb * block).reshape(nb, block).astype(np.float32)
        return (((2 * c2 - 3) * np.float32(1 / 3)) * scale[:, None]).reshape(-1)[:n]
    codes = _unpack_nibbles(parts[1], nb * block).reshape(nb, block)
    if name == "int4":
        vals = codes.astype(np.int8) - np.int8(8)
        return (vals * scale[:, None]).astype(np.float32).reshape(-1)[:n]
    return (_E3M0_LUT[codes] * scale[:, None]).reshape(-1)[:n]


def dequantise_int8_into(parts: list[np.ndarray], out: np.ndarray, block: int = DEFAULT_BLOCK) -> np.ndarray:
    """``dequantise(parts, "int8", out.size, block)`` written into ``out`` (float32, a multiple of
    ``block`` values), bitwise the same: each code cast to float32 times its block's scale."""
    scale, q = parts
    n = out.size
    if n % block or q.size != n or scale.size != n // block or out.dtype != np.float32:
        raise QuantError(f"int8: {q.size} codes, {scale.size} scales into {n} values with block {block}")
    ob = out.reshape(-1, block)
    ob[...] = q.reshape(-1, block)
    ob *= scale[:, None]
    return out


def roundtrip(x: np.ndarray, name: str, block: int = DEFAULT_BLOCK) -> np.ndarray:
    """dequantise(quantise(x)): what the receiver will see. Handy for error feedback."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    return dequantise(quantise(x, name, block), name, x.size, block)
