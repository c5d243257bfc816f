"""A crashed learner resumes where the run holds its work (issue 38): the record, the decision, the
keeper on a real server, the schedule and data position, and a learner process killed -9 at half
its budget and started again."""

import asyncio

import numpy as np
import orjson
import pytest

from bus.progress import BadProgress, Progress, progress_from_dict, resume_from
from bus.streams import ensure_run
from bus.subjects import Subjects
from learner.data import Corpus
from learner.inner import make_schedule
from learner.progress import ProgressKeeper
from tests.system import FAST_AGG, MetricsTap, Procs, wait_for


async def _until(pred, timeout: float, interval: float = 0.05) -> bool:
    ok, _ = await wait_for(lambda: _now(pred()), timeout, interval)
    return bool(ok)


async def _now(v):
    return v


class _Log:
    def __init__(self):
        self.lines = []

    def __getattr__(self, level):
        return lambda event, **kw: self.lines.append((level, event, kw))


# -- the record and the decision (pure) ------------------------------------------------------------


def test_a_record_round_trips_and_a_bad_one_is_refused_naming_the_field():
    p = Progress("us-0", "abc", step=310, trained=312, budget=600, restarts=1, lost=2, at=1.5)
    assert progress_from_dict(orjson.loads(orjson.dumps(p.to_dict()))) == p
    for bad, field in (({"step": -1}, "step"), ({"step": 1.5}, "step"), ({"budget": True}, "budget"),
                       ({"schema": 9}, "schema"), ({"learner": ""}, "learner"), ({"at": float("nan")}, "at"),
                       ({"done": "yes"}, "done"), ({"trained": 300}, "trained")):
        with pytest.raises(BadProgress, match=field):
            progress_from_dict({**p.to_dict(), **bad})
    with pytest.raises(BadProgress):
        progress_from_dict([1, 2])


def test_resume_continues_at_the_step_the_run_holds_and_counts_restarts_and_lost_steps():
    first = resume_from(None, 600)
    assert (first.start_step, first.restarts, first.remaining, first.resumed) == (0, 0, 600, False)
    rec = Progress("us-0", "old", step=310, trained=316, budget=600, restarts=1, lost=3)
    r = resume_from(rec, 600)
    assert (r.start_step, r.restarts, r.lost, r.lost_total, r.previous, r.remaining) == (310, 2, 6, 9, "old", 290)
    assert r.resumed
    # a longer budget this time: the rest of it; a shorter one: nothing left
    assert resume_from(rec, 1000).remaining == 690
    assert (resume_from(rec, 200).start_step, resume_from(rec, 200).remaining) == (200, 0)
    # DILOCO_RESUME=false: step 0, the restart still counted
    off = resume_from(rec, 600, enabled=False)
    assert (off.start_step, off.restarts, off.remaining) == (0, 2, 600)
    # an island's loop decides its own budget
    assert (resume_from(rec, None).start_step, resume_from(rec, None).remaining) == (310, None)


def test_the_resumed_schedule_is_the_schedule_at_that_step_with_an_optional_rewarm():
    base = make_schedule(0.01, 50, 1000)
    at = make_schedule(0.01, 50, 1000, start_step=400)
    for t in (0, 1, 99, 599, 700):
        assert float(at(t)) == pytest.approx(float(base(400 + t)), rel=1e-6)
    warm = make_schedule(0.01, 50, 1000, start_step=400, rewarm_steps=20)
    assert float(warm(0)) == pytest.approx(float(base(400)) / 20, rel=1e-6)
    assert float(warm(19)) == pytest.approx(float(base(419)), rel=1e-6)
    with pytest.raises(ValueError):
        make_schedule(0.01, 50, 1000, start_step=-1)


def test_batches_by_step_continue_the_stream_and_never_repeat_a_step():
    shard = Corpus(np.arange(20_000, dtype=np.uint16) % 256).shard(1, 2, 16, seed=7)
    a = [shard.batch_at(t, 4) for t in range(40)]
    again = [shard.batch_at(t, 4) for t in range(20, 40)]  # a learner resumed at step 20
    assert all(np.array_equal(x, y) for x, y in zip(a[20:], again))
    starts = {int(b[0, 0]) + 1000 * int(b[1, 0]) for b in a}
    assert len(starts) == 40  # every step its own draw
    other = Corpus(np.arange(20_000, dtype=np.uint16) % 256).shard(1, 2, 16, seed=8)
    assert not np.array_equal(other.batch_at(0, 4), a[0])
    with pytest.raises(ValueError):
        shard.batch_at(-1, 4)


# -- the keeper on a real server -------------------------------------------------------------------


async def test_the_keeper_writes_reads_back_and_yields_to_a_newer_process_with_the_same_id(js):
    await ensure_run(js, "t")
    log_a, log_b = _Log(), _Log()
    a = ProgressKeeper(js, "t", "us-0", "inc-a", 600, log_a)
    assert await a.load() is None
    a.adopt(resume_from(None, 600))
    assert await a.write(0, 0)
    assert await a.write(24, 30)
    assert await a.write(24, 30)  # unchanged: not written again
    assert a.writes == 2
    # a new process with the same id (the old one cut off, not dead): it takes the record over
    b = ProgressKeeper(js, "t", "us-0", "inc-b", 600, log_b)
    rec = await b.load()
    assert (rec.incarnation, rec.step, rec.trained) == ("inc-a", 24, 30)
    r = resume_from(rec, 600)
    b.adopt(r)
    assert await b.write(r.start_step, r.start_step, force=True)
    assert not await a.write(36, 40)  # the old one is told, once, and stops writing
    assert a.superseded and [e for _, e, _ in log_a.lines] == ["progress_superseded"]
    assert not await a.write(48, 50)
    kv = await js.key_value(Subjects("t").bucket("progress"))
    final = progress_from_dict(orjson.loads((await kv.get("us-0")).value))
    assert (final.incarnation, final.step, final.restarts, final.lost) == ("inc-b", 24, 1, 6)


async def test_a_run_without_a_progress_bucket_trains_from_zero_and_says_so_once(js):
    log = _Log()
    k = ProgressKeeper(js, "nobucket", "us-0", "inc", 10, log)
    assert await k.load() is None
    assert not await k.write(1, 1)
    assert [e for _, e, _ in log.lines] == ["progress_unavailable"]


# -- a learner process killed -9 at half its budget ------------------------------------------------

SYNTH = {"DILOCO_COMPUTE": "synthetic", "DILOCO_STEP_TIME": "0.04", "DILOCO_SYNC_EVERY": "8",
         "DILOCO_HEARTBEAT_INTERVAL": "0.5", "DILOCO_METRICS_INTERVAL": "0.1", "DILOCO_WARMUP_STEPS": "0",
         "DILOCO_NUM_LEARNERS": "2"}
BUDGET, H = 160, 8


async def test_a_learner_killed_at_half_its_budget_resumes_and_trains_the_budget_once(nats_server, nc, js, tmp_path):
    procs = Procs(nats_server.url, "rs", str(tmp_path))
    tap = MetricsTap()
    await tap.start(nc, "rs")
    try:
        procs.start("aggregator", "aggregator", DILOCO_REQUIRE_MEMBERSHIP="false", **FAST_AGG)
        for lid in ("a", "b"):
            procs.start(lid, "learner", DILOCO_LEARNER_ID=lid, DILOCO_TOTAL_STEPS=str(BUDGET), **SYNTH)
        assert await _until(lambda: (tap.get("learner", "a").get("step") or 0) >= BUDGET // 2, 90, 0.02), \
            tap.get("learner", "a")
        procs.kill("a")
        seen = tap.get("learner", "a")["step"]  # metrics every 0.1 s, steps of 0.04 s: at most 3 behind
        first = tap.get("learner", "a")["incarnation"]
        procs.start("a2", "learner", DILOCO_LEARNER_ID="a", DILOCO_TOTAL_STEPS=str(BUDGET), **SYNTH)
        ok = await _until(lambda: procs.procs["a2"].poll() is not None and procs.procs["b"].poll() is not None, 90, 0.2)
        assert ok and procs.procs["a2"].returncode == 0, (tmp_path / "a2.log").read_text()[-3000:]
        resumed = [orjson.loads(x) for x in (tmp_path / "a2.log").read_text().splitlines()
                   if '"event": "resumed"' in x]
        assert len(resumed) == 1, (tmp_path / "a2.log").read_text()[-3000:]
        r = resumed[0]
        start = r["step"]
        # it starts where the run holds its work: less than a sync period before where it died
        assert seen - H <= start <= seen + 3, (seen, r)
        assert r["previous"] == first and r["restarts"] == 1 and r["remaining"] == BUDGET - start
        assert r["data_step"] == start
        # the id trained its budget once: the dead process's steps, then the rest
        last = tap.get("learner", "a")
        assert last["incarnation"] != first and last["step"] == BUDGET and last["start_step"] == start
        trained = seen + (BUDGET - start)
        assert BUDGET <= trained + 3 and trained <= BUDGET + H, (seen, start)
        kv = await js.key_value(Subjects("rs").bucket("progress"))
        rec = progress_from_dict(orjson.loads((await kv.get("a")).value))
        assert (rec.step, rec.done, rec.restarts) == (BUDGET, True, 1)
        assert 0 <= rec.lost <= H
        # started again with the budget done: nothing to train, exit 0 at once
        procs.start("a3", "learner", DILOCO_LEARNER_ID="a", DILOCO_TOTAL_STEPS=str(BUDGET), **SYNTH)
        ok = await _until(lambda: procs.procs["a3"].poll() is not None, 30, 0.1)
        assert ok and procs.procs["a3"].returncode == 0
        assert "nothing left to train" in (tmp_path / "a3.log").read_text()
    finally:
        procs.close()
        await asyncio.sleep(0)


async def test_status_shows_restarts_and_lost_steps_per_learner(nc, js):
    from monitor.status import gather_status, render_status

    await ensure_run(js, "st")
    k = ProgressKeeper(js, "st", "us-0", "inc-b", 600, _Log())
    await k.load()
    k.adopt(resume_from(Progress("us-0", "inc-a", step=300, trained=302), 600))
    assert await k.write(300, 300)
    st = await gather_status(nc, "st")
    assert st["progress"]["us-0"]["restarts"] == 1 and st["progress"]["us-0"]["lost"] == 2
    now = st["ts"]
    st["membership"] = {"counts": {"active": 1}, "unreadable": {}, "members": [
        {"learner": "us-0", "region": "us", "state": "active", "since": now - 5, "last_seen": now - 1, "step": 310,
         "reason": ""}]}
    text = render_status(st)
    assert "RESTARTS" in text and "1 (2 lost)" in text, text
