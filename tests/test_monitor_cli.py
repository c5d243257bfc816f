"""``diloco metrics`` and ``diloco status`` run as a user runs them: real subprocesses of the
``diloco`` console script, configured by DILOCO_NATS_URL / DILOCO_RUN, against a real server."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from nats.js.errors import KeyNotFoundError

from bus.codec import dumps_json
from bus.config import CommonConfig
from bus.protocol import MANIFEST_KEY, Manifest
from bus.streams import ensure_run
from bus.subjects import GLOBAL, Subjects
from bus.transport import VersionedStore
from monitor.config import MonitorConfig
from monitor.membership import Heartbeat, heartbeat_to_dict
from monitor.service import MonitorService

DILOCO = str(Path(sys.executable).parent / "diloco")


def env_for(url: str, run: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(DILOCO_NATS_URL=url, DILOCO_RUN=run)
    return env


async def diloco(env: dict, *args: str, timeout: float = 30.0) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(DILOCO, *args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), timeout)
    return p.returncode, out.decode(), err.decode()


def metrics_messages(run: str, now: float) -> list[tuple[str, dict]]:
    s = Subjects(run)
    base = {"run": run, "ts": now}
    return [
        (s.metrics("learner", "l0"), {**base, "role": "learner", "learner": "l0", "region": "eu", "state": "active",
                                      "step": 120, "loss": 2.3456, "tokens_per_s": 1500.0, "bytes_sent": 3 << 20,
                                      "bytes_received": 5 << 20, "staleness": 1}),
        (s.metrics("learner", "l1"), {**base, "role": "learner", "learner": "l1", "region": "us", "step": 80,
                                      "loss": 2.9, "tokens_per_s": 900.0}),
        (s.metrics("aggregator", "agg"), {**base, "role": "aggregator", "versions": {"0": 3, "1": 2}, "merges": 4,
                                          "accepted": 9, "rejected": {"stale": 2, "evicted": 1}}),
        (s.metrics("monitor", "mon"), {**base, "role": "monitor", "counts": {"active": 2, "evicted": 1},
                                       "rejected_heartbeats": {}, "leader": True}),
        (s.metrics("evaluator", "ev"), {**base, "role": "evaluator", "eval_loss": 3.21, "version": 7}),
    ]


async def publish_metrics(nc, run: str, stop: asyncio.Event) -> None:
    while not stop.is_set():
        for subject, msg in metrics_messages(run, time.time()):
            await nc.publish(subject, dumps_json(msg))
        await nc.publish(Subjects(run).metrics("learner", "junk"), b"\x00 not json")
        await asyncio.sleep(0.1)


async def test_metrics_once_json_table_and_filters(nats_server, nc):
    run = "m1"
    env = env_for(nats_server.url, run)
    stop = asyncio.Event()
    pub = asyncio.create_task(publish_metrics(nc, run, stop))
    try:
        (rc1, out1, err1), (rc2, out2, err2), (rc3, out3, err3) = await asyncio.gather(
            diloco(env, "metrics", "--once", "--json", "--wait", "1.5"),
            diloco(env, "metrics", "--once", "--wait", "1.5"),
            diloco(env, "metrics", "--once", "--json", "--wait", "1.5", "--role", "learner", "--region", "us"),
        )
    finally:
        stop.set()
        await pub
    assert (rc1, rc2, rc3) == (0, 0, 0), (err1, err2, err3)

    snap = orjson.loads(out1)
    assert snap["run"] == run and set(snap["learners"]) == {"l0", "l1"}
    l0 = snap["learners"]["l0"]
    assert (l0["region"], l0["state"], l0["step"], l0["loss"], l0["bytes_sent"]) == ("eu", "active", 120, 2.3456,
                                                                                       3 << 20)
    assert snap["aggregator"]["versions"] == {"0": 3, "1": 2} and snap["aggregator"]["rejected"] == {"stale": 2,
                                                                                                    "evicted": 1}
    assert snap["monitor"]["counts"] == {"active": 2, "evicted": 1}
    assert snap["evaluator"]["eval_loss"] == 3.21 and snap["evaluator"]["version"] == 7
    assert snap["malformed"].get("not_json", 0) >= 1 and snap["applied"] >= 5

    assert "\x1b" not in out2  # --once prints a plain table, no cursor control
    lines = out2.splitlines()
    assert lines[0].startswith(f"run {run} | 2 learners")
    assert any(line.split()[:3] == ["eu", "l0", "active"] and "2.3456" in line for line in lines)
    assert any(line.split()[:2] == ["us", "l1"] for line in lines)
    assert any(line.startswith("aggregator  merges 4  accepted 9  rejected 3") for line in lines)
    assert any(line.startswith("monitor     active 2  evicted 1") for line in lines)
    assert any(line.startswith("evaluator   eval_loss 3.2100 after 7 merges") for line in lines)

    filtered = orjson.loads(out3)
    assert set(filtered["learners"]) == {"l1"} and filtered["aggregator"] is None and filtered["monitor"] is None


async def _read_until(stream, pred, timeout: float) -> bytes:
    buf = b""
    t_end = time.monotonic() + timeout
    while not pred(buf):
        chunk = await asyncio.wait_for(stream.read(4096), max(0.05, t_end - time.monotonic()))
        if not chunk:
            break
        buf += chunk
    return buf


async def test_metrics_live_json_lines_and_live_table(nats_server, nc):
    run = "m2"
    env = env_for(nats_server.url, run)
    stop = asyncio.Event()
    pub = asyncio.create_task(publish_metrics(nc, run, stop))
    lines_p = await asyncio.create_subprocess_exec(DILOCO, "metrics", "--json", "--role", "aggregator", env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    table_p = await asyncio.create_subprocess_exec(DILOCO, "metrics", "--interval", "0.3", env=env,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        got = await _read_until(lines_p.stdout, lambda b: b.count(b"\n") >= 3, 20)
        screen = await _read_until(table_p.stdout, lambda b: b.count(b"\x1b[H\x1b[2J") >= 3 and b"l1" in b, 20)
    finally:
        stop.set()
        await pub
        for p in (lines_p, table_p):
            if p.returncode is None:
                p.send_signal(signal.SIGINT)
        rcs = [await asyncio.wait_for(p.wait(), 10) for p in (lines_p, table_p)]
    assert rcs == [0, 0], [(await p.stderr.read()).decode() for p in (lines_p, table_p)]
    msgs = [orjson.loads(line) for line in got.splitlines()[:3]]
    assert all(m["role"] == "aggregator" and m["merges"] == 4 for m in msgs)
    last = screen.split(b"\x1b[H\x1b[2J")[-1].decode()
    assert "l0" in last and "l1" in last and "aggregator  merges 4" in last and "(connected)" in last


async def test_status_json_and_text(nats_server, nc, js):
    run = "s1"
    env = env_for(nats_server.url, run)
    await ensure_run(js, run)
    await VersionedStore(js, run, GLOBAL).put(0, 3, b"\x07" * 100)
    manifest = Manifest(run, "modelhash123456", {"d": 8}, 0, 2, "planhash", time.time())
    await (await js.key_value(Subjects(run).bucket("run"))).put(MANIFEST_KEY, dumps_json(manifest.to_dict()))
    common = CommonConfig(nats_url=nats_server.url, run=run, metrics_interval=0.2)
    svc = MonitorService(common, MonitorConfig(heartbeat_interval=0.2, suspect_after=0.6, evict_after=1.0,
                                               monitor_id="mon-a", lease_ttl=2.0))
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    await asyncio.wait_for(svc.ready.wait(), 10)

    async def beat():
        while True:
            for name, versions in (("l0", {0: 3}), ("l1", {0: 3})):
                hb = Heartbeat(name, "eu", "inc", 10, 5.0, versions, time.time())
                await nc.publish(Subjects(run).heartbeat(name), dumps_json(heartbeat_to_dict(hb)))
            await asyncio.sleep(0.2)

    beating = asyncio.create_task(beat())
    try:
        t0 = time.monotonic()
        while not (len(svc.members) == 2 and all(m.state.value == "active" for m in svc.members.values())):
            assert time.monotonic() - t0 < 5
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # written to KV
        (rc1, out1, err1), (rc2, out2, err2), (rc3, out3, err3) = await asyncio.gather(
            diloco(env, "status", "--json"), diloco(env, "status"), diloco(env, "status", "--run", "nothing"))
    finally:
        beating.cancel()
        stop.set()
        await task
    assert (rc1, rc2, rc3) == (0, 0, 0), (err1, err2, err3)

    st = orjson.loads(out1)
    assert st["run"] == run
    assert st["server"]["version"].count(".") == 2 and st["server"]["jetstream"] is True
    assert st["jetstream"]["streams"] >= 7 and "error" not in st["jetstream"]
    assert st["membership"]["counts"]["active"] == 2
    assert [(m["learner"], m["state"]) for m in st["membership"]["members"]] == [("l0", "active"), ("l1", "active")]
    assert st["leader"]["id"] == "mon-a" and st["leader"]["valid"] is True
    assert st["manifest"]["num_fragments"] == 2 and st["versions"] == {"0": 3, "1": None}
    assert st["streams"][f"DILOCO_{run}_GLOBAL"]["messages"] == 2
    assert st["streams"][f"DILOCO_{run}_EVENTS"]["messages"] >= 4  # joining + active for both
    assert st["streams"][f"KV_diloco_{run}_members"]["messages"] >= 2

    lines = out2.splitlines()
    assert lines[0] == f"run        {run}"
    assert any(line.startswith("leader     mon-a (lease valid") for line in lines)
    assert any(line.startswith("members    2: joining 0, active 2") for line in lines)
    assert any(line.split()[:3] == ["l0", "eu", "active"] for line in lines)
    assert any(line.startswith("versions   2 fragments, model modelhash123") for line in lines)
    assert any(line.split() == ["f0=v3", "f1=-"] for line in lines)
    assert any(line.split()[:3] == [f"DILOCO_{run}_GLOBAL", "2", "msgs"] for line in lines)

    assert "no membership bucket" in out3 and "no run manifest yet" in out3 and "leader     none" in out3


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


async def test_dir_watches_the_run_of_a_diloco_up_output_folder(nats_server, nc, tmp_path):
    """`--dir` takes the URL, run and credentials from the folder's watch.env (what `diloco up`
    writes), over a shell whose DILOCO_* variables point elsewhere; a folder without one is one line."""
    from diloco.up import write_watch_env

    run = "m3"
    path = write_watch_env(str(tmp_path), nats_server.url, run, None)
    assert os.stat(path).st_mode & 0o777 == 0o600
    env = env_for(f"nats://127.0.0.1:{_dead_port()}", "elsewhere")
    stop = asyncio.Event()
    pub = asyncio.create_task(publish_metrics(nc, run, stop))
    try:
        rc, out, err = await diloco(env, "metrics", "--dir", str(tmp_path), "--once", "--json", "--wait", "1.5")
    finally:
        stop.set()
        await pub
    assert rc == 0, err
    snap = orjson.loads(out)
    assert snap["run"] == run and set(snap["learners"]) == {"l0", "l1"}
    rc, out, err = await diloco(env, "status", "--dir", str(tmp_path / "nothing"))
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "watch.env" in err and "diloco up" in err


async def test_unreachable_server_is_one_line_and_exit_4():
    url = f"nats://user:hunter2@127.0.0.1:{_dead_port()}"
    env = dict(env_for(url, "r"), DILOCO_CONNECT_TIMEOUT="1")  # the default 10 s: tests/test_failfast.py
    results = await asyncio.gather(
        diloco(env, "status"), diloco(env, "status", "--json"), diloco(env, "metrics", "--once", "--wait", "0.5"),
        diloco(env, "metrics"))
    for (rc, out, err), prog in zip(results, ["status", "status", "metrics", "metrics"]):
        assert rc == 4 and out == ""  # bus.entry.EXIT_UNAVAILABLE
        assert len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"diloco {prog}: cannot connect to nats://***@127.0.0.1:")
        assert "within 1s (DILOCO_CONNECT_TIMEOUT): connection refused" in err
        assert "hunter2" not in err and "Traceback" not in err

    rc, out, err = await diloco(env, "status", "--url", "localhost:4222")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--url='localhost:4222'" in err
    rc, out, err = await diloco(env_for("not-a-url", "r"), "metrics", "--once")
    assert rc == 2 and err.strip().startswith("diloco metrics: DILOCO_NATS_URL='not-a-url'")


async def test_diloco_monitor_process_serves_and_stops_on_sigterm(nats_server, nc, js):
    run = "proc"
    env = env_for(nats_server.url, run)
    env.update(DILOCO_HEARTBEAT_INTERVAL="0.2", DILOCO_SUSPECT_AFTER="0.6", DILOCO_EVICT_AFTER="1",
               DILOCO_MONITOR_ID="mon-p", DILOCO_METRICS_INTERVAL="0.2")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "monitor", env=env, cwd="/",
                                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    members = None
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            hb = Heartbeat("l0", "eu", "inc", 1, 1.0, {}, time.time())
            await nc.publish(Subjects(run).heartbeat("l0"), dumps_json(heartbeat_to_dict(hb)))
            try:
                members = await js.key_value(Subjects(run).bucket("members"))
                if orjson.loads((await members.get("l0")).value)["state"] == "active":
                    break
            except Exception:
                pass
            await asyncio.sleep(0.2)
        else:
            raise AssertionError("the monitor process never wrote l0 as active")
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 15)
    err = (await proc.stderr.read()).decode()
    assert rc == 0, err
    logs = [orjson.loads(line) for line in err.splitlines() if line.startswith("{")]
    events = [rec["event"] for rec in logs]
    assert "leader" in events and "lease_released" in events and events[-1] in ("monitor_stopped", "nats_closed",
                                                                                  "nats_disconnected")
    assert all(rec["run"] == run and rec["role"] == "monitor" for rec in logs)
    lease = await js.key_value(Subjects(run).bucket("lease"))
    with pytest.raises(KeyNotFoundError):  # released on SIGTERM: a standby takes over at once
        await lease.get("leader")

    rc, out, err = await diloco(dict(env, DILOCO_EVICT_AFTER="0.5"), "monitor")
    assert rc == 2 and err.strip() == ("diloco monitor: DILOCO_SUSPECT_AFTER=0.6 must be < DILOCO_EVICT_AFTER=0.5")


async def test_trust_shows_the_evidence_and_clear_stores_a_clear_the_aggregator_reads(nats_server, nc, js):
    """``diloco trust``: each learner's trust and, for a suspect, its evidence (from the aggregators'
    metrics); ``diloco trust clear LEARNER``: a clear in the run bucket, what ``bus.trust_clears``
    gives the aggregator (its id grows with every clear)."""
    from bus.trust_clears import read_clears

    run = "t1"
    env = env_for(nats_server.url, run)
    await ensure_run(js, run)
    rec = {"l0": {"trust": 0.0, "reason": "opposes", "score": -1.1, "suspected_on": 3, "fragments": 4,
                  "distrusted": 12, "weighed": True,
                  "evidence": {"median": -1.1, "best": -0.8, "partner": "l2", "own": 1.9, "pairs": 3}},
           "l1": {"trust": 1.0, "reason": "", "score": 1.2, "weighed": True}}

    async def publish():
        while True:
            await nc.publish(Subjects(run).metrics("aggregator", "agg"),
                             dumps_json({"role": "aggregator", "run": run, "ts": time.time(), "id": "agg", "trust": rec}))
            await asyncio.sleep(0.2)

    pub = asyncio.create_task(publish())
    try:
        rc, out, err = await diloco(env, "trust", "--wait", "1")
    finally:
        pub.cancel()
    assert rc == 0, err
    assert "l0" in out and "0.00 opposes" in out and "median -1.1, best -0.8 (l2), own 1.9, on 3/4 fragments" in out
    assert read_clears is not None and await read_clears(js, run, ["l0", "l1"]) == {}
    rc, out, err = await diloco(env, "trust", "clear", "l0")
    assert rc == 0, err
    assert "l0's trust records cleared" in out
    first = await read_clears(js, run, ["l0", "l1"])
    assert set(first) == {"l0"}
    rc, out, err = await diloco(env, "trust", "clear", "l0")
    assert rc == 0 and (await read_clears(js, run, ["l0"]))["l0"] > first["l0"]
    rc, out, err = await diloco(env, "trust", "clear", "bad.id")  # not a learner id: one line, no traceback
    assert rc != 0 and "Traceback" not in err and "learner" in err, err


# -- issue 42: --once waits for every live learner and no longer; an unknown command is suggested --------


def test_once_waits_for_the_live_members_within_the_filters():
    from monitor.cli import expected_learners, missing_reports
    from monitor.metrics_view import MetricsSnapshot, fold

    states = {"l0": ("active", "eu"), "l1": ("joining", "us"), "l2": ("rejoining", "us"), "l3": ("evicted", "eu"),
              "l4": ("left", "us"), "l5": ("suspect", "eu")}
    assert expected_learners(states) == {"l0", "l1", "l2"}  # evicted, left and silent (suspect) ones never report
    assert expected_learners(states, region="us") == {"l1", "l2"}
    assert expected_learners(states, learner="l0") == {"l0"} and expected_learners(states, learner="l3") == set()
    assert expected_learners(states, role="aggregator") == set()
    snap = MetricsSnapshot(run="r")
    assert missing_reports(snap, {"l1", "l0"}, {"monitor"}) == ["l0", "l1", "monitor"]
    snap = fold(snap, {"role": "learner", "run": "r", "learner": "l0", "ts": time.time(), "step": 1})
    snap = fold(snap, {"role": "monitor", "run": "r", "ts": time.time(), "counts": {}, "leader": True})
    assert missing_reports(snap, {"l1", "l0"}, {"monitor"}) == ["l1"]
    snap = fold(snap, {"role": "learner", "run": "r", "learner": "l1", "ts": time.time()})
    assert missing_reports(snap, {"l0", "l1"}, {"monitor"}) == []


@pytest.mark.timeout(300)
async def test_metrics_once_waits_for_a_late_live_learner_and_no_longer(nats_server, nc, js):
    """Four learners live in the members bucket (one evicted): --once returns as soon as the fourth,
    which reports 1.5 s late, has (not the whole --wait); one that never reports is named on stderr."""
    from bus.members import Member, State, member_to_dict

    run = "once"
    await ensure_run(js, run)
    kv = await js.key_value(Subjects(run).bucket("members"))
    now = time.time()
    for name, state in (("l0", State.ACTIVE), ("l1", State.ACTIVE), ("l2", State.JOINING), ("l3", State.ACTIVE),
                        ("gone", State.EVICTED)):
        await kv.put(name, dumps_json(member_to_dict(Member(name, "eu", state, now, now, "test", "inc"))))
    stop = asyncio.Event()

    async def publish(names: tuple[str, ...], after: float) -> None:
        await asyncio.sleep(after)
        while not stop.is_set():
            for x in names:
                msg = {"role": "learner", "run": run, "learner": x, "region": "eu", "ts": time.time(), "step": 3}
                await nc.publish(Subjects(run).metrics("learner", x), dumps_json(msg))
            await asyncio.sleep(0.3)

    env = env_for(nats_server.url, run)
    pubs = [asyncio.create_task(publish(("l0", "l1", "l2"), 0.0)), asyncio.create_task(publish(("l3",), 1.5))]
    try:
        t0 = time.monotonic()
        # a --wait far above what the command takes at any load (6 s at idle, 21 s beside two CPU hogs
        # and a suite: its Python start), so returning early is told from waiting it out at any load
        rc, out, err = await diloco(env, "metrics", "--once", "--json", "--wait", "120", timeout=150)
        took = time.monotonic() - t0
        for p in pubs[1:]:
            p.cancel()
        rc2, out2, err2 = await diloco(env, "metrics", "--once", "--json", "--wait", "1")
    finally:
        stop.set()
        await asyncio.gather(*pubs, return_exceptions=True)
    assert rc == 0, err
    assert set(orjson.loads(out)["learners"]) == {"l0", "l1", "l2", "l3"}
    assert took < 60, took  # the whole --wait was 120 s; this is Python's start plus l3's 1.5 s
    assert rc2 == 0 and set(orjson.loads(out2)["learners"]) == {"l0", "l1", "l2"}
    assert err2.strip() == "diloco metrics: not heard from l3 within --wait 1s (live in the members bucket)", err2


async def test_status_of_a_server_that_stops_answering_is_one_line_and_exit_4():
    """A port that takes the connection and answers NATS's handshake but no request (a server going
    away): one line naming it, exit 4, after one 5 s request, not a page of ERROR lines and exit 0."""
    async def half_server(reader, writer):
        writer.write(b'INFO {"server_id":"x","version":"2.10.0","max_payload":1048576,"jetstream":true}\r\n')
        await writer.drain()
        while line := await reader.readline():
            if line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
                await writer.drain()

    srv = await asyncio.start_server(half_server, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        t0 = time.monotonic()
        rc, out, err = await diloco(env_for(f"nats://127.0.0.1:{port}", "gone"), "status", "--wait", "0")
        took = time.monotonic() - t0
    finally:
        srv.close()
    assert rc == 4 and out == "" and len(err.strip().splitlines()) == 1, (rc, out, err)
    assert err.startswith(f"diloco status: the server at nats://127.0.0.1:{port} does not answer"), err
    assert took < 15, took


def test_an_unknown_command_suggests_the_closest_in_one_line(capsys):
    from diloco.cli import main

    assert main(["lerner"]) == 2
    err = capsys.readouterr().err
    assert err == "diloco: unknown command 'lerner': did you mean learner? (diloco --help lists them)\n"
    assert main(["statsu"]) == 2 and "did you mean status?" in capsys.readouterr().err
    assert main(["frobnicate"]) == 2
    assert capsys.readouterr().err == "diloco: unknown command 'frobnicate': (diloco --help lists them)\n"
