"""`diloco aggregator` as shard workers (aggregator.shards): the supervisor with stand-in workers,
then real shard workers on a real server, one of them killed with SIGKILL."""

import asyncio
import os
import signal
import subprocess
import sys
import time

import numpy as np
import orjson
import pytest

from aggregator.config import AggregatorConfig
from aggregator.shards import Shards
from bus.log import get_logger
from bus.subjects import GLOBAL, Subjects
from bus.transport import VersionedStore
from tests.agg_helpers import PLAN, PY, REPLAY_AGG, assert_replay_matches, env, merge_events, sending_learners

# a stand-in worker: says which fragments it owns and its pid, then lives until stopped, or exits
# with the code named for its fragments
WORKER = """
import os, sys, time
frag = os.environ["DILOCO_AGG_FRAGMENTS"]
with open(sys.argv[1], "a") as f:
    f.write(f"{frag} {os.getpid()} {os.environ['DILOCO_AGGREGATOR_ID']} {os.environ['DILOCO_EMBEDDED_MONITOR']}\\n")
code = dict(x.split("=") for x in sys.argv[2].split(",") if x).get(frag)
if code is not None:
    sys.exit(int(code))
time.sleep(600)
"""


def _started(path) -> list[tuple[str, int, str, str]]:
    try:
        with open(path) as f:
            return [(a, int(b), c, d) for a, b, c, d in (line.split() for line in f if line.strip())]
    except FileNotFoundError:
        return []


async def _until(cond, timeout=30.0):
    t = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < t, "timed out"
        await asyncio.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _shards(tmp_path, exits: str = ""):
    path = tmp_path / "started"
    argv = (sys.executable, "-c", WORKER, str(path), exits)
    return path, Shards(AggregatorConfig(aggregator_id="agg-x"), [range(0, 2), range(2, 3)], get_logger(), argv=argv)


async def test_a_killed_shard_worker_is_started_again_and_a_stop_stops_every_worker(tmp_path):
    path, shards = _shards(tmp_path)
    stop = asyncio.Event()
    task = asyncio.create_task(shards.run(stop))
    await _until(lambda: len(_started(path)) == 2)
    first = {a: (pid, who, mon) for a, pid, who, mon in _started(path)}
    # each owns its range under its own id, and runs no monitor of its own (the supervisor's is the one)
    assert {a: (who, mon) for a, (_, who, mon) in first.items()} == {
        "0-1": ("agg-x-s0", "false"), "2": ("agg-x-s1", "false")}
    os.kill(first["2"][0], signal.SIGKILL)
    await _until(lambda: len(_started(path)) == 3)
    again = _started(path)[-1]
    assert again[0] == "2" and again[1] != first["2"][0]
    assert _alive(first["0-1"][0]), "the other shard was not touched"
    assert shards.workers[1].restarts == 1 and shards.workers[0].restarts == 0
    stop.set()
    assert await asyncio.wait_for(task, 60) == 0
    assert not any(_alive(pid) for _, pid, _, _ in _started(path))


async def test_a_worker_that_a_restart_cannot_mend_stops_the_aggregator_with_its_code(tmp_path):
    path, shards = _shards(tmp_path, exits="2=3")  # the second shard: a run that does not match (3)
    stop = asyncio.Event()
    assert await asyncio.wait_for(shards.run(stop), 60) == 3
    started = _started(path)
    assert [a for a, *_ in started].count("2") == 1, "it was restarted"
    assert not any(_alive(pid) for _, pid, _, _ in started), "the other worker was left running"


def _children(pid: int) -> dict[str, int]:
    """The live child processes of ``pid`` by the fragments they own (their DILOCO_AGG_FRAGMENTS)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] == "Z":
                continue
            with open(f"/proc/{d}/environ", "rb") as f:
                envs = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except (OSError, ValueError, IndexError):
            continue
        out[envs.get(b"DILOCO_AGG_FRAGMENTS", b"?").decode()] = int(d)
    return out


# two shard workers started, one killed, replayed: 20-40 s on a loaded 2-core machine
@pytest.mark.timeout(240)
async def test_a_shard_worker_killed_with_sigkill_is_replayed_bit_for_bit_while_the_other_goes_on(
        nats_server, nc, js):
    from monitor.status import gather_status, render_status

    run = "shards"
    s = Subjects(run)
    heads: list[tuple[int, int, float]] = []

    async def on_head(m):
        h = orjson.loads(m.data)
        heads.append((h["f"], h["v"], time.monotonic()))

    await nc.subscribe(s.versioned_heads(GLOBAL), cb=on_head)
    recovered: list[dict] = []  # with "at": when it reached us

    async def on_recovered(m):
        recovered.append({**orjson.loads(m.data), "at": time.monotonic()})

    await nc.subscribe(s.event("recovered"), cb=on_recovered)
    # the tiny model's 2 fragments, one per shard worker (auto would run one process: a small model)
    agg = subprocess.Popen([PY, "-m", "diloco.cli", "aggregator"],
                           env=env(nats_server.url, run, **REPLAY_AGG, DILOCO_AGG_SHARDS="2"))
    try:
        await _until(lambda: set(_children(agg.pid)) == {"0", "1"}, 120)
        store = VersionedStore(js, run, GLOBAL)

        async def both_heads():
            try:
                return all([await store.head(p) for p in range(PLAN.num_fragments)])
            except Exception:
                return False
        t = time.monotonic() + 120
        while not await both_heads():
            assert time.monotonic() < t and agg.poll() is None, "the run was not created"
            await asyncio.sleep(0.1)
        sent: dict[tuple, tuple[np.ndarray, int]] = {}
        stop = asyncio.Event()
        # each learner's sends alternate between the two fragments (the two workers)
        tasks = sending_learners(js, run, store, stop, sent, lambda rng, i: i % PLAN.num_fragments)
        await _until(lambda: all(sum(1 for f, *_ in heads if f == p) >= 5 for p in range(2)), 60)
        # diloco status shows each shard worker with the fragments it owns
        st = await gather_status(nc, run, seen_wait=5.0)
        assert {(a["id"], a["fragments"]) for a in st["aggregators"]} == {("agg-0-s0", "0"), ("agg-0-s1", "1")}
        assert "agg-0-s1" in render_status(st)
        victim = _children(agg.pid)["1"]
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        await _until(lambda: any(r["fragment"] == 1 and r["aggregator"] == "agg-0-s1" and r["at"] > killed
                                 for r in recovered), 120)
        back = min(r["at"] for r in recovered if r["fragment"] == 1 and r["at"] > killed)
        assert _children(agg.pid)["1"] != victim
        # fragment 0's worker merged on while fragment 1's was down
        assert any(f == 0 and killed < t_ < back for f, _, t_ in heads), "fragment 0 stopped with fragment 1"
        await asyncio.sleep(1.0)  # merges after the restart too
        stop.set()
        await asyncio.gather(*tasks[:2])
        events = await merge_events(js, run, sent)
        tasks[2].cancel()
        # nothing lost or applied twice; the parameters are the pure replay of the recorded merges
        await assert_replay_matches(js, run, events, sent)
        assert not any(r["lost"] for r in recovered), recovered
        assert any(f == 1 and t_ > back for f, _, t_ in heads), "fragment 1 did not merge after its restart"
        pids = list(_children(agg.pid).values())
        agg.send_signal(signal.SIGTERM)
        assert agg.wait(60) == 0
        assert not any(_alive(pid) for pid in pids), "a shard worker outlived its aggregator"
    finally:
        if agg.poll() is None:
            agg.kill()
            agg.wait()


def test_the_cores_are_the_affinity_or_a_containers_cpu_quota_whichever_is_fewer(tmp_path):
    from aggregator.shards import usable_cores

    affinity = len(os.sched_getaffinity(0))
    f = tmp_path / "cpu.max"
    f.write_text("max 100000\n")
    assert usable_cores(str(f)) == affinity
    f.write_text("150000 100000\n")  # --cpus=1.5
    assert usable_cores(str(f)) == min(affinity, 2)
    f.write_text("50000 100000\n")
    assert usable_cores(str(f)) == 1
    assert usable_cores(str(tmp_path / "none")) == affinity  # no cgroup v2 file: the affinity


async def test_a_worker_that_cannot_be_started_is_tried_again_until_the_stop(tmp_path):
    shards = Shards(AggregatorConfig(aggregator_id="agg-x"), [range(0, 1), range(1, 2)], get_logger(),
                    argv=(str(tmp_path / "no-such-program"),))
    stop = asyncio.Event()
    task = asyncio.create_task(shards.run(stop))
    await _until(lambda: all(w.restarts >= 1 for w in shards.workers), 10)
    stop.set()
    assert await asyncio.wait_for(task, 10) == 0


async def test_a_cancelled_supervisor_stops_its_workers(tmp_path):
    path, shards = _shards(tmp_path)
    task = asyncio.create_task(shards.run(asyncio.Event()))
    await _until(lambda: len(_started(path)) == 2)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not any(_alive(pid) for _, pid, _, _ in _started(path))
