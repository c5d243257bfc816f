"""`diloco metrics --serve`: the Prometheus exposition of a run, and `diloco status`'s fresh SEEN."""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import orjson
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from monitor.status import freshen_seen, heard_from_monitor
from monitor.metrics_view import MetricsSnapshot, fold_all
from monitor.prometheus import SnapshotCollector, families, parse_listen
from tests.system import FAST_AGG, FAST_MONITOR, SYNTH_LEARNER, Procs, wait_for
from tests.test_monitor_cli import env_for, metrics_messages

DILOCO = str(Path(sys.executable).parent / "diloco")
RUN = "prom"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without run): value} of an exposition text."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "run"))
            out[s.name, labels] = s.value
    return out


def exposition(snap: MetricsSnapshot) -> str:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(SnapshotCollector(lambda: snap))
    return generate_latest(reg).decode()


def test_every_reported_value_is_exposed_with_its_labels():
    now = 1_700_000_000.0
    snap = fold_all(MetricsSnapshot(run="r1"), [m for _, m in metrics_messages("r1", now)])
    text = exposition(snap)
    got = samples(text)
    l0 = (("learner", "l0"), ("region", "eu"))
    assert got["diloco_learner_step", l0] == 120
    assert got["diloco_learner_loss", l0] == pytest.approx(2.3456)
    assert got["diloco_learner_tokens_per_second", l0] == 1500.0
    assert got["diloco_learner_bytes_sent_total", l0] == 3 << 20
    assert got["diloco_learner_bytes_received_total", l0] == 5 << 20
    assert got["diloco_learner_staleness", l0] == 1
    assert got["diloco_learner_last_report_timestamp_seconds", l0] == now
    assert got["diloco_learner_state", (*l0, ("state", "active"))] == 1
    assert got["diloco_learner_state", (*l0, ("state", "evicted"))] == 0
    # a learner that never reported its state or bytes has no such samples (not zeros)
    l1 = (("learner", "l1"), ("region", "us"))
    assert got["diloco_learner_step", l1] == 80
    assert ("diloco_learner_bytes_sent_total", l1) not in got
    assert not any(k[0] == "diloco_learner_state" and ("learner", "l1") in k[1] for k in got)
    assert got["diloco_global_version", (("fragment", "0"),)] == 3
    assert got["diloco_global_version", (("fragment", "1"),)] == 2
    assert got["diloco_aggregator_merges_total", ()] == 4
    assert got["diloco_aggregator_accepted_total", ()] == 9
    assert got["diloco_aggregator_rejected_total", (("reason", "stale"),)] == 2
    assert got["diloco_members", (("state", "active"),)] == 2
    assert got["diloco_members", (("state", "evicted"),)] == 1
    assert got["diloco_members", (("state", "left"),)] == 0
    assert got["diloco_eval_loss", ()] == pytest.approx(3.21)
    assert got["diloco_eval_version", ()] == 7
    assert got["diloco_metrics_applied_total", ()] == 5
    assert 'run="r1"' in text


def test_a_diverged_loss_is_exposed_as_nan_and_an_empty_snapshot_has_no_role_samples():
    snap = fold_all(MetricsSnapshot(run="r2"), [
        {"role": "learner", "run": "r2", "ts": 1.0, "learner": "x", "loss": float("nan")},
        {"role": "learner", "run": "r2", "ts": 1.0, "learner": "x\nbad", "step": 1},  # malformed id
    ])
    got = samples(exposition(snap))
    assert math.isnan(got["diloco_learner_loss", (("learner", "x"), ("region", ""))])
    assert sum(v for (n, _), v in got.items() if n == "diloco_metrics_malformed_total") == 1
    empty = families(MetricsSnapshot(run="r3"))
    assert {f.name for f in empty if f.samples} == {"diloco_metrics_applied"}


@pytest.mark.parametrize("text,expected", [(":9464", ("127.0.0.1", 9464)), ("0.0.0.0:9464", ("0.0.0.0", 9464)),
                                           ("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:9000", ("::1", 9000))])
def test_listen_addresses(text, expected):
    """`:PORT` is this machine only (the README's localhost); every interface takes `0.0.0.0:PORT`."""
    assert parse_listen(text) == expected


def test_serve_without_a_host_listens_on_loopback_only():
    """The real server: `:0` binds 127.0.0.1 (a scrape there answers), `0.0.0.0:0` every interface."""
    import urllib.request

    from monitor.prometheus import serve

    for listen, host in ((":0", "127.0.0.1"), ("0.0.0.0:0", "0.0.0.0")):
        server, _, (bound, port) = serve(listen, lambda: MetricsSnapshot(run="lo"))
        try:
            assert bound == host, (listen, bound)
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            assert 'diloco_metrics_applied_total{run="lo"} 0.0' in body
        finally:
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize("text", ["9464", "host:", "host:port", ":70000", ""])
def test_a_bad_listen_address_names_what_it_expected(text):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen(text)


def test_status_takes_the_monitors_fresher_heartbeat_times():
    msg = {"role": "monitor", "seen": {"a": 105.0, "b": 90.0, "c": "x", "d": float("inf"), "e": -1}}
    heard = heard_from_monitor(msg)
    assert heard == {"a": 105.0, "b": 90.0}
    assert heard_from_monitor({"role": "learner", "seen": {"a": 1.0}}) == {}
    assert heard_from_monitor(["not", "a", "dict"]) == {}
    members = [{"learner": "a", "last_seen": 100.0}, {"learner": "b", "last_seen": 100.0},
               {"learner": "z", "last_seen": 50.0}]
    out = freshen_seen(members, heard)
    assert [(m["last_seen"], m["seen_from"]) for m in out] == [(105.0, "monitor"), (100.0, "record"),
                                                               (50.0, "record")]
    assert members[0]["last_seen"] == 100.0  # not modified in place


@pytest.fixture
def procs(nats_server, tmp_path):
    p = Procs(nats_server.url, RUN, str(tmp_path))
    yield p
    p.close()


async def test_prometheus_scrapes_a_live_run_and_status_shows_fresh_heartbeats(nats_server, procs):
    """A real run (aggregator, monitor, two learners): `diloco metrics --serve` started as a user starts
    it, scraped over HTTP until the run's merges, members and learners show; then `diloco status`:
    learners beating every 0.2 s are seen well under the members bucket's 5 s rewrite period."""
    procs.start("aggregator", "aggregator", **FAST_AGG)
    procs.start("monitor", "monitor", DILOCO_MONITOR_ID="mon-a", DILOCO_METRICS_INTERVAL="0.5", **FAST_MONITOR)
    for lid in ("a", "b"):
        procs.start(lid, "learner", DILOCO_LEARNER_ID=lid, DILOCO_METRICS_INTERVAL="0.5", **SYNTH_LEARNER)
    env = env_for(nats_server.url, RUN)
    server = subprocess.Popen([DILOCO, "metrics", "--serve", "127.0.0.1:0"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(server.stdout.readline), 30)
        assert "/metrics" in line, (line, server.poll())
        url = line.split("http://", 1)[1].split()[0]

        def scrape() -> dict:
            with urllib.request.urlopen(f"http://{url}", timeout=5) as r:
                assert r.headers["Content-Type"].startswith("text/plain")
                return samples(r.read().decode())

        async def ready():
            got = await asyncio.to_thread(scrape)
            return got if (got.get(("diloco_aggregator_merges_total", ())) or 0) > 0 \
                and got.get(("diloco_members", (("state", "active"),))) == 2 \
                and all(got.get(("diloco_learner_step", (("learner", lid), ("region", "local")))) for lid in "ab") \
                else None

        got, _ = await wait_for(ready, 60, 0.5)
        assert got, await asyncio.to_thread(scrape)
        first = got[("diloco_aggregator_merges_total", ())]
        await asyncio.sleep(1.5)
        assert (await asyncio.to_thread(scrape))[("diloco_aggregator_merges_total", ())] > first  # live

        t0 = time.monotonic()
        st = subprocess.run([DILOCO, "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert st.returncode == 0, st.stderr
        status = orjson.loads(st.stdout)
        members = {m["learner"]: m for m in status["membership"]["members"]}
        assert set(members) == {"a", "b"}
        for m in members.values():
            assert m["state"] == "active" and m["seen_from"] == "monitor", m
            assert status["ts"] - m["last_seen"] < 1.0, (status["ts"] - m["last_seen"], m)
        assert took < 30, took
    finally:
        server.terminate()
        try:
            rc = server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
            rc = server.wait(10)
    assert rc == 0, server.stderr.read()
