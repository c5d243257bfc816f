"""One BLAS thread in the roles' processes.

numpy's OpenBLAS starts a thread per core for a dot product or a norm of a few thousand values. On a
machine whose cores are busy (the learners' JAX steps beside an aggregator, ``diloco up``, a CI
runner), those threads wait for each other to be scheduled: a float64 norm of 15,000 values took 1.9 ms
instead of 6 us beside two learners and a benchmark (once, by hand), and 0.20 ms instead of 4 us
beside four JAX processes (``bench.aggregator``, ``blas_threads``; 1.7x beside two): the trust check's
norms made the aggregator too slow for its learners (issue 37). The roles' vector work is
memory-bound and single-threaded anyway (numpy ufuncs), so one BLAS thread costs nothing where the
cores are free.

``threadpoolctl`` sets the limit on the BLAS library numpy has loaded, whichever it is, after
import (an environment variable works only before numpy is loaded). A user's own choice wins: with
``OPENBLAS_NUM_THREADS``, ``MKL_NUM_THREADS`` or ``OMP_NUM_THREADS`` set, nothing is changed. JAX's
CPU threads are not BLAS threads and are not touched. Not applied to an island: its process is the
user's.
"""

from __future__ import annotations

import os

USER_VARS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")


def single_threaded_blas(environ=os.environ) -> bool:
    """Limit numpy's BLAS to one thread unless the user chose a number; True if it was limited."""
    if any(environ.get(v) for v in USER_VARS):
        return False
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover - a dependency; an install without it keeps the default
        return False
    import numpy  # noqa: F401  (its BLAS must be loaded for threadpoolctl to find it)

    threadpool_limits(limits=1, user_api="blas")
    return True
