"""Membership with real processes: kill -9, restart, monitor restart, and a cut network link."""

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import orjson

import pytest
from nats.js.api import DeliverPolicy

from tests.netproxy import NetProxy
from tests.system import FAST_AGG, FAST_MONITOR, SYNTH_LEARNER, MetricsTap, Procs, member_states, wait_for

RUN = "sys"
DILOCO = str(Path(sys.executable).parent / "diloco")


@pytest.fixture
def procs(nats_server, tmp_path):
    p = Procs(nats_server.url, RUN, str(tmp_path))
    yield p
    p.close()


async def test_evict_readmit_monitor_restart_and_network_cut(nats_server, nc, js, procs):
    tap = MetricsTap()
    await tap.start(nc, RUN)
    procs.start("aggregator", "aggregator", **FAST_AGG)
    procs.start("monitor", "monitor", DILOCO_MONITOR_ID="mon-a", **FAST_MONITOR)
    proxy = NetProxy("127.0.0.1", nats_server.port)
    for lid in ("a", "b"):
        procs.start(lid, "learner", DILOCO_LEARNER_ID=lid, **SYNTH_LEARNER)
    procs.start("c", "learner", url=proxy.url, DILOCO_LEARNER_ID="c", **SYNTH_LEARNER)

    async def all_active():
        s = await member_states(js, RUN)
        return s if all(s.get(k) == "active" for k in "abc") else None

    states, _ = await wait_for(all_active, 60)
    assert states, await member_states(js, RUN)
    await wait_for(lambda: _true(tap.get("aggregator", "agg-0").get("contributions", {}).get("a", 0) > 0), 20)

    # 1. kill -9 a learner: evicted within evict_after (1 s) + 1 s, and the aggregator stops counting it
    procs.kill("a")
    evicted, waited = await wait_for(lambda: _state_is(js, "a", "evicted"), 10, 0.05)
    assert evicted and waited <= 1.0 + 1.0 + 0.3, waited  # + one KV/poll round trip
    ok, _ = await wait_for(lambda: _true(tap.get("aggregator", "agg-0").get("active") == 2), 5)
    assert ok, tap.get("aggregator", "agg-0")

    # 2. restart it: readmitted, from the newest versions, and its contributions are accepted again
    before = tap.get("aggregator", "agg-0")["contributions"].get("a", 0)
    procs.start("a", "learner", DILOCO_LEARNER_ID="a", **SYNTH_LEARNER)
    active, _ = await wait_for(lambda: _state_is(js, "a", "active"), 60)
    assert active
    ok, _ = await wait_for(lambda: _true(tap.get("aggregator", "agg-0")["contributions"].get("a", 0) > before), 20)
    assert ok
    rejected = tap.get("aggregator", "agg-0").get("rejected", {})
    assert not rejected.get("too_stale") and not rejected.get("future_version"), rejected

    # 3. restart the monitor: nobody alive is evicted
    sub = await js.subscribe(f"diloco.{RUN}.events.membership", deliver_policy=DeliverPolicy.NEW)
    procs.kill("monitor")
    await asyncio.sleep(0.5)
    procs.start("monitor", "monitor", DILOCO_MONITOR_ID="mon-b", **FAST_MONITOR)
    await asyncio.sleep(4.0)  # more than the start-up grace (one evict timeout) and several ticks
    evictions = []
    while True:
        try:
            m = await sub.next_msg(timeout=0.2)
        except Exception:
            break
        if b'"evicted"' in m.data:
            evictions.append(m.data)
    assert not evictions, evictions
    assert (await all_active()) is not None

    # 4. cut learner c's network: evicted; heal it: readmitted (rejoining -> active)
    proxy.cut()
    evicted, _ = await wait_for(lambda: _state_is(js, "c", "evicted"), 10, 0.05)
    assert evicted
    proxy.heal()
    active, _ = await wait_for(lambda: _state_is(js, "c", "active"), 30)
    assert active
    proxy.close()

    # 5. the CLI, run as a user runs it, against this live run
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(DILOCO_NATS_URL=nats_server.url, DILOCO_RUN=RUN)
    status = subprocess.run([DILOCO, "status", "--json"], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    st = orjson.loads(status.stdout)
    text = status.stdout
    assert all(f'"{k}"' in text for k in "abc") and '"active"' in text, text[:500]
    assert st, text[:200]
    metrics = subprocess.run([DILOCO, "metrics", "--once", "--wait", "2"], env=env, capture_output=True,
                             text=True, timeout=60)
    assert metrics.returncode == 0, metrics.stderr
    for needle in ("a", "b", "c", "aggregator", "monitor"):
        assert needle in metrics.stdout, metrics.stdout


async def _true(v):
    return v


async def _state_is(js, learner, state):
    return (await member_states(js, RUN)).get(learner) == state


async def test_a_learner_that_reaches_its_budget_leaves_and_its_last_work_is_merged(nats_server, nc, js, procs):
    """A learner that is done is not a failure: after its final sync it sends a leaving heartbeat,
    the monitor marks it ``left`` (never evicted for the silence that follows), and the aggregator
    merges every outer gradient it sent, the final sync's included (no inactive_learner rejection)."""
    tap = MetricsTap()
    await tap.start(nc, RUN)
    procs.start("aggregator", "aggregator", **FAST_AGG)
    procs.start("monitor", "monitor", DILOCO_MONITOR_ID="mon-a", **FAST_MONITOR)
    budget = {"a": "60", "b": "100"}
    learners = {lid: procs.start(lid, "learner", DILOCO_LEARNER_ID=lid, **{**SYNTH_LEARNER, "DILOCO_MAX_STEPS": n,
                                                                           "DILOCO_FINAL_SYNC": "true"})
                for lid, n in budget.items()}
    for lid, p in learners.items():
        ok, _ = await wait_for(lambda p=p: _true(p.poll() is not None), 60)
        assert ok and p.returncode == 0, lid
    sent = {lid: tap.get("learner", lid).get("contributions") for lid in budget}
    assert all(n and n > 0 for n in sent.values()), sent
    # silent for several evict_after (1 s): still left, never evicted
    await asyncio.sleep(3.0)
    assert await member_states(js, RUN) == {"a": "left", "b": "left"}

    def accounted():
        """Every contribution sent is merged, none rejected: not those of a learner that left, nor its
        first ones, which can reach the aggregator before the monitor admitted it (they are held
        until it is: aggregator/admission.py)."""
        agg = tap.get("aggregator", "agg-0")
        merged, rejected = agg.get("contributions", {}), agg.get("rejected", {})
        return (all(merged.get(lid, 0) == n for lid, n in sent.items()) and not rejected), merged, rejected

    ok, _ = await wait_for(lambda: _true(accounted()[0]), 20)
    assert ok, (accounted(), sent)
    transitions = []
    sub = await js.subscribe(f"diloco.{RUN}.events.membership", deliver_policy=DeliverPolicy.ALL, ordered_consumer=True)
    while True:
        try:
            m = await sub.next_msg(timeout=1.0)
        except Exception:
            break
        transitions.append(orjson.loads(m.data))
    await sub.unsubscribe()
    assert [t["new"] for t in transitions if t["learner"] == "a"][-1] == "left"
    assert not any(t["new"] == "evicted" for t in transitions), transitions
