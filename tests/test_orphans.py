"""Issue 42: every child a harness or benchmark starts dies with it, even when it is SIGKILLed.

A parent process starts children the way the harnesses do (``tests.system.Procs``, the chaos
harness's ``ChaosRun``, ``bench.runs.Cluster`` and its ``eval_once``, a ``bus.procs.process_pool``
of workers, and a child started from a thread that ends at once), each child a ``sleep``; the test
SIGKILLs the parent and checks by pid that every process below it is gone within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from bus.procs import popen

ROOT = str(Path(__file__).resolve().parents[1])

PARENT = textwrap.dedent("""
    import asyncio, json, os, sys, tempfile, threading, time
    import bench.runs as runs
    import tests.chaos.harness as harness
    import tests.system as system
    from bus.procs import process_pool

    sleeper, logdir = sys.argv[1], sys.argv[2]
    system.PY = harness.PY = runs.PY = sleeper  # every role child is a `sleep`
    url = "nats://127.0.0.1:1"
    pids = {}
    procs = system.Procs(url, "orphans", logdir)
    pids["tests.system"] = procs.start("a", "monitor").pid
    t = threading.Thread(target=lambda: pids.__setitem__("from_a_thread", procs.start("b", "monitor").pid))
    t.start()
    t.join()
    chaos = harness.ChaosRun(logdir, learners=1)
    chaos.start("monitor")
    pids["tests.chaos"] = chaos.procs["monitor"].pid
    cluster = runs.Cluster("orphans")
    cluster.dir, cluster.url = logdir, url
    pids["bench.runs"] = cluster.start("m", "monitor").pid
    os.mkdir(f"{logdir}/workers")  # each worker leaves a file there once past its initializer
    pool = process_pool(2, initializer=tempfile.mkstemp, initargs=("", "w", f"{logdir}/workers"))
    busy = [pool.submit(time.sleep, 600) for _ in range(2)]
    while len(os.listdir(f"{logdir}/workers")) < 2:
        time.sleep(0.05)
    for i, pid in enumerate(pool._processes):
        pids[f"pool_worker{i}"] = pid

    async def main():
        asyncio.create_task(cluster.eval_once(timeout=600))
        await asyncio.sleep(0.5)  # the evaluator forked, the workers took their tasks
        print(json.dumps(pids), flush=True)
        await asyncio.sleep(600)

    asyncio.run(main())
""")


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) of a live process, None if gone; a zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if rest[0] in "ZX" else (rest[0], int(rest[1]), int(rest[19]))


def _descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live process below ``root``."""
    tree: dict[int, list[tuple[int, int]]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := _stat(int(d))) is not None:
            tree.setdefault(st[1], []).append((int(d), st[2]))
    out, todo = {}, [root]
    while todo:
        for pid, started in tree.get(todo.pop(), []):
            out[pid] = started
            todo.append(pid)
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.timeout(60)
def test_children_die_with_a_killed_parent(tmp_path):
    sleeper = tmp_path / "sleeper"
    sleeper.write_text("#!/bin/sh\nexec sleep 600\n")
    sleeper.chmod(0o755)
    parent = popen([sys.executable, "-c", PARENT, str(sleeper), str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                   text=True, env={**os.environ, "PYTHONPATH": ROOT})
    try:
        line = parent.stdout.readline()
        assert line, f"the parent exited {parent.wait()} before it started its children"
        named = json.loads(line)
        below = _descendants(parent.pid)
        assert set(named.values()) <= set(below), (named, below)
        assert len(below) > len(named)  # eval_once's evaluator too (and the pool's resource tracker)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        alive = below
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = {p: s for p, s in alive.items() if (st := _stat(p)) is not None and st[2] == s}
        names = {pid: name for name, pid in named.items()}
        assert not alive, f"outlived their killed parent: {[names.get(p, p) for p in alive]}"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
