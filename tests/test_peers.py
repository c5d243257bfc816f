"""bench.peers: the pure parts (events, crediting, recovery timings, bytes, the replica's schedule and
fragments) without torch, and the torchft peer itself when its venv is there (``.ci/run`` builds it
with ``python -m bench.peers --build-only``; the tests skip, with the reason, only where it could not
be built)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench import peer_torchft as worker
from bench import peers
from bench import peers_model as pm

ROOT = Path(__file__).resolve().parent.parent


def sync(t, replica, pid, frag, mstep, steps, commit=True, part=True, at=0, heal=False):
    return {"e": "sync", "t": t, "replica": replica, "pid": pid, "frag": frag, "commit": commit, "steps": steps,
            "mstep": mstep, "part": part, "n": 2, "at": at, "heal": heal}


# -- events and crediting --------------------------------------------------------------------------


def test_parse_events_skips_a_line_cut_by_a_kill():
    lines = [json.dumps({"e": "ready", "t": 1.0}), '{"e": "sync", "t": 2.0, "fr', "", "[1, 2]",
             json.dumps({"e": "done", "t": 3.0})]
    assert [d["e"] for d in pm.parse_events(lines)] == ["ready", "done"]


def test_torchft_merges_group_committed_participants_by_fragment_and_manager_step():
    ev = [sync(10.2, 0, 100, 0, 0, 5), sync(10.1, 1, 200, 0, 0, 5),
          sync(11.0, 0, 100, 1, 1, 10), sync(11.0, 1, 200, 1, 1, 10, commit=False),  # failed commit: no credit
          sync(12.0, 0, 100, 0, 2, 10), sync(12.0, 2, 300, 0, 2, 7, part=False),  # not in the allreduce
          sync(12.0, 3, 400, 0, 2, 0, heal=True),  # just healed: it sent the peer's pseudo-gradient
          {"e": "step", "t": 9.0, "replica": 0, "pid": 100}]
    merges, steps = pm.torchft_merges(ev)
    assert [(ts, f, sorted(k[0] for k in keys)) for ts, f, keys in merges] == [
        (10.1, 0, ["replica-0", "replica-1"]), (11.0, 1, ["replica-0"]), (12.0, 0, ["replica-0"])]
    assert steps[("replica-1", "200", 0, 0)] == 5
    assert ("replica-2", "300", 0, 2) not in steps and ("replica-1", "200", 1, 1) not in steps
    assert ("replica-3", "400", 0, 2) not in steps


def test_credit_counts_merges_inside_the_window_as_goodput_does():
    merges = [(1.0, 0, [("a", "1", 0, 0)]), (2.0, 0, [("a", "1", 0, 1), ("b", "1", 0, 1)]),
              (3.0, 1, [("a", "1", 1, 1), ("c", "9", 1, 1)]), (9.0, 0, [("a", "1", 0, 2)])]
    steps = {("a", "1", 0, 0): 10, ("a", "1", 0, 1): 10, ("b", "1", 0, 1): 4, ("a", "1", 1, 1): 10,
             ("a", "1", 0, 2): 10}
    credited, n, unknown = pm.credit(merges, steps, 1.5, 5.0, step_s=0.2, P=2)
    assert (n, unknown) == (3, 1)  # c's key has no step count
    assert credited == pytest.approx((10 + 4 + 10) * 0.2 / 2)
    assert pm.goodput(credited, M=2, window_s=3.5) == pytest.approx(credited / 7.0)
    assert pm.goodput(1.0, 2, 0.0) == 0.0


def test_one_history_gets_the_same_goodput_in_both_record_formats():
    """Two replicas, P=2, H=4: the same syncs as torchft events and as our merge records."""
    ev, ours, steps = [], [], {}
    for r in range(6):
        frag, t = r % 2, 1.0 + r
        for rep in (0, 1):
            n = 2 if r < 2 and frag == 0 else 4
            ev.append(sync(t, rep, 10 + rep, frag, r, n))
            steps[(f"replica-{rep}", f"inc{rep}", frag, r)] = n
        ours.append((t, frag, [(f"replica-{rep}", f"inc{rep}", frag, r) for rep in (0, 1)]))
    merges, tsteps = pm.torchft_merges(ev)
    a = pm.credit(merges, tsteps, 0.0, 10.0, 0.1, 2)
    b = pm.credit(ours, steps, 0.0, 10.0, 0.1, 2)
    assert a == pytest.approx(b) and a[1] == 12


def test_resume_and_first_shared_samples():
    merges = [(1.0, 0, [("a", "1", 0, 0), ("b", "1", 0, 0)]),
              (3.0, 0, [("b", "1", 0, 1)]),  # after a's kill at 2.0: b's work merged again, 1.0 s later
              (8.0, 0, [("b", "1", 0, 2), ("a", "2", 0, 2)])]  # a's new incarnation (started at 5.0)
    kills = [(2.0, "a", "1")]
    assert pm.resume_samples(kills, merges) == [1.0]
    assert pm.first_shared_samples([(5.0, "a")], merges, kills) == [3.0]
    # a restart whose incarnation never reaches a merge gives no sample; a kill with no later merge neither
    assert pm.first_shared_samples([(9.0, "a")], merges, kills) == []
    assert pm.resume_samples([(9.0, "a", "2")], merges) == []
    assert pm.summary([]) == {"median": None, "mean": None, "n": 0}
    assert pm.summary([1.0, 3.0, 8.0]) == {"median": 3.0, "mean": 4.0, "n": 3}


def test_bytes_per_outer_step():
    assert pm.loopback_link_bytes(1000) == 2000  # one lo tx byte is one replica's out and another's in
    assert pm.per_outer_step(4000, contributions=8, P=2) == 1000.0  # 8 fragment syncs = 4 outer steps
    assert pm.per_outer_step(4000, 0, 2) is None
    assert pm.ratio(3.0, 1.5) == 2.0 and pm.ratio(None, 1.0) is None and pm.ratio(1.0, 0) is None


def test_systems_row_from_torchft_events():
    sp = {"M": 2, "step_s": 0.1, "H": 4, "P": 2}
    ev = [sync(1.0 + r, rep, 10 + rep, r % 2, r, 4) for r in range(4) for rep in (0, 1)]
    row = peers.systems_row("torchft_x", ev, kills=[], starts=[], t0w=0.5, t1w=4.5, link=8000, sp=sp, extra={})
    assert row["goodput"] == pytest.approx(8 * 4 * 0.1 / 2 / (2 * 4.0))
    assert row["applied_all"] == 8 and row["link_bytes"] == 16000
    assert row["bytes_per_outer_step"] == pytest.approx(16000 / 4)
    # each fragment's two full rounds, 2 s apart, of 0.4 s of steps: 1.6 s of overhead (no failure near)
    assert row["timings"]["round_overhead_s"] == {"median": 1.6, "mean": 1.6, "n": 2}
    assert row["timings"]["resume_s"]["n"] == row["timings"]["first_shared_s"]["n"] == 0


# -- the replica's own arithmetic (no torch needed) ------------------------------------------------


def test_replica_schedule_is_the_learners():
    from learner.inner import make_schedule

    s = make_schedule(1.0, 30, 300)
    for t in (0, 1, 15, 29, 30, 31, 100, 299, 300, 400):
        assert worker.schedule(t, 30, 300) == pytest.approx(float(s(t)), abs=1e-6), t


def test_replica_fragments_cover_every_tensor_once_in_order():
    from learner.spec import ModelSpec, param_shapes

    names = list(param_shapes(ModelSpec(d_model=128, n_layers=4, n_heads=4, d_ff=512, seq_len=128)))
    for P in (1, 2, 4):
        g = worker.fragment_groups(names, 4, P)
        assert len(g) == P and sorted(sum(g, [])) == sorted(names)
        assert all(g), g
    assert worker.fragment_groups(names, 4, 4)[1] == [k for k in names if k.startswith("blocks/1/")]


# -- the peer's environment -------------------------------------------------------------------------


def test_missing_peer_says_why_in_one_line(tmp_path):
    with pytest.raises(peers.PeerUnavailable, match=str(tmp_path / "none")):
        peers.ensure_venv(tmp_path / "none", build=False)
    p = subprocess.run([sys.executable, "-m", "bench.peers", "--venv", str(tmp_path / "none"), "--no-build"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "peer (torchft) is unavailable" in p.stderr and p.stdout == ""


VENV = Path(os.environ.get("DILOCO_PEERS_VENV", ROOT / ".peers-venv"))


@pytest.fixture(scope="module")
def peer_venv():
    why = peers.peer_ready(VENV)
    if why is not None:
        pytest.skip(f"the torchft peer is unavailable: {why} (build it: python -m bench.peers --build-only)")
    return VENV


def test_the_torch_copy_of_the_model_computes_the_same_loss(peer_venv, tmp_path):
    from learner.model import loss_fn, to_jax
    from learner.spec import ModelSpec, init_params

    spec = ModelSpec(d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=16, tied_embeddings=True)
    init = init_params(spec, 3)
    np.savez(tmp_path / "init.npz", **init)
    batch = np.random.default_rng(0).integers(0, 256, size=(4, 17)).astype(np.int32)
    np.save(tmp_path / "batch.npy", batch)
    code = (f"import sys, json, numpy as np, torch; sys.path.insert(0, {str(ROOT / 'bench')!r}); import peer_torchft as w\n"
            f"init = dict(np.load({str(tmp_path / 'init.npz')!r})); b = torch.from_numpy(np.load({str(tmp_path / 'batch.npy')!r}).astype(np.int64))\n"
            "m = w.Transformer({'d_model': 32, 'n_layers': 2, 'n_heads': 4, 'd_ff': 64, 'seq_len': 16}, init, torch, torch.nn)\n"
            "lg = m(b[:, :-1]).detach(); print(float(torch.nn.functional.cross_entropy(lg.reshape(-1, 256), b[:, 1:].reshape(-1))))")
    p = subprocess.run([str(peers.peer_python(peer_venv)), "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert float(p.stdout.strip()) == pytest.approx(float(loss_fn(to_jax(init), batch, spec)), abs=1e-4)


def test_torchft_replicas_sync_and_the_survivor_goes_on_after_a_kill(peer_venv):
    """Two synthetic replicas and a lighthouse (short timeouts); kill -9 one: the other's fragment
    syncs commit again within seconds, and the loopback counter saw the allreduces. Restart it: it
    heals from the survivor, and its first sync after the heal (the survivor's pseudo-gradient) earns
    nothing, so no process is credited more steps than it took."""
    g = peers.TorchftGroup(peer_venv, (500, 200), "t")
    args = ["--kind", "synthetic", "--H", "4", "--P", "2", "--step-time", "0.05", "--params", "20000"]
    try:
        for i in (0, 1):
            g.start(i, *args)

        def commits(replica: int, after: float = 0.0) -> int:
            return sum(1 for d in g.read() if d["e"] == "sync" and d["replica"] == replica and d["commit"]
                       and d["part"] and d["t"] > after)

        assert peers.wait_until(lambda: commits(0) >= 3 and commits(1) >= 3, 90), g.log_tail("replica-0")
        both = [d for d in g.read() if d["e"] == "sync" and d["n"] == 2 and d["commit"]]
        assert both, "no sync had both replicas in it"
        pid = g.kill(1)
        t_kill = time.time()
        assert pid is not None
        assert peers.wait_until(lambda: commits(0, t_kill) >= 3, 30), g.log_tail("replica-0")
        g.start(1, *args)
        t_start = time.time()
        assert peers.wait_until(lambda: commits(1, t_start) >= 3, 90), g.log_tail("replica-1")
        events = g.read()
        link = g.bytes()
    finally:
        g.close()
    merges, _ = pm.torchft_merges(events)
    resume = pm.resume_samples([(t_kill, "replica-1", str(pid))], merges)
    assert resume and resume[0] < 10.0
    heals = [d for d in events if d["e"] == "heal"]
    # the restarted process healed once (a first process may heal too: it joins a peer already a step ahead)
    assert [d["pid"] for d in heals].count(g.pids[1]) == 1
    _, steps = pm.torchft_merges(events)
    for p_ in {d["pid"] for d in events if d["e"] == "sync"}:
        took = max(d["at"] for d in events if d["e"] == "sync" and d["pid"] == p_)
        credited = sum(v for k, v in steps.items() if k[1] == str(p_)) / 2  # P=2: a step counts once per fragment
        assert credited <= took, (p_, credited, took)
    for pid_ in {h["pid"] for h in heals}:  # the sync after each heal, and only those, are marked (not credited)
        syncs = [d for d in events if d["e"] == "sync" and d["pid"] == pid_]
        own = [h for h in heals if h["pid"] == pid_]
        assert sum(d["heal"] for d in syncs) == len(own)
        assert all(next(d for d in syncs if d["t"] >= h["t"])["heal"] for h in own)
    if link is not None:  # in a namespace of its own: at least one fp32 fragment (10,000 values) per shared sync
        assert link >= sum(1 for _, _, k in merges if len(k) == 2) * 10_000 * 4


def test_a_killed_runs_namespace_and_what_runs_in_it_are_swept():
    import shutil

    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("network namespaces need root and iproute2")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid whose run is gone
    name = f"dlpeer{dead.pid}zz"
    assert subprocess.run(["ip", "netns", "add", name]).returncode == 0
    left = subprocess.Popen(["ip", "netns", "exec", name, "sleep", "300"])
    try:
        assert peers.wait_until(lambda: subprocess.run(["ip", "netns", "pids", name], capture_output=True,
                                                       text=True).stdout.strip() != "", 10)
        assert name in peers.sweep_stale_namespaces()
        assert left.wait(10) == -9  # killed, not left running without its namespace
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        if left.poll() is None:
            left.kill()
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
