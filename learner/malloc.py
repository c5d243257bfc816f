"""Host memory of a learner process: freed pages given back to the system.

glibc keeps freed memory in its heap arenas (one per thread) unless it sits at an arena's top,
and it serves allocations below its mmap threshold from those arenas; the threshold itself rises
to the size of every mmapped block freed (up to 32 MiB). An island in hook mode frees the
previous step's parameters (XLA buffers of the size of the leaves) in its worker thread while the
user's next step allocates new ones: the heap kept the freed pages, and an island's peak memory
over its user's own loop was 2.8x the parameter bytes at 50M parameters against 2.1x with a
:func:`trim` after each free (`bench.island`, docs/learner.md).

Fixing the mmap threshold low instead (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``) gave 2.07x too, but
every step's XLA buffers above it were then fresh mmaps, zeroed by the kernel: the built-in
model's inner step was 9% slower (5 alternating runs of each) and so was the 50M loop; so it is
not done.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_libc = None


def trim() -> bool:
    """``malloc_trim(0)`` on glibc: give the free pages of every heap arena back to the system
    (pages in the middle of an arena too); False (nothing done) off glibc."""
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            fn = lib.malloc_trim
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            _libc = fn
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return False
    _libc(0)
    return True
