"""SIGTERM / SIGINT -> an asyncio.Event, the way every role process stops cleanly; and the way a
parent (benchmarks, tests) stops the role processes it started."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterable


def install_stop(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGTERM or SIGINT (where the loop supports signal handlers)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass


async def cancel_all(tasks: Iterable[asyncio.Task], every: float = 1.0) -> None:
    """Cancel ``tasks`` and wait until every one has ended, cancelling again those that run on. On
    Python 3.11 ``asyncio.wait_for`` can swallow a cancellation that arrives as the wait it guards
    completes (CPython gh-86296, fixed in 3.12); nats-py waits in one under every fetch, and our
    loops in one between passes, so a task cancelled once can run on as if it never was (a service
    whose stop then waited for ever: test_full_disk, once in a loaded suite). Their exceptions are
    retrieved (not raised), as ``gather(return_exceptions=True)`` does. Cancelled itself meanwhile
    (a stop's own caller giving up on it), it still ends every task, then raises the cancellation:
    ``asyncio.wait`` does not pass a cancellation on to what it waits for."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    interrupted = False
    while pending:
        for t in pending:
            t.cancel()
        try:
            _, pending = await asyncio.wait(pending, timeout=every)
        except asyncio.CancelledError:
            interrupted = True
            pending = {t for t in pending if not t.done()}
    for t in tasks:
        if not t.cancelled():
            t.exception()
    if interrupted:
        raise asyncio.CancelledError


def terminate_all(procs: Iterable[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGTERM every live process, wait up to ``timeout`` seconds in all, SIGKILL the stragglers."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    t_end = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(0.1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
