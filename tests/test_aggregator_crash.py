"""Crash loop: kill -9 the aggregator at random instants while learners publish, then check that
versions are monotonic and the global parameters equal a replay of exactly the applied contributions.

Kills fall between merges and their checkpoints (every DILOCO_CHECKPOINT_EVERY = 32 versions by
default): each restart loads the newest checkpoint and replays the merge log from the GRAD stream."""

import asyncio
import random
import signal
import subprocess

import numpy as np
import orjson
import pytest
from nats.js.api import DeliverPolicy

from bus.subjects import GLOBAL, Subjects
from bus.transport import VersionedStore
from tests.agg_helpers import PLAN, PY, REPLAY_AGG, assert_replay_matches, env, merge_events, sending_learners

RUN = "crash"
S = Subjects(RUN)
AGG = REPLAY_AGG


def _spawn(url):
    return subprocess.Popen([PY, "-m", "diloco.cli", "aggregator"], env=env(url, RUN, **AGG),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _rejections(js, keys) -> str:
    """What the audit trail says about ``keys`` (the reject events), for the failure message."""
    sub = await js.subscribe(S.event("reject"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    found = []
    while True:
        try:
            e = orjson.loads((await sub.next_msg(timeout=1.0)).data)
        except Exception:
            break
        if (e.get("learner"), e.get("incarnation"), e.get("fragment"), e.get("round")) in keys:
            found.append(e)
    return f"their reject events: {found}" if found else "no reject event names them"


# 20 kills, each a new aggregator process that starts and replays: 55 s at idle, past the suite's
# 120 s default beside two CPU hogs
@pytest.mark.timeout(360)
async def test_kill_dash_nine_loop_loses_nothing_and_applies_nothing_twice(nats_server, nc, js):
    heads_seen: list[tuple[int, int]] = []

    async def on_head(m):
        h = orjson.loads(m.data)
        heads_seen.append((h["f"], h["v"]))

    await nc.subscribe(S.versioned_heads(GLOBAL), cb=on_head)
    agg = _spawn(nats_server.url)
    store = VersionedStore(js, RUN, GLOBAL)
    for _ in range(200):  # wait for the first aggregator to create the run
        try:
            if all([await store.head(p) for p in range(PLAN.num_fragments)]):
                break
        except Exception:
            pass
        await asyncio.sleep(0.1)
    sent: dict[tuple, tuple[np.ndarray, int]] = {}
    stop = asyncio.Event()
    # fragments at random
    tasks = sending_learners(js, RUN, store, stop, sent, lambda rng, i: rng.randrange(PLAN.num_fragments))
    rng = random.Random(7)
    trials = 20
    started = asyncio.Queue()  # recovered events, live: an aggregator that finished its start
    live = await nc.subscribe(S.event("recovered"), cb=started.put)
    for i in range(trials):
        if i % 2:  # anywhere, start-up included
            await asyncio.sleep(rng.uniform(0.3, 1.6))
        else:  # after the start, between merges and checkpoints: however slow a loaded machine starts it
            try:
                await asyncio.wait_for(started.get(), 20)
            except asyncio.TimeoutError:
                pass
            await asyncio.sleep(rng.uniform(0.2, 1.2))
        while not started.empty():
            started.get_nowait()
        agg.send_signal(signal.SIGKILL)
        agg.wait()
        agg = _spawn(nats_server.url)
    await live.unsubscribe()
    stop.set()
    await asyncio.gather(*tasks[:2])
    # the last aggregator drains everything that was acknowledged by the bus
    events = await merge_events(js, RUN, sent)
    agg.send_signal(signal.SIGTERM)
    assert agg.wait(20) in (0, -signal.SIGTERM)
    tasks[2].cancel()

    applied = {k for keys, _, _ in events.values() for k in keys}
    lost = set(sent) - applied
    assert not lost, f"lost: {len(lost)} contributions {sorted(lost)[:5]}; " + await _rejections(js, lost)
    # versions monotonic per fragment, as every head publication was seen live
    last = {}
    for f, v in heads_seen:
        assert v >= last.get(f, -1), f"fragment {f} went back from {last[f]} to {v}"
        last[f] = v
    # every version was published, none skipped (a restart publishes the replayed versions the
    # crashed process had queued): learners follow each version's applied keys
    for f in range(PLAN.num_fragments):
        seen = {v for g, v in heads_seen if g == f}
        assert set(range(1, last[f] + 1)) <= seen, f"fragment {f}: versions never published: " \
            f"{sorted(set(range(1, last[f] + 1)) - seen)[:10]}"
    # replay exactly the recorded merges with the pure merge step: same parameters, bit for bit
    await assert_replay_matches(js, RUN, events, sent)
    assert len(sent) > 100 and sum(len(k) for k, _, _ in events.values()) == len(sent)
    # the kills fell between merges and their checkpoints: restarts replayed the merge log (the
    # bit-exact check above covers those replays), and none lost a contribution
    rec = await js.subscribe(S.event("recovered"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    recovered = []
    while True:
        try:
            recovered.append(orjson.loads((await rec.next_msg(timeout=1.0)).data))
        except Exception:
            break
    # (a kill during start-up, before recovery is done, leaves no event: not every restart has one;
    # half the kills wait for the start to be over)
    assert sum(1 for r in recovered if r["replayed"]) >= trials // 4, recovered
    assert not any(r["lost"] for r in recovered), recovered
    assert any(scale < 1 for _, scale, _ in events.values())  # the participation scale was exercised
