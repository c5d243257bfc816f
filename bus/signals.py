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
