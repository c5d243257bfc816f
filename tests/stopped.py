"""Freezing a process (a nats-server) for a test: SIGSTOP, and wait until it has really stopped.

``kill(pid, SIGSTOP)`` returns before every thread of a multi-threaded process (the Go server) has
stopped: a probe sent right after it was once answered in 0.3 ms by the "stopped" server. So
:func:`stopped` waits until each thread in ``/proc/<pid>/task`` shows state T (stopped) before the
test goes on, and always sends SIGCONT on the way out.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager


def _all_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True  # nothing left running
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue  # a thread that exited meanwhile
        if state not in ("T", "t"):
            return False
    return True


def stop(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every thread of it has stopped (the caller sends SIGCONT)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not _all_stopped(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout}s of SIGSTOP")
        time.sleep(0.001)


@contextmanager
def stopped(pid: int, timeout: float = 5.0) -> Iterator[None]:
    """``pid`` stopped (every thread) for the body, then continued."""
    try:
        stop(pid, timeout)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
