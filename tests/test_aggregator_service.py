"""The aggregator service against a real nats-server: rejections, merges, slow learners."""

import asyncio
import os
import signal
import threading
import time

from collections import Counter

import numpy as np
import pytest
import orjson
from nats.js.api import DeliverPolicy

from aggregator.config import AggregatorConfig
from aggregator.quorum import AUTO
from aggregator.service import AggregatorService
from bus import codec
from bus.chunks import checksum, chunk_headers
from bus.config import CommonConfig
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkPublisher, VersionedStore
from bus.conn import connect
from learner.builtin import create_builtin_run
from tests.agg_helpers import MODEL, PLAN, FakeLearner, cancel_until_done, set_members

RUN = "agg"


async def _start(nats_server, **cfg):
    common = CommonConfig(nats_url=nats_server.url, run=RUN, metrics_interval=0.2, partial_timeout=1.0)
    nc = await connect(common, name="create")
    try:  # as `diloco aggregator` does before the aggregator
        await create_builtin_run(nc.jetstream(timeout=10), common, MODEL)
    finally:
        await nc.close()
    svc = AggregatorService(common, AggregatorConfig(**cfg))
    stop = asyncio.Event()
    task = asyncio.create_task(svc.run(stop))
    for _ in range(200):
        if svc.states and hasattr(svc, "consumer"):
            break
        await asyncio.sleep(0.05)
    assert svc.states, "aggregator did not start"
    return svc, stop, task


async def _until(pred, timeout=10.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return False


async def _send_merged(svc, learner, p: int, rounds) -> None:
    """``learner`` sends fragment p one contribution per round in ``rounds`` (its base the version
    before), each merged and published before the next."""
    for r in rounds:
        await learner.send(p, base=r)
        assert await _until(lambda: svc.published.get(p) == r + 1, 15), (p, r)


async def _crash(svc, task) -> None:
    """A kill: the service's task cancelled, no clean stop, no checkpoint at the end."""
    await cancel_until_done(task)
    await svc.nc.close()


def _hold_checkpoints(svc, fragments: set[int]) -> tuple[asyncio.Event, list, list]:
    """The service's checkpoint puts of ``fragments`` wait until the returned event is set; every
    put started is listed as (fragment, version), every one stored with its bytes."""
    real, held, started, stored = svc.sstore.put, asyncio.Event(), [], []

    async def put(p, version, blob, meta):
        started.append((p, version))
        if p in fragments:
            await held.wait()
        head = await real(p, version, blob, meta)
        stored.append((p, version, blob.tobytes() if hasattr(blob, "tobytes") else bytes(blob)))
        return head

    svc.sstore.put = put
    return held, started, stored


async def test_every_rejection_reason_is_counted_and_leaves_global_state_unchanged(nats_server, js):
    # admission_wait: the stranger (never admitted) is held that long, then rejected
    svc, stop, task = await _start(nats_server, quorum=1, grace="fixed", grace_seconds=0.1, max_staleness=2,
                                   norm_outlier_factor=5.0, norm_min_history=5, admission_wait=0.5)
    n = PLAN.sizes[0]
    await set_members(js, RUN, {"good": "active", "sleepy": "evicted"})
    await _until(lambda: svc.membership.members.get("good") == "active")
    store = VersionedStore(js, RUN, GLOBAL)
    before = {p: (await store.get(p)) for p in range(PLAN.num_fragments)}
    good = FakeLearner(js, RUN, "good")
    # 5 honest contributions first, so the norm history of fragment 0 exists: versions 1..5
    for v in range(5):
        await good.send(0, base=v)
        assert await _until(lambda: svc.published.get(0) == v + 1)
    snapshot = {p: (svc.states[p].version, svc.states[p].params.copy()) for p in svc.states}
    bad = FakeLearner(js, RUN, "good")
    crafted = [
        dict(run="other"),  # wrong_run
        dict(model="0" * 16),  # wrong_model
        dict(base=99),  # future_version
        dict(base=2),  # too_stale (5 - 2 > 2)
        dict(steps=0),  # bad_counters
        dict(tokens=1),  # bad_counters (fewer tokens than steps)
        dict(tokens=2**62, steps=1),  # bad_counters (above the manifest's max tokens per inner step)
        dict(frag=7),  # forged_subject: fragment 7 claimed on fragment 0's subject
        dict(learner="sleepy"),  # forged_subject: another learner's id on good's subject
    ]
    for over in crafted:
        await bad.send(0, base=over.pop("base", 5), **over)
    await FakeLearner(js, RUN, "stranger").send(0, base=5)  # unknown_learner
    await FakeLearner(js, RUN, "sleepy").send(0, base=5)  # inactive_learner
    await bad.send(0, base=5, vector=np.full(n, np.nan, np.float32))  # non_finite
    await bad.send(0, base=5, vector=np.full(n, 1e3, np.float32))  # norm_bound (no history needed)
    await bad.send(0, base=5, vector=np.full(n, 1e-2, np.float32))  # norm_outlier (10x the honest norm)
    await bad.send(0, base=5, vector=np.zeros(n + 1, np.float32))  # wrong_shape
    await bad.send(0, base=5, vector=np.zeros((2, n // 2), np.float32))  # wrong_shape: right size, 2-D
    # replay of an already-applied contribution (same learner, incarnation, fragment, round) after
    # the bus's dedupe window (simulated by a new message id)
    replay = FakeLearner(js, RUN, "good")
    replay.inc, replay.round = good.inc, {0: 0, 1: 0}
    await replay.send(0, base=4, obj_suffix=".again")
    # garbage on the gradient subject: random bytes; a truncated chunk; a wrong chunk count; a
    # chunk set that never completes; a size announcement over the pending limit
    subj = Subjects(RUN).grad(0, "good")
    await js.publish(subj, b"\x00garbage")
    blob = bytes(codec.encode_array(np.ones(n, np.float32)))
    meta = {"run": RUN}
    await js.publish(subj, blob[:-3], headers=chunk_headers("trunc", 0, 1, len(blob), checksum(blob), meta))
    await js.publish(subj, blob[:100], headers=chunk_headers("count", 0, 2, len(blob), checksum(blob), meta))
    await js.publish(subj, blob[100:], headers=chunk_headers("count", 1, 3, len(blob), checksum(blob), meta))
    await js.publish(subj, blob[:100], headers=chunk_headers("partial", 0, 2, len(blob), checksum(blob), meta))
    await js.publish(subj, b"x", headers=chunk_headers("huge", 0, 1, 8 * 1024**3, 0, meta))
    want = {"wrong_run": 1, "wrong_model": 1, "future_version": 1, "too_stale": 1, "bad_counters": 3,
            "forged_subject": 2, "unknown_learner": 1, "inactive_learner": 1, "non_finite": 1, "norm_outlier": 1,
            "norm_bound": 1, "wrong_shape": 2, "duplicate": 1, "transport_bad_header": 1, "transport_size": 1,
            "transport_mismatch": 1, "transport_expired": 1, "transport_too_large": 1}
    ok = await _until(lambda: dict(svc.stats.rejected) == want, 15)
    assert ok, dict(svc.stats.rejected)
    for p, (v, params) in snapshot.items():
        assert svc.states[p].version == v and np.array_equal(svc.states[p].params, params)
    head, blob = await store.get(0)
    assert head.version == 5 and np.array_equal(codec.decode_array(blob), snapshot[0][1])
    # every rejection is also an audit event in JetStream
    sub = await js.subscribe(Subjects(RUN).event("reject"), deliver_policy=DeliverPolicy.ALL)
    audited = Counter()
    while sum(audited.values()) < sum(want.values()):
        audited[orjson.loads((await sub.next_msg(timeout=5)).data)["reason"]] += 1
    assert audited == Counter(want)
    stop.set()
    await task
    assert before[0][0].version == 0


async def test_merge_publishes_version_with_applied_keys_and_nesterov_step(nats_server, js):
    svc, stop, task = await _start(nats_server, grace="fixed", grace_seconds=0.2, merge="mean", quorum=2,
                                   outer_momentum=0.9)
    await set_members(js, RUN, {"a": "active", "b": "active"})
    await _until(lambda: len(svc.membership.active()) == 2)
    store = VersionedStore(js, RUN, GLOBAL)
    _, blob0 = await store.get(0)
    theta0 = np.array(codec.decode_array(blob0))
    a, b = FakeLearner(js, RUN, "a", 1), FakeLearner(js, RUN, "b", 2)
    va = np.full(PLAN.sizes[0], 0.01, np.float32)
    vb = np.full(PLAN.sizes[0], 0.03, np.float32)
    ka = await a.send(0, base=0, vector=va)
    kb = await b.send(0, base=0, vector=vb)
    assert await _until(lambda: svc.published.get(0) == 1)
    head, blob = await store.get(0)
    assert head.version == 1 and sorted(map(tuple, head.meta["applied"])) == sorted([ka, kb])
    # equal tokens and staleness: mean 0.02, a whole round (2 of 2 learners); Nesterov from zero
    # momentum (momentum 0.9 here, the default is 0): u = g + 0.9 g = 1.9 g
    expect = theta0 - np.float32(0.7) * np.float32(1.9) * np.float32(0.02)
    np.testing.assert_allclose(codec.decode_array(blob), expect, rtol=1e-5, atol=1e-7)
    stop.set()
    await task


async def test_without_a_monitor_rounds_stop_waiting_for_a_learner_after_its_final_sync(nats_server, js):
    """No membership (DILOCO_REQUIRE_MEMBERSHIP=false), every active learner waited for: a learner's
    final sync (``final``) takes it out of the active set, so the others' rounds merge without it
    (before, they waited for it for ever, and since their learners hold their steps for a merge, the
    run stalled); what it sent is still merged; a new process of the same id is active again, and
    late work of an earlier process of it does not count as one."""
    svc, stop, task = await _start(nats_server, require_membership=False, quorum=0, trust="off")
    a, b_old = FakeLearner(js, RUN, "a", 1), FakeLearner(js, RUN, "b", 4)
    await a.send(0, base=0)
    await b_old.send(0, base=0)
    assert await _until(lambda: svc.membership.seen == {"a", "b"})  # both known
    b = FakeLearner(js, RUN, "b", 2)  # b restarted once
    await a.send(1, base=0)
    await asyncio.sleep(0.5)
    assert svc.published.get(1, 0) == 0  # every active learner: b is waited for
    kb = await b.send(1, base=0, final=1)  # b's final sync
    assert await _until(lambda: svc.published.get(1) == 1)
    head, _ = await VersionedStore(js, RUN, GLOBAL).get(1)
    assert kb in [tuple(k) for k in head.meta["applied"]] and len(head.meta["applied"]) == 2  # a's and b's
    assert svc.membership.active() == {"a"} and svc.membership.leavers() == {"b"}
    v = svc.states[0].version
    ka = await a.send(0, base=v)
    # b is not waited for (the version published, not only merged: its head is read next; waiting
    # for the merge alone read the previous head once in a loaded suite)
    assert await _until(lambda: svc.published.get(0, -1) > v)
    head, _ = await VersionedStore(js, RUN, GLOBAL).get(0)
    assert ka in [tuple(k) for k in head.meta["applied"]]
    assert svc.stats.contributions["b"] == 2  # b's earlier process's round and b's final one
    await b_old.send(0, base=v)  # a late message of b's earlier process: b stays done
    assert await _until(lambda: any(x.c.learner == "b" for x in svc.intake.buffers[0]))
    assert svc.membership.finished == {"b": b.inc} and svc.membership.active() == {"a"}
    b2 = FakeLearner(js, RUN, "b", 3)  # b restarted: a new incarnation, active again
    await b2.send(1, base=1)
    assert await _until(lambda: "b" not in svc.membership.finished)
    assert svc.membership.active() == {"a", "b"}
    stop.set()
    await task


async def test_slow_learner_does_not_hold_back_versions_and_still_counts(nats_server, js):
    svc, stop, task = await _start(nats_server, require_membership=False, grace="fixed", grace_seconds=0.05,
                                   quorum=1, max_staleness=50)
    fast, slow = FakeLearner(js, RUN, "fast", 1), FakeLearner(js, RUN, "slow", 2)
    fast_sent = slow_sent = 0
    t_end = time.monotonic() + 4.0

    async def run(learner, period):
        nonlocal fast_sent, slow_sent
        base = svc.states[0].version
        while time.monotonic() < t_end:
            await asyncio.sleep(period)
            await learner.send(0, base=base)
            if learner is fast:
                fast_sent += 1
            else:
                slow_sent += 1
            base = svc.states[0].version  # take the newest version, as a learner would
    await asyncio.gather(run(fast, 0.1), run(slow, 0.3))
    await _until(lambda: sum(svc.stats.contributions.values()) == fast_sent + slow_sent, 5)
    v = svc.states[0].version
    # versions advance at the fast learner's pace (K=1), not the slow one's
    assert v >= 0.8 * fast_sent, (v, fast_sent, slow_sent)
    assert svc.stats.contributions["slow"] == slow_sent and slow_sent >= 5
    stop.set()
    await task


async def test_two_aggregators_own_disjoint_fragments(nats_server, js):
    a, stop_a, task_a = await _start(nats_server, require_membership=False, aggregator_id="agg-a",
                                     agg_fragments="0", grace="fixed", grace_seconds=0.05)
    b, stop_b, task_b = await _start(nats_server, require_membership=False, aggregator_id="agg-b",
                                     agg_fragments="1", grace="fixed", grace_seconds=0.05)
    assert set(a.states) == {0} and set(b.states) == {1}
    fl = FakeLearner(js, RUN, "l")
    for v in range(3):
        await fl.send(0, base=v)
        await fl.send(1, base=v)
        assert await _until(lambda: a.published.get(0) == v + 1 and b.published.get(1) == v + 1)
    store = VersionedStore(js, RUN, GLOBAL)
    assert (await store.head(0)).version == 3 and (await store.head(1)).version == 3
    assert a.stats.accepted == 3 and b.stats.accepted == 3 and not a.stats.rejected and not b.stats.rejected
    for stop, task in ((stop_a, task_a), (stop_b, task_b)):
        stop.set()
        await task


async def _merge_events(js, n: int) -> dict[int, dict]:
    """The first ``n`` merge events of fragment 0, by version."""
    sub = await js.subscribe(Subjects(RUN).event("merge"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    events: dict[int, dict] = {}
    while len(events) < n:
        e = orjson.loads((await sub.next_msg(timeout=5)).data)
        if e["fragment"] == 0:
            events[e["version"]] = e
    return events


async def test_a_learner_that_finished_keeps_its_share_of_the_run(nats_server, js):
    """Islands of unequal speeds with one step budget: the fast one finishes first (its final sync),
    and the slow one's later outer gradients still move a fragment by lr/M each, M counting the
    finished learner, long after the participation window: alone at a whole round each, the
    reference's model ended 6-8.6% worse (aggregator.step.run_participants)."""
    svc, stop, task = await _start(nats_server, require_membership=False, quorum=1, grace="fixed",
                                   grace_seconds=0.05, max_staleness=100, participation_window=0.0)
    try:
        fast, slow = FakeLearner(js, RUN, "fast", 1), FakeLearner(js, RUN, "slow", 2)
        await fast.send(0, base=0)
        assert await _until(lambda: svc.states[0].version == 1)
        await slow.send(0, base=1)
        assert await _until(lambda: svc.states[0].version == 2)
        await fast.send(0, base=2, final=1)  # its step budget reached: it sends nothing more
        await slow.send(0, base=2)
        assert await _until(lambda: svc.states[0].version == 3)
        assert svc.membership.leavers() == {"fast"} and svc.membership.active() == {"slow"}
        for v in (3, 4):
            await asyncio.sleep(0.1)  # past the window: only the leaver's share keeps it in
            await slow.send(0, base=v)
            assert await _until(lambda: svc.states[0].version == v + 1)
        events = await _merge_events(js, 5)
        assert [(events[v]["per_round"], events[v]["scale"]) for v in (4, 5)] == [(2, 0.5), (2, 0.5)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_an_adopted_merge_record_that_applied_none_of_ours_publishes_it_then_merges_ours(nats_server, js):
    """The STATE stream holds a merge record of version 1 that applied another learner's work only
    (here one the GRAD stream no longer holds: replayed as applied without its effect). Adopting it
    acknowledges nothing of ours: version 1 is published as the record says, and our contribution
    goes back to the buffer and is merged into version 2. (The adoption used to end the aggregator:
    an IndexError counting the quorum wait of a merge with no contribution of its own.)"""
    from aggregator.mlog import LoggedContribution, MergeRecord

    svc, stop, task = await _start(nats_server, require_membership=False, quorum=1, grace="fixed",
                                   grace_seconds=0.05, max_staleness=100)
    S = Subjects(RUN)
    try:
        learner = FakeLearner(js, RUN, "a", 1)
        gone = LoggedContribution("b", "b-inc", 0, 1, 0, (10**9,), 0.01, 0)  # sequences the stream never held
        rec = MergeRecord(0, 1, (gone,), 1.0, 2, svc.versions.settings_dict)
        await js.publish(S.merge_log(0, 1 % svc.merge_log.slots()), rec.to_bytes(), headers={"Nats-Msg-Id": f"{RUN}.mlog.0.1"})
        key = await learner.send(0, base=0)
        assert await _until(lambda: svc.published.get(0) == 2, 15), (svc.published, task.done())
        assert not task.done() and svc.stats.replay_lost == 1
        events = await _merge_events(js, 2)
        assert [k[0] for k in events[1]["applied"]] == ["b"]
        assert [tuple(k) for k in events[2]["applied"]] == [tuple(key)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_a_merge_record_committed_behind_our_back_is_adopted_not_overwritten(nats_server, js):
    """The STATE stream holds a merge record of version v+1 that this process does not know about
    (a publish that was stored although it reported a failure): the aggregator's own record of v+1
    is deduplicated, so it reads the stored one back, adopts that merge, acks the contributions it
    applied and merges the rest after it. A restart replays the same state, bit for bit."""
    from aggregator.contribution import Contribution
    from aggregator.mlog import LoggedContribution, MergeRecord
    from aggregator.step import merge_step

    svc, stop, task = await _start(nats_server, require_membership=False, quorum=1, grace="fixed",
                                   grace_seconds=0.05, max_staleness=100)
    S = Subjects(RUN)
    try:
        learner = FakeLearner(js, RUN, "a", 1)
        st0 = svc.states[0]
        # what an earlier attempt committed: version 1 holding round 1 of learner "a", at scale 0.5
        vec = (np.random.default_rng(3).standard_normal(PLAN.sizes[0]) * 1e-3).astype(np.float32)
        c1 = Contribution(RUN, svc.model_hash, "a", learner.inc, 0, 1, 0, 10, 640, vec)
        norm = float(np.sqrt(np.dot(vec, vec)))
        seq = (await js.stream_info(S.stream("grad"))).state.last_seq + 1  # where round 1's one chunk will land
        rec = MergeRecord(0, 1, (LoggedContribution("a", learner.inc, 0, 1, 0, (seq,), norm, 0),), 0.5, 1,
                          svc.versions.settings_dict)
        await js.publish(S.merge_log(0, 1 % svc.merge_log.slots()), rec.to_bytes(), headers={"Nats-Msg-Id": f"{RUN}.mlog.0.1"})
        ahead = merge_step(st0, [c1], svc.versions.settings, [norm], 0.5, 1)  # not what the service would compute
        assert svc.states[0].version == 0
        # round 1 arrives and round 2 after it
        await learner.send(0, base=0, vector=vec)
        await learner.send(0, base=0)
        assert await _until(lambda: svc.published.get(0) == 2, 15)
        assert svc.states[0].applied.is_duplicate(c1)
        head = await VersionedStore(js, RUN, GLOBAL).head(0)
        assert head.version == 2
        # the log since the checkpoint counts each version once (the adopted one was counted twice)
        pos = svc.merge_log.logpos[0]
        assert pos.versions_since == svc.states[0].version - pos.checkpoint_version
        # version 1 is the committed one (its merge event says so), version 2 holds round 2 only
        events = await _merge_events(js, 2)
        assert events[1]["scale"] == 0.5 and [k[3] for k in events[1]["applied"]] == [1]
        assert [k[3] for k in events[2]["applied"]] == [2]
        live = svc.states[0]
        assert not np.array_equal(live.params, ahead.params)  # version 2 was applied on top of it
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    # a restart: the stop checkpointed version 2; replaying the log from version 0 gives it too
    svc2, stop2, task2 = await _start(nats_server, require_membership=False, quorum=1)
    try:
        assert svc2.states[0].version == 2 and svc2.states[0].applied.is_duplicate(c1)
        assert np.array_equal(svc2.states[0].params, live.params)
    finally:
        stop2.set()
        await asyncio.wait_for(task2, 15)


async def test_a_record_stored_despite_a_failed_publish_is_retried_as_it_is(nats_server, js):
    """A merge-log publish that stores the record and then reports a failure (a lost ack): the
    same record is retried (deduplicated), nothing is acked before it, nothing merged twice, and a
    restart from the version-0 checkpoint replays the merges to the same parameters."""
    svc, stop, task = await _start(nats_server, require_membership=False, quorum=1, grace="fixed",
                                   grace_seconds=0.05, max_staleness=100, checkpoint_every=1000)
    real = svc.js.publish
    lost = {"n": 0}

    async def publish(subject, payload, **kw):
        ack = await real(subject, payload, **kw)
        if ".log." in subject and lost["n"] < 2:
            lost["n"] += 1
            raise TimeoutError("the ack was lost")
        return ack

    svc.js.publish = publish
    try:
        learner = FakeLearner(js, RUN, "a", 1)
        await _send_merged(svc, learner, 0, range(3))
        assert lost["n"] == 2 and svc.stats.merges == 3 and svc.states[0].version == 3
        live = svc.states[0]
    finally:
        svc.js.publish = real
        await _crash(svc, task)  # nothing checkpointed since version 0
    svc2, stop2, task2 = await _start(nats_server, require_membership=False, quorum=1)
    try:
        assert svc2.states[0].version == 3 and svc2.stats.replayed == 3 and svc2.stats.replay_lost == 0
        assert np.array_equal(svc2.states[0].params, live.params)
        assert svc2.states[0].to_bytes() == live.to_bytes()
    finally:
        stop2.set()
        await asyncio.wait_for(task2, 15)


async def test_a_checkpoint_is_stored_from_the_live_state_while_other_fragments_merge_and_a_crash_replays(
        nats_server, js):
    """A checkpoint is stored by a task from its fragment's own arrays (no copy: 8 bytes per value
    of the fragment while it was stored). With its put held, the other fragments and intake go on
    (the loop used to wait for the put: at 4 x 100M half its time); the fragment's own merges wait
    until it is stored, so what is stored is the version it was taken at. A crash while the put is
    held replays from the previous checkpoint to the same state, bit for bit, and merges what
    waited."""
    svc, stop, task = await _start(nats_server, require_membership=False, quorum=1, grace="fixed",
                                   grace_seconds=0.05, max_staleness=100, checkpoint_every=3)
    held, started, stored = _hold_checkpoints(svc, {0})
    try:
        learner = FakeLearner(js, RUN, "a", 1)
        await _send_merged(svc, learner, 0, range(3))
        assert await _until(lambda: started == [(0, 3)], 5), started  # due at version 3, held
        at3 = svc.states[0].to_bytes()
        for r in range(2):  # fragment 0 waits for its checkpoint: buffered, not merged
            await learner.send(0, base=3)
        await _send_merged(svc, learner, 1, range(4))  # fragment 1 merges meanwhile (checkpointed at 3)
        assert await _until(lambda: len(svc.intake.buffers[0]) == 2, 5)
        assert svc.states[0].version == 3 and svc.states[0].to_bytes() == at3
        assert (1, 3) in started and svc.merge_log.logpos[0].checkpoint_version == 0
        held.set()  # stored: what was taken at version 3, and fragment 0 merges what waited
        assert await _until(lambda: svc.merge_log.logpos[0].checkpoint_version == 3, 15)
        assert [b for p, v, b in stored if (p, v) == (0, 3)] == [at3]
        assert await _until(lambda: svc.published.get(0) == 4, 15)  # (one merge of both)
        assert svc.merge_log.logpos[0].versions_since == 1 and svc.states[0].last_merge and len(svc.states[0].last_merge) == 2
        live = {p: svc.states[p].to_bytes() for p in (0, 1)}
    finally:
        await _crash(svc, task)
    svc2, stop2, task2 = await _start(nats_server, require_membership=False, quorum=1)
    try:
        assert svc2.states[0].version == 4 and svc2.states[1].version == 4 and svc2.stats.replay_lost == 0
        assert {p: svc2.states[p].to_bytes() for p in (0, 1)} == live
    finally:
        stop2.set()
        await asyncio.wait_for(task2, 15)


async def test_a_crash_while_a_checkpoint_is_stored_replays_from_the_one_before_and_merges_what_waited(
        nats_server, js):
    """A kill while a fragment's checkpoint is still being stored (its put held, the contributions
    that came meanwhile buffered and not acknowledged): the restart replays from the checkpoint
    before to the version the held one was taken at, bit for bit, and the contributions that
    waited are delivered again and merged."""
    svc, stop, task = await _start(nats_server, require_membership=False, quorum=1, grace="fixed",
                                   grace_seconds=0.05, max_staleness=100, checkpoint_every=3, ack_wait=2)
    held, started, _ = _hold_checkpoints(svc, {0, 1})  # never set: still being stored at the crash
    try:
        learner = FakeLearner(js, RUN, "a", 1)
        await _send_merged(svc, learner, 0, range(3))
        assert await _until(lambda: started == [(0, 3)], 5), started
        for r in range(2):
            await learner.send(0, base=3)
        assert await _until(lambda: len(svc.intake.buffers[0]) == 2, 5)
        at3 = svc.states[0].to_bytes()
        assert svc.states[0].version == 3 and svc.merge_log.logpos[0].checkpoint_version == 0
    finally:
        await _crash(svc, task)  # the checkpoint never stored
    svc2, stop2, task2 = await _start(nats_server, require_membership=False, quorum=1, ack_wait=2)
    try:
        assert svc2.stats.replayed == 3 and svc2.stats.replay_lost == 0
        assert svc2.merge_log.logpos[0].checkpoint_version == 0
        assert svc2.states[0].version >= 3
        if svc2.states[0].version == 3:
            assert svc2.states[0].to_bytes() == at3
        # the two that waited, delivered again and merged (rounds 4 and 5 of the learner)
        assert await _until(lambda: svc2.states[0].applied.highest_round("a", learner.inc, 0) == 5, 20)
        assert svc2.states[0].version in (4, 5) and not svc2.intake.buffers[0]
    finally:
        stop2.set()
        await asyncio.wait_for(task2, 15)


async def test_an_early_checkpoint_is_written_only_once_enough_was_merged_since_the_last(
        nats_server, js):
    """A GRAD stream that keeps dropping what the log points to (an aggregator behind its learners:
    the stream full of work not merged yet) forced a checkpoint after every merge or two: at 4 x
    100M, 16-22 checkpoints of 100 MB per 20 s. Now one is written once the contributions merged
    since the last hold EARLY_CHECKPOINT_RATIO times a checkpoint's bytes; the ones before are counted
    as skipped. (Keeping up, the bound is lower: aggregator.mlog.early_checkpoint_pays.)"""
    from types import SimpleNamespace

    from aggregator.mlog import EARLY_CHECKPOINT_RATIO

    svc, stop, task = await _start(nats_server, require_membership=False, quorum=1, grace="fixed",
                                   grace_seconds=0.05, max_staleness=100, checkpoint_every=1000,
                                   checkpoint_seconds=900)
    real_info = svc.js.stream_info
    grad = Subjects(RUN).stream("grad")

    async def stream_info(name, *a, **kw):
        if name != grad:
            return await real_info(name, *a, **kw)
        # everything the log points to is gone already (dropped at the stream's byte limit)
        return SimpleNamespace(state=SimpleNamespace(first_seq=10**9, last_seq=10**9 + 100, bytes=10**6, messages=100),
                               config=SimpleNamespace(max_bytes=10**6))

    real_consumer = svc.js.consumer_info

    async def consumer_info(stream, name, *a, **kw):
        got = await real_consumer(stream, name, *a, **kw)
        return SimpleNamespace(num_pending=90, num_ack_pending=got.num_ack_pending) if stream == grad else got

    svc.js.stream_info = stream_info
    svc.js.consumer_info = consumer_info
    try:
        # the fake stream holds mostly work not read (the consumer's backlog against the stream's
        # messages, below): behind, so 4 checkpoints' bytes
        ckpt = EARLY_CHECKPOINT_RATIO * svc.merge_log.checkpoint_bytes(0)
        learner = FakeLearner(js, RUN, "a", 1)
        r = 0
        while svc.merge_log.logpos[0].bytes_since < ckpt:
            await learner.send(0, base=r)
            r += 1
            assert await _until(lambda: svc.published.get(0) == r, 15)
            if svc.merge_log.logpos[0].bytes_since < ckpt:  # a look at the stream (every 2 s) finds it overtaken: skipped
                skipped = svc.stats.checkpoints_early_skipped
                assert await _until(lambda: svc.stats.checkpoints_early_skipped > skipped, 10)
                assert svc.stats.checkpoints_early == 0 and svc.merge_log.logpos[0].checkpoint_version == 0
        assert r >= 8  # one fp32 contribution holds a third of a checkpoint's bytes
        assert svc.merge_log.grad_behind  # (said once: grad_stream_behind)
        assert await _until(lambda: svc.stats.checkpoints_early == 1, 10)
        assert await _until(lambda: svc.merge_log.logpos[0].checkpoint_version == r, 10)
        assert svc.merge_log.logpos[0].bytes_since == 0 and svc.merge_log.logpos[0].versions_since == 0
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_a_rejection_is_settled_only_once_its_audit_event_is_stored(nats_server, js):
    """The contribution of a rejection is terminated after its event is in JetStream: while the
    event cannot be stored it stays unsettled (a crash then redelivers it, to be judged again),
    and nothing queued is dropped. (It used to be terminated at once, and a kill -9 before the
    event lost the record of an acknowledged contribution: the chaos run's ``none_lost``.)"""
    svc, stop, task = await _start(nats_server, quorum=1, grace="fixed", grace_seconds=0.1)
    await set_members(js, RUN, {"good": "active"})
    await _until(lambda: svc.membership.members.get("good") == "active")
    real_publish = svc.js.publish
    events = Subjects(RUN).event("reject")
    outage = {"on": True}

    async def publish(subject, payload, **kw):
        if subject == events and outage["on"]:
            raise TimeoutError("the events stream is unreachable")
        return await real_publish(subject, payload, **kw)

    svc.js.publish = publish
    bad = FakeLearner(js, RUN, "good")
    for _ in range(3):
        await bad.send(0, base=0, run="other")  # wrong_run
    assert await _until(lambda: svc.stats.rejected.get("wrong_run") == 3)
    await asyncio.sleep(0.5)  # a few rounds of the main loop with the publish failing
    assert len(svc.intake.audit) == 3  # kept, not dropped
    info = await js.consumer_info(Subjects(RUN).stream("grad"), "agg_0_1")
    assert info.num_ack_pending >= 3  # not settled: a crash now would redeliver them
    outage["on"] = False
    assert await _until(lambda: not svc.intake.audit)
    sub = await js.subscribe(events, deliver_policy=DeliverPolicy.ALL)
    got = [orjson.loads((await sub.next_msg(timeout=5)).data)["reason"] for _ in range(3)]
    assert got == ["wrong_run"] * 3
    for _ in range(50):
        info = await js.consumer_info(Subjects(RUN).stream("grad"), "agg_0_1")
        if info.num_ack_pending == 0:
            break
        await asyncio.sleep(0.1)
    assert info.num_ack_pending == 0
    stop.set()
    await task


async def test_a_contribution_that_beats_its_learners_admission_is_held_then_merged(nats_server, js):
    """The CI failure of stop 19: a fresh learner's first outer gradients reached the aggregator
    before the monitor admitted it and were rejected as unknown_learner (work lost)."""
    svc, stop, task = await _start(nats_server, quorum=1, grace="fixed", grace_seconds=0.05, admission_wait=30)
    await set_members(js, RUN, {"other": "active"})
    await _until(lambda: "other" in svc.membership.members)
    new, joining = FakeLearner(js, RUN, "new", 1), FakeLearner(js, RUN, "joiner", 2)
    for who, p in ((new, 0), (new, 1), (joining, 0)):
        await who.send(p, base=0)
    await set_members(js, RUN, {"joiner": "joining"})
    assert await _until(lambda: len(svc.intake.hold) == 3), len(svc.intake.hold)
    await asyncio.sleep(0.5)  # nothing is merged or rejected while they wait
    assert len(svc.intake.hold) == 3 and not svc.stats.rejected and svc.stats.merges == 0
    await set_members(js, RUN, {"new": "active"})
    assert await _until(lambda: svc.stats.contributions["new"] == 2), dict(svc.stats.contributions)
    assert len(svc.intake.hold) == 1 and svc.states[0].version == 1 and svc.states[1].version == 1
    await set_members(js, RUN, {"joiner": "active"})
    assert await _until(lambda: svc.stats.contributions["joiner"] == 1)
    assert len(svc.intake.hold) == 0 and not svc.stats.rejected
    # an eviction while held rejects at once, for the current reason
    late = FakeLearner(js, RUN, "late", 3)
    await late.send(0, base=svc.states[0].version)
    assert await _until(lambda: len(svc.intake.hold) == 1)
    await set_members(js, RUN, {"late": "evicted"})
    assert await _until(lambda: svc.stats.rejected == {"inactive_learner": 1}), dict(svc.stats.rejected)
    assert len(svc.intake.hold) == 0
    stop.set()
    await task


async def test_a_stale_outlier_reference_restarts_when_most_learners_are_refused(nats_server, js):
    """Every honest norm outgrew the reference (a warm-up ending): the first refusals are counted,
    then, once both active learners were refused, the reference restarts and their next outer
    gradients are merged. One learner alone (below) never restarts it."""
    svc, stop, task = await _start(nats_server, quorum=1, grace="fixed", grace_seconds=0.05,
                                   norm_outlier_factor=5.0, norm_min_history=5)
    n = PLAN.sizes[0]
    await set_members(js, RUN, {"a": "active", "b": "active"})
    await _until(lambda: len(svc.membership.active()) == 2)
    a, b = FakeLearner(js, RUN, "a"), FakeLearner(js, RUN, "b")
    for v in range(5):  # the reference: small honest norms
        await a.send(0, base=v)
        assert await _until(lambda: svc.published.get(0) == v + 1)
    big = np.full(n, 1e-2, np.float32)  # 10x the reference
    await a.send(0, base=5, vector=big)
    assert await _until(lambda: svc.stats.rejected.get("norm_outlier") == 1)
    await a.send(0, base=5, vector=big)  # the same learner again: still refused, no restart
    assert await _until(lambda: svc.stats.rejected.get("norm_outlier") == 2)
    assert svc.stats.reference_restarts == 0 and svc.states[0].version == 5
    await b.send(0, base=5, vector=big)  # a second learner: half of the active ones -> restart
    assert await _until(lambda: svc.stats.reference_restarts == 1)
    assert svc.stats.rejected["norm_outlier"] == 3 and svc.states[0].version == 5
    await a.send(0, base=5, vector=big)  # merged now
    assert await _until(lambda: svc.published.get(0) == 6)
    assert svc.stats.rejected["norm_outlier"] == 3
    stop.set()
    await task


async def test_a_lock_step_round_merges_its_fragments_together_and_never_waits_past_the_grace(nats_server, js):
    """aggregator.rounds in the service: fragment 0 of a synchronous round waits while b's fragment 1
    is still to come, then both merge in one look; a round whose fragment 1 never comes holds
    fragment 0 for the grace window only."""
    svc, stop, task = await _start(nats_server, grace="fixed", grace_seconds=1.5, quorum=2)
    await set_members(js, RUN, {"a": "active", "b": "active"})
    await _until(lambda: len(svc.membership.active()) == 2)
    a, b = FakeLearner(js, RUN, "a", 1), FakeLearner(js, RUN, "b", 2)
    for p in (0, 1):
        await a.send(p, base=0, lockstep=1)
    await b.send(0, base=0, lockstep=1)
    await _until(lambda: len(svc.intake.buffers[0]) == 2 and len(svc.intake.buffers[1]) == 1)
    await asyncio.sleep(0.6)  # fragment 0 has its quorum, but b's round is not complete
    assert svc.states[0].version == 0 and svc.stats.round_holds == 1
    await b.send(1, base=0, lockstep=1)
    assert await _until(lambda: svc.published.get(0) == 1 and svc.published.get(1) == 1)
    assert svc.stats.round_holds_expired == 0 and not svc.versions.held_since
    # round 2: b's fragment 1 never comes (its publish failed): fragment 0 merges after the grace
    t0 = time.monotonic()
    for p in (0, 1):
        await a.send(p, base=1, lockstep=1)
    await b.send(0, base=1, lockstep=1)
    assert await _until(lambda: svc.published.get(0) == 2, 5)
    assert time.monotonic() - t0 >= 1.4 and svc.stats.round_holds_expired == 1
    assert svc.states[1].version == 1 and len(svc.intake.buffers[1]) == 1  # still waiting for b
    stop.set()
    await task


async def test_the_membership_is_watched_anew_when_the_server_comes_back(nats_server, js):
    """A members watch that outlived a server restart stayed silent 5-14 s (bench.soak): learners
    readmitted meanwhile were still evicted here and their work was rejected. After a reconnect the
    aggregator watches the bucket anew: a change made right after the restart is seen at once."""
    svc, stop, task = await _start(nats_server, quorum=1)
    try:
        await set_members(js, RUN, {"l0": "evicted"})
        assert await _until(lambda: svc.membership.members.get("l0") == "evicted")
        nats_server.kill()
        await asyncio.get_running_loop().run_in_executor(None, nats_server.start)
        assert await _until(lambda: svc.nc.is_connected, 20)
        client = await connect(CommonConfig(nats_url=nats_server.url, run=RUN), name="readmit")
        try:
            kv = await client.jetstream(timeout=10).key_value(Subjects(RUN).bucket("members"))
            t0 = time.monotonic()
            await kv.put("l0", orjson.dumps({"learner": "l0", "state": "active"}))
            assert await _until(lambda: svc.membership.members.get("l0") == "active", 4.0), svc.membership.members
            print(f"seen {time.monotonic() - t0:.2f} s after the restart's first write")
        finally:
            await client.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def test_an_operators_trust_clear_reaches_every_fragments_next_merge_and_survives_a_restart(nats_server, js):
    """``diloco trust clear``: the key in the run bucket is read by the aggregator, each fragment
    forgets the learner's record at its next merge (and records the clear), the learner is measured
    afresh and, lying on, named again; a restarted aggregator keeps the clear applied, once."""
    from bus.trust_clears import request_clear

    svc, stop, task = await _start(nats_server, quorum=4, grace="fixed", grace_seconds=5.0, trust="weigh")
    names = ["l0", "l1", "l2", "l3"]
    await set_members(js, RUN, {x: "active" for x in names})
    await _until(lambda: len(svc.membership.active()) == 4)
    fakes = {x: FakeLearner(js, RUN, x, i) for i, x in enumerate(names)}
    rng = np.random.default_rng(0)
    version = {0: 0, 1: 0}

    async def one_round():
        for p in (0, 1):
            common = rng.standard_normal(PLAN.sizes[p])
            for x in names:
                v = (common + rng.standard_normal(PLAN.sizes[p])) * 1e-3 * (-1 if x == "l0" else 1)
                await fakes[x].send(p, base=version[p], vector=v.astype(np.float32))
            assert await _until(lambda: svc.published.get(p, 0) == version[p] + 1), svc.stats.to_metrics()
            version[p] += 1

    for _ in range(8):
        await one_round()
    assert all(svc.states[p].trust.learners["l0"].reason == "opposes" for p in (0, 1))
    assert all(svc.states[p].last_trust[0] == 0.0 for p in (0, 1))  # l0 sent first: weight 0
    cid = await request_clear(js, RUN, "l0", by="test")
    assert await _until(lambda: svc.versions.trust_clears.get("l0") == cid, timeout=10)
    await one_round()
    for p in (0, 1):
        tr = svc.states[p].trust
        assert tr.cleared == {"l0": cid} and tr.learners["l0"].seen == 1 and not tr.learners["l0"].reason
        assert svc.states[p].last_trust[0] == 1.0  # measured afresh: trusted until the evidence is back
    for _ in range(7):
        await one_round()
    assert all(svc.states[p].trust.learners["l0"].reason == "opposes" for p in (0, 1))
    stop.set()
    await task
    svc2, stop2, task2 = await _start(nats_server, quorum=4, grace="fixed", grace_seconds=5.0, trust="weigh")
    try:
        assert all(svc2.states[p].trust.cleared == {"l0": cid} for p in (0, 1))
        assert all(svc2.states[p].trust.learners["l0"].reason == "opposes" for p in (0, 1))
    finally:
        stop2.set()
        await task2


async def test_the_default_quorum_closes_a_round_on_time_and_waits_for_every_lock_step_learner(nats_server, js):
    """DILOCO_QUORUM=auto (the default): a round closes half its fastest contributor's period after
    that contributor's arrival (10 steps at the reported 0.2 s: 1 s), with whoever came by then and
    without a learner that did not; a lock-step (synchronous) round waits for every active learner."""
    svc, stop, task = await _start(nats_server, trust="off")
    assert svc.cfg.quorum == AUTO
    await set_members(js, RUN, {"a": "active", "b": "active", "c": "active"})
    await _until(lambda: len(svc.membership.active()) == 3)
    store = VersionedStore(js, RUN, GLOBAL)
    a, b, c = FakeLearner(js, RUN, "a", 1), FakeLearner(js, RUN, "b", 2), FakeLearner(js, RUN, "c", 3)
    pace = {"period": 10, "step_s": 0.2}
    t0 = time.monotonic()
    ka = await a.send(0, base=0, **pace)
    kb = await b.send(0, base=0, **pace)
    assert await _until(lambda: svc.published.get(0) == 1)
    assert time.monotonic() - t0 >= 0.9  # it waited for c until the round's time was up
    head, _ = await store.get(0)
    assert sorted(map(tuple, head.meta["applied"])) == sorted([ka, kb])  # c was not waited for longer
    # lock-step contributions of fragment 1: the round waits for c past every deadline, then merges at once
    la = await a.send(1, base=0, lockstep=1, **pace)
    lb = await b.send(1, base=0, lockstep=1, **pace)
    await asyncio.sleep(2.5)
    assert svc.published.get(1, 0) == 0
    lc = await c.send(1, base=0, lockstep=1, **pace)
    assert await _until(lambda: svc.published.get(1) == 1)
    head, _ = await store.get(1)
    assert sorted(map(tuple, head.meta["applied"])) == sorted([la, lb, lc])
    stop.set()
    await task


@pytest.mark.parametrize("slow_server", [False, True])
async def test_a_busy_aggregator_judges_a_round_s_deadline_by_what_it_had_read(nats_server, js, monkeypatch, slow_server):
    """DILOCO_QUORUM=auto: the aggregator is busy (blocked) for 0.6 s right after reading a's
    contribution, past the round's deadline (0.1-0.15 s after a's arrival); b's contribution of the
    same round reaches the server meanwhile, well before that deadline. The round is judged at the
    time the aggregator had read everything the server held (``aggregator.quorum.input_clock``), so
    it waits for its next read and merges a and b together. Judged by the real clock it closed with a
    alone (b went into the next round, a version stale): what the guard test's 30x slower aggregator
    did to half its rounds."""
    svc, stop, task = await _start(nats_server, trust="off", quorum=AUTO)
    await set_members(js, RUN, {"a": "active", "b": "active"})
    await _until(lambda: len(svc.membership.active()) == 2)
    store = VersionedStore(js, RUN, GLOBAL)
    a, b = FakeLearner(js, RUN, "a", 1), FakeLearner(js, RUN, "b", 2)
    pace = {"period": 10, "step_s": 0.02}  # a round time of 0.2 s: its deadline half of that
    await a.send(0, base=0, **pace)
    await b.send(0, base=0, **pace)
    assert await _until(lambda: svc.published.get(0) == 1)
    await asyncio.sleep(0.5)  # b is due again (its arrival plus its round time), so a's round waits for it

    # b's next contribution goes out from another thread (its own loop and connection) while the
    # aggregator's loop is blocked
    ready, go, sent = threading.Event(), threading.Event(), threading.Event()
    keys: list = []

    def other_learner() -> None:
        async def run() -> None:
            nc = await connect(CommonConfig(nats_url=nats_server.url, run=RUN), name="b")
            b.pub = ChunkPublisher(nc.jetstream(timeout=10), max_chunk=4096)
            ready.set()
            await asyncio.to_thread(go.wait, 10)
            keys.append(await b.send(0, base=1, **pace))
            sent.set()
            await nc.close()
        asyncio.run(run())

    thread = threading.Thread(target=other_learner)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 10)
    handle = svc.intake.handle

    async def busy_after_a(r, now):
        await handle(r, now)
        if getattr(r, "meta", {}).get("learner") == "a":
            go.set()
            assert sent.wait(10)  # b is stored on the server while this loop is blocked
            time.sleep(0.6)
            if slow_server:  # its answers come after the aggregator's next wait (10 ms) ran out
                from tests.stopped import stop

                stop(nats_server.proc.pid)
                asyncio.get_running_loop().call_later(0.3, os.kill, nats_server.proc.pid, signal.SIGCONT)

    monkeypatch.setattr(svc.intake, "handle", busy_after_a)
    ka = await a.send(0, base=1, **pace)
    assert await _until(lambda: svc.published.get(0) == 2)
    await asyncio.to_thread(thread.join, 10)
    head, _ = await store.get(0)
    assert sorted(map(tuple, head.meta["applied"])) == sorted([ka, keys[0]]), head.meta["applied"]
    # every learner's highest round merged so far (a learner that missed a head learns it here)
    assert head.meta["merged"] == [["a", a.inc, 2], ["b", b.inc, 2]]
    stop.set()
    await task
