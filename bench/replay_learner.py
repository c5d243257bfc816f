"""Replaying learners: stand-ins for synthetic learners that cost the machine almost no CPU.

A synthetic learner (``DILOCO_COMPUTE=synthetic``) sleeps instead of training, but still builds,
quantises and publishes real fragment vectors: two numpy passes over its parameters per step. With
16 of them on 2 cores the learners, not the aggregator, use the CPU (docs/BENCHMARKS.md, Scale).

Here every fragment's outer gradient is encoded ONCE per process with the real codec (``v`` and
``-v``, so replays alternate and the global parameters do not drift), split into chunk payloads and
its crc32 computed once. Each learner (an asyncio task with its own NATS connection, so the broker
sees one client per learner) then replays them on a real learner's schedule: fragment p at steps
``offset_p + j H`` (``offset_p = floor(p H / P)``, ``bus.fragments.sync_offsets``), one step every
``step_time`` seconds, from a random phase per learner; each time with fresh metadata
(``bus.protocol.grad_meta``: its learner id, incarnation, the next round, the newest global version
seen as base, H steps (the first time too: a replay is a whole round), H x tokens_per_step tokens,
period H) and a fresh object id. A fragment whose previous publish is still in flight is skipped
and its steps go with the next one, as a real learner does. Heartbeats every ``hb_interval`` carry
the versions seen, so the monitor admits the learners and the aggregator counts them. The values
are Gaussian with a per-element standard deviation of ``0.25 x max_inner_lr x H``: norm a quarter
of an AdamW learner moving every value by the full peak learning rate each step (the aggregator's
``norm_bound`` is 2x that, honest learners measured 0.63-0.75x), finite, float32 after decoding.

What it does not do: train, download global versions (heads only: one small message per
version; a real learner downloads each fragment once per round), or send error feedback.

Used by ``bench.scale_synth`` (one process per group of learners, started with ``python -c``)
and ``tests/test_scale_synth.py`` (in-process: :class:`Replayer`).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import resource
import sys
import time
import uuid

import numpy as np
import orjson

from bus import codec
from bus.chunks import checksum, chunk_headers, split
from bus.config import CommonConfig, from_env
from bus.conn import connect
from bus.fragments import sync_offsets
from bus.log import get_logger, setup
from bus.protocol import grad_meta, grad_obj_id
from bus.runs import run_tree, wait_manifest
from bus.signals import install_stop
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkPublisher, TransportError, VersionedStore, follow_heads
from learner.loop import peak_rss_mib
from monitor.membership import Heartbeat, heartbeat_to_dict

#: per-element std of a replayed outer gradient, in units of max_inner_lr x steps (see module doc)
VALUE_SCALE = 0.25


class Blob:
    """One pre-encoded outer gradient: chunk payloads, size and crc32, computed once."""

    def __init__(self, blob: bytearray, max_chunk: int):
        self.blob = bytes(blob)
        self.size = len(self.blob)
        self.crc = checksum(self.blob)
        self.parts = split(self.blob, max_chunk)


def make_blobs(sizes, max_inner_lr: float, H: int, quantiser: str, max_chunk: int, seed: int = 0) -> list[list[Blob]]:
    """Per fragment [blob of v, blob of -v]; v Gaussian, std VALUE_SCALE x max_inner_lr x H."""
    rng = np.random.default_rng(seed)
    std = np.float32(VALUE_SCALE * max_inner_lr * H)
    out = []
    for n in sizes:
        v = rng.standard_normal(int(n), dtype=np.float32)
        v *= std
        pos = Blob(codec.encode_array(v, quantiser), max_chunk)
        np.negative(v, out=v)
        out.append([pos, Blob(codec.encode_array(v, quantiser), max_chunk)])
        del v
    return out


class Replayer:
    """Learners ``ids`` of run ``common.run`` replaying pre-encoded fragments (see module doc).

    ``await Replayer(...).run(stop)``; counters: ``published``, ``skipped``, ``failed``,
    ``bytes_sent``, ``publish_s`` (seconds per publish, last 200)."""

    def __init__(self, common: CommonConfig, ids: list[str], *, step_time: float = 0.1, H: int = 24,
                 quantiser: str = "int8", tokens_per_step: int = 2048, hb_interval: float = 1.0,
                 seed: int = 0, name: str = "replay", manifest_timeout: float = 600.0):
        self.common, self.ids, self.step_time, self.H = common, list(ids), step_time, int(H)
        self.quantiser, self.tokens_per_step, self.hb_interval = quantiser, int(tokens_per_step), hb_interval
        self.seed, self.name, self.manifest_timeout = seed, name, manifest_timeout
        self.s = Subjects(common.run)
        self.log = get_logger(component="replay", name=name)
        self.versions: dict[int, int] = {}  # newest global version seen per fragment (heads only)
        self.published = self.skipped = self.failed = self.bytes_sent = 0
        self.publish_s: list[float] = []
        self.ready = asyncio.Event()  # blobs made, every fragment's head seen
        self.t_first: float | None = None  # monotonic time of the first publish

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.common, name=f"replay-{self.name}")
        tasks: list[asyncio.Task] = []
        try:
            js = nc.jetstream(timeout=10)
            m = await wait_manifest(js, self.common.run, timeout=self.manifest_timeout)
            self.model_hash = m.model_hash
            _, plan = run_tree(m)
            self.P = plan.num_fragments
            lr = m.max_inner_lr or 0.01
            if m.max_tokens_per_step:
                self.tokens_per_step = min(self.tokens_per_step, m.max_tokens_per_step)
            self.blobs = await asyncio.to_thread(make_blobs, plan.sizes, lr, self.H, self.quantiser,
                                                 self.common.max_chunk_bytes, self.seed)

            async def on_head(h) -> None:
                if h.version > self.versions.get(h.fragment, -1):
                    self.versions[h.fragment] = h.version

            store = VersionedStore(js, self.common.run, GLOBAL)
            tasks.append(asyncio.create_task(follow_heads(
                store, stop, on_head, lambda p: self.versions.get(p, -1), self.P, self.log, poll_interval=2.0)))
            while len(self.versions) < self.P and not stop.is_set():
                await asyncio.sleep(0.05)
            self.ready.set()
            rng = random.Random(self.seed)
            tasks += [asyncio.create_task(self._learner(i, rng.random(), stop)) for i in self.ids]
            tasks.append(asyncio.create_task(self._metrics(nc, stop)))
            await stop.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await nc.close()

    async def _learner(self, lid: str, phase: float, stop: asyncio.Event) -> None:
        nc = await connect(self.common, name=f"learner-{lid}")
        js = nc.jetstream(timeout=10)
        pub = ChunkPublisher(js, self.common.max_chunk_bytes, self.common.inflight_chunks)
        inc, nonce = uuid.uuid4().hex[:12], uuid.uuid4().hex[:12]
        H, dt = self.H, self.step_time
        t0 = time.monotonic() + phase * H * dt
        offsets = sync_offsets(self.P, H)
        due = [t0 + (off if off >= 1 else H) * dt for off in offsets]  # as learner.loop.Bookkeeper
        # steps the next contribution carries: H from the first one on (a real learner's first sync
        # of fragment p holds offset_p steps only, too few for a replayed round's norm: norm_bound)
        steps = [H] * self.P
        rounds = [0] * self.P
        inflight: set[int] = set()
        pending: set[asyncio.Task] = set()

        def heartbeat(leaving: bool = False) -> bytes:
            hb = heartbeat_to_dict(Heartbeat(
                learner=lid, region=self.common.region, incarnation=inc,
                step=max(0, int((time.monotonic() - t0) / dt)), tokens_per_s=self.tokens_per_step / dt,
                versions=dict(self.versions), sent_at=time.time()))
            if leaving:
                hb["leaving"] = True
            return orjson.dumps(hb)

        async def beats() -> None:
            while True:
                try:
                    await nc.publish(self.s.heartbeat(lid), heartbeat())
                except Exception as e:
                    self.log.debug("heartbeat_failed", error=repr(e))
                await asyncio.sleep(self.hb_interval)

        async def send(p: int, r: int, n_steps: int) -> None:
            b = self.blobs[p][r % 2]
            meta = grad_meta(run=self.common.run, model=self.model_hash, learner=lid, incarnation=inc, fragment=p,
                             round_=r, base_version=self.versions[p], inner_steps=n_steps,
                             tokens=n_steps * self.tokens_per_step, region=self.common.region, period=H)
            oid = grad_obj_id(self.common.run, lid, inc, p, r) + "." + nonce
            t = time.monotonic()
            try:
                await _publish(pub, self.s.grad(p, lid), oid, b, meta)
                self.published += 1
                self.bytes_sent += b.size
                self.publish_s = self.publish_s[-199:] + [time.monotonic() - t]
            except (TimeoutError, TransportError) as e:
                self.failed += 1
                steps[p] += n_steps  # the work goes with the next one
                self.log.warning("publish_failed", learner=lid, fragment=p, error=repr(e))
            finally:
                inflight.discard(p)

        hb_task = asyncio.create_task(beats())
        try:
            while not stop.is_set():
                p = min(range(self.P), key=due.__getitem__)
                wait = due[p] - time.monotonic()
                if wait > 0:
                    try:
                        await asyncio.wait_for(stop.wait(), wait)
                        break
                    except TimeoutError:
                        pass
                due[p] += H * dt
                if p in inflight:  # previous publish still going: skip, its steps go with the next
                    self.skipped += 1
                    steps[p] += H
                    continue
                inflight.add(p)
                n, steps[p] = steps[p], H
                r, rounds[p] = rounds[p], rounds[p] + 1
                if self.t_first is None:
                    self.t_first = time.monotonic()
                task = asyncio.create_task(send(p, r, n))
                pending.add(task)
                task.add_done_callback(pending.discard)
        finally:
            hb_task.cancel()
            for t in list(pending):
                t.cancel()
            await asyncio.gather(hb_task, *pending, return_exceptions=True)
            try:  # done: the monitor marks us left, not evicted
                await nc.publish(self.s.heartbeat(lid), heartbeat(leaving=True))
                await nc.flush(timeout=2)
            except Exception:
                pass
            await nc.close()

    def metrics(self) -> dict:
        lat = sorted(self.publish_s)
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return {"role": "replay", "run": self.common.run, "ts": time.time(), "id": self.name,
                "learners": len(self.ids), "published": self.published, "skipped": self.skipped,
                "failed": self.failed, "bytes_sent": self.bytes_sent,
                "publish_s_p50": lat[len(lat) // 2] if lat else None, "publish_s_max": lat[-1] if lat else None,
                "cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "rss_mib": peak_rss_mib(),
                "versions": {str(p): v for p, v in self.versions.items()}}

    async def _metrics(self, nc, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await nc.publish(self.s.metrics("replay", self.name), codec.dumps_json(self.metrics()))
            except Exception:
                pass
            try:
                await asyncio.wait_for(stop.wait(), self.common.metrics_interval)
            except TimeoutError:
                pass


async def _publish(pub: ChunkPublisher, subject: str, obj_id: str, b: Blob, meta: dict) -> None:
    """``ChunkPublisher.publish`` of a pre-split blob with its crc32 known (the same headers and
    window of acks, retries through ``ChunkPublisher._publish_one``), so a replay hashes nothing."""
    n = len(b.parts)
    t_end = time.monotonic() + pub.deadline
    window: list[tuple[int, asyncio.Future, dict]] = []

    async def settle(i: int, fut, hdrs: dict) -> None:
        try:
            ack = await asyncio.wait_for(fut, pub.ack_timeout)
        except Exception:
            pub.retries += 1
            ack = await pub._publish_one(subject, b.parts[i], hdrs, t_end)
        if getattr(ack, "stream", None) is None:
            raise TransportError(f"no ack for a chunk of {obj_id}")

    for i, part in enumerate(b.parts):
        hdrs = chunk_headers(obj_id, i, n, b.size, b.crc, meta)
        try:
            fut = await pub.js.publish_async(subject, part, headers=dict(hdrs), wait_stall=pub.ack_timeout)
        except Exception:
            fut = asyncio.get_running_loop().create_future()
            fut.set_exception(TransportError("publish_async failed"))
        window.append((i, fut, hdrs))
        if len(window) >= pub.inflight:
            await settle(*window.pop(0))
    for item in window:
        await settle(*item)
    pub.bytes_sent += b.size


def main(argv: list[str] | None = None) -> int:
    """``python -c 'from bench.replay_learner import main; main()' --ids a,b ...`` (DILOCO_NATS_URL,
    DILOCO_RUN, DILOCO_REGION, DILOCO_METRICS_INTERVAL from the environment)."""
    p = argparse.ArgumentParser(prog="replay_learner", description=__doc__.splitlines()[0])
    p.add_argument("--ids", required=True, help="comma-separated learner ids")
    p.add_argument("--name", default="replay", help="this process's id in metrics")
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--sync-every", type=int, default=24, help="H")
    p.add_argument("--quantiser", default="int8")
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--hb-interval", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    common = from_env(CommonConfig)
    setup(common.log_level, run=common.run, role="replay", island=common.region)
    r = Replayer(common, a.ids.split(","), step_time=a.step_time, H=a.sync_every, quantiser=a.quantiser,
                 tokens_per_step=a.tokens_per_step, hb_interval=a.hb_interval, seed=a.seed, name=a.name)

    async def go() -> None:
        stop = asyncio.Event()
        install_stop(stop)
        await r.run(stop)

    asyncio.run(go())
    return 0
