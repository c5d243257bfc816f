"""``diloco simulate`` (diloco/simulate.py): the quick run's JSON line and its exit codes. One
in-process reference run of the tiny model for a few steps (mostly JAX compiling: a few seconds),
the rest instant."""

import subprocess
import sys
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent


def simulate(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", "simulate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_quick_gives_quality_against_data_parallel_and_goodput_in_one_json_line():
    r = simulate("--quick", "--json", "--learners", "2", "--sync-every", "4", "--steps", "8", "--failure-rate", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = orjson.loads(lines[0])
    c = out["config"]
    assert (c["M"], c["H"], c["steps"], c["mode"], c["model_preset"], c["quick"]) == (2, 4, 8, "decoupled", "tiny", True)
    q = out["quality"]
    assert q["params"] > 0 and q["dp_loss"] > 0 and q["loss"] > 0 and q["merges"] > 0
    assert abs(q["gap"] - (q["loss"] - q["dp_loss"]) / q["dp_loss"]) < 1e-4
    assert "not a prediction" in q["what"]  # the figure says what it is
    g = out["goodput"]
    assert g["failure_rate_per_learner_per_hour"] == 2.0 and g["row"] == "decoupled"
    assert set(g["modes"]) == {"dp", "sync", "decoupled"}
    assert all(0.0 < v <= 1.0 for v in g["modes"].values())
    assert g["modes"]["decoupled"] >= g["modes"]["sync"] >= g["modes"]["dp"]  # who waits for a failed island
    assert g["failures_simulated"] > 0


def test_goodput_only_and_the_table():
    r = simulate("--goodput-only", "--learners", "4", "--failure-rate", "0")
    assert r.returncode == 0, r.stderr
    assert "goodput" in r.stdout and "<- this configuration" in r.stdout and "quality" not in r.stdout
    r = simulate("--goodput-only", "--json", "--mode", "sync")
    out = orjson.loads(r.stdout)
    assert out["quality"] is None and out["goodput"]["row"] == "sync" and out["config"]["P"] == 1


def test_bad_flags_exit_2():
    for args in (["--bogus"], ["--learners", "0"], ["--failure-rate", "-1"], ["--model-preset", "huge"],
                 ["--learners", "2", "--quorum", "3"]):
        r = simulate(*args, "--goodput-only")
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "diloco simulate" in r.stderr
