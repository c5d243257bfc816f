"""One BLAS thread in the roles' processes (bus/blas.py), unless the user chose a number."""

import subprocess
import sys

CHECK = ("import numpy, threadpoolctl; from bus.blas import single_threaded_blas; "
         "r = single_threaded_blas(); "
         "print(r, [i['num_threads'] for i in threadpoolctl.threadpool_info() if i['user_api'] == 'blas'])")


def _run(**env) -> str:
    import os

    e = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")}
    e.update(env)
    return subprocess.run([sys.executable, "-c", CHECK], env=e, capture_output=True, text=True, check=True).stdout.strip()


def test_roles_run_numpy_with_one_blas_thread():
    assert _run() == "True [1]"


def test_a_users_thread_count_wins():
    assert _run(OPENBLAS_NUM_THREADS="2") == "False [2]"
