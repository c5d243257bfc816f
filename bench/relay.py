"""A TCP relay that adds one-way delay and loss, for the WAN harness (this kernel has no ``netem``).

Every chunk read from one side is written to the other ``delay`` seconds after it was read, in
order (a chunk never overtakes the one before it), in both directions. Loss on a byte stream cannot
drop bytes; what a lost segment costs a TCP connection is a retransmission: the relay models each
chunk as ``ceil(len / MSS)`` segments, each lost with probability ``loss``, and holds a chunk that
lost any for one more retransmission timeout (``max(RTO_MIN, 2 x delay)``, Linux's 200 ms floor)
before it goes on (head-of-line blocking, as TCP gives). The rate limit is not the relay's job:
``tc tbf`` on the link does it (:mod:`bench.netns`).

Backpressure: a direction stops reading once ``max_buffer`` bytes wait in it, so a fast sender on
a thin link fills its own socket buffers rather than this process's memory.

``schedule`` and ``lost_segments`` are the pure parts; :class:`Relay` is the asyncio shell. Run it
in a thread of its own (``Relay.serve_in_thread``, inside a namespace with
:func:`bench.netns.in_netns`).
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time

MSS = 1448
RTO_MIN = 0.2


def lost_segments(nbytes: int, loss: float, rng: random.Random) -> int:
    """How many of the ``ceil(nbytes / MSS)`` segments of a chunk are lost (each with ``loss``)."""
    if loss <= 0 or nbytes <= 0:
        return 0
    n = math.ceil(nbytes / MSS)
    return sum(1 for _ in range(n) if rng.random() < loss)


def schedule(now: float, previous: float, delay: float, lost: int) -> float:
    """Release time of a chunk read at ``now``: ``delay`` later, one RTO more per round of loss,
    never before the chunk read before it (``previous``)."""
    rto = max(RTO_MIN, 2 * delay)
    return max(now + delay + (rto if lost else 0.0), previous)


class Relay:
    """Listen on ``listen`` and relay every connection to ``target`` with ``delay`` s and ``loss``."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay: float = 0.0, loss: float = 0.0,
                 seed: int = 0, max_buffer: int = 4 << 20):
        self.listen, self.target = listen, target
        self.delay, self.loss = delay, loss
        self.rng = random.Random(seed)
        self.max_buffer = max_buffer
        self.bytes = {"up": 0, "down": 0}  # up: listen side -> target; down: target -> listen side
        self.connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def _direction(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, key: str) -> None:
        q: asyncio.Queue = asyncio.Queue()
        room = asyncio.Condition()
        queued = 0
        previous = 0.0

        async def reader() -> None:
            nonlocal queued, previous
            try:
                while True:
                    async with room:
                        await room.wait_for(lambda: queued < self.max_buffer)
                    data = await r.read(65536)
                    if not data:
                        break
                    now = time.monotonic()
                    previous = schedule(now, previous, self.delay, lost_segments(len(data), self.loss, self.rng))
                    queued += len(data)
                    q.put_nowait((previous, data))
            except Exception:
                pass
            q.put_nowait((previous, b""))

        async def writer() -> None:
            nonlocal queued
            try:
                while True:
                    at, data = await q.get()
                    wait = at - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    if not data:
                        break
                    w.write(data)
                    await w.drain()
                    self.bytes[key] += len(data)
                    async with room:
                        queued -= len(data)
                        room.notify_all()
            except Exception:
                pass
            finally:
                try:
                    w.close()
                except Exception:
                    pass

        await asyncio.gather(reader(), writer())

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            tr, tw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.close()
            return
        self.connections += 1
        self._writers.update((cw, tw))
        try:
            await asyncio.gather(self._direction(cr, tw, "up"), self._direction(tr, cw, "down"))
        except asyncio.CancelledError:  # close(): end quietly (the stream protocol reads our result)
            pass
        finally:
            self._writers.difference_update((cw, tw))

    async def serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._handle, *self.listen, reuse_address=True)
        self._ready.set()
        async with self._server:
            try:
                await self._server.serve_forever()
            except asyncio.CancelledError:
                pass

    def serve_in_thread(self, start: callable = None, timeout: float = 10.0) -> "Relay":
        """Serve on a thread of its own; ``start(fn)`` starts that thread (default: a plain daemon
        thread; the WAN harness passes one that enters a namespace first). Returns once listening."""

        def body() -> None:
            try:
                asyncio.run(self.serve())
            except BaseException as e:
                self._error = e
                self._ready.set()

        if start is None:
            threading.Thread(target=body, daemon=True, name="relay").start()
        else:
            start(body)
        if not self._ready.wait(timeout) or self._error is not None:
            raise RuntimeError(f"relay {self.listen} -> {self.target} did not start: {self._error!r}")
        return self

    def set_delay(self, delay: float, loss: float | None = None) -> None:
        """Change the delay (and loss) for chunks read from now on."""
        self.delay = delay
        if loss is not None:
            self.loss = loss

    def close(self) -> None:
        loop, srv = self._loop, self._server
        if loop is None or srv is None or loop.is_closed():
            return

        def stop() -> None:
            srv.close()
            for w in list(self._writers):
                w.close()
            for t in asyncio.all_tasks(loop):
                t.cancel()

        try:
            loop.call_soon_threadsafe(stop)
        except RuntimeError:
            pass
