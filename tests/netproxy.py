"""A TCP proxy for failure injection: put it between one client and the server, then cut and heal.

``cut()`` closes every proxied connection and makes new ones fail at once (the client sees a dead
link and keeps reconnecting); ``heal()`` lets connections through again. Runs in its own thread
with its own event loop, so a test can use it from sync or async code alike.
"""

from __future__ import annotations

import asyncio
import socket
import threading


class NetProxy:
    def __init__(self, target_host: str, target_port: int):
        self.target = (target_host, target_port)
        self.cut_flag = False
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while not self.cut_flag:
                data = await r.read(65536)
                if not data:
                    break
                w.write(data)
                await w.drain()
        except Exception:
            pass
        finally:
            try:
                w.close()
            except Exception:
                pass

    async def _handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        if self.cut_flag:
            w.close()
            return
        try:
            ur, uw = await asyncio.open_connection(*self.target)
        except OSError:
            w.close()
            return
        self._writers |= {w, uw}
        await asyncio.gather(self._pipe(r, uw), self._pipe(ur, w))
        self._writers -= {w, uw}

    def cut(self) -> None:
        def do() -> None:
            self.cut_flag = True
            for w in list(self._writers):
                w.close()
        self._loop.call_soon_threadsafe(do)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(lambda: setattr(self, "cut_flag", False))

    def close(self) -> None:
        async def shutdown() -> None:
            self.cut_flag = True
            for w in list(self._writers):
                w.close()
            if self._server is not None:
                self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        if self._loop.is_running():
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop)
        self._thread.join(5)
