"""The goodput simulator (simulation/goodput_model.py, bench/goodput_sim.py): properties of the model
and the benchmark's JSON line. Fast: no servers, a few seconds in all."""

import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.goodput import failure_trace
from simulation.goodput_model import (
    CHIPS,
    SCALE_MODES,
    TRACE_MODES,
    BenchSystem,
    ScaleModel,
    dp_goodput,
    failure_stream,
    infer_startup,
    scale_table,
    simulate_scale,
    simulate_trace,
    table_error,
)

BENCH = {"M": 8, "step": 0.2, "H": 10, "P": 2}


@pytest.mark.parametrize("mode", SCALE_MODES)
def test_no_failures_no_loss_at_scale(mode):
    no_faults = ScaleModel(mtbi_s=float("inf"), dp_overhead=0.0)
    r = simulate_scale(mode, 1_200_000, 8, no_faults, failures=1000)
    assert r["failures"] == 0
    assert r["goodput"] == pytest.approx(1.0, abs=1e-9)
    # the lock-step overhead is all a failure-free dp job loses
    assert simulate_scale("dp", 1_200_000, 1, replace(no_faults, dp_overhead=0.1))["goodput"] == pytest.approx(0.9)


@pytest.mark.parametrize("mode", TRACE_MODES)
def test_no_failures_no_loss_in_the_bench_replay(mode):
    r = simulate_trace(mode, [], window=30.0, system=BenchSystem(latency_s=0.0), dt=0.005, **BENCH)
    assert r["stepping"] == pytest.approx(1.0, abs=0.01)
    assert r["goodput"] == pytest.approx(1.0, abs=0.05)  # edges: work sent before, merged after


def test_failure_stream_rate_and_islands():
    t, isl = failure_stream(np.random.default_rng(1), rate=0.5, duration=20_000.0, M=4)
    assert np.all(np.diff(t) >= 0) and 0 <= t.min() and t.max() < 20_000.0
    assert len(t) == pytest.approx(10_000, rel=0.05)
    assert np.bincount(isl, minlength=4) == pytest.approx([len(t) / 4] * 4, rel=0.1)


def test_goodput_falls_with_chips_in_every_mode():
    rows = scale_table(failures=3000)
    for key, vals in rows.items():
        assert all(a > b for a, b in itertools.pairwise(vals)), (key, vals)


@pytest.mark.parametrize("chips", [300_000, 2_400_000])
def test_decoupled_beats_sync_beats_dp_on_the_same_failures(chips):
    g = {m: simulate_scale(m, chips, 8, failures=5000, seed=3)["goodput"] for m in ("decoupled", "sync", "dp")}
    assert g["decoupled"] > g["sync"] > g["dp"], g


def test_mode_order_on_the_bench_trace():
    trace = failure_trace(7, 60.0, 30.0, 3.0)
    g = {m: simulate_trace(m, trace, window=60.0, dt=0.005, **BENCH)["goodput"] for m in TRACE_MODES}
    assert g["decoupled"] > g["sync"] > g["dp"] > g["dp_static"], g


def test_dp_event_loop_matches_its_closed_form():
    model = ScaleModel()
    sim = [simulate_scale("dp", n, 1, model, failures=50_000)["goodput"] for n in CHIPS]
    assert sim == pytest.approx(list(dp_goodput(CHIPS, model)), abs=0.006)


def test_table1_within_three_points():
    err, errs = table_error(scale_table(failures=20_000))
    assert err <= 3.0, errs
    assert set(errs) == {"dp", "4", "8", "16"} and all(len(v) == 5 for v in errs.values())


def test_a_slower_start_up_is_recovered_from_the_stepping_share():
    trace = failure_trace(7, 30.0, 20.0, 3.0)
    s = simulate_trace("decoupled", trace, window=30.0, system=BenchSystem(startup_s=2.0), **BENCH)["stepping"]
    assert infer_startup(trace, s, window=30.0, **BENCH) == pytest.approx(2.0, abs=0.1)


def test_cli_quick_with_a_measured_file(tmp_path):
    # a bench.goodput --out file of the quick shape (figures made up: only the comparison is checked)
    trace = failure_trace(7, 12.0, 20.0, 3.0)
    measured = {"bench": "goodput", "M": 8, "step_time": 0.2, "H": 10, "P": 2, "window_s": 12.0, "mtbf_s": 20.0,
                "repair_s": 3.0, "seed": 7, "failures": 6, "trace": trace,
                "modes": {"decoupled": {"compute_share": 0.75}},
                "goodput": {"decoupled": 0.7, "sync": 0.5, "dp": 0.45}}
    path = tmp_path / "goodput.json"
    path.write_text(json.dumps(measured))
    bench = Path(__file__).resolve().parent.parent / "bench" / "goodput_sim.py"
    p = subprocess.run([sys.executable, str(bench), "--quick", "--measured", str(path), "--out", str(tmp_path / "o.json")],
                       check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r == json.loads((tmp_path / "o.json").read_text())
    assert r["bench"] == "goodput_sim" and r["table1_max_error"] <= 3.0
    assert r["trace_regenerated_identical"] is True
    cmp = r["sim_vs_measured"]
    assert set(cmp["modes"]) == {"decoupled", "sync", "dp"}
    assert cmp["max_abs_diff"] == max(abs(v["diff"]) for v in cmp["modes"].values())
    assert "published" in p.stdout and set(r["table"]) >= {"dp", "decoupled_M4", "decoupled_M8", "decoupled_M16"}


def test_without_a_measured_file_the_comparison_is_null():
    from bench.goodput_sim import default_run

    r = default_run(True, BenchSystem())
    assert r["sim_vs_measured"] is None and r["measured_file"] is None and "no measured file" in r["measured_note"]
    assert set(r["sim"]) == {"decoupled", "sync", "dp"}


# -- the timings bench.goodput measures (bench/goodput_timings.py) and the simulator takes ---------

def test_startup_is_the_first_heartbeat_of_a_later_incarnation():
    from bench.goodput_timings import startup_samples

    first_hb = {("a", "i1"): 1.0, ("a", "i2"): 13.5, ("a", "i3"): 40.0, ("b", "j1"): 1.1}
    assert startup_samples([(12.0, "a"), (30.0, "a"), (50.0, "b")], first_hb) == [1.5, 10.0]


def test_suspect_is_the_first_exit_from_active_after_the_kill():
    from bench.goodput_timings import suspect_samples

    trans = [(5.0, "a", "active", "suspect"), (10.9, "a", "active", "suspect"), (11.0, "a", "suspect", "evicted"),
             (10.7, "b", "joining", "active")]
    assert suspect_samples([(10.0, "a"), (10.0, "b")], trans) == pytest.approx([0.9])


def test_release_counts_only_kills_the_survivors_were_waiting_on():
    from bench.goodput_timings import release_samples

    arrivals = {("a", "1", 0, 0): 9.0, ("b", "1", 0, 0): 9.0, ("c", "1", 0, 0): 10.5, ("a", "1", 0, 1): 12.0,
                ("b", "1", 0, 1): 13.9, ("a", "1", 0, 2): 20.0, ("a", "1", 0, 3): 30.1, ("b", "1", 0, 3): 30.2}
    merges = [(9.5, 0, [["a", "1", 0, 0], ["b", "1", 0, 0], ["c", "1", 0, 0]]),  # before the kill
              (12.0, 0, [["a", "1", 0, 0], ["b", "1", 0, 0]]),  # without c, both there before c left
              (14.0, 0, [["a", "1", 0, 1], ["b", "1", 0, 1]]),  # b arrived after c left: not waiting
              (21.0, 0, [["c", "1", 0, 2], ["a", "1", 0, 2]]),  # holds the killed incarnation
              (30.25, 0, [["a", "1", 0, 3], ["b", "1", 0, 3]])]  # 0.05 s idle, but before c left at 30.24
    trans = [(10.6, "c", "active", "suspect"), (13.5, "c", "active", "suspect"), (13.6, "c", "suspect", "evicted"),
             (15.5, "c", "active", "suspect"), (30.24, "c", "active", "suspect")]
    kills = [(10.0, "c", "1"), (13.0, "c", "2"), (15.0, "c", "1"), (16.0, "c", None), (30.0, "c", "3"), (40.0, "c", "4")]
    # (the last kill: no transition out of active after it, so no release is known)
    assert release_samples(kills, merges, arrivals, trans) == pytest.approx([2.0, 0.25])


def test_round_overhead_uses_consecutive_full_merges_of_a_fragment():
    from bench.goodput_timings import mode_timings, round_overhead_samples

    full = [["x", "1", 0, 0]] * 2
    merges = [(1.0, 0, full), (1.05, 1, full), (1.3, 0, full), (1.6, 0, full[:1]), (1.9, 0, full), (2.2, 0, full),
              (2.3, 1, full)]
    assert round_overhead_samples(merges, 2, 0.2) == pytest.approx([0.1, 0.1, 1.05])
    assert round_overhead_samples(merges, 2, 0.2, failures=[1.2], margin=0.1) == pytest.approx([0.1])
    assert round_overhead_samples(merges, 2, 0.2, failures=[1.35], margin=0.0) == pytest.approx([0.1, 0.1])
    assert round_overhead_samples(merges, 2, 0.2, failures=[1.85]) == pytest.approx([0.1])  # margin 1 s
    t = mode_timings(M=2, round_s=0.2, lockstep=False, starts=[], kills=[], first_hb={}, transitions=[],
                     merges=merges, arrivals={})
    assert t["round_overhead_s"] == {"median": None, "mean": None, "n": 0} and t["startup_s"]["n"] == 0
    t = mode_timings(M=2, round_s=0.2, lockstep=True, starts=[(2.25, "x")], kills=[], first_hb={},
                     transitions=[], merges=merges, arrivals={})
    assert t["round_overhead_s"] == {"median": 0.1, "mean": 0.1, "n": 2}


def test_measured_timings_drive_the_trace_simulation():
    trace = failure_trace(7, 30.0, 20.0, 3.0)
    base = BenchSystem()
    fast = {"release_s": {"median": 0.8, "n": 3}, "round_overhead_s": {"median": 0.01, "mean": 0.02, "n": 9},
            "startup_s": {"median": 0.3, "n": 3}}
    slow = {"release_s": {"median": 2.5, "n": 3}, "round_overhead_s": {"median": 0.1, "mean": 0.5, "n": 9},
            "startup_s": {"median": 0.3, "n": 3}}
    assert base.measured(fast, "dp").latency_s == 0.02 and base.measured(slow, "sync").release_s == 2.5
    assert base.measured(slow, "decoupled") == base  # start-up equal; no round or release in async mode
    assert base.measured(slow, "dp_static").detect_s(static=True) == base.detect_s(static=True)
    assert base.measured({"startup_s": {"median": None, "n": 0}}, "dp") == base
    thin = {"release_s": {"median": 3.0, "n": 2}, "suspect_s": {"median": 0.55, "n": 9},
            "first_step_s": {"median": 1.25, "n": 4}, "startup_s": {"median": 0.3, "n": 4},
            "admit_s": {"median": 0.31, "n": 4}}
    m = base.measured(thin, "sync")  # under 3 release samples: the monitor's suspect time instead
    assert (m.release_s, m.startup_s, m.admit_after_start()) == (0.55, 0.3, 0.31)
    assert base.admit_after_start() == base.startup_s + base.heartbeat_s
    for mode in ("sync", "dp"):
        g = [simulate_trace(mode, trace, window=30.0, system=base.measured(t, mode), **BENCH)["goodput"]
             for t in (fast, slow)]
        assert g[0] > g[1] + 0.03, (mode, g)
