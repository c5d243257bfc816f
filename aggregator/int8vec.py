"""An int8 outer gradient kept as it came, decoded block by block where it is read (pure, numpy).

A learner's default uplink is int8 (one code per value, one float32 scale per ``qblock`` values).
Decoding a contribution into a float32 vector when it arrives costs 4 bytes per value for as long
as it waits for its merge, and the aggregator of a large model holds many: at 4 x 100M that was
most of its memory (issue 41, item 3). An :class:`Int8Vector` keeps the codes and scales (views on
the received blob: 1 byte per value and a scale per block) and each reader decodes only the block it
needs into a scratch block that stays in cache: the merge (``aggregator.merge``), the norm
(:func:`aggregator.merge.l2_norm`), the trust check's sample (``aggregator.trust.samples``).

A decoded block is bitwise what ``bus.codec.decode_array`` gives for the same values (each code cast
to float32, times its block's scale), so a merge of Int8Vectors equals the merge of their decoded
arrays bit for bit.
"""

from __future__ import annotations

from typing import Union

import numpy as np


class Int8Vector:
    """A flat float32 vector of ``size`` values stored as int8 ``codes`` and float32 ``scales`` (one
    per ``qblock`` values; ``size`` a multiple of ``qblock``). Read-only; holds views on its blob."""

    __slots__ = ("codes", "scales", "qblock", "size")
    ndim = 1
    dtype = np.dtype(np.float32)

    def __init__(self, scales: np.ndarray, codes: np.ndarray, qblock: int):
        if codes.dtype != np.int8 or scales.dtype != np.float32 or codes.ndim != 1 or scales.ndim != 1:
            raise ValueError("an Int8Vector needs flat int8 codes and float32 scales")
        if qblock < 1 or codes.size % qblock or scales.size * qblock != codes.size:
            raise ValueError(f"{codes.size} codes and {scales.size} scales do not make blocks of {qblock}")
        self.codes, self.scales, self.qblock, self.size = codes, scales, int(qblock), int(codes.size)

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    @property
    def nbytes(self) -> int:
        """What it holds: its codes and scales (a quarter of the decoded vector and a little)."""
        return int(self.codes.nbytes + self.scales.nbytes)

    def read(self, sl: slice, out: np.ndarray) -> np.ndarray:
        """Values ``sl`` (a step-1 slice) decoded into the first values of ``out`` (float32); returns
        that view. Whole blocks are decoded as ``bus.quant.dequantise_int8_into`` does, a partial
        block at either end value by value: bitwise the same."""
        start, stop, step = sl.indices(self.size)
        if step != 1 or not out.flags.c_contiguous:
            raise ValueError("an Int8Vector is read by step-1 slices into a contiguous buffer")
        with np.errstate(over="ignore", invalid="ignore"):  # a forged scale gives inf or nan: validation
            return self._read(start, stop, out)  # rejects it (all_finite), without a RuntimeWarning

    def _read(self, start: int, stop: int, out: np.ndarray) -> np.ndarray:
        q = self.qblock
        o = out[:max(0, stop - start)]
        i = start
        while i < stop:
            b = i // q
            if i % q == 0 and stop - i >= q:  # whole blocks
                nb = (stop - i) // q
                ob = o[i - start:i - start + nb * q].reshape(nb, q)
                ob[...] = self.codes[i:i + nb * q].reshape(nb, q)
                ob *= self.scales[b:b + nb, None]
                i += nb * q
                continue
            j = min(stop, (b + 1) * q)  # a partial block
            part = o[i - start:j - start]
            part[...] = self.codes[i:j]
            part *= self.scales[b]
            i = j
        return o

    def decoded(self) -> np.ndarray:
        """The whole float32 vector (a new array of 4 bytes per value: for small vectors and tests)."""
        return self.read(slice(0, self.size), np.empty(self.size, dtype=np.float32))

    def all_finite(self, block: int = 1 << 18) -> bool:
        """Every decoded value finite: a non-finite scale gives nan or inf (0 x inf is nan), and so
        can a finite one, when a code times it overflows float32 (1e38 x 127). Decodes block by
        block: validation asks only when the norm was not finite (the rare path)."""
        if not np.isfinite(self.scales).all():
            return False
        scratch = np.empty(min(block, max(self.size, 1)), dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for start in range(0, self.size, block):
                if not np.isfinite(self.read(slice(start, min(start + block, self.size)), scratch)).all():
                    return False
        return True

    def __array__(self, dtype=None, copy=None):
        a = self.decoded()
        return a if dtype is None else a.astype(dtype, copy=False)


Vector = Union[np.ndarray, Int8Vector]
"""What a contribution carries: a flat float32 array, or an int8 one kept as it came."""


def from_parts(parts: list[np.ndarray], n: int, qblock: int) -> Int8Vector | None:
    """The Int8Vector of an int8 blob's parts ([scales, codes]), or None when ``n`` is not a whole
    number of blocks (such a blob is decoded whole)."""
    if n % qblock or len(parts) != 2:
        return None
    return Int8Vector(parts[0], parts[1], qblock)


def read(v, sl: slice, out: np.ndarray) -> np.ndarray:
    """Values ``sl`` of ``v``: a view of a float32 array, or an Int8Vector's decoded into ``out``."""
    if isinstance(v, Int8Vector):
        return v.read(sl, out)
    return v[sl]


def all_finite(v) -> bool:
    """Every value of ``v`` (an array or an Int8Vector) finite."""
    if isinstance(v, Int8Vector):
        return v.all_finite()
    return bool(np.isfinite(v).all())


def is_vector(v) -> bool:
    """A float32 ndarray or an Int8Vector (what a contribution may carry)."""
    return isinstance(v, Int8Vector) or isinstance(v, np.ndarray)
