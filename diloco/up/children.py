"""``diloco up``'s child processes: each in its own process group, killed if the launcher dies
(``PR_SET_PDEATHSIG``), stopped group by group (SIGTERM, then SIGKILL after a timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass

from bus.procs import popen
from diloco.up.plan import ProcSpec

# -- child processes ----------------------------------------------------------------------------------


@dataclass
class Child:
    spec: ProcSpec
    log_path: str
    cwd: str
    proc: subprocess.Popen | None = None
    started: float | None = None
    ended: float | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            # its own session (a terminal's Ctrl-C reaches the launcher only, which stops the children in
            # order), and it dies with the launcher, SIGKILL included (bus.procs)
            self.proc = popen(self.spec.argv(), env=self.spec.env, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, cwd=self.cwd)
        self.started = time.time()

    def poll(self) -> int | None:
        if self.proc is None:
            return None
        rc = self.proc.poll()
        if rc is not None and self.ended is None:
            self.ended = time.time()
        return rc

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.poll() is None

    def signal(self, sig: int) -> None:
        if not self.alive:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    @property
    def exit_code(self) -> int | None:
        return self.poll()


def stop_children(groups: list[list[Child]], timeout: float, say=print) -> None:
    """SIGTERM each group in turn, wait up to ``timeout`` for it, SIGKILL its stragglers."""
    asyncio.run(astop_children(groups, timeout, say))


async def astop_children(groups: list[list[Child]], timeout: float, say=print) -> None:
    """:func:`stop_children` without blocking the event loop (a second Ctrl-C is still handled)."""
    for group in groups:
        alive = [c for c in group if c.alive]
        for c in alive:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(c.alive for c in alive) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for c in alive:
            if c.alive:
                say(f"diloco up: {c.spec.name} did not stop within {timeout:.0f}s: SIGKILL")
                c.signal(signal.SIGKILL)
        for c in alive:
            if c.proc is not None:
                with contextlib.suppress(Exception):
                    c.proc.wait(5)

