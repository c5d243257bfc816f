"""A full disk in the middle of a run (issue 29, part 3; docs/RELIABILITY.md, "Full disk").

``diloco nats`` runs in a user + mount namespace whose ``--store-dir`` is a small tmpfs; the
aggregator, the monitor and two learners train against it. A filler file then takes the rest of
the filesystem: nats-server fails its writes with "no space left on device" and answers none of
them (its streams keep that write error until it restarts). The test checks that every role
says so in one line (``store_full``), that the aggregator stops merging (no version advances),
then frees the space and checks that the run resumes with no step of ours: ``diloco nats``
restarts the server once space is back, the roles reconnect, the aggregator merges again. A
kill -9 and restart of the aggregator after the episode resumes from a consistent state; at the
end every outer gradient JetStream acknowledged was applied exactly once or rejected with a
reason, and no fragment's version ever went back.

The second test is the other way a store runs out: the server's ``max_file_store`` used up by
storage no stream reserved (every write refused at once: "insufficient resources"). The third
runs the aggregator in-process with its STATE writes refused, to check what the first cannot see
from outside: the merge it could not store is undone, its contributions stay unacknowledged, and
they are merged once the store takes writes again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time
import urllib.request

import orjson
import pytest
from nats.js.api import StorageType, StreamConfig

from bus.config import CommonConfig
from bus.conn import connect
from bus.procs import popen
from bus.server import EmbeddedServer, free_port
from bus.store_health import FULL, StoreWatch
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkPublisher, TransportError, VersionedStore
from tests.agg_helpers import PY, env
from tests.system import FAST_AGG, FAST_MONITOR, SYNTH_LEARNER

RUN = "fulldisk"
FS_MIB = 96  # the store's filesystem (tmpfs pages are memory: only what is written)
LEARNERS = ("l0", "l1")
ROLES = ("aggregator", "monitor", *LEARNERS)


def _namespace_unavailable() -> str | None:
    """Why this machine cannot give an unprivileged process a filesystem of its own size, or None."""
    d = tempfile.mkdtemp(prefix="diloco-fs-probe-")
    try:
        p = subprocess.run(["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare is not available: {e}"
    finally:
        os.rmdir(d)
    if p.returncode != 0:
        return f"no user + mount namespace with a tmpfs here (unshare -Urm: {p.stderr.strip()[:200]})"
    return None


class DiskServer:
    """``diloco nats`` whose store is a ``size_mib`` tmpfs in a user + mount namespace of its own."""

    def __init__(self, workdir: str, size_mib: int):
        self.workdir, self.store = workdir, os.path.join(workdir, "store")
        os.makedirs(self.store)
        self.port, self.http = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        cmd = (f"mount -t tmpfs -o size={size_mib}m tmpfs {self.store} && exec {PY} -m diloco.cli nats "
               f"--store-dir {self.store} --port {self.port} --http-port {self.http} "
               f"--log-file {os.path.join(workdir, 'nats.log')} --heal-min-free-mib 16")
        self.out = open(os.path.join(workdir, "diloco-nats.log"), "ab")
        self.proc = popen(["unshare", "-Urm", "sh", "-c", cmd], stdout=self.out, stderr=self.out)
        # the filesystem as the server sees it (its mount namespace), from here
        self.root = f"/proc/{self.proc.pid}/root{self.store}"

    def wait_healthy(self, timeout: float = 30.0) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            assert self.proc.poll() is None, self.text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/healthz?js-enabled-only=true",
                                            timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            time.sleep(0.1)
        raise AssertionError(f"diloco nats not healthy: {self.text()}")

    def fill(self) -> int:
        """Take every free byte of the store's filesystem; returns how many."""
        n = 0
        fd = os.open(os.path.join(self.root, "filler"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            block = b"\0" * 65536
            while block:
                try:
                    n += os.write(fd, block)
                except OSError:  # ENOSPC: then what is left, smaller
                    block = block[: len(block) // 2]
        finally:
            os.close(fd)
        return n

    def free(self) -> None:
        os.remove(os.path.join(self.root, "filler"))

    def text(self) -> str:
        with open(os.path.join(self.workdir, "diloco-nats.log")) as f:
            return f.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def lines(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("{"):
                    try:
                        out.append(orjson.loads(line))
                    except orjson.JSONDecodeError:
                        pass
    except FileNotFoundError:
        pass
    return out


def events(logdir: str, name: str, event: str) -> list[dict]:
    return [d for d in lines(os.path.join(logdir, f"{name}.log")) if d.get("event") == event]


async def until(pred, timeout: float, interval: float = 0.2):
    t_end = time.monotonic() + timeout
    while True:
        v = await pred()
        if v or time.monotonic() > t_end:
            return v
        await asyncio.sleep(interval)


async def published_keys(js, s: Subjects) -> set[tuple]:
    """Every complete outer gradient in the GRAD stream: what JetStream acknowledged."""
    from tests.chaos.harness import published_keys as grad_keys

    return await grad_keys(js, s, poll_timeout=0.5)


async def audit(js, s: Subjects, published: set[tuple], timeout: float) -> tuple[list, set, dict]:
    """Applied keys (with repeats, from the merge events), rejected keys, and the merge events'
    versions per fragment, once they cover ``published`` (or at ``timeout``)."""
    from tests.chaos.harness import audit_events

    applied_by, rejected = await audit_events(js, s, published, timeout, poll_timeout=0.2)
    per_fragment: dict[int, list[int]] = {}
    for f, v in sorted(applied_by):
        per_fragment.setdefault(f, []).append(v)
    return [k for ks in applied_by.values() for k in ks], rejected, per_fragment


@pytest.mark.timeout(150)
@pytest.mark.parametrize("rounds", ["in_flight", "stored"])
async def test_a_full_disk_pauses_the_run_loses_nothing_and_it_resumes_by_itself(tmp_path, rounds):
    """``rounds``: what the learners' last rounds are when the disk fills. ``in_flight``: the run goes
    on until the disk is full (mostly a publish of each learner is out: it is not acknowledged).
    ``stored``: the aggregator is stopped (SIGSTOP) for 1.5 s before the fill and continued after
    it, so the learners' last rounds are stored and not merged, and their syncs wait for the
    aggregator: a learner then writes nothing but its probes (the nineteenth round's CI failure:
    one learner that had nothing in flight said nothing for 40 s)."""
    why = _namespace_unavailable()
    if why:
        pytest.skip(why)
    logdir = str(tmp_path)
    srv = DiskServer(str(tmp_path / "nats"), FS_MIB)
    procs: dict[str, subprocess.Popen] = {}

    def start(name: str, module: str, **extra: str) -> None:
        log = open(os.path.join(logdir, f"{name}.log"), "ab")
        argv = ["diloco.cli", "aggregator"] if module == "aggregator" else [module]
        procs[name] = subprocess.Popen([PY, "-m", *argv], env=env(srv.url, RUN, **extra), stdout=log, stderr=log,
                                       start_new_session=True)
        log.close()

    agg_env = {**FAST_AGG, "DILOCO_EMBEDDED_MONITOR": "false", "DILOCO_ACK_WAIT": "5"}
    nc = None
    try:
        await asyncio.get_running_loop().run_in_executor(None, srv.wait_healthy)
        start("monitor", "monitor", **FAST_MONITOR)
        start("aggregator", "aggregator", **agg_env)
        for name in LEARNERS:
            start(name, "learner", DILOCO_LEARNER_ID=name, **SYNTH_LEARNER)
        nc = await connect(CommonConfig(nats_url=srv.url, run=RUN), "full-disk-test")
        js = nc.jetstream(timeout=3)
        s = Subjects(RUN)
        heads = VersionedStore(js, RUN, GLOBAL)
        seen: list[tuple[float, int, int]] = []  # (time, fragment, version) of every head read

        async def versions() -> dict[int, int]:
            out = {}
            for p in (0, 1):
                try:
                    h = await heads.head(p)
                except Exception:  # the server restarting
                    continue
                if h is not None:
                    out[p] = h.version
                    seen.append((time.monotonic(), p, h.version))
            return out

        async def advanced(past: dict[int, int], by: int):
            v = await versions()
            return v if len(v) == 2 and all(v[p] >= past.get(p, 0) + by for p in (0, 1)) else None

        # 1. the run trains
        t0 = time.monotonic()
        assert await until(lambda: advanced({}, 3), 60), (await versions(), srv.text())
        t_warm = time.monotonic() - t0

        # 2. the disk fills: every role says so once, and the aggregator stops merging
        if rounds == "stored":
            procs["aggregator"].send_signal(signal.SIGSTOP)
            await asyncio.sleep(1.5)
        try:
            filled = srv.fill()
        finally:
            if rounds == "stored":
                procs["aggregator"].send_signal(signal.SIGCONT)
        t_fill = time.monotonic()

        async def all_said():
            return all(events(logdir, n, "store_full") for n in ROLES)

        assert await until(all_said, 40), {n: len(events(logdir, n, "store_full")) for n in ROLES}
        t_said = time.monotonic() - t_fill
        frozen = await versions()
        await asyncio.sleep(4.0)  # merging stays paused
        assert await versions() == frozen, (frozen, await versions())
        assert srv.proc.poll() is None and "nats-server restarted" not in srv.text()
        for n in ROLES:
            said = events(logdir, n, "store_full")
            assert len(said) == 1, (n, said)
            assert said[0]["level"] == "warning" and said[0]["effect"] and "no space left" in said[0]["message"], said
        # no storm of errors meanwhile: the line above is all each role says at warning or worse
        t_line = {n: events(logdir, n, "store_full")[0]["timestamp"] for n in ROLES}
        for n in ROLES:
            loud = [d["event"] for d in lines(os.path.join(logdir, f"{n}.log"))
                    if d.get("level") in ("warning", "error") and d.get("timestamp", "") > t_line[n]]
            assert not loud, (n, loud)
        # the aggregator merged nothing once it knew (a merge it could not store was undone)
        agg_said = t_line["aggregator"]
        assert not [d for d in events(logdir, "aggregator", "merged") if d["timestamp"] > agg_said]

        # 3. space is freed: diloco nats restarts the server, the run resumes by itself
        srv.free()
        t_free = time.monotonic()
        assert await until(lambda: advanced(frozen, 2), 40), (frozen, await versions(), srv.text())
        t_resumed = time.monotonic() - t_free
        assert "nats-server restarted" in srv.text(), srv.text()
        assert await until(lambda: _true(all(events(logdir, n, "store_writable") for n in ROLES)), 20), \
            {n: len(events(logdir, n, "store_writable")) for n in ROLES}

        # 4. a kill -9 of the aggregator after the episode: it resumes from what it had stored
        before = await versions()
        procs["aggregator"].send_signal(signal.SIGKILL)
        procs["aggregator"].wait(10)
        start("aggregator2", "aggregator", **agg_env)
        assert await until(lambda: advanced(before, 2), 40), (before, await versions())
        recovered = {d["fragment"]: d["version"] for d in events(logdir, "aggregator2", "fragment_recovered")}
        assert set(recovered) == {0, 1} and all(recovered[p] >= before[p] for p in (0, 1)), (recovered, before)

        # 5. the learners stop; every acknowledged contribution was applied once or rejected
        for name in LEARNERS:
            procs[name].send_signal(signal.SIGTERM)
        for name in LEARNERS:
            procs[name].wait(30)
        published = await published_keys(js, s)
        applied, rejected, merge_versions = await audit(js, s, published, 30)
        lost = published - set(applied) - rejected
        assert not lost, sorted(lost)[:10]
        assert len(applied) == len(set(applied)), "a contribution applied twice"
        for p, vs in merge_versions.items():  # every version made once, none skipped
            assert vs == list(range(1, len(vs) + 1)) or vs == list(range(vs[0], vs[0] + len(vs))), (p, vs)
        # one episode each, said once, however the episode ended (before, a learner's publish sent to
        # the server before its restart timed out after it: a second store_full, in 13 of 20 runs)
        for n in ROLES:
            said = [d["event"] for d in lines(os.path.join(logdir, f"{n}.log"))
                    if d.get("event") in ("store_full", "store_writable")]
            assert said == ["store_full", "store_writable"], (n, said)
        last: dict[int, int] = {}
        for _, p, v in seen:
            assert v >= last.get(p, -1), ("a version went back", p, v, last)
            last[p] = v
        print(f"\nfull disk ({rounds}): warm-up {t_warm:.1f} s; filled {filled / 2**20:.0f} MiB; every role said so "
              f"{t_said:.1f} s after; resumed {t_resumed:.1f} s after the space was freed; "
              f"{len(published)} contributions acknowledged, {len(set(applied))} applied, "
              f"{len(rejected)} rejected, 0 lost; versions {last}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
        if nc is not None:
            await nc.close()
        srv.close()


async def _true(v):
    return v


async def test_a_used_up_max_file_store_is_said_once_and_writes_resume_when_freed(tmp_path):
    """The server's JetStream storage (``max_file_store``) used up by a stream that reserved none:
    every write is refused at once, "insufficient resources" (503, 10023), and stored again as soon
    as the storage is freed, with no restart."""
    with EmbeddedServer(store_dir=str(tmp_path / "store"), max_file_store=48 * 2**20) as srv:
        nc = await connect(CommonConfig(nats_url=srv.url, run=RUN), "test")
        js = nc.jetstream(timeout=3)
        await js.add_stream(StreamConfig(name="G", subjects=["g.>"], storage=StorageType.FILE, max_bytes=2**20))
        await js.add_stream(StreamConfig(name="FILLER", subjects=["filler"], storage=StorageType.FILE))
        logged: list[tuple[str, str, dict]] = []

        class Log:
            def __getattr__(self, level):
                return lambda event, **kw: logged.append((level, event, kw))

        watch = StoreWatch(Log(), "testing", probe=lambda: js.stream_info("G"))
        pub = ChunkPublisher(js, max_chunk=1024, ack_timeout=1.0, deadline=3.0, watch=watch)
        await pub.publish("g.a", "obj-1", b"x" * 3000, {})
        blob = b"f" * (4 * 2**20)
        with pytest.raises(Exception):
            for _ in range(20):
                await js.publish("filler", blob)
        with pytest.raises(TransportError):
            await pub.publish("g.a", "obj-2", b"y" * 3000, {})
        assert watch.faulted and [e for _, e, _ in logged] == ["store_full"]
        assert logged[0][2]["reason"] == FULL and logged[0][2]["server"] == "insufficient resources"
        await js.purge_stream("FILLER")
        await pub.publish("g.a", "obj-2", b"y" * 3000, {})
        assert not watch.faulted and [e for _, e, _ in logged] == ["store_full", "store_writable"]
        await nc.close()


async def test_a_merge_the_store_refuses_is_undone_kept_unacked_and_merged_once_it_takes_writes(nats_server, js):
    """The aggregator at a full store (its STATE writes refused as a server at its max_file_store
    refuses them): the merge whose record cannot be stored is undone (the state in memory goes back
    to the stored one), its contribution stays in the buffer unacknowledged, nothing more is merged
    or published; once the store takes writes (its probe is stored) both contributions are merged,
    acknowledged and published, and a restart replays exactly that state."""
    from nats.js.errors import ServiceUnavailableError

    from aggregator.config import AggregatorConfig
    from aggregator.service import AggregatorService
    from learner.builtin import create_builtin_run
    from tests.agg_helpers import MODEL, FakeLearner, cancel_until_done

    run = "agg"
    common = CommonConfig(nats_url=nats_server.url, run=run, metrics_interval=0.2, partial_timeout=1.0)
    cfg = dict(require_membership=False, quorum=1, grace="fixed", grace_seconds=0.05, max_staleness=100,
               checkpoint_every=1000)
    await create_builtin_run(js, common, MODEL)

    async def start():
        svc = AggregatorService(common, AggregatorConfig(**cfg))
        task = asyncio.create_task(svc.run(asyncio.Event()))
        assert await until(lambda: _true(bool(svc.states) and hasattr(svc, "consumer")), 10)
        return svc, task

    async def stopped(task) -> None:
        await cancel_until_done(task)  # no clean stop: what is stored is all a restart has

    svc, task = await start()
    s = Subjects(run)
    real = svc.js.publish
    full = {"on": False}

    async def publish(subject, payload, **kw):
        if full["on"] and subject.startswith(f"{s.prefix}.state."):
            raise ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources")
        return await real(subject, payload, **kw)

    svc.js.publish = publish
    try:
        learner = FakeLearner(js, run, "a", 1)
        for r in range(2):
            await learner.send(0, base=r)
            assert await until(lambda: _true(svc.published.get(0) == r + 1), 15)
        stored = svc.states[0].to_bytes()
        full["on"] = True
        await learner.send(0, base=2)
        assert await until(lambda: _true(svc.store_watch.faulted), 10)
        await learner.send(0, base=2)
        await asyncio.sleep(1.0)  # several passes of the main loop, the store still full
        assert svc.states[0].version == 2 and svc.states[0].to_bytes() == stored  # undone: what is stored
        assert not svc.merge_log.uncommitted and len(svc.intake.buffers[0]) == 2 and svc.published[0] == 2
        assert svc.stats.merges == 2
        info = await js.consumer_info(s.stream("grad"), "agg_0_1")
        assert info.num_ack_pending >= 2  # neither acknowledged: a crash now redelivers both
        assert (await VersionedStore(js, run, GLOBAL).head(0)).version == 2
        full["on"] = False  # the probe (every 5 s) is stored: merging resumes by itself
        assert await until(lambda: _true(svc.published.get(0, 0) >= 3 and not svc.intake.buffers[0]), 15)
        assert not svc.store_watch.faulted and svc.store_watch.health.episodes == 1
        applied = sorted(k[3] for k in svc.states[0].last_merge) if svc.states[0].version == 3 else None
        assert applied in ([3, 4], None), applied
        assert await until(lambda: _true(svc.stats.merges >= 3), 5)
        for _ in range(50):
            info = await js.consumer_info(s.stream("grad"), "agg_0_1")
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.1)
        assert info.num_ack_pending == 0
        live = svc.states[0].to_bytes()
        version = svc.states[0].version
    finally:
        svc.js.publish = real
        await stopped(task)
        await svc.nc.close()
    svc2, task2 = await start()
    try:
        assert svc2.states[0].version == version and svc2.states[0].to_bytes() == live
        assert svc2.stats.replay_lost == 0
    finally:
        await stopped(task2)
        await svc2.nc.close()
