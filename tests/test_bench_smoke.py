"""Cheap checks of the evidence benchmarks' pure parts (the benchmarks themselves take minutes:
run them with ``python -m bench.<name> --quick``)."""

import subprocess
import sys
from pathlib import Path

import pytest

from bench.goodput import M, failure_trace
from bench.runs import Cluster


def test_failure_trace_is_seeded_and_alternates():
    a = failure_trace(7, 100.0, 20.0, 3.0)
    assert a == failure_trace(7, 100.0, 20.0, 3.0)
    assert a != failure_trace(8, 100.0, 20.0, 3.0)
    assert all(0 <= t < 100.0 for t, _, _ in a)
    for i in range(M):
        kinds = [k for _, k, j in a if j == i]
        assert all(x != y for x, y in zip(kinds, kinds[1:]))  # kill, start, kill, ...
        assert not kinds or kinds[0] == "kill"


def test_peak_rate_over_one_second_windows():
    c = Cluster.__new__(Cluster)
    # 100 B/s steadily, then a 1000 B burst between t=2.0 and t=2.25
    c.samples = [(t / 4, {"x": (int(100 * t / 4) + (1000 if t >= 9 else 0), 0)}) for t in range(20)]
    assert 1000 <= c.peak_rate("x") <= 1100 + 1e-9
    assert c.bytes_at("x", 1.1) == (100, 0)
    assert c.peak_rate("missing") == 0.0


def test_aggregator_variants_of_the_jax_benchmarks():
    import pytest

    from bench.runs import AGG_VARIANTS, aggregator_settings, learner_settings
    from diloco.up.plan import BANDWIDTH_PRESETS

    assert aggregator_settings("quorum", 4) == {"DILOCO_QUORUM": "4"}
    # the lean variant is diloco up --preset lean, for both roles
    assert aggregator_settings("lean", 4) == learner_settings("lean") == BANDWIDTH_PRESETS["lean"]
    assert learner_settings("defaults") == {}
    assert aggregator_settings("k1", 4) == {"DILOCO_QUORUM": "1"} and aggregator_settings("defaults", 4) == {}
    assert aggregator_settings("k1dn", 4)["DILOCO_DELAY_N"] == "4"
    assert aggregator_settings("auto", 4) == {"DILOCO_QUORUM": "auto"}
    assert set(AGG_VARIANTS) == {"defaults", "quorum", "auto", "k1", "k1dn", "lean"}
    with pytest.raises(ValueError):
        aggregator_settings("k2", 4)


@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).resolve().parent.parent / "bench").glob("*.py")
                                          if '__name__ == "__main__"' in p.read_text()))
def test_every_benchmark_runs_by_its_path_too(script, tmp_path):
    """`python bench/transport.py` as well as `python -m bench.transport`, from any folder (it failed
    with ModuleNotFoundError: No module named 'bench')."""
    path = Path(__file__).resolve().parent.parent / "bench" / script
    p = subprocess.run([sys.executable, str(path), "--help"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    # not benchmarks: tools of one (peer_torchft.py is bench.peers' torchft replica, run in the peer's venv)
    assert "--quick" in p.stdout or script in ("dp.py", "reference.py", "netns.py", "peer_torchft.py",
                                                       "byzantine_learner.py"), p.stdout[:500]


def test_the_lean_preset_is_the_same_run_in_the_reference():
    """bench.fidelity --preset lean compares the system with the reference: both sides must read the
    preset the same way (codecs, chain, k, outer optimizer)."""
    from aggregator.config import AggregatorConfig
    from bench.fidelity import LEAN_REFERENCE
    from bus.config import from_env
    from diloco.up.plan import BANDWIDTH_PRESETS
    from learner.config import LearnerConfig

    env = BANDWIDTH_PRESETS["lean"]
    lc, ac = from_env(LearnerConfig, env), from_env(AggregatorConfig, env)
    assert (lc.quantiser, lc.topk_chunk, lc.topk_k, lc.feedback_decay) == (
        LEAN_REFERENCE["quantiser"], LEAN_REFERENCE["topk_chunk"], LEAN_REFERENCE["topk_k"],
        LEAN_REFERENCE["feedback_decay"])
    assert (ac.downlink_quantiser, ac.downlink_chain, ac.downlink_topk_k, ac.outer_lr, ac.outer_momentum) == (
        LEAN_REFERENCE["downlink"], LEAN_REFERENCE["downlink_chain"], LEAN_REFERENCE["down_k"],
        LEAN_REFERENCE["outer_lr"], LEAN_REFERENCE["outer_momentum"])


def test_inner_opt_summary_compares_with_data_parallel_adamw_and_with_sync():
    from bench.inner_opt import summary

    rows = [{"M": 4, "kind": k, "mode": m, "eval_loss": v} for k, m, v in [
        ("adamw", "dp", 2.0), ("adamw", "sync", 2.1), ("adamw", "decoupled", 2.2),
        ("muon", "dp", 1.8), ("muon", "sync", 2.0), ("muon", "decoupled", 2.02)]]
    s = summary(rows)
    assert s["gap_adamw_m4"] == 0.1 and s["gap_muon_m4"] == 0.01 and s["gap_same_muon_m4"] == 0.1222
    assert s["async_cost_adamw_m4"] == 0.0476 and s["async_cost_muon_m4"] == 0.01


def test_size_trend_summary_gives_each_sizes_gap_and_the_trend():
    from bench.size_trend import summary

    rows = [{"size": z, "M": 4, "mode": m, "eval_loss": v} for z, m, v in [
        ("tiny", "dp", 2.0), ("tiny", "sync", 2.1), ("tiny", "decoupled", 2.2),
        ("mid", "dp", 1.5), ("mid", "sync", 1.53), ("mid", "decoupled", 1.56)]]
    s = summary(rows, {"tiny": 17504, "mid": 252384})
    assert s["gap_tiny_m4"] == 0.1 and s["sync_gap_tiny_m4"] == 0.05 and s["async_cost_tiny_m4"] == 0.0476
    assert s["gap_mid_m4"] == 0.04 and s["params_mid"] == 252384
    assert s["trend_m4"] == -0.06  # the largest size's gap minus the smallest's: it falls


def test_quorum_summary_gives_each_quorums_gap_cost_and_the_best():
    from bench.quorum import quorums, summary

    assert quorums(8) == [8, 4, 2, 1, -1] and quorums(4) == [4, 2, 1, -1] and quorums(1) == [1, -1]
    assert quorums(2, ("all", "1")) == [2, 1] and quorums(8, ("auto", "half")) == [4, -1]
    rows = [{"M": 4, "mode": "dp", "K": 4, "speeds": "equal", "eval_loss": 1.5},
            {"M": 4, "mode": "sync", "K": 4, "speeds": "equal", "eval_loss": 1.53}]
    rows += [{"M": 4, "mode": "decoupled", "K": k, "speeds": sp, "eval_loss": v} for k, sp, v in [
        (4, "equal", 1.56), (2, "equal", 1.545), (1, "equal", 1.59), (4, "spread", 1.62), (1, "spread", 1.59),
        (-1, "spread", 1.575)]]
    s = summary(rows)
    assert s["gap_k_all_m4_equal"] == 0.04 and s["gap_k2_m4_equal"] == 0.03 and s["async_cost_k1_m4_spread"] == 0.0392
    assert s["best_k_m4_equal"] == 2 and s["best_k_m4_spread"] == "auto" and s["gap_k_auto_m4_spread"] == 0.05
    assert "gap_k2_m4_spread" not in s  # not run: not reported


def test_inner_lr_summary_reads_the_gap_against_tuned_data_parallel():
    from bench.inner_lr import summary

    rows = [{"M": 4, "mode": m, "lr": lr, "eval_loss": v} for m, lr, v in [
        ("dp", 0.008, 1.55), ("dp", 0.016, 1.50), ("dp", 0.024, 1.52),
        ("decoupled", 0.008, 1.60), ("decoupled", 0.016, 1.56), ("decoupled", 0.024, 1.58)]]
    s = summary(rows, {4: 0.008})
    assert s["dp_best_m4"] == 1.5 and s["dp_best_lr_m4"] == 0.016 and s["decoupled_best_lr_m4"] == 0.016
    assert s["gap_tuned_m4"] == 0.04  # each side at its own best rate
    assert s["gap_default_m4"] == 0.0667 and s["default_lr_m4"] == 0.008  # the default rate against tuned DP
    assert "gap_default_m4" not in summary(rows, {4: 0.03})  # the default rate not run: not reported
    # the default is the default rate at the default period, 12 (a row without H ran 12): a row at
    # another period counts for the best, not for the default
    rows8 = [{"M": 8, "mode": "dp", "lr": 0.024, "eval_loss": 1.5}, {"M": 8, "mode": "decoupled", "lr": 0.024,
             "eval_loss": 1.65}, {"M": 8, "mode": "decoupled", "lr": 0.024, "H": 6, "eval_loss": 1.62}]
    s = summary(rows8, {8: 0.024})
    assert s["gap_default_m8"] == 0.1 and s["gap_tuned_m8"] == 0.08 and s["decoupled_best_H_m8"] == 6
    assert "dp_best_H_m8" not in s
    assert "gap_default_m8" not in summary([rows8[0], rows8[2]], {8: 0.024})


def test_a_budget_shared_by_speed_sums_to_the_run_and_follows_the_speeds():
    from bench.algorithm import out_of_step, steps_by_speed

    times = out_of_step(8)["step_times"]
    got = steps_by_speed(582 * 8, times)
    assert sum(got) == 582 * 8 and list(got) == sorted(got, reverse=True)
    assert max(abs(n * t - got[0] * times[0]) for n, t in zip(got, times)) <= 2  # all finish together
    assert steps_by_speed(5, (1.0, 1.0, 1.0)) in ((2, 2, 1), (2, 1, 2), (1, 2, 2)) and steps_by_speed(1, (1.0, 9.0)) == (1, 1)


def test_dynamic_local_updates_at_fixed_speeds_follow_the_learner_s_rule():
    from bench.algorithm import out_of_step, periods_by_speed

    times = out_of_step(8)["step_times"]
    got = periods_by_speed(12, times)
    assert got[0] == 12 and all(p * t == pytest.approx(12) for p, t in zip(got, times))  # rounds of equal time
    assert periods_by_speed(12, times, whole=True) == (12, 11, 10, 10, 9, 9, 8, 8)  # Liu et al.'s floor
    assert periods_by_speed(12, (1.0, 1.0)) == (12, 12) and periods_by_speed(4, (1.0, 9.0)) == (4, 1)

