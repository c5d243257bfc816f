"""The aggregator's store health at the start of the run: provisioning the run's streams while the
store is full. The store's health itself, and the probe write that tells a role with nothing to
write that the store is full (or writes again), are ``bus.store_health``."""

from __future__ import annotations

import asyncio
from typing import Any

from bus.streams import ensure_run


async def provision(js: Any, run: str, limits: Any, watch: Any, stop: asyncio.Event) -> None:
    """``ensure_run(update=True)``; while the store is full (a stream update rewrites its metadata
    file: "no space left on device") it is retried every few seconds, said once, instead of the
    aggregator failing at start (what a restart during a full disk did)."""
    while True:
        try:
            await ensure_run(js, run, limits, update=True)
        except Exception as e:
            if stop.is_set() or not await watch.failed(e):
                raise
            try:
                await asyncio.wait_for(stop.wait(), watch.health.probe_every)
            except asyncio.TimeoutError:
                pass
            if stop.is_set():
                raise
            continue
        watch.stored()
        return
