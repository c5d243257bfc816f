"""The aggregator's store health at the edges of the run: provisioning the run's streams while the
store is full, and the small write that tells an aggregator with nothing to merge that the store
is full (or writes again). The store's health itself is ``bus.store_health.StoreWatch``."""

from __future__ import annotations

import asyncio
from typing import Any

from bus.streams import ensure_run

#: seconds without a stored write after which the aggregator writes its ``state_probe``: an
#: aggregator with nothing to merge learns of a full store too (and says so)
STORE_IDLE_PROBE = 10.0
#: bytes of that probe: as much as a chunk of a small fragment, more than a filesystem block, so
#: that it does not fit in the unused end of a block the stream has already written (a tiny write
#: is stored there on a full disk: measured on tmpfs, docs/RELIABILITY.md)
STATE_PROBE_BYTES = 64 * 1024


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


async def write_probe(js: Any, subject: str, timeout: float = 5.0) -> None:
    """``STATE_PROBE_BYTES`` to ``subject`` (``state_probe``: the STATE stream keeps one message of it)."""
    await js.publish(subject, bytes(STATE_PROBE_BYTES), timeout=timeout)


async def probe_store(js: Any, subject: str, watch: Any) -> None:
    """A probe write: every few seconds while the store is faulted (merging resumes once one is
    stored), and after ``STORE_IDLE_PROBE`` seconds without a stored write."""
    if not watch.probe_due(STORE_IDLE_PROBE):
        return
    try:
        await write_probe(js, subject)
    except Exception as e:  # noqa: BLE001 - still full, or the server restarting
        await watch.failed(e)
    else:
        watch.stored()
