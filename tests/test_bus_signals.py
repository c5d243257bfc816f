"""bus.signals.cancel_all: every task ends, also one that runs on after a cancellation (what
Python 3.11's ``asyncio.wait_for`` does when a cancellation arrives as its wait completes)."""

from __future__ import annotations

import asyncio

from bus.signals import cancel_all


async def _runs_on(swallowed: list, times: int) -> None:
    """Sleeps until cancelled, swallowing the first ``times`` cancellations (the loop goes on, as
    after a swallowed one); each swallowed is noted in ``swallowed``."""
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if len(swallowed) < times:
                swallowed.append(1)
                continue
            raise


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again_until_it_ends():
    swallowed: list = []

    async def fails() -> None:
        raise ValueError("retrieved, not raised")

    tasks = [asyncio.create_task(_runs_on(swallowed, 2)), asyncio.create_task(asyncio.sleep(10)),
             asyncio.create_task(fails())]
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all(tasks, every=0.05), 5)
    assert all(t.done() for t in tasks) and len(swallowed) == 2
    assert tasks[0].cancelled() and tasks[1].cancelled() and isinstance(tasks[2].exception(), ValueError)
    await cancel_all([])  # nothing to do


async def test_cancelled_itself_it_still_ends_every_task_then_raises_the_cancellation():
    """A stop whose own caller cancels it meanwhile (a test's re-cancelling helper): ``asyncio.wait``
    does not pass that on, so a task that had swallowed the first cancellation would run on."""
    swallowed: list = []
    task = asyncio.create_task(_runs_on(swallowed, 1))
    await asyncio.sleep(0)
    stop = asyncio.create_task(cancel_all([task], every=0.2))
    await asyncio.sleep(0.05)  # the first cancellation swallowed; cancel_all waits to cancel again
    stop.cancel()
    try:
        await asyncio.wait_for(stop, 5)
    except asyncio.CancelledError:
        pass
    assert stop.cancelled() and task.done() and task.cancelled() and swallowed == [1]
