"""Peers side by side: torchft's DiLoCo and ours on the same failure trace and the same model, one run.

The peer runs in a venv of its own (``--venv``, default ``.peers-venv``; built on first use with
``pip install torch==2.13.0 torchft==0.2.0 numpy``, the CPU torch from the machine's wheels), never
in the project's; if it cannot be built the benchmark prints one line saying why and exits 2. Each
torchft replica group is one process (``bench/peer_torchft.py``) with its own TCPStore, Manager,
ProcessGroupGloo and ``DiLoCo(sync_every=H)``; one ``torchft_lighthouse`` forms the quorums. The
torchft processes run in a network namespace of their own where root can make one, so the
namespace's loopback counter is exactly their traffic (lighthouse, stores, gloo, checkpoint copies).

**Systems tier** (``bench.goodput``'s setting: M=8, synthetic compute of STEP_TIME a step, H=10,
P=2, the same seeded kill -9 / restart trace, the same window and crediting, bench/peers_model.py):
ours ``decoupled`` and ``sync`` (bench.goodput.run_mode, int8 outer gradients) against torchft at
its README's lighthouse settings (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``,
heartbeat timeout 5 s by default) and at shorter heartbeat and join timeouts (``--settings``; the
best is the one compared). Per system: goodput, kill -> the survivors' work merged again
(``resume_s``), restart -> the new process's first contribution in a global version
(``first_shared_s``), the failure-free round overhead, and the bytes through one replica's link per
outer step (a sync of every fragment), in + out, control traffic included.

**Model tier**: the built-in default model (836,736 parameters) in both frameworks, M=2, the same
version-0 parameters, corpus shards, AdamW settings and schedule, outer Nesterov (lr 0.7, momentum
0.5) and H=12 with P=4 fragments (torchft needs H divisible by P; our default P=8 is a second row);
learner/replica 1 is killed with kill -9 halfway and restarted after ``--repair`` seconds with the
steps it had left. The held-out loss is computed by the same code for both (``learner.inner``'s eval
on ``Corpus.heldout_batches``, the evaluator's batches) on torchft's global parameters (each
fragment's last committed copy) and on our evaluator's global model. fp32 both ways in the matched
row (torchft's quantised allreduce needs triton, a GPU); our defaults (int8 up) as a second row.

``goodput_vs_torchft`` = ours decoupled / torchft's best setting; ``bytes_vs_torchft`` = torchft's
bytes per outer step per replica / ours decoupled (how many times fewer we move).

    python -m bench.peers --quick --out peers.json     (~2 min: a short window, a small model)
    python -m bench.peers --out peers.json             (~20 min)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import netns
from bench import peers_model as pm
from bench.common import finish, parser, progress
from bus.procs import popen

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "bench" / "peer_torchft.py"
TORCH = "torch==2.13.0"  # the CPU build lies among the machine's wheels; a bare `torch` pulls a 3 GB CUDA one
TORCHFT = "torchft==0.2.0"

#: torchft's lighthouse settings: its README's (``readme``) and shorter timeouts; (heartbeat ms, join ms)
SETTINGS = {"readme": (5000, 10000), "hb1000_join1000": (1000, 1000), "hb500_join200": (500, 200),
            "hb250_join100": (250, 100)}


class PeerUnavailable(RuntimeError):
    """The peer environment cannot be had here; the message says why."""


# -- the peer's environment ------------------------------------------------------------------------


def peer_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def peer_ready(venv: Path) -> str | None:
    """None when the venv imports torch and torchft and has the lighthouse; else why not."""
    py, lh = peer_python(venv), venv / "bin" / "torchft_lighthouse"
    if not py.exists() or not lh.exists():
        return f"no peer venv at {venv}"
    p = subprocess.run([str(py), "-c", "import torch, torchft, numpy; print(torch.__version__)"],
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return f"{venv}: torch/torchft do not import: {p.stderr.strip().splitlines()[-1:] or p.returncode}"
    return None


def ensure_venv(venv: Path, build: bool = True) -> Path:
    """The peer venv, built if missing (about a minute and 1 GB); PeerUnavailable if it cannot be."""
    why = peer_ready(venv)
    if why is None:
        return venv
    if not build:
        raise PeerUnavailable(why)
    progress(f"building the peer venv at {venv} ({TORCH}, {TORCHFT}, numpy)")
    try:
        if not peer_python(venv).exists():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=300)
        p = subprocess.run([str(peer_python(venv)), "-m", "pip", "install", "-q", TORCH, TORCHFT, "numpy"],
                           capture_output=True, text=True, timeout=1800)
    except (OSError, subprocess.SubprocessError) as e:
        raise PeerUnavailable(f"cannot build the peer venv at {venv}: {e}") from e
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["?"]
        raise PeerUnavailable(f"pip could not install {TORCH} {TORCHFT} into {venv}: {tail[0]}")
    why = peer_ready(venv)
    if why is not None:
        raise PeerUnavailable(why)
    return venv


# -- a private network namespace (exact loopback counters) -----------------------------------------


class Namespace:
    """``ip netns`` of our own with ``lo`` up, or none (``name`` None, ``why`` says why)."""

    def __init__(self, tag: str) -> None:
        self.name: str | None = None
        self.why: str | None = None
        if os.geteuid() != 0 or not shutil.which("ip"):
            self.why = "a network namespace needs root and iproute2"
            return
        name = f"dlpeer{os.getpid()}{tag}"
        p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if p.returncode != 0:
            self.why = f"ip netns add: {p.stderr.strip()}"
            return
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=False)
        self.name = name

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name] if self.name else []

    def lo_tx(self) -> int | None:
        if not self.name:
            return None
        p = subprocess.run([*self.prefix(), "cat", "/sys/class/net/lo/statistics/tx_bytes"],
                           capture_output=True, text=True)
        return int(p.stdout.strip()) if p.returncode == 0 else None

    def close(self) -> None:
        if self.name:
            netns.delete_namespaces([self.name])  # kills what runs there, then deletes it
            self.name = None


def sweep_stale_namespaces() -> list[str]:
    """Delete the ``dlpeer<pid><tag>`` namespaces of bench.peers runs whose process is gone (a run
    killed from outside leaves its namespace behind), and kill what still runs in them."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return []
    gone = [n for n in netns.list_namespaces()
            if (m := _OWNER.match(n)) and not netns._pid_alive(int(m.group(1)))]
    netns.delete_namespaces(gone)
    return gone


_OWNER = re.compile(r"^dlpeer(\d+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchftGroup:
    """A lighthouse and replica processes in one namespace; events in one JSON-lines file."""

    def __init__(self, venv: Path, setting: tuple[int, int], tag: str) -> None:
        self.venv, self.setting = venv, setting
        self.dir = tempfile.mkdtemp(prefix="diloco-peers-")
        self.events = os.path.join(self.dir, "events.jsonl")
        self.ns = Namespace(tag)
        self.port = 29510 if self.ns.name else free_port()
        self.procs: dict[int, subprocess.Popen] = {}
        self.pids: dict[int, int] = {}
        hb, join = setting
        try:
            with open(os.path.join(self.dir, "lighthouse.log"), "ab") as log:
                self.lighthouse = popen(
                    [*self.ns.prefix(), str(self.venv / "bin" / "torchft_lighthouse"), "--min_replicas", "1",
                     "--quorum_tick_ms", "100", "--join_timeout_ms", str(join), "--heartbeat_timeout_ms", str(hb),
                     "--bind", f"127.0.0.1:{self.port}"], stdout=log, stderr=log)
        except OSError:
            self.ns.close()
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.lo0 = self.ns.lo_tx()

    def start(self, i: int, *args: str) -> None:
        log = open(os.path.join(self.dir, f"replica-{i}.log"), "ab")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DILOCO_", "TORCHFT_"))}
        env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.procs[i] = popen(
            [*self.ns.prefix(), str(peer_python(self.venv)), str(WORKER), "--replica", str(i),
             "--lighthouse", f"http://127.0.0.1:{self.port}", "--events", self.events, *args],
            stdout=log, stderr=log, env=env)
        log.close()
        self.pids[i] = self.procs[i].pid

    def kill(self, i: int) -> int | None:
        p = self.procs.get(i)
        if p is None or p.poll() is not None:
            return None
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        return p.pid

    def read(self) -> list[dict]:
        try:
            with open(self.events) as f:
                return pm.parse_events(f)
        except OSError:
            return []

    def bytes(self) -> int | None:
        lo = self.ns.lo_tx()
        return None if lo is None or self.lo0 is None else lo - self.lo0

    def log_tail(self, name: str, n: int = 15) -> str:
        try:
            with open(os.path.join(self.dir, f"{name}.log"), errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        for p in [*self.procs.values(), self.lighthouse]:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except OSError:
                    pass
                p.wait()
        self.ns.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# -- systems tier ---------------------------------------------------------------------------------


def systems_params() -> dict:
    from bench import goodput as g
    from bench.runs import model_config
    from learner.spec import count_params

    n = count_params(model_config(g.MODEL).spec())
    return {"M": g.M, "step_s": g.STEP_TIME, "H": g.H, "P": g.P, "params": int(n)}


def wait_until(pred, timeout: float, poll: float = 0.1) -> bool:
    t = time.monotonic() + timeout
    while time.monotonic() < t:
        if pred():
            return True
        time.sleep(poll)
    return pred()


def torchft_systems(venv: Path, name: str, setting: tuple[int, int], trace, T: float, sp: dict) -> dict:
    """One torchft setting under the trace; goodput and timings as bench.goodput measures ours."""
    M, step_s, H, P = sp["M"], sp["step_s"], sp["H"], sp["P"]
    args = ["--kind", "synthetic", "--H", str(H), "--P", str(P), "--step-time", str(step_s),
            "--params", str(sp["params"])]  # the Manager's and gloo's timeouts at torchft's default, 60 s
    g = TorchftGroup(venv, setting, name[:4])
    try:
        for i in range(M):
            g.start(i, *args)

        def all_stepping() -> bool:
            return len({d["replica"] for d in g.read() if d["e"] == "step"}) >= M

        if not wait_until(all_stepping, 180):
            raise RuntimeError(f"torchft {name}: replicas did not start:\n" + g.log_tail("replica-0"))
        t0w, t0 = time.time(), time.monotonic()
        kills: list[tuple[float, str, str | None]] = []
        starts: list[tuple[float, str]] = []
        down: set[int] = set()  # replicas the trace killed and has not restarted yet
        crashes = 0

        def supervise(until: float) -> None:
            """Sleep until ``until`` (monotonic); a replica that exits by itself (a torchft timeout
            or error) is restarted at once, as a job supervisor would, and counted."""
            nonlocal crashes
            while True:
                for i, proc in g.procs.items():
                    if i not in down and proc.poll() is not None:
                        crashes += 1
                        starts.append((time.time(), pm.replica_name(i)))
                        g.start(i, *args)
                left = until - time.monotonic()
                if left <= 0:
                    return
                time.sleep(min(left, 0.1))

        for t, what, i in trace:
            supervise(t0 + t)
            if what == "kill":
                pid = g.kill(i)
                down.add(i)
                kills.append((time.time(), pm.replica_name(i), str(pid) if pid else None))
            else:
                down.discard(i)
                starts.append((time.time(), pm.replica_name(i)))
                g.start(i, *args)
        supervise(t0 + T)
        t1w = time.time()
        link = g.bytes()
        events = g.read()
    finally:
        g.close()
    return systems_row(f"torchft_{name}", events, kills, starts, t0w, t1w, link, sp,
                       {"heartbeat_timeout_ms": setting[0], "join_timeout_ms": setting[1], "crashes": crashes,
                        "netns": g.ns.why is None, "bytes_note": g.ns.why})


def systems_row(label: str, events: list[dict], kills, starts, t0w: float, t1w: float, link: int | None,
                sp: dict, extra: dict) -> dict:
    M, step_s, H, P = sp["M"], sp["step_s"], sp["H"], sp["P"]
    merges, steps = pm.torchft_merges(events)
    credited, n, unknown = pm.credit(merges, steps, t0w, t1w, step_s, P)
    window = t1w - t0w
    applied_all = sum(len(k) for _, _, k in merges)
    out = {"system": label, "window_s": round(window, 2), "kills": len(kills), "restarts": len(starts),
           "goodput": round(pm.goodput(credited, M, window), 4), "credited_s": round(credited, 2),
           "applied_contributions": n, "unmatched_applied": unknown, "applied_all": applied_all,
           "failed_syncs": sum(1 for d in events if d["e"] == "sync" and not d.get("commit")),
           "heals": sum(1 for d in events if d["e"] == "heal"),
           "timings": pm.recovery_timings(kills, starts, merges, M=M, round_s=H * step_s, lockstep=True),
           "link_bytes": pm.loopback_link_bytes(link) if link is not None else None,
           "bytes_per_outer_step": (pm.per_outer_step(pm.loopback_link_bytes(link), applied_all, P)
                                    if link is not None else None), **extra}
    return out


async def ours_systems(mode: str, trace, T: float, sp: dict) -> dict:
    from bench.goodput import run_mode

    ev: dict = {}
    r = await run_mode(mode, trace, T, ev)
    e = ev[mode]
    merges = [(ts, f, [tuple(k) for k in keys]) for ts, f, keys in e["merges"]]
    kills = [tuple(k) for k in e["kills"]]
    starts = [tuple(s) for s in e["starts"]]
    H = sp["H"] if mode != "dp" else 1
    return {"system": f"ours_{mode}", "window_s": r["window_s"], "kills": r["kills"], "restarts": r["restarts"],
            "goodput": r["goodput"], "credited_s": r["credited_s"], "applied_contributions": r["applied_contributions"],
            "unmatched_applied": r["unmatched_applied"], "applied_all": r["applied_all"],
            "rejected": r["rejected"],
            "timings": pm.recovery_timings(kills, starts, merges, M=sp["M"], round_s=H * sp["step_s"],
                                           lockstep=mode != "decoupled"),
            "link_bytes": r["learner_link_bytes"],
            "bytes_per_outer_step": pm.per_outer_step(r["learner_link_bytes"], r["applied_all"], sp["P"]),
            "aggregator_bytes_per_outer_step": pm.per_outer_step(r["aggregator_link_bytes"], r["applied_all"], sp["P"]),
            "goodput_timings": r["timings"]}


# -- model tier ------------------------------------------------------------------------------------


def model_setup(quick: bool, steps: int, M: int, P: int, workdir: str) -> dict:
    """Version 0, the per-replica batches and the run's settings, written for the torchft side, and
    the DILOCO_* settings of ours (the same values)."""
    import numpy as np

    from bench.runs import SMALL_MODEL, model_config
    from bus.config import from_env
    from learner.config import EvalConfig, LearnerConfig
    from learner.data import load_corpus
    from learner.loop import batch_seed
    from learner.spec import count_params, init_params

    env = dict(SMALL_MODEL) if quick else {}
    env.update({"DILOCO_BATCH_SIZE": "8" if quick else "16", "DILOCO_TOTAL_STEPS": str(steps),
                "DILOCO_EVAL_BATCHES": "8", "DILOCO_EVAL_BATCH_SIZE": "16", "DILOCO_SYNC_EVERY": "12",
                "DILOCO_INNER_OPTIMIZER": "adamw"})  # torchft's replica is AdamW: ours too (Muon is our default)
    lc, ec = from_env(LearnerConfig, env), from_env(EvalConfig, env)
    mc = model_config(env)
    spec = mc.spec()
    init = init_params(spec, mc.seed)
    np.savez(os.path.join(workdir, "init.npz"), **init)
    corpus = load_corpus(lc.data or None, max_bytes=lc.data_max_bytes)
    for i in range(M):
        for inc in range(2):  # the first process and its restart sample like a learner's incarnations
            sh = corpus.shard(i, M, spec.seq_len, batch_seed(lc.data_seed, f"replica-{i}", str(inc)))
            np.save(os.path.join(workdir, f"data-{i}-{inc}.npy"), np.stack([sh.batch(lc.batch_size) for _ in range(steps)]))
    np.save(os.path.join(workdir, "heldout.npy"), corpus.heldout_batches(spec.seq_len, ec.eval_batch_size, ec.eval_batches))
    lr = lc.lr_for(spec.d_model, learners=M)
    env["DILOCO_INNER_LR"] = repr(lr)  # both sides at one rate
    opt = {"lr": lr, "warmup": lc.warmup, "total": lc.total_steps, "wd": lc.weight_decay, "clip": lc.clip_norm,
           "outer_lr": 0.7, "outer_momentum": 0.5}
    sp = {"d_model": spec.d_model, "n_layers": spec.n_layers, "n_heads": spec.n_heads, "d_ff": spec.d_ff,
          "seq_len": spec.seq_len}
    return {"env": env, "spec": sp, "opt": opt, "params": int(count_params(spec)), "batch": lc.batch_size,
            "H": lc.sync_every, "P": P, "eval": {"batches": ec.eval_batches, "batch_size": ec.eval_batch_size}}


def children_cpu_s() -> float:
    """CPU seconds (user + system) of every child process that has ended and been waited for."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def heldout_loss(env: dict, params_npz: str, heldout_npy: str) -> float:
    import numpy as np

    from bench.runs import model_config
    from learner.inner import make_eval_fn
    from learner.model import to_jax

    spec = model_config(env).spec()
    f = make_eval_fn(spec)
    p = to_jax(dict(np.load(params_npz)))
    return float(np.mean([float(f(p, b)) for b in np.load(heldout_npy)]))


def torchft_model(venv: Path, setup: dict, workdir: str, M: int, steps: int, repair: float,
                  setting: tuple[int, int], kill_at: float = 0.5) -> dict:
    H, P = setup["H"], setup["P"]
    base = ["--kind", "model", "--H", str(H), "--P", str(P), "--init", os.path.join(workdir, "init.npz"),
            "--spec", json.dumps(setup["spec"]), "--opt", json.dumps(setup["opt"])]
    save = os.path.join(workdir, "torchft-global-{}.npz")
    g = TorchftGroup(venv, setting, "mdl")
    t0 = time.monotonic()
    killed_at = None
    try:
        for i in range(M):
            g.start(i, *base, "--steps", str(steps), "--data", os.path.join(workdir, f"data-{i}-0.npy"),
                    "--save", save.format(i))

        def steps_of(i: int) -> int:  # inner steps of replica i's current process at its latest sync
            pid = g.pids.get(i)
            return max((int(d["at"]) for d in g.read() if d["e"] == "sync" and d["pid"] == pid), default=0)

        victim = M - 1

        def half() -> bool:
            failed = {i: p.returncode for i, p in g.procs.items() if p.poll() not in (None, 0)}
            if failed:
                raise RuntimeError(f"torchft model: replicas exited {failed}:\n" + g.log_tail(f"replica-{min(failed)}"))
            return steps_of(victim) >= int(steps * kill_at)

        if kill_at > 0:
            if not wait_until(half, 1800, 0.25):
                raise RuntimeError("torchft model: the victim never reached its kill step:\n"
                                   + g.log_tail(f"replica-{victim}"))
            g.kill(victim)
            killed_at = steps_of(victim)
            progress(f"torchft model: killed replica {victim} at step {killed_at}; restart in {repair} s")
            time.sleep(repair)
            g.start(victim, *base, "--steps", str(steps - killed_at),
                    "--data", os.path.join(workdir, f"data-{victim}-1.npy"), "--save", save.format(victim))
        if not wait_until(lambda: all(p.poll() is not None for p in g.procs.values()), 1800, 0.5):
            raise RuntimeError("torchft model: replicas did not finish:\n" + g.log_tail("replica-0"))
        wall = time.monotonic() - t0
        link = g.bytes()
        events = g.read()
        bad = {i: p.returncode for i, p in g.procs.items() if p.returncode != 0}
        if bad:
            raise RuntimeError(f"torchft model: exits {bad}:\n" + g.log_tail("replica-0"))
    finally:
        g.close()
    merges, st = pm.torchft_merges(events)
    applied = sum(len(k) for _, _, k in merges)
    done = [d for d in events if d["e"] == "done"]
    # the global model: the copy of the replica that finished last (the newest manager step)
    last = max(done, key=lambda d: (int(d["mstep"]), float(d["t"])))
    save = save.format(last["replica"])
    return {"system": "torchft", "codec": "fp32", "H": H, "P": P, "wall_s": round(wall, 2),
            "loss": heldout_loss(setup["env"], save, os.path.join(workdir, "heldout.npy")),
            "killed_at_step": killed_at,
            "steps_done": sum(int(d["steps"]) for d in done) + (killed_at or 0),
            "steps_merged": sum(st.values()) // P, "global_from_replica": last["replica"],
            "heals": sum(1 for d in events if d["e"] == "heal"), "failed_syncs": sum(1 for d in events if d["e"] == "sync" and not d["commit"]),
            "link_bytes": pm.loopback_link_bytes(link) if link is not None else None,
            "bytes_per_outer_step": pm.per_outer_step(pm.loopback_link_bytes(link), applied, P) if link is not None else None}


async def ours_model(setup: dict, M: int, steps: int, repair: float, learner: dict, label: str,
                     kill_at: float = 0.5) -> dict:
    from bench.runs import Cluster

    names = [f"learner-{i}" for i in range(M)]
    victim = names[-1]
    frag = {k: v for k, v in learner.items() if k == "DILOCO_NUM_FRAGMENTS"}  # the run's: every process
    learner = {k: v for k, v in learner.items() if k not in frag}
    # metrics every 0.1 s: the kill lands within a few steps of halfway
    async with Cluster(f"peers{label.replace('_', '')}", {**setup["env"], **frag}, metrics_interval=0.1) as c:
        c.start("aggregator", "aggregator", DILOCO_REQUIRE_MEMBERSHIP="false")
        t0 = time.monotonic()
        for n in names:
            c.start(n, "learner", DILOCO_LEARNER_ID=n, DILOCO_MAX_STEPS=str(steps), DILOCO_NUM_LEARNERS=str(M), **learner)
        killed_at = 0
        if kill_at > 0:
            ok = await c.wait_for(lambda: (c.metrics("learner", victim).get("step") or 0) >= int(steps * kill_at),
                                  1800, 0.1)
            if not ok:
                raise RuntimeError(f"ours {label}: the victim never reached its kill step:\n" + c.log_tail(victim))
            c.kill(victim)
            killed_at = int(c.metrics("learner", victim).get("step") or 0)
            progress(f"ours {label}: killed {victim} at step {killed_at}; restart in {repair} s")
            await asyncio.sleep(repair)
            c.start(victim, "learner", DILOCO_LEARNER_ID=victim, DILOCO_MAX_STEPS=str(steps - killed_at),
                    DILOCO_NUM_LEARNERS=str(M), **learner)
        if not await c.wait_exit(names, 1800):
            raise RuntimeError(f"ours {label}: learners did not finish")
        wall = time.monotonic() - t0
        await c.wait_for(lambda: not c.metrics("aggregator", "agg-0").get("buffered"), 10.0)
        await asyncio.sleep(1.0)
        agg = c.metrics("aggregator", "agg-0")
        done = sum(int(c.metrics("learner", n).get("step") or 0) for n in names) + killed_at
        conn = c.connz()
        ev = await c.eval_once()
    from bench.runs import model_config
    from bus.config import from_env
    from learner.config import LearnerConfig

    link = sum(i + o for n, (i, o) in conn.items() if n.startswith("learner-"))
    applied = int(sum((agg.get("contributions") or {}).values()) or agg.get("accepted") or 0)
    P = model_config({**setup["env"], **frag}).num_fragments  # the settings' or the roles' default
    codec = from_env(LearnerConfig, {**setup["env"], **learner}).quantiser
    return {"system": f"ours_{label}", "codec": codec, "H": setup["H"], "P": P,
            "wall_s": round(wall, 2), "loss": float(ev["eval_loss"]), "killed_at_step": killed_at, "steps_done": done,
            "merges": agg.get("merges"), "rejected": agg.get("rejected"), "link_bytes": link,
            "applied_contributions": applied or None,
            "bytes_per_outer_step": pm.per_outer_step(link, applied, P) if applied else None}


# -- the whole run ---------------------------------------------------------------------------------


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--venv", default=str(ROOT / ".peers-venv"), help="the peer's venv (built if missing)")
    p.add_argument("--no-build", action="store_true", help="do not build the peer venv; exit 2 if it is missing")
    p.add_argument("--build-only", action="store_true", help="build the peer venv (if missing) and exit")
    p.add_argument("--window", type=float, default=None, help="systems tier: measured seconds per system")
    p.add_argument("--mtbf", type=float, default=30.0, help="systems tier: mean up-time of a replica, seconds")
    p.add_argument("--repair", type=float, default=3.0, help="seconds before a killed replica is restarted")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--settings", default=None, help="torchft lighthouse settings to run: " + ",".join(SETTINGS))
    p.add_argument("--ours", default=None, help="our modes in the systems tier (decoupled,sync)")
    p.add_argument("--clean-window", type=float, default=None,
                   help="systems tier: seconds of a failure-free run per system (0: none; default 20, --quick 0)")
    p.add_argument("--steps", type=int, default=None, help="model tier: inner steps per replica")
    p.add_argument("--kill-at", type=float, default=0.5,
                   help="model tier: kill -9 replica 1 at this share of its steps (0: no kill)")
    p.add_argument("--model-variants", default=None, help="model tier: our rows, of fp32_p4,defaults,sync_fp32_p4 (default: the first two; --quick: fp32_p4)")
    p.add_argument("--tiers", default="systems,model")
    a = p.parse_args()
    # a SIGTERM unwinds like an exception, so every namespace, process and folder is cleaned up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        venv = ensure_venv(Path(a.venv), build=not a.no_build)
    except PeerUnavailable as e:
        print(f"bench.peers: the peer (torchft) is unavailable: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    if a.build_only:
        progress(f"the peer venv is ready: {venv}")
        return
    swept = sweep_stale_namespaces()
    if swept:
        progress(f"deleted namespaces of earlier runs that were killed: {swept}")
    tiers = a.tiers.split(",")
    if a.clean_window is None:
        a.clean_window = 0.0 if a.quick else 20.0
    out: dict = {"bench": "peers", "quick": a.quick, "torch": TORCH, "torchft": TORCHFT}
    if "systems" in tiers:
        from bench.goodput import failure_trace

        sp = systems_params()
        T = a.window or (10.0 if a.quick else 100.0)
        trace = failure_trace(a.seed, T, a.mtbf, a.repair)
        names = a.settings.split(",") if a.settings else (["readme", "hb500_join200"] if a.quick else list(SETTINGS))
        ours = a.ours.split(",") if a.ours else (["decoupled"] if a.quick else ["decoupled", "sync"])
        progress(f"systems tier: M={sp['M']}, {sp['params']} parameters, H={sp['H']}, P={sp['P']}, "
                 f"{sum(1 for e in trace if e[1] == 'kill')} kills in {T} s (MTBF {a.mtbf} s, seed {a.seed})")
        rows = {}
        for m in ours:
            rows[f"ours_{m}"] = asyncio.run(ours_systems(m, trace, T, sp))
            progress(f"ours {m}: goodput {rows[f'ours_{m}']['goodput']}, "
                     f"{rows[f'ours_{m}']['bytes_per_outer_step']} B per outer step per replica")
        for n in names:
            rows[f"torchft_{n}"] = torchft_systems(venv, n, SETTINGS[n], trace, T, sp)
            r = rows[f"torchft_{n}"]
            progress(f"torchft {n}: goodput {r['goodput']}, {r['failed_syncs']} failed syncs, "
                     f"{r['bytes_per_outer_step']} B per outer step per replica")
        clean = {}
        if a.clean_window > 0:  # no failures: what a round costs each system when nothing goes wrong
            H_s = sp["H"] * sp["step_s"]
            for m in ours:
                clean[f"ours_{m}"] = asyncio.run(ours_systems(m, [], a.clean_window, sp))
            clean["torchft"] = torchft_systems(venv, "clean", SETTINGS["readme"], [], a.clean_window, sp)
            for k, r in clean.items():
                # measured: consecutive full rounds' period minus their steps (lock-step systems only; a
                # goodput over a short window is too coarse for this: its edges move it by a tenth)
                r["overhead_per_round_s"] = r["timings"]["round_overhead_s"]["median"]
                progress(f"failure-free {k}: goodput {r['goodput']}, round overhead {r['overhead_per_round_s']} s "
                         f"(rounds of {H_s} s)")
        tft = {k: v for k, v in rows.items() if k.startswith("torchft_")}
        best = max(tft, key=lambda k: tft[k]["goodput"])
        dec = rows.get("ours_decoupled")
        out["systems"] = {"params": sp, "window_s": T, "mtbf_s": a.mtbf, "repair_s": a.repair, "seed": a.seed,
                          "failures": sum(1 for e in trace if e[1] == "kill"), "rows": rows,
                          "failure_free": {"window_s": a.clean_window, "rows": clean,
                                           "goodput": {k: v["goodput"] for k, v in clean.items()},
                                           "overhead_per_round_s": {k: v["overhead_per_round_s"] for k, v in clean.items()}},
                          "torchft_best_setting": best,
                          "goodput": {k: v["goodput"] for k, v in rows.items()}}
        if dec:
            out["goodput_vs_torchft"] = pm.ratio(dec["goodput"], tft[best]["goodput"])
            out["goodput_vs_torchft_readme"] = pm.ratio(dec["goodput"], (tft.get("torchft_readme") or {}).get("goodput"))
            out["bytes_vs_torchft"] = pm.ratio(tft[best]["bytes_per_outer_step"], dec["bytes_per_outer_step"])
    if "model" in tiers:
        M, P = 2, 4
        steps = a.steps or (48 if a.quick else 300)
        with tempfile.TemporaryDirectory(prefix="diloco-peers-model-") as wd:
            setup = model_setup(a.quick, steps, M, P, wd)
            progress(f"model tier: {setup['params']} parameters, M={M}, {steps} steps of batch {setup['batch']}, "
                     f"H={setup['H']}, " + (f"kill -9 of replica 1 at {a.kill_at:.0%} of its steps" if a.kill_at else "no kill"))
            setting = SETTINGS[out.get("systems", {}).get("torchft_best_setting", "torchft_readme")[len("torchft_"):]]
            cpu0 = children_cpu_s()
            rows = {"torchft": torchft_model(venv, setup, wd, M, steps, a.repair, setting, a.kill_at)}
            rows["torchft"]["cpu_s"] = round(children_cpu_s() - cpu0, 1)  # every process of the run, all cores
            progress(f"torchft model: held-out {rows['torchft']['loss']:.4f} in {rows['torchft']['wall_s']} s")
            variants = {"fp32_p4": {"DILOCO_QUANTISER": "fp32", "DILOCO_NUM_FRAGMENTS": str(P)}, "defaults": {},
                        # lock-step like torchft (a learner waits for the version with its work; all fragments
                        # at once every H): separates the algorithm from the price of never waiting
                        "sync_fp32_p4": {"DILOCO_MODE": "sync", "DILOCO_QUANTISER": "fp32", "DILOCO_NUM_FRAGMENTS": str(P)}}
            chosen = a.model_variants.split(",") if a.model_variants else (["fp32_p4"] if a.quick else ["fp32_p4", "defaults"])
            for label in chosen:
                lenv = variants[label]
                cpu0 = children_cpu_s()
                rows[f"ours_{label}"] = asyncio.run(ours_model(setup, M, steps, a.repair, lenv, label, a.kill_at))
                rows[f"ours_{label}"]["cpu_s"] = round(children_cpu_s() - cpu0, 1)
                progress(f"ours {label}: held-out {rows[f'ours_{label}']['loss']:.4f} in {rows[f'ours_{label}']['wall_s']} s")
        t = rows["torchft"]["loss"]
        out["model"] = {"params": setup["params"], "M": M, "steps": steps, "batch": setup["batch"], "H": setup["H"],
                        "settings": setup["env"], "opt": setup["opt"], "rows": rows,
                        "loss_vs_torchft": {k: round((v["loss"] - t) / t, 4) for k, v in rows.items() if k != "torchft"}}
        m = rows.get("ours_fp32_p4")
        out["model_bytes_vs_torchft"] = pm.ratio(rows["torchft"]["bytes_per_outer_step"], m and m["bytes_per_outer_step"])
    finish(out, a.out)


if __name__ == "__main__":
    main()
