"""The learner service and the evaluator against a real nats-server.

Version 0 and the manifest come from ``learner.builtin.create_builtin_run`` (no aggregator
process); the test itself plays the aggregator where one is needed (publishing newer global
versions with ``VersionedStore.put``). Learners run as real subprocesses (``python -m learner``)
unless a test needs to look inside one, then in-process. Tiny model: d_model 32, 2 layers,
seq 32, P = 4.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from learner.builtin import create_builtin_run
from learner.spec import make_plan
from bus import codec
from bus.chunks import CHUNK_HEADER
from bus.config import CommonConfig
from bus.protocol import parse_grad_meta
from bus.subjects import GLOBAL, Subjects
from bus.transport import Assembled, ChunkConsumer, VersionedStore, ack_all
from learner.config import EvalConfig, LearnerConfig, ModelConfig
from bus.fragments import gather_all
from learner.spec import init_params, spec_hash
from monitor.membership import Member, State, member_to_dict

ROOT = Path(__file__).resolve().parent.parent
RUN = "lt"
S = Subjects(RUN)
MC = ModelConfig(d_model=32, n_layers=2, n_heads=4, d_ff=64, seq_len=32, num_fragments=4)
SPEC = MC.spec()
PLAN = make_plan(SPEC, MC.num_fragments, MC.max_imbalance)
V0 = gather_all(PLAN, init_params(SPEC, 0))
MODEL_ENV = {"DILOCO_D_MODEL": "32", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "4", "DILOCO_D_FF": "64",
             "DILOCO_SEQ_LEN": "32", "DILOCO_NUM_FRAGMENTS": "4"}


# -- helpers ---------------------------------------------------------------------------------------


async def bootstrap(js):
    """Create the run (version 0 from seed 0, then the manifest), as `diloco run create` does."""
    from bus.runs import read_manifest

    await create_builtin_run(js, CommonConfig(run=RUN), MC)
    return await read_manifest(js, RUN)


def learner_env(server, **kw) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(MODEL_ENV)
    env.update(DILOCO_NATS_URL=server.url, DILOCO_RUN=RUN, DILOCO_MODE="synthetic", DILOCO_BATCH_SIZE="4",
               DILOCO_DATA_MAX_BYTES="200000", DILOCO_HEARTBEAT_INTERVAL="0.2", DILOCO_METRICS_INTERVAL="0.3",
               DILOCO_MANIFEST_TIMEOUT="20", JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               DILOCO_FINAL_WAIT="0")  # most of these learners have no aggregator to wait for
    env.update({f"DILOCO_{k.upper()}": str(v) for k, v in kw.items()})
    return env


def configs(server, **kw) -> tuple[CommonConfig, ModelConfig, LearnerConfig]:
    common = CommonConfig(nats_url=server.url, run=RUN, metrics_interval=0.3)
    base = dict(mode="synthetic", batch_size=4, heartbeat_interval=0.2, manifest_timeout=20.0,
                final_wait=0.0)  # most of these learners have no aggregator to wait for
    base.update(kw)
    return common, MC, LearnerConfig(**base)


class Proc:
    """A child process (``python -m <module>``) whose output lines are collected."""

    def __init__(self, env: dict, module: str = "learner", args: tuple = ()):
        self.env, self.module, self.args = env, module, args
        self.out: list[str] = []
        self.err: list[str] = []
        self.proc = None
        self._readers: list[asyncio.Task] = []

    async def start(self) -> "Proc":
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module, *self.args, env=self.env, cwd=str(ROOT),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        self._readers = [asyncio.create_task(self._read(self.proc.stdout, self.out)),
                         asyncio.create_task(self._read(self.proc.stderr, self.err))]
        return self

    @staticmethod
    async def _read(stream, into: list[str]) -> None:
        async for line in stream:
            into.append(line.decode(errors="replace").rstrip("\n"))

    async def wait(self, timeout: float) -> int:
        rc = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.gather(*self._readers)
        return rc

    async def stop(self, timeout: float = 10.0) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        return await self.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()

    def events(self) -> list[dict]:
        out = []
        for line in self.err:
            try:
                out.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                pass
        return out


class Sniff:
    """Collects (receive time, decoded JSON) of a core NATS subject."""

    def __init__(self):
        self.msgs: list[tuple[float, dict]] = []

    async def start(self, nc, subject: str) -> "Sniff":
        async def cb(m):
            self.msgs.append((time.monotonic(), orjson.loads(m.data)))

        await nc.subscribe(subject, cb=cb)
        return self

    async def wait_for(self, pred, timeout: float = 15.0) -> dict:
        t_end = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < t_end:
            for _, m in self.msgs[seen:]:
                if pred(m):
                    return m
            seen = len(self.msgs)
            await asyncio.sleep(0.05)
        raise AssertionError(f"no matching message in {timeout}s; last: {self.msgs[-1:]}")


class GradSniff:
    """Outer-gradient chunks seen on the grad subjects (core subscription: survives restarts)."""

    def __init__(self):
        self.metas: list[dict] = []

    async def start(self, nc) -> "GradSniff":
        async def cb(m):
            if not m.headers:  # a waiting learner's store probe (Subjects.grad_probe)
                return
            h = orjson.loads(m.headers[CHUNK_HEADER])
            if h["i"] == 0:
                self.metas.append(h["m"])

        await nc.subscribe(S.grad_all, cb=cb)
        return self

    async def wait_count(self, n: int, pred=lambda m: True, timeout: float = 15.0) -> list[dict]:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            got = [m for m in self.metas if pred(m)]
            if len(got) >= n:
                return got
            await asyncio.sleep(0.05)
        raise AssertionError(f"only {len([m for m in self.metas if pred(m)])} of {n} gradients in {timeout}s")


async def consume_grads(js, n: int, timeout: float = 60.0) -> list[Assembled]:
    cons = ChunkConsumer(js, S.stream("grad"), "test", [S.grad_fragment_filter(p) for p in range(MC.num_fragments)])
    await cons.start()
    got: list[Assembled] = []
    t_end = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < t_end:
        for r in await cons.poll(timeout=0.3):
            assert isinstance(r, Assembled), r
            got.append(r)
            await ack_all(r.tokens)
    await cons.unsubscribe()
    return got


async def put_version(js, p: int, version: int, vec: np.ndarray, **meta) -> None:
    store = VersionedStore(js, RUN, GLOBAL)
    await store.put(p, version, codec.encode_array(np.asarray(vec, np.float32)),
                    {"model": spec_hash(SPEC), "plan": PLAN.plan_hash(), **meta})


def versions_of(hb: dict) -> dict[int, int]:
    return {int(k): v for k, v in hb["versions"].items()}


# -- (a) real JAX learner publishes outer-gradient fragments --------------------------------------


async def _twelve_steps_of_one_learner(nats_server, js, **env) -> list:
    """A real JAX learner process, H=4 over P=4 fragments for 12 steps; its 15 outer gradients. No
    aggregator merges them: the sync window is off (every due sync goes out; the window's own test is
    test_with_nothing_merged_a_learner_defers_and_its_final_sync_sends_every_step)."""
    # slowdown: each step ~30x its compute (a few ms -> tens of ms), so a publish is done before its
    # fragment is due again: on a loaded machine one still in flight was skipped (its work carried
    # into the next sync: 9 outer gradients instead of 15, seen once in the suite under load)
    proc = await Proc(learner_env(nats_server, mode="async", learner_id="learner-1", sync_every=4, max_steps=12,
                                  warmup_steps=0, total_steps=100, sync_window=0, slowdown=30, **env)).start()
    try:
        # 12 steps of 30x their compute: 5-10 s at idle, 60 s once with two CPU hogs beside a suite
        # (the slowdown multiplies a loaded machine's compute too); the callers' timeouts allow it
        assert await proc.wait(180) == 0, "\n".join(proc.err[-20:])
    finally:
        proc.kill()
    return await consume_grads(js, 15)


@pytest.mark.timeout(300)
async def test_jax_learner_publishes_outer_gradients(nats_server, js):
    await bootstrap(js)
    metrics = await Sniff().start(js._nc, S.metrics("learner", "learner-1"))
    grads = await _twelve_steps_of_one_learner(nats_server, js, quantiser="int8", error_feedback=1)
    # 12 steps, H = 4, P = 4: one fragment per step, then the final sync of fragments 1-3 (their
    # 3, 2 and 1 steps since their last sync; fragment 0 synced at step 12)
    assert len(grads) == 15
    incs = set()
    by_frag: dict[int, list] = {}
    for g in grads:
        meta = parse_grad_meta(g.meta)
        assert meta["run"] == RUN and meta["model"] == spec_hash(SPEC) and meta["learner"] == "learner-1"
        assert meta["base"] == 0  # nobody merged: every contribution is against version 0
        assert meta["tokens"] == meta["steps"] * 4 * 32
        incs.add(meta["inc"])
        by_frag.setdefault(meta["frag"], []).append(meta)
        delta = codec.decode_array(g.blob)
        assert delta.shape == (PLAN.sizes[meta["frag"]],)
        assert np.all(np.isfinite(delta)) and np.abs(delta).max() > 0
        assert np.abs(delta).max() < 1.0  # a few AdamW steps of lr <= 1e-3 from the global params
        # <run>.<learner>.<incarnation>.<fragment>.<round>.<secret nonce of this process>
        prefix = f"{RUN}.learner-1.{meta['inc']}.{meta['frag']}.{meta['round']}."
        assert g.obj_id.startswith(prefix) and len(g.obj_id) == len(prefix) + 12
    assert len(incs) == 1 and len(next(iter(incs))) == 12
    for p, metas in by_frag.items():
        metas.sort(key=lambda m: m["round"])
        # fragment p first syncs at step offset_p = p (p = 0: at step H = 4), then every 4 steps;
        # the final sync sends the rest, so every step of every fragment is sent exactly once
        assert [m["steps"] for m in metas] == ([4, 4, 4] if p == 0 else [p, 4, 4, 4 - p])
        assert [m["round"] for m in metas] == list(range(len(metas)))
        # the final sync says so (a run without a monitor stops waiting for this learner): only it
        assert [m.get("final", 0) for m in metas] == ([0, 0, 0] if p == 0 else [0, 0, 0, 1])
    last = metrics.msgs[-1][1]
    assert last["step"] == 12 and last["contributions"] == 15 and last["mode"] == "async"
    assert last["bytes_sent"] == sum(len(g.blob) for g in grads)
    # a fresh run (every fragment at version 0): built from the manifest's seed, nothing downloaded
    assert last["bytes_received"] == 0 and last["rss_mib"] > 0 and last["loss"] < 5.6
    assert 0 < last["quant_error"] < 0.1 and last["step_seconds_total"] > 0


@pytest.mark.timeout(300)
async def test_a_jax_learner_sends_sparse_outer_gradients_with_its_codec_settings(nats_server, js):
    """DILOCO_QUANTISER=topk2 with its chunk and k: every blob is that sparse codec, at most k values
    of every chunk, and the first round of a fragment sends its k largest (no residual yet)."""
    from bus import sparse

    await bootstrap(js)
    grads = await _twelve_steps_of_one_learner(nats_server, js, quantiser="topk2", topk_chunk=256, topk_k=8,
                                               feedback_decay=0.95)
    assert len(grads) == 15
    for g in grads:
        h, _ = codec.decode_header(g.blob)
        assert (h["q"], h["b"], h["k"]) == ("topk2", 256, 8)
        meta = parse_grad_meta(g.meta)
        n = PLAN.sizes[meta["frag"]]
        delta = np.asarray(codec.decode_array(g.blob))
        assert delta.shape == (n,) and np.all(np.isfinite(delta))
        nz = np.count_nonzero(delta)
        assert 0 < nz <= sparse.layout(n, 256, 8)[1]
        assert len(g.blob) < 0.1 * 4 * n  # under a tenth of fp32


async def test_delta_is_base_minus_theta_exactly(nats_server, js):
    """In-process, fp32 and H = 1, no new global version: every contribution holds only the progress
    since the previous one, so the contributions of a fragment add up to v0 - theta_final and the
    first is v0 - theta_1 (no work is sent twice)."""
    from learner.service import Learner

    await bootstrap(js)
    # step_time leaves every publish time to finish: a fragment still in flight when due is skipped;
    # nothing is merged (no aggregator), so the sync window is off: every due sync goes out
    common, model, cfg = configs(nats_server, sync_every=1, max_steps=5, step_time=0.1, quantiser="fp32",
                                 error_feedback=False, sync_window=0)
    learner = Learner(common, model, cfg)
    assert await learner.run() == 0
    grads = await consume_grads(js, 20)
    assert len(grads) == 20
    total = {p: np.zeros_like(V0[p], dtype=np.float64) for p in range(4)}
    rounds = {p: [] for p in range(4)}
    for g in grads:
        m = g.meta
        assert m["steps"] == 1 and m["base"] == 0
        total[m["frag"]] += codec.decode_array(g.blob)
        rounds[m["frag"]].append(m["round"])
    for p in range(4):
        assert sorted(rounds[p]) == list(range(rounds[p][0], rounds[p][0] + 5))
        np.testing.assert_allclose(total[p], V0[p] - learner.backend.frags[p], rtol=1e-5, atol=1e-6)
        # the sum of 5 separate steps' progress is not 5 x the full progress (the old double counting)
        assert np.abs(total[p]).sum() < 2 * np.abs(V0[p] - learner.backend.frags[p]).sum()
    assert learner.book.contributions == 20 and learner.quant_error == 0.0
    assert learner.book.counters()["skipped"] == 0


async def test_the_work_of_a_failed_publish_joins_the_next_outer_gradient(nats_server, js, monkeypatch):
    """A publish that fails for good gives its outer gradient back (decoded from its blob, which is
    all the learner keeps of it in flight): the fragment's next contribution carries it, so the
    contributions that did go out still add up to v0 - theta_final."""
    from bus.transport import ChunkPublisher
    from learner.service import Learner

    await bootstrap(js)
    real = ChunkPublisher.publish
    failed = []

    async def flaky(self, subject, obj_id, blob, meta):
        if ".grad.0." in subject and not failed:
            failed.append(obj_id)
            raise ConnectionError("injected: the first outer gradient of fragment 0 does not go out")
        return await real(self, subject, obj_id, blob, meta)

    monkeypatch.setattr(ChunkPublisher, "publish", flaky)
    common, model, cfg = configs(nats_server, sync_every=1, max_steps=5, step_time=0.1, quantiser="fp32",
                                 error_feedback=False, sync_window=0)  # no aggregator: every due sync goes out
    learner = Learner(common, model, cfg)
    assert await learner.run() == 0
    assert len(failed) == 1
    grads = await consume_grads(js, 19)
    assert len(grads) == 19  # 20 syncs, one of them lost on the way and given back
    total = {p: np.zeros_like(V0[p], dtype=np.float64) for p in range(4)}
    steps = {p: 0 for p in range(4)}
    for g in grads:
        total[g.meta["frag"]] += codec.decode_array(g.blob)
        steps[g.meta["frag"]] += g.meta["steps"]
    for p in range(4):
        np.testing.assert_allclose(total[p], V0[p] - learner.backend.frags[p], rtol=1e-5, atol=1e-6)
    assert learner.unsent == [None] * 4 and not learner._sent


async def test_with_nothing_merged_a_learner_defers_and_its_final_sync_sends_every_step(nats_server, js):
    """The sync window (issue 37) with no aggregator: each fragment's first round goes out, every later
    due sync is deferred (its round is never merged), the learner says so once, and the final sync
    sends the rest, so every step of every fragment is still sent exactly once."""
    from learner.service import Learner

    await bootstrap(js)
    common, model, cfg = configs(nats_server, sync_every=2, max_steps=10, step_time=0.05, quantiser="fp32",
                                 error_feedback=False)
    learner = Learner(common, model, cfg)
    assert await learner.run() == 0
    grads = await consume_grads(js, 8)
    assert len(grads) == 8  # 4 fragments: a first round each, then one final sync each
    by_frag: dict[int, list] = {}
    total = {p: np.zeros_like(V0[p], dtype=np.float64) for p in range(4)}
    for g in grads:
        by_frag.setdefault(g.meta["frag"], []).append(g.meta)
        total[g.meta["frag"]] += codec.decode_array(g.blob)
    for p in range(4):
        steps = [m["steps"] for m in sorted(by_frag[p], key=lambda m: m["round"])]
        first = 2 if p in (0, 1) else 1  # offsets floor(p H / P) = 0, 0, 1, 1 (0: first due at H)
        assert steps == [first, 10 - first], (p, steps)
        np.testing.assert_allclose(total[p], V0[p] - learner.backend.frags[p], rtol=1e-5, atol=1e-6)
    c = learner.book.counters()
    assert c["deferred"] == 4 and learner._told_behind  # one deferral per fragment, said once
    assert c["holds"] == 0  # no monitor and nothing of it merged: nothing to hold for


async def test_without_a_monitor_a_learner_holds_once_its_work_is_merged(nats_server, js):
    """No monitor (no membership record): once a head lists one of its rounds, the aggregator merges
    this learner's work, so a sync deferred for a period holds its steps (DILOCO_SYNC_HOLD) as an
    admitted learner's does. Before the eighth round it never held there, and a lagging aggregator
    let it train alone for up to 16 periods (the guard test +22.0% in one suite run)."""
    from learner.service import Learner

    await bootstrap(js)
    common, model, cfg = configs(nats_server, sync_every=2, max_steps=24, step_time=0.02, quantiser="fp32",
                                 error_feedback=False, sync_timeout=0.5)
    learner = Learner(common, model, cfg)

    async def merge_first_round_of_fragment_0() -> None:
        for g in await consume_grads(js, 4, timeout=30):  # every fragment's first round
            if g.meta["frag"] == 0:
                await put_version(js, 0, 1, V0[0], applied=[[g.meta["learner"], g.meta["inc"], 0, g.meta["round"]]])
                return
        raise AssertionError("no outer gradient of fragment 0")

    rc, _ = await asyncio.gather(learner.run(), merge_first_round_of_fragment_0())
    assert rc == 0
    c = learner.book.counters()
    # fragment 0's next round is never merged (nothing else merges): its deferred sync holds the
    # steps for DILOCO_SYNC_TIMEOUT, then trains on; the other fragments were never merged
    assert c["holds"] >= 1 and c["holds_expired"] >= 1 and learner.held_s >= 0.4, c
    assert learner.book.merged_any() and learner.merges_reach


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_a_learner_waiting_for_the_aggregator_learns_of_a_full_store_and_says_so_once(nats_server, js,
                                                                                          monkeypatch, mode):
    """A learner whose steps are held for the aggregator's merge (or, in sync mode, that waits for
    its round's merge) writes nothing, so a store that filled after its last stored write went
    unsaid: in the nineteenth round's CI one learner of the full-disk test said nothing for 40 s
    (its round was stored just before the disk filled; the aggregator then could not merge it). Now
    it writes a probe on its own GRAD subject once no write was stored for STORE_IDLE_PROBE s while
    it waits: the store's refusal is said once (``store_full``), and ``store_writable`` when a probe
    is stored again. The refusal is the one a server at its max_file_store answers (10023), put on
    this learner's writes to GRAD."""
    from nats.js.errors import ServiceUnavailableError

    from bus import store_health
    from learner.service import Learner

    monkeypatch.setattr("learner.service.STORE_IDLE_PROBE", 0.5)
    await bootstrap(js)
    common, model, cfg = configs(nats_server, sync_every=2, max_steps=100_000, step_time=0.02, quantiser="fp32",
                                 error_feedback=False, sync_timeout=60,
                                 **({"mode": "sync", "compute": "synthetic"} if mode == "sync" else {}))
    learner = Learner(common, model, cfg)
    said: list[tuple[str, dict]] = []
    log = learner.store_watch.log

    class Log:  # the learner's own log, and what its store watch said
        def __getattr__(self, level):
            def emit(event, **kw):
                said.append((event, kw))
                getattr(log, level)(event, **kw)
            return emit

    learner.store_watch.log = Log()
    learner.store_watch.health.probe_every = 0.5
    full = {"on": False}
    stop = asyncio.Event()
    run = asyncio.create_task(learner.run(stop))

    def waiting() -> bool:
        # and none of its publishes out: an acknowledgement of a write sent before the store "fills"
        # here would say it writes again (a sync-mode learner waits for its publishes first; under
        # the whole suite's load one was still out: store_full, store_writable, store_full)
        held = bool(learner.book.holding()) if mode == "async" else bool(learner._awaiting)
        return held and not learner.book.inflight()

    try:
        if mode == "async":
            for g in await consume_grads(js, 4, timeout=30):  # every fragment's first round; fragment 0's merged
                if g.meta["frag"] == 0:
                    await put_version(js, 0, 1, V0[0],
                                      applied=[[g.meta["learner"], g.meta["inc"], 0, g.meta["round"]]])
                    break
            else:
                raise AssertionError("no outer gradient of fragment 0")
        # async: its next round of fragment 0 is never merged (held); sync: no round is ever merged
        await _until(waiting)
        assert waiting(), learner.book.counters()
        real, real_async = learner.js.publish, learner.js.publish_async

        def refused(subject: str) -> bool:
            return full["on"] and subject.startswith(f"{S.prefix}.grad.")

        async def publish(subject, payload=b"", **kw):
            if refused(subject):
                raise ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources")
            return await real(subject, payload, **kw)

        async def publish_async(subject, payload=b"", **kw):
            if refused(subject):
                raise ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources")
            return await real_async(subject, payload, **kw)

        learner.js.publish, learner.js.publish_async = publish, publish_async
        full["on"] = True
        await _until(lambda: learner.store_watch.faulted, 10)
        assert learner.store_watch.faulted, said
        assert waiting() and learner.book.counters()["holds_expired"] == 0  # said while waiting
        await asyncio.sleep(1.5)  # several probes, all refused: said once
        assert [e for e, _ in said] == ["store_full"], said
        assert said[0][1]["reason"] == store_health.FULL and said[0][1]["server"] == "insufficient resources"
        assert learner.store_watch.health.refused >= 2
        full["on"] = False  # the next probe is stored
        await _until(lambda: not learner.store_watch.faulted, 10)
        assert [e for e, _ in said] == ["store_full", "store_writable"], said
        probe = await js.get_last_msg(S.stream("grad"), S.grad_probe(learner.id))
        assert len(probe.data) == store_health.PROBE_BYTES
        assert learner.metrics()["store_faults"] == 1
    finally:
        full["on"] = False  # (a publish still refused would be retried past the stop)
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0


async def test_the_phase_lock_moves_a_learners_syncs_by_its_lead_in_each_merge(nats_server, js):
    """DILOCO_PHASE_LOCK: each head states its learners' leads over the round's phase, every syncing
    learner's arrival (``aggregator.quorum.arrival_leads``); the learner moves its syncs by its share of its own, at
    most half a round, once per version. Here each lead is over half a round (4 steps of 20 ms), so
    each head moves it by exactly gain x period / 2 / fragments = 0.25 steps."""
    from learner.service import Learner

    await bootstrap(js)
    common, model, cfg = configs(nats_server, sync_every=4, max_steps=100_000, step_time=0.02, quantiser="fp32",
                                 error_feedback=False, phase_lock=0.5)
    learner = Learner(common, model, cfg)
    stop = asyncio.Event()
    run = asyncio.create_task(learner.run(stop))
    try:
        await _until(lambda: learner.book.step >= 8)
        me = [learner.id, learner.incarnation]
        await put_version(js, 0, 1, V0[0], lead=[[*me, 5.0], ["other", "x", -5.0]])  # early: later syncs
        await _until(lambda: learner.book.phase_shifted != 0)
        assert learner.book.phase_shifted == pytest.approx(0.25)
        await put_version(js, 1, 1, V0[1], lead=[["other", "x", 1.0]])  # a merge without this learner
        await put_version(js, 0, 2, V0[0], lead=[[*me, -5.0]])  # late: earlier syncs
        await _until(lambda: learner.book.phase_shifted != 0.25)
        assert learner.book.phase_shifted == pytest.approx(0.0)
        assert learner.metrics()["phase_shifted"] == 0.0
    finally:
        stop.set()
        assert await asyncio.wait_for(run, 30) == 0


# -- (b) heartbeats keep flowing during long steps; SIGTERM stops a learner promptly ---------------


async def test_heartbeats_flow_during_a_long_step_and_sigterm_stops(nats_server, js):
    await bootstrap(js)
    hbs = await Sniff().start(js._nc, S.heartbeat("learner-2"))
    # a first step of 30 s (10 s x slowdown 3): a stop that waited for it would take over 25 s, an
    # interrupted one takes a process's exit (3.1 s once at load ~8, against a 3 s step before)
    proc = await Proc(learner_env(nats_server, learner_id="learner-2", step_time=10.0, slowdown=3.0,
                                  heartbeat_interval=0.25)).start()
    try:
        await hbs.wait_for(lambda m: True, timeout=15)
        t0 = time.monotonic()
        await asyncio.sleep(2.4)
        window = [(t, m) for t, m in hbs.msgs if t >= t0 - 0.3]
        assert all(m["step"] == 0 for _, m in window)  # still inside the first step
        gaps = np.diff([t for t, _ in window])
        assert len(window) >= 9 and gaps.max() < 0.5, gaps
        hb = window[-1][1]
        assert hb["learner"] == "learner-2" and hb["region"] == "local" and versions_of(hb) == {0: 0, 1: 0, 2: 0, 3: 0}
        t_stop = time.monotonic()
        assert await proc.stop(20) == 0
        assert time.monotonic() - t_stop < 15.0  # the synthetic step is interrupted, not waited for
        assert any(e.get("event") == "stop_requested" for e in proc.events())
    finally:
        proc.kill()


# -- (c) a learner survives a NATS restart and carries on -----------------------------------------


async def test_learner_survives_nats_restart(nats_server, js):
    await bootstrap(js)
    grads = await GradSniff().start(js._nc)
    hbs = await Sniff().start(js._nc, S.heartbeat("learner-3"))
    proc = await Proc(learner_env(nats_server, learner_id="learner-3", step_time=0.02, sync_every=2)).start()
    try:
        before = await grads.wait_count(4)
        inc = before[0]["inc"]
        nats_server.kill()
        await asyncio.sleep(1.0)
        nats_server.start()
        mark = len(grads.metas)
        after = await grads.wait_count(6, pred=lambda m: grads.metas.index(m) >= mark, timeout=20)
        assert {m["inc"] for m in after} == {inc}  # the same process carried on
        rounds = {}
        for m in grads.metas:
            rounds.setdefault(m["frag"], []).append(m["round"])
        assert max(max(r) for r in rounds.values()) > max(m["round"] for m in before)
        # it still follows global versions after the restart
        js2 = js._nc.jetstream(timeout=10)
        await put_version(js2, 0, 1, V0[0])
        hb = await hbs.wait_for(lambda m: versions_of(m).get(0) == 1, timeout=20)
        assert hb["incarnation"] == inc
        assert proc.proc.returncode is None
        assert await proc.stop() == 0
        events = [e.get("event") for e in proc.events()]
        assert "nats_disconnected" in events and "nats_reconnected" in events
        # one line per change of state, not two per failed reconnect attempt (bus.conn.ConnectionLog)
        conn_lines = [e for e in events if e and e.startswith("nats_")]
        assert len(conn_lines) <= 3 * events.count("nats_disconnected") + 2 and "nats_error" not in events, conn_lines
    finally:
        proc.kill()


# -- (d) late start from the newest versions, (f) newer versions are mixed in ----------------------


async def test_late_learner_starts_from_newest_and_mixes_in_new_versions(nats_server, js):
    await bootstrap(js)
    for p in range(4):
        await put_version(js, p, 5, V0[p] + 1.0)
    grads = await GradSniff().start(js._nc)
    hbs = await Sniff().start(js._nc, S.heartbeat("learner-4"))
    proc = await Proc(learner_env(nats_server, learner_id="learner-4", step_time=0.03, sync_every=4,
                                  quantiser="fp32")).start()
    try:
        hb = await hbs.wait_for(lambda m: True)
        assert versions_of(hb) == {0: 5, 1: 5, 2: 5, 3: 5}
        first = (await grads.wait_count(1))[0]
        assert first["base"] == 5
        # a newer global version of fragment 1, far from the learner's parameters
        await put_version(js, 1, 6, np.full(PLAN.sizes[1], 3.0, np.float32))
        hb = await hbs.wait_for(lambda m: versions_of(m).get(1) == 6)
        assert versions_of(hb)[0] == 5
        await grads.wait_count(1, pred=lambda m: m["frag"] == 1 and m["base"] == 6)
        assert await proc.stop() == 0
    finally:
        proc.kill()
    # deltas are small against their base: the learner trained from v5 (v0 + 1) and from v6 (all 3.0),
    # not from its own init or a mix of old and new (mix_alpha = 0 overwrites)
    cons = await consume_grads(js, len(grads.metas))
    assert cons
    for g in cons:
        d = codec.decode_array(g.blob)
        assert g.meta["base"] in (5, 6) and np.abs(d).max() < 0.2, (g.meta, np.abs(d).max())


# -- (e) a learner of another model refuses to start --------------------------------------------


@pytest.mark.parametrize("env,needle", [({"d_model": 64}, "model spec hash"),
                                        ({"num_fragments": 3}, "fragment plan")])
async def test_run_mismatch_exits_with_one_clear_line(nats_server, js, env, needle):
    await bootstrap(js)
    proc = await Proc(learner_env(nats_server, learner_id="learner-5", **env)).start()
    try:
        assert await proc.wait(20) == 3
    finally:
        proc.kill()
    plain = [line for line in proc.err if not line.startswith("{")]
    assert len(plain) == 1, proc.err
    assert plain[0].startswith("diloco learner learner-5: refusing to start:") and needle in plain[0]


# -- (g) evicted while alive: resynchronise -------------------------------------------------------


async def test_eviction_triggers_resync(nats_server, js):
    from learner.service import Learner

    await bootstrap(js)
    common, model, cfg = configs(nats_server, learner_id="learner-6", step_time=0.02, sync_every=2,
                                 quantiser="int8", error_feedback=True, mix_alpha=0.5, max_steps=100000)
    learner = Learner(common, model, cfg)
    seen: dict = {}
    orig = learner._resync

    async def spy():
        await orig()
        seen.update(residual=list(learner.residual), frags=[f.copy() for f in learner.backend.frags],
                    versions=learner.book.versions())

    learner._resync = spy
    metrics = await Sniff().start(js._nc, S.metrics("learner", "learner-6"))
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    try:
        t_end = time.monotonic() + 15
        while not all(r is not None for r in learner.residual) and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        assert all(r is not None for r in learner.residual)
        newest = [V0[p] + 0.5 for p in range(4)]
        for p in range(4):
            await put_version(js, p, 2, newest[p])
        kv = await js.key_value(S.bucket("members"))

        def record(inc: str) -> bytes:
            now = time.time()
            return orjson.dumps(member_to_dict(Member("learner-6", "local", State.EVICTED, now, now, "silent", inc)))

        await kv.put("learner-6", record("previous-life"))  # a record of an earlier process: no resync
        await asyncio.sleep(0.6)
        assert learner.book.resyncs == 0 and learner.member_state == "evicted"
        await kv.put("learner-6", record(learner.incarnation))
        while "versions" not in seen and time.monotonic() < t_end + 10:
            await asyncio.sleep(0.02)
        assert seen["versions"] == {0: 2, 1: 2, 2: 2, 3: 2}
        assert all(r is None for r in seen["residual"])
        for p in range(4):  # overwritten with the newest version, not mixed (alpha 0.5)
            np.testing.assert_array_equal(seen["frags"][p], newest[p])
        m = await metrics.wait_for(lambda m: m["resyncs"] == 1)
        assert m["state"] == "evicted" and m["incarnation"] == learner.incarnation
        assert learner.book.resyncs == 1
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


# -- synchronous mode: wait for the merged version listing our contribution ----------------------


async def test_sync_mode_waits_for_the_merged_version(nats_server, js):
    from learner.service import Learner

    await bootstrap(js)
    common, model, cfg = configs(nats_server, learner_id="learner-7", mode="sync", compute="synthetic", sync_every=2,
                                 step_time=0.0, sync_timeout=1.5, quantiser="fp32", max_steps=100000)
    learner = Learner(common, model, cfg)
    grads = await GradSniff().start(js._nc)
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    versions = {p: 0 for p in range(4)}
    try:
        # play the aggregator for 2 rounds: sync mode sends every fragment every H = 2 steps, then
        # waits until each one is applied by a global version
        for rnd in range(2):
            metas = (await grads.wait_count(4 * (rnd + 1)))[4 * rnd:]
            assert sorted(m["frag"] for m in metas) == [0, 1, 2, 3] and {m["round"] for m in metas} == {rnd}
            for i, m in enumerate(metas):
                await asyncio.sleep(0.1)
                assert learner.book.step == 2 * (rnd + 1)  # blocked until all four are merged
                p = m["frag"]
                versions[p] += 1
                # the aggregator's form [learner, inc, fragment, round]; the short form works too
                key = [m["learner"], m["inc"], p, m["round"]] if i % 2 else [m["learner"], m["inc"], m["round"]]
                await put_version(js, p, versions[p], V0[p], applied=[["other", "x", p, 0], key])
        await grads.wait_count(9)  # the third round started
        assert learner.book.versions() == versions and learner.sync_timeouts == 0
        assert learner.blocked_s >= 8 * 0.1
        # nobody answers: the learner waits sync_timeout, then goes on
        t0 = time.monotonic()
        await grads.wait_count(16, timeout=10)
        assert time.monotonic() - t0 >= 1.0 and learner.sync_timeouts == 4
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


class FlakyReads:
    """The real global reader, whose first read of fragment ``fragment`` at version >= 1 fails as a
    request to a restarting server does (a nats timeout): the download of a new version fails for
    the link, not for the version."""

    def __init__(self, monkeypatch, fragment: int, always: int | None = None):
        """``always``: every read of this version of the fragment fails (no server answers for it)."""
        from bus.global_reader import GlobalReader

        self.failed: list[int] = []
        self.reads: list[int] = []
        real = GlobalReader.read

        async def read(reader, head):
            if head.fragment == fragment and head.version >= 1:
                self.reads.append(head.version)
                if not self.failed or head.version == always:
                    self.failed.append(head.version)
                    import nats.errors

                    raise nats.errors.TimeoutError
            return await real(reader, head)

        monkeypatch.setattr(GlobalReader, "read", read)


async def _learner_on_its_way(nats_server, js, learner_id: str, **kw):
    """A synthetic learner of the bootstrapped run, running, with a sniffer of its outer gradients."""
    from learner.service import Learner

    common, model, cfg = configs(nats_server, learner_id=learner_id, compute="synthetic", sync_every=4,
                                 step_time=0.02, quantiser="fp32", max_steps=100000, **kw)
    learner = Learner(common, model, cfg)
    grads = await GradSniff().start(js._nc)
    stop = asyncio.Event()
    return learner, grads, stop, asyncio.create_task(learner.run(stop))


async def _until(pred, timeout: float = 20.0) -> None:
    t_end = time.monotonic() + timeout
    while not pred() and time.monotonic() < t_end:
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode,fetch", [("async", "round"), ("async", "every"), ("sync", "round")])
async def test_a_version_whose_download_failed_for_the_link_is_downloaded_again(nats_server, js, monkeypatch,
                                                                               mode, fetch):
    """A download that fails for the link or the server (a timeout) is tried again at the next step
    boundary or pass of a wait, whatever the fetch policy; before, fetch=every and synchronous mode
    dropped the version until the next head (a synchronous learner then waited DILOCO_SYNC_TIMEOUT
    for a version it had been told of), and the version is not refused."""
    await bootstrap(js)
    flaky = FlakyReads(monkeypatch, fragment=1)
    learner, grads, stop, task = await _learner_on_its_way(nats_server, js, "learner-9", mode=mode, fetch=fetch,
                                                           sync_timeout=30.0)
    try:
        metas = await grads.wait_count(4, timeout=30)  # the first round of every fragment
        for m in metas:  # version 1 of each fragment, merging this learner's round
            key = [m["learner"], m["inc"], m["frag"], m["round"]]
            await put_version(js, m["frag"], 1, V0[m["frag"]] + 0.01, applied=[key])
        await _until(lambda: learner.book.versions() == {p: 1 for p in range(4)})
        assert learner.book.versions() == {p: 1 for p in range(4)}, (learner.book.versions(), flaky.reads)
        assert flaky.failed == [1] and flaky.reads.count(1) >= 2  # failed once, then downloaded
        assert learner.fetch_retries.failures == 1 and learner.rejected_globals == {}
        assert learner.sync_timeouts == 0
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


@pytest.mark.parametrize("fetch", ["round", "every"])
async def test_a_version_no_server_answers_for_is_refused_after_the_sync_timeout(nats_server, js, monkeypatch, fetch):
    """Tried again, but not for the whole run: a head whose download fails for DILOCO_SYNC_TIMEOUT
    seconds (a forged one no server answers for) is refused as ``unfetchable``, and the next
    version is taken."""
    await bootstrap(js)
    flaky = FlakyReads(monkeypatch, fragment=1, always=1)
    learner, grads, stop, task = await _learner_on_its_way(nats_server, js, "learner-10", fetch=fetch,
                                                           sync_timeout=1.0)
    try:
        m = next(m for m in await grads.wait_count(4, timeout=30) if m["frag"] == 1)
        await put_version(js, 1, 1, V0[1] + 0.01, applied=[[m["learner"], m["inc"], 1, m["round"]]])
        await _until(lambda: learner.rejected_globals.get("unfetchable", 0) > 0)
        assert learner.rejected_globals == {"unfetchable": 1} and flaky.reads.count(1) >= 2, flaky.reads
        tried = flaky.reads.count(1)
        await put_version(js, 1, 2, V0[1] + 0.02)
        await _until(lambda: learner.book.versions()[1] == 2)
        assert learner.book.versions()[1] == 2
        await asyncio.sleep(0.3)
        assert flaky.reads.count(1) == tried  # not tried again once refused
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


# -- evaluator -------------------------------------------------------------------------------------


async def test_eval_once_prints_heldout_loss_of_version_0(nats_server, js):
    await bootstrap(js)
    proc = await Proc(learner_env(nats_server, eval_batches=2, eval_batch_size=4), module="learner.evaluator",
                      args=("--once",)).start()
    try:
        assert await proc.wait(60) == 0, "\n".join(proc.err[-10:])
    finally:
        proc.kill()
    assert len(proc.out) == 1
    rec = orjson.loads(proc.out[0])
    assert rec["role"] == "evaluator" and rec["run"] == RUN and rec["version"] == 0
    assert rec["versions"] == {"0": 0, "1": 0, "2": 0, "3": 0}
    assert abs(rec["eval_loss"] - np.log(256)) < 0.1  # a fresh init ignores its input


async def _start_evaluator(nats_server, js, eval_id: str, eval_interval: float, sync_timeout: float = 120.0,
                           **common_over):
    """An in-process evaluator of the bootstrapped run, and a sniffer of its metrics subject."""
    from learner.evaluator import Evaluator

    await bootstrap(js)
    metrics = await Sniff().start(js._nc, S.metrics("evaluator", eval_id))
    common, model, lcfg = configs(nats_server, data_max_bytes=200000, sync_timeout=sync_timeout)
    common = dataclasses.replace(common, **common_over)
    ev = Evaluator(common, model, lcfg, EvalConfig(eval_id=eval_id, eval_interval=eval_interval, eval_batches=1,
                                                   eval_batch_size=4))
    stop = asyncio.Event()
    return metrics, ev, stop, asyncio.create_task(ev.run(stop))


async def test_evaluator_publishes_when_versions_change(nats_server, js):
    metrics, ev, stop, task = await _start_evaluator(nats_server, js, "ev", 0.2)
    try:
        first = await metrics.wait_for(lambda m: True, timeout=30)
        assert first["version"] == 0 and first["eval_id"] == "ev" and np.isfinite(first["eval_loss"])
        await asyncio.sleep(0.6)
        assert ev.evaluations == 1  # nothing changed: no new evaluation
        await put_version(js, 2, 1, np.zeros(PLAN.sizes[2], np.float32))
        m = await metrics.wait_for(lambda m: m["version"] == 1)
        assert m["versions"]["2"] == 1 and m["version_min"] == 0 and m["eval_loss"] != first["eval_loss"]
        assert m["rejected_globals"] == {}
        # a version of the wrong size is counted, not taken
        await put_version(js, 1, 4, np.zeros(PLAN.sizes[1] + 1, np.float32))
        await asyncio.sleep(0.3)
        await put_version(js, 3, 1, np.zeros(PLAN.sizes[3], np.float32))
        m = await metrics.wait_for(lambda m: m["versions"]["3"] == 1)
        assert m["versions"]["1"] == 0 and m["rejected_globals"] == {"bad_blob": 1}
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


async def test_evaluator_downloads_again_a_version_whose_download_failed_for_the_link(nats_server, js, monkeypatch):
    """A timed-out download is not the version's fault: the evaluator tries it again and evaluates
    it (before, it was refused as ``bad_blob`` and the fragment stayed at its old version until its
    next head)."""
    flaky = FlakyReads(monkeypatch, fragment=2)
    metrics, ev, stop, task = await _start_evaluator(nats_server, js, "ev3", 0.2)
    try:
        await metrics.wait_for(lambda m: True, timeout=30)
        await put_version(js, 2, 1, np.zeros(PLAN.sizes[2], np.float32))
        m = await metrics.wait_for(lambda m: m["versions"]["2"] == 1, timeout=10)
        assert flaky.failed == [1] and flaky.reads.count(1) >= 2
        assert m["rejected_globals"] == {} and m["fetch_failures"] == 1
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


async def test_evaluator_refuses_a_version_no_server_answers_for_after_the_sync_timeout(nats_server, js, monkeypatch):
    flaky = FlakyReads(monkeypatch, fragment=2, always=1)
    metrics, ev, stop, task = await _start_evaluator(nats_server, js, "ev4", 0.2, sync_timeout=1.0)
    try:
        await metrics.wait_for(lambda m: True, timeout=30)
        await put_version(js, 2, 1, np.zeros(PLAN.sizes[2], np.float32))
        m = await metrics.wait_for(lambda m: m["rejected_globals"].get("unfetchable") == 1, timeout=15)
        assert m["versions"]["2"] == 0 and flaky.reads.count(1) >= 2
        await put_version(js, 2, 2, np.zeros(PLAN.sizes[2], np.float32))
        await metrics.wait_for(lambda m: m["versions"]["2"] == 2, timeout=10)
        assert ev._retry == {}
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


async def test_evaluator_repeats_its_last_record_between_evaluations(nats_server, js):
    """Issue 16: `diloco metrics --once` (a 3 s window) showed no evaluator while one ran, because
    it published only when it evaluated (at most every DILOCO_EVAL_INTERVAL). Between evaluations
    the last record goes out again every DILOCO_METRICS_INTERVAL, with the time it was evaluated."""
    metrics, ev, stop, task = await _start_evaluator(nats_server, js, "ev2", 60.0, metrics_interval=0.2)
    try:
        first = await metrics.wait_for(lambda m: True, timeout=30)
        await asyncio.sleep(1.5)
        again = [m for _, m in metrics.msgs[1:]]
        assert len(again) >= 4, len(again)  # about every 0.2 s, far more often than every 60 s
        assert all(m["evaluated_at"] == first["ts"] and m["eval_loss"] == first["eval_loss"] for m in again)
        assert again[-1]["ts"] > first["ts"] + 1.0 and ev.evaluations == 1
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


# -- downlink: one download per fragment and own sync (DILOCO_FETCH=round) -------------------------


@pytest.mark.parametrize("fetch", ["round", "every"])
async def test_fetch_round_downloads_once_per_sync_after_the_delay(nats_server, js, fetch):
    from learner.service import Learner

    await bootstrap(js)
    common, model, cfg = configs(nats_server, learner_id="learner-8", compute="synthetic", sync_every=8,
                                 step_time=0.03, quantiser="fp32", max_steps=100000, fetch=fetch, fetch_delay=3)
    learner = Learner(common, model, cfg)
    grads = await GradSniff().start(js._nc)
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    p = 1
    size = len(codec.encode_array(V0[p]))
    taken: list[tuple[int, int]] = []  # (version, steps since the sync of fragment 1) at each download
    on_downloaded = learner.book.on_downloaded

    def spy(q, version):
        if q == p:
            taken.append((version, learner.book.frags[p].steps))
        on_downloaded(q, version)

    learner.book.on_downloaded = spy
    try:
        await grads.wait_count(1, pred=lambda m: m["frag"] == p)
        received0 = learner.store.bytes_received
        # 30 foreign versions of fragment 1 over ~1.5 s (the learner syncs it every 8 x 30 ms)
        for v in range(1, 31):
            await put_version(js, p, v, V0[p] + 0.001 * v)
            await asyncio.sleep(0.05)
        t_end = time.monotonic() + 10
        while learner.book.frags[p].base_version != 30 and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        assert learner.book.frags[p].base_version == 30
        downloads = (learner.store.bytes_received - received0) / size
        rounds = learner.book.frags[p].next_round
        assert downloads == int(downloads) == len(taken)  # nothing else was downloaded
        if fetch == "round":
            # one download per round, and one more per sync the window deferred: this learner is never
            # admitted (no monitor), and one not admitted takes the newest version when its sync is
            # deferred (its round is held until admission, which needs current versions)
            deferred = learner.book.frags[p].deferred
            assert 1 <= downloads <= rounds + deferred, (downloads, rounds, deferred)
            assert all(steps >= 3 for _, steps in taken), taken  # 3 steps after the sync
        else:
            assert downloads > rounds, (downloads, rounds)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


# -- DILOCO_START_WITH: start in step with the other learners ------------------------------------


async def test_start_with_waits_for_active_peers_then_gives_up_after_the_wait(nats_server, js):
    from learner.service import Learner

    await bootstrap(js)
    kv = await js.key_value(S.bucket("members"))

    def active(lid: str) -> bytes:
        now = time.time()
        return orjson.dumps(member_to_dict(Member(lid, "local", State.ACTIVE, now, now, "test", "inc")))

    # the test plays the monitor: nothing happens until two learners are active
    common, model, cfg = configs(nats_server, learner_id="learner-6", step_time=0.01, start_with=2, start_wait=30.0)
    learner = Learner(common, model, cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    try:
        await kv.put("learner-6", active("learner-6"))
        await kv.put("learner-7", orjson.dumps({**orjson.loads(active("learner-7")), "state": "joining"}))
        await asyncio.sleep(1.5)
        assert learner.book.step == 0
        await kv.put("learner-7", active("learner-7"))
        t_end = time.monotonic() + 10
        while learner.book.step == 0 and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        assert learner.book.step > 0 and learner.blocked_s >= 1.0  # it waited (its start-up ate a little of the 1.5 s)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
    # nobody else comes: it starts anyway once DILOCO_START_WAIT has passed
    common, model, cfg = configs(nats_server, learner_id="learner-8", step_time=0.01, start_with=5, start_wait=0.5)
    learner = Learner(common, model, cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    try:
        t_end = time.monotonic() + 10
        while learner.book.step == 0 and time.monotonic() < t_end:
            await asyncio.sleep(0.02)
        assert learner.book.step > 0 and 0.5 <= learner.blocked_s < 5
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
