"""``diloco up``: the pure planning and summary helpers, then real runs as subprocesses (tiny model)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest

from diloco import up as L

# -- pure helpers ----------------------------------------------------------------------------------


def test_learner_ids_round_robin_over_regions():
    assert L.learner_ids(5, ["us", "eu"]) == [("us-0", "us"), ("eu-0", "eu"), ("us-1", "us"), ("eu-1", "eu"),
                                             ("us-2", "us")]
    assert L.learner_ids(2, ["ap"]) == [("ap-0", "ap"), ("ap-1", "ap")]


@pytest.mark.parametrize("text", ["", "us,us", "us,e.u", "a b"])
def test_bad_regions_are_refused(text):
    with pytest.raises(ValueError):
        L.parse_regions(text)


def test_env_precedence_preset_then_caller_then_flags():
    caller = {"PATH": "/bin", "DILOCO_D_MODEL": "48", "DILOCO_N_HEADS": "2", "DILOCO_MAX_STEPS": "77",
              "XLA_FLAGS": "--mine"}
    env = L.base_env(caller, "tiny", None, quick=False, n_learners=4, cpu_count=2)
    assert env["DILOCO_D_MODEL"] == "48"  # the caller's env beats the preset
    assert env["DILOCO_N_LAYERS"] == "2"  # the preset fills the rest
    assert env["DILOCO_MAX_STEPS"] == "77" and env["DILOCO_TOTAL_STEPS"] == "77"
    assert env["XLA_FLAGS"] == "--mine" and env["PATH"] == "/bin"
    # the algorithm's settings are the roles' own defaults (issue 24: one set of defaults)
    assert not {"DILOCO_QUORUM", "DILOCO_OUTER_MOMENTUM", "DILOCO_OUTER_LR"} & set(env)
    env = L.base_env(caller, "tiny", 30, quick=False, n_learners=4, cpu_count=2)
    assert env["DILOCO_MAX_STEPS"] == "30" and env["DILOCO_TOTAL_STEPS"] == "30"  # the flag beats the env
    assert "DILOCO_WARMUP_STEPS" not in env  # the learner's own: a share of the schedule
    env = L.base_env({}, "default", None, quick=False, n_learners=4, cpu_count=2)
    assert env["DILOCO_MAX_STEPS"] == str(L.DEFAULT_STEPS["default"]) and "DILOCO_D_MODEL" not in env
    assert env["XLA_FLAGS"] == L.SINGLE_THREAD_XLA  # 5 JAX processes on 2 cores
    assert "XLA_FLAGS" not in L.base_env({}, "default", None, quick=False, n_learners=2, cpu_count=64)
    assert L.base_env({}, "tiny", None, quick=True)["DILOCO_MAX_STEPS"] == str(L.QUICK_STEPS)


def test_plan_gives_every_process_its_identity():
    env = L.base_env({"DILOCO_RUN": "r1"}, "tiny", 10, quick=False)
    procs = L.with_urls(L.plan_processes(env, 3, ["us", "eu"]),
                        lambda region: f"nats://{region or 'hub'}:4222")
    roles = [p.role for p in procs]
    assert roles == ["aggregator", "monitor", "eval", "learner", "learner", "learner"]
    learners = [p for p in procs if p.role == "learner"]
    assert [p.env["DILOCO_LEARNER_ID"] for p in learners] == ["us-0", "eu-0", "us-1"]
    assert [p.env["DILOCO_SHARD_INDEX"] for p in learners] == ["0", "1", "2"]  # disjoint data shards
    assert {p.env["DILOCO_NUM_LEARNERS"] for p in learners} == {"3"}
    assert learners[1].env["DILOCO_NATS_URL"] == "nats://eu:4222" and learners[1].env["DILOCO_REGION"] == "eu"
    assert procs[0].env["DILOCO_NATS_URL"] == "nats://hub:4222"
    assert all(p.env["DILOCO_RUN"] == "r1" for p in procs)
    L.validate_envs(procs)  # every role accepts its environment
    assert procs[0].argv()[1:] == ["-m", "diloco.cli", "aggregator"]


def test_each_process_gets_its_own_user(tmp_path):
    from diloco.auth import init

    env = L.base_env({"DILOCO_RUN": "r1"}, "tiny", 10, quick=False)
    procs = L.plan_processes(env, 3, ["us", "eu"])
    r = init(tmp_path / "auth", "r1", [(p.learner_id, p.region) for p in procs if p.role == "learner"],
             hash_mode="plain")
    procs = L.with_credentials(procs, r.env_files)
    users = {p.name: p.env["DILOCO_NATS_USER"] for p in procs}
    assert users == {"aggregator": "aggregator", "monitor": "monitor", "evaluator": "evaluator",
                     "learner-us-0": "learner-us-0", "learner-eu-0": "learner-eu-0", "learner-us-1": "learner-us-1"}
    assert len({p.env["DILOCO_NATS_PASSWORD"] for p in procs}) == len(procs)  # nobody shares a password
    assert [p.env["DILOCO_LEARNER_ID"] for p in procs if p.role == "learner"] == ["us-0", "eu-0", "us-1"]
    L.validate_envs(procs)
    assert L.auth_enabled(L.parse_args([])) and not L.auth_enabled(L.parse_args(["--no-auth"]))
    # the leaf topology too: the hub and every leaf carry the run's account (diloco/auth_leaf.py)
    assert L.auth_enabled(L.parse_args(["--topology", "leaf"]))
    assert not L.auth_enabled(L.parse_args(["--topology", "leaf", "--no-auth"]))


def test_bad_variable_stops_before_anything_starts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env["DILOCO_INNER_LR"] = "fast"
    p = subprocess.run([sys.executable, "-m", "diloco.cli", "up", "--out", str(tmp_path / "o")], env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "DILOCO_INNER_LR" in p.stderr
    assert not (tmp_path / "o").exists()


def test_a_previous_runs_output_is_named_before_it_is_replaced(tmp_path):
    from diloco.up import previous_run

    assert previous_run(str(tmp_path)) is None
    (tmp_path / "logs").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    assert previous_run(str(tmp_path)) == "summary.json, logs"


def test_dp_equivalent_bytes():
    # 4 learners, 1000 params, 100 inner steps in total: 2 * 3/4 * 1000 * 2 bytes * 100
    assert L.dp_equivalent_bytes(1000, 4, 100) == 300_000
    assert L.dp_equivalent_bytes(1000, 1, 100) == 0


def _metrics(role, **kw):
    return {"role": role, "run": "r", "ts": kw.pop("ts", time.time()), **kw}


def test_run_state_folds_metrics_and_events():
    st = L.RunState(run="r", t0=0.0)
    st.on_metrics(_metrics("evaluator", eval_loss=5.5, version=0, ts=1.0))
    st.on_metrics(_metrics("learner", learner="us-0", region="us", step=10, loss=3.0, incarnation="a", ts=2.0))
    st.on_metrics(_metrics("learner", learner="us-0", region="us", step=5, loss=4.0, incarnation="a", ts=1.5))
    st.on_metrics(_metrics("aggregator", versions={"0": 2, "1": 3}, merges=5, contributions={"us-0": 4}, ts=2.0))
    st.on_metrics(_metrics("evaluator", eval_loss=3.5, version=5, ts=3.0))
    st.on_metrics(_metrics("evaluator", eval_loss=3.5, version=5, ts=4.0, evaluated_at=3.0))  # a repeat
    assert [e["ts"] for e in st.evals] == [1.0, 3.0]  # a repeat of the last evaluation is not a new point
    st.on_metrics({"role": "learner", "run": "other", "learner": "x", "ts": 1.0})
    ev = {"learner": "us-0", "old": "active", "new": "evicted", "at": 10.0}
    st.on_event(ev)
    st.on_event(dict(ev))  # a republished event counts once
    st.on_event({"learner": "us-0", "old": "evicted", "new": "rejoining", "at": 11.0})
    assert st.learners["us-0"]["step"] == 10  # an older message does not roll the row back
    assert st.contributions() == {"us-0": 4} and st.versions() == {"0": 2, "1": 3}
    assert st.evictions == 1
    assert st.evictions_while_running({"us-0": 20.0}) == 1
    assert st.evictions_while_running({"us-0": 5.0}) == 0  # evicted after it finished: not a failure
    line = st.compact_line(now=12.0)
    assert "us-0 10 3.000" in line and "fragments v2..v3" in line and "eval 3.500 (from 5.500)" in line
    # the live table takes the repeat too (it shows the evaluator between evaluations): 5 applied
    assert st.snapshot.applied == 5 and st.snapshot.skipped == {"stale": 1, "other_run": 1}


def test_the_shard_workers_of_one_aggregator_are_shown_as_one_aggregator():
    st = L.RunState(run="r", t0=0.0)
    st.on_metrics(_metrics("aggregator", id="agg-0-s0", versions={"0": 4, "1": 5}, merges=9, ts=2.0,
                           contributions={"us-0": 5, "eu-0": 4}, rejected={"too_stale": 1}, checkpoints=1))
    st.on_metrics(_metrics("aggregator", id="agg-0-s1", versions={"2": 3}, merges=3, ts=3.0,
                           contributions={"us-0": 2}, rejected={"too_stale": 2, "duplicate": 1}, checkpoints=2))
    st.on_metrics(_metrics("aggregator", id="agg-0-s0", versions={"0": 3, "1": 4}, merges=7, ts=1.0))  # older
    assert st.versions() == {"0": 4, "1": 5, "2": 3}
    assert st.contributions() == {"us-0": 7, "eu-0": 4}
    agg = st.aggregator
    assert (agg["merges"], agg["checkpoints"], agg["rejected"], agg["ts"]) == (
        12, 3, {"too_stale": 3, "duplicate": 1}, 2.0)  # ts: every worker has reported since
    assert st.merge_history[-1][1] == 12


def test_summary_has_the_promised_keys():
    st = L.RunState(run="r", t0=0.0)
    st.on_metrics(_metrics("evaluator", eval_loss=5.0, version=0, ts=1.0, versions={"0": 0}))
    st.on_metrics(_metrics("evaluator", eval_loss=3.0, version=4, ts=9.0, versions={"0": 4}))
    st.on_metrics(_metrics("aggregator", versions={"0": 4}, merges=4, contributions={"us-0": 3, "eu-0": 2},
                           log_bytes=900, checkpoint_bytes=5000, checkpoints=2))
    for lid in ("us-0", "eu-0"):
        st.on_metrics(_metrics("learner", learner=lid, step=50, loss=2.0, contributions=3, incarnation="i"))
    specs = L.plan_processes(L.base_env({}, "tiny", 50, quick=False), 2, ["us", "eu"])
    traffic = {"client_bytes": 4000, "servers": {"nats": {"in_bytes": 1, "out_bytes": 2}},
               "connections": [{"server": "nats", "name": "learner-us-0", "in_bytes": 600, "out_bytes": 400},
                               {"server": "nats", "name": "learner-eu-0", "in_bytes": 500, "out_bytes": 500},
                               {"server": "nats", "name": "aggregator-agg-0", "in_bytes": 1000, "out_bytes": 1000}]}
    s = L.build_summary(state=st, specs=specs, exit_codes={}, traffic=traffic, params=1000, wall_time_s=12.0,
                        train_time_s=8.0, status="completed", settings={})
    for key in ("initial_eval_loss", "final_eval_loss", "learners", "versions", "evictions", "broker_bytes",
                "dp_equivalent_bytes", "broker_over_dp", "wall_time_s"):
        assert key in s
    assert s["initial_eval_loss"] == 5.0 and s["final_eval_loss"] == 3.0
    assert s["learners"]["us-0"] == {**s["learners"]["us-0"], "region": "us", "steps": 50, "contributions": 3,
                                     "link_bytes": 1000}
    assert s["total_inner_steps"] == 100
    assert s["dp_equivalent_bytes"] == L.dp_equivalent_bytes(1000, 2, 100) == 200_000
    assert s["broker_bytes"] == 4000 and s["learner_link_bytes"] == 2000
    assert s["aggregator_durability_bytes"] == {"log_bytes": 900, "checkpoint_bytes": 5000, "checkpoints": 2}
    assert s["broker_bytes_by_role"] == {"aggregator": {"in_bytes": 1000, "out_bytes": 1000},
                                         "learner": {"in_bytes": 1100, "out_bytes": 900}}
    assert s["dp_over_broker"] == pytest.approx(50.0)
    assert "held-out loss  5.0000 -> 3.0000" in L.render_summary(s)


def test_the_plot_marks_merges_evictions_and_the_final_held_out_loss(tmp_path):
    st = L.RunState(run="r", t0=100.0)
    st.on_metrics(_metrics("evaluator", eval_loss=5.0, version=0, ts=101.0))
    for ts, merges in ((102.0, 0), (104.0, 3), (105.0, 3), (106.0, 7)):  # 3 changes of the count
        st.on_metrics(_metrics("aggregator", versions={"0": merges}, merges=merges, ts=ts))
    st.on_metrics(_metrics("learner", learner="us-0", step=10, loss=3.0, incarnation="i", ts=103.0))
    st.on_metrics(_metrics("learner", learner="us-0", step=20, loss=2.5, incarnation="i", ts=106.0))
    st.on_event({"learner": "us-0", "old": "active", "new": "evicted", "at": 105.5})
    st.on_metrics(_metrics("evaluator", eval_loss=2.75, version=7, ts=107.0))
    specs = L.plan_processes(L.base_env({}, "tiny", 50, quick=False), 1, ["us"])
    s = L.build_summary(state=st, specs=specs, exit_codes={}, traffic={}, params=1000, wall_time_s=8.0,
                        train_time_s=6.0, status="completed", settings={})
    assert s["merge_history"] == [{"t": 2.0, "merges": 0}, {"t": 4.0, "merges": 3}, {"t": 6.0, "merges": 7}]
    assert s["eviction_times"] == [{"t": 5.5, "learner": "us-0"}]
    path = tmp_path / "eval.png"
    drawn = L.plot_eval(s, st, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    legend = drawn.pop("legend")
    assert drawn == {"learners": 1, "eval_points": 2, "merge_steps": 3, "evictions": 1,
                     "final": "final held-out 2.7500 (after 7 merges)"}
    # every line drawn is in the one legend, the merges of the right axis too
    assert legend == ["train us-0", "held-out (global model; labels: merges it holds)", "eviction",
                      "merges so far (right axis)"]


# -- real runs --------------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _survivors(out: Path) -> list[str]:
    """Processes still alive that belong to this launch: recorded pids, or DILOCO_UP_OUT=<out> in their env."""
    alive = []
    procs = json.loads((out / "processes.json").read_text())
    pids = [procs["launcher"], *procs["servers"].values(), *(c["pid"] for c in procs["children"] if c["pid"])]
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if state != "Z":
            alive.append(f"pid {pid}")
    marker = f"DILOCO_UP_OUT={out}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if marker in (d / "environ").read_bytes().split(b"\0"):
                alive.append(f"pid {d.name}: {(d / 'cmdline').read_bytes()[:200]!r}")
        except OSError:
            continue
    return alive


def _server_url(out: Path, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The launched server's client URL, from OUT/processes.json once the server is up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(FileNotFoundError, ValueError):
            urls = json.loads((out / "processes.json").read_text()).get("server_urls") or {}
            if urls.get("nats"):
                return urls["nats"]
        time.sleep(0.1)
    raise AssertionError("no server URL in processes.json")


async def _try_connect(url: str, **kw) -> None:
    nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3, **kw)
    await nc.close()


# about 20 s each on a quiet 2-core machine; the timeouts leave room for a machine shared with others
@pytest.mark.timeout(300)
def test_up_quick_trains_and_leaves_nothing_behind(tmp_path):
    from bus.config import parse_env_file

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "diloco.cli", "up", "--quick", "--steps", "400", "--out", str(out),
                             "--progress", "line"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        url = _server_url(out, proc)
        # auth by default: no anonymous access, and no access with a wrong password
        for kw in ({}, {"user": "metrics", "password": "not-the-password"}):
            with pytest.raises(Exception) as ei:
                asyncio.run(_try_connect(url, **kw))
            assert "authorization" in repr(ei.value).lower() or isinstance(ei.value, nats.errors.NoServersError), \
                ei.value
        creds = parse_env_file((out / "auth" / "metrics.env").read_text())
        asyncio.run(_try_connect(url, user=creds["DILOCO_NATS_USER"], password=creds["DILOCO_NATS_PASSWORD"]))
        # the run's output folder is all a watcher needs (issue 16): its watch.env, 0600, with auth on
        assert (out / "watch.env").stat().st_mode & 0o777 == 0o600
        clean = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
        w = subprocess.run([str(Path(sys.executable).parent / "diloco"), "metrics", "--dir", str(out), "--once",
                            "--json", "--wait", "1"], env=clean, capture_output=True, text=True, timeout=60)
        assert w.returncode == 0 and json.loads(w.stdout)["run"] == "up", w.stderr
        stdout, stderr = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    p = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads((out / "processes.json").read_text())["auth"] == str(out / "auth")
    assert f"watch from another terminal with diloco metrics --dir {out}" in p.stdout + p.stderr
    assert creds["DILOCO_NATS_PASSWORD"] not in p.stdout + p.stderr + (out / "summary.json").read_text()
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "completed"
    assert s["initial_eval_version"] == 0
    assert s["final_eval_loss"] < 0.9 * s["initial_eval_loss"], s["eval_history"]
    assert set(s["learners"]) == {"us-0", "eu-0", "us-1", "eu-1"}
    for lid, l in s["learners"].items():
        assert l["steps"] == 400 and l["exit_code"] == 0, (lid, l)
        assert l["contributions"] > 0, (lid, l)  # accepted and applied by the aggregator
    # a healthy run rejects nothing: contributions sent before the monitor admitted their learner
    # (tiny steps outrun its first heartbeats) are held until it does (aggregator/admission.py)
    assert not s["rejected"], s["rejected"]
    assert all(v > 0 for v in s["versions"].values())
    assert s["evictions"] == 0
    assert s["broker_bytes"] > 0 and s["dp_equivalent_bytes"] > 0 and s["broker_over_dp"] > 0
    assert (out / "eval_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    merges = [m["merges"] for m in s["merge_history"]]
    assert merges and merges == sorted(merges) and merges[-1] == s["merges"], s["merge_history"]
    logs = {p.name for p in (out / "logs").iterdir()}
    assert {"aggregator.log", "monitor.log", "evaluator.log", "learner-us-0.log", "nats-server.log"} <= logs
    assert "held-out loss" in p.stdout and "eu-1" in p.stdout  # progress lines and the summary
    assert _survivors(out) == []


@pytest.mark.timeout(300)
def test_up_sigint_mid_run_stops_everything_and_writes_a_summary(tmp_path):
    out = tmp_path / "out"
    # two learners, one per region (stopping several of each role is the point; --quick's four
    # cost the suite 10 CPU seconds more)
    proc = subprocess.Popen([sys.executable, "-m", "diloco.cli", "up", "--quick", "--learners", "2", "--steps",
                             "100000", "--out", str(out), "--progress", "line", "--progress-interval", "0.5"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # until a learner reports steps
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if any(f"{lid} " in line and not line.split(f"{lid} ")[1].startswith("0 ")
                   for lid in ("us-0", "eu-0")):
                break
        assert proc.poll() is None, "".join(lines)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode in (0, 130), "".join(lines) + rest
    s = json.loads((out / "summary.json").read_text())
    assert s["status"] == "interrupted"
    assert s["initial_eval_loss"] is not None and s["total_inner_steps"] > 0
    assert _survivors(out) == []


def test_status_and_exit_code_of_a_stop():
    from diloco.up.launcher import exit_code, final_status

    assert final_status(None, None) == "completed"
    assert final_status(None, "aggregator exited") == "failed"
    assert final_status(signal.SIGINT, "aggregator exited") == "interrupted"  # the user stopped it: that first
    assert exit_code(signal.SIGINT, None) == 130 and exit_code(signal.SIGTERM, "x") == 143
    assert exit_code(None, None) == 0 and exit_code(None, "x") == 1 and exit_code(None, None, 1) == 1


# A real `diloco up` with a terminal's Ctrl-C (SIGINT to the launcher's process group) sent from
# inside one of its phases: the hook only chooses the instant, the launcher and its children are
# the real ones. Mid-training is test_up_sigint_mid_run_stops_everything_and_writes_a_summary.
_CTRL_C_AT = r'''
import os, signal, sys
import diloco.topology
import diloco.up.launcher as L
from diloco import cli

at, argv = sys.argv[1], sys.argv[2:]


def ctrl_c():
    os.killpg(os.getpgrp(), signal.SIGINT)


if at == "server":  # as the server starts
    make = diloco.topology.make_topology

    def make_topology(*a, **kw):
        topo = make(*a, **kw)
        start = topo.start

        def start_(*a, **kw):
            ctrl_c()
            return start(*a, **kw)

        topo.start = start_
        return topo

    diloco.topology.make_topology = make_topology
elif at == "children":  # between the first central role started and the next
    start_child = L.Launcher.start_child

    def start_child_(self, spec):
        child = start_child(self, spec)
        ctrl_c()
        return child

    L.Launcher.start_child = start_child_
elif at == "output":  # while the plot of a completed run is drawn
    plot = L.plot_eval

    def plot_eval(*a, **kw):
        ctrl_c()
        return plot(*a, **kw)

    L.plot_eval = plot_eval
sys.exit(cli.main(["up", *argv]))
'''


# server, children: about 5 s each; output: a whole run of 1 learner x 5 steps, about 25 s
@pytest.mark.timeout(240)
@pytest.mark.parametrize("at,during", [("server", "starting the server"),
                                       ("children", "starting aggregator, monitor, evaluator"),
                                       ("output", "writing the summary")])
def test_ctrl_c_at_any_phase_ends_in_a_truthful_summary_and_no_process(tmp_path, at, during):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-c", _CTRL_C_AT, at, "--quick", "--learners", "1", "--regions", "us",
                        "--steps", "5", "--out", str(out), "--progress", "line"], env=_env(), capture_output=True,
                       text=True, timeout=220, start_new_session=True)  # its own group, as in a terminal
    said = p.stdout[-3000:] + p.stderr[-3000:]
    assert p.returncode == 130, said
    assert "Traceback" not in p.stderr, said
    s = json.loads((out / "summary.json").read_text())
    assert (s["status"], s["interrupted_during"], s["signal"]) == ("interrupted", during, "SIGINT"), said
    assert f"run up: interrupted (SIGINT while {during})" in p.stdout, said  # what it has is printed
    assert _survivors(out) == []
    if at == "output":  # a completed run's figures are kept, and its plot is drawn
        assert s["final_eval_loss"] is not None and s["learners"]["us-0"]["steps"] == 5, s
        assert (out / "eval_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert s["initial_eval_loss"] is None and not (out / "eval_loss.png").exists()
