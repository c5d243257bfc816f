"""Host memory of a learner process: fragment-sized arrays given back to the system when freed.

A learner allocates and frees a fragment-sized float32 array several times per sync (the
fragment read from the parameters, the outer gradient, the decoded copy, the blob). glibc serves
allocations above its mmap threshold with mmap and unmaps them on free, but it *raises* that
threshold to the size of every mmapped block freed (up to 32 MiB): after the first sync, arrays
of a few MiB come from the heap arenas (one per thread), which fragment and are not returned.
`bench.island` at 50M parameters: an island's peak over its own loop was 3.6x the parameter bytes
with the dynamic threshold and 2.1x with it fixed at 1 MiB (base copies and residuals are 2x).

Setting the threshold (``mallopt(M_MMAP_THRESHOLD, n)``) also fixes it: glibc no longer moves it.
Process-wide, once; nothing happens off glibc (macOS, musl) or with ``n == 0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_MMAP_THRESHOLD = -3
_done: set[int] = set()


def fix_mmap_threshold(nbytes: int) -> bool:
    """``mallopt(M_MMAP_THRESHOLD, nbytes)`` on glibc, once per value; True if it was applied."""
    if nbytes <= 0 or nbytes in _done:
        return nbytes in _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, int(nbytes)) != 1:
        return False
    _done.add(nbytes)
    return True
