"""bench.goodput's measured timings on the real system: a short data-parallel run (8 synthetic
learners, the real server, aggregator and monitor) with two kills and a restart. What the
simulator is given for ``sim_vs_measured`` comes from these figures, so they must come out of a
real run with the samples they claim. About 20 s."""

import asyncio

from bench.goodput import run_mode
from bench.runs import FAST_MONITOR

SUSPECT = float(FAST_MONITOR["DILOCO_SUSPECT_AFTER"])
HEARTBEAT = float(FAST_MONITOR["DILOCO_HEARTBEAT_INTERVAL"])


def test_a_short_dp_run_measures_every_timing():
    trace = [(1.0, "kill", 3), (2.5, "start", 3), (4.0, "kill", 5)]
    events: dict = {}
    # (five failure-free rounds before the trace starts: in its fixed first second a loaded machine
    # had 3-4 rounds, the count then failed the suite at load 10-15)
    r = asyncio.run(run_mode("dp", trace, 7.0, events, warm_rounds=5))
    t = r["timings"]
    assert (r["kills"], r["restarts"]) == (2, 1)
    assert {k: v["n"] for k, v in t.items() if k != "release_s"} == {
        "startup_s": 1, "first_step_s": 1, "admit_s": 1, "suspect_s": 2, "round_overhead_s": t["round_overhead_s"]["n"]}
    assert t["round_overhead_s"]["n"] >= 5 and 0.0 <= t["round_overhead_s"]["median"] < 1.0, t
    # silence since the last heartbeat (at most one interval before the kill) plus the threshold
    assert SUSPECT - HEARTBEAT <= t["suspect_s"]["median"] < SUSPECT + 2.0, t
    # the survivors of an H=1 round (0.2 s steps) have sent it before the dead learner is suspected
    # (>= 0.4 s after the kill): each kill gives a release
    assert t["release_s"]["n"] >= 1 and t["release_s"]["median"] >= SUSPECT - HEARTBEAT, t
    # the monitor admits at a heartbeat: the tap and the monitor hear the same message, each on
    # its own clock read (the monitor's can be the earlier by a millisecond)
    assert 0.0 < t["startup_s"]["median"] - 0.05 <= t["admit_s"]["median"] < 10.0, t
    assert 0.0 < t["first_step_s"]["median"] < 10.0, t
    # the raw records the timings came from
    ev = events["dp"]
    assert [k[1] for k in ev["kills"]] == ["learner-3", "learner-5"] and all(k[2] for k in ev["kills"])
    assert any(new == "suspect" and name == "learner-3" for _, name, _, new in ev["transitions"])
    assert r["goodput"] > 0 and r["applied_contributions"] > 0
