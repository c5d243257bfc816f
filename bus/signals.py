"""SIGTERM / SIGINT -> an asyncio.Event, the way every role process stops cleanly."""

from __future__ import annotations

import asyncio
import signal


def install_stop(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGTERM or SIGINT (where the loop supports signal handlers)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass
