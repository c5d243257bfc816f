"""Fragment transport throughput against raw nats-py JetStream publish of the same bytes.

For 1, 16 and 64 MiB fragments: publisher -> JetStream -> pull consumer -> assembled fragment,
through :class:`bus.transport.ChunkPublisher` and :class:`ChunkConsumer` (chunking, headers, crc32,
dedupe ids, assembly), against raw ``js.publish_async`` of the same bytes in messages of the same
size with the same in-flight window, pulled with ``fetch`` and acked. Both run against the same
embedded server in the same process, interleaved, so the ratio is fair on a noisy shared machine.

Also encode/decode GB/s of every codec (``bench.codecs``) (``codec_gbps``, GB of float32 input per second), and
how long a polling consumer holds what arrived (``poll_delay_ms``): bursts of 16 small messages at
random 0.2-0.3 s intervals against a loop of polls with a 0.2 s timeout, publish -> returned by the
poll, for nats-py's ``fetch(32, timeout)`` and for :func:`bus.transport.prompt_fetch` (what
``ChunkConsumer.poll`` uses), interleaved on one server.

    python bench/transport.py --quick --out transport.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import statistics
import time

import numpy as np

from bench.common import finish, parser, progress
from bench.codecs import codec_speed
from bus.config import CommonConfig
from bus.conn import connect
from bus.server import EmbeddedServer
from bus.streams import Limits, ensure_run
from bus.subjects import Subjects
from bus.transport import ChunkConsumer, ChunkPublisher, ack_all, prompt_fetch

MiB = 1024 * 1024
CHUNK = MiB
WINDOW = 16


async def _raw_once(js, cons_sub, subject: str, blob: bytes) -> float:
    parts = [blob[i : i + CHUNK] for i in range(0, len(blob), CHUNK)]
    t0 = time.perf_counter()

    async def produce():
        pending = []
        for p in parts:
            pending.append(await js.publish_async(subject, p))
            if len(pending) >= WINDOW:
                await pending.pop(0)
        for f in pending:
            await f

    async def consume():
        got = 0
        while got < len(parts):
            try:
                msgs = await cons_sub.fetch(WINDOW, timeout=2)
            except asyncio.TimeoutError:
                continue
            for m in msgs:
                await m.ack()
            got += len(msgs)

    await asyncio.gather(produce(), consume())
    return time.perf_counter() - t0


async def _ours_once(pub: ChunkPublisher, cons: ChunkConsumer, subject: str, blob: bytes, k: int) -> float:
    t0 = time.perf_counter()

    async def consume():
        while True:
            for r in await cons.poll(timeout=2):
                await ack_all(r.tokens)
                if getattr(r, "blob", None) is not None and r.obj_id == f"o{k}":
                    assert len(r.blob) == len(blob)
                    return

    await asyncio.gather(pub.publish(subject, f"o{k}", blob, {"k": k}), consume())
    return time.perf_counter() - t0


async def transport(quick: bool) -> dict:
    sizes = [1, 16, 64]
    reps = 2 if quick else 5
    with EmbeddedServer() as srv:
        cfg = CommonConfig(nats_url=srv.url, run="bench")
        nc = await connect(cfg, "bench-pub")
        nc2 = await connect(cfg, "bench-sub")
        js, js2 = nc.jetstream(timeout=30), nc2.jetstream(timeout=30)
        await ensure_run(js, "bench", Limits(max_bytes=2 * 1024**3))  # 64 MiB fragments
        s = Subjects("bench")
        await js.add_stream(name="RAW", subjects=["raw.>"], max_bytes=2 * 1024**3)
        raw_sub = await js2.pull_subscribe("raw.>", durable="raw", stream="RAW", pending_bytes_limit=512 * MiB)
        pub = ChunkPublisher(js, max_chunk=CHUNK, inflight=WINDOW)
        cons = ChunkConsumer(js2, s.stream("grad"), "bench", [s.grad_all], batch=WINDOW)
        await cons.start()
        rows = {}
        k = 0
        for mib in sizes:
            blob = np.random.default_rng(mib).bytes(mib * MiB)
            raw_t, our_t = [], []
            for _ in range(reps):
                raw_t.append(await _raw_once(js, raw_sub, "raw.x", blob))
                k += 1
                our_t.append(await _ours_once(pub, cons, s.grad(0, "bench"), blob, k))
                await js.purge_stream("RAW")
                await js.purge_stream(s.stream("grad"))
            raw_mibs = mib / statistics.median(raw_t)
            our_mibs = mib / statistics.median(our_t)
            rows[f"{mib}MiB"] = {"raw_MiBps": round(raw_mibs, 1), "fragment_MiBps": round(our_mibs, 1),
                                 "ratio": round(our_mibs / raw_mibs, 3)}
            progress(f"{mib} MiB: {rows[f'{mib}MiB']}")
        await nc.close()
        await nc2.close()
    return rows


async def _poll_delays(js, pjs, name: str, fetch, bursts: int, seed: int) -> list[float]:
    await js.add_stream(name=name, subjects=[f"{name}.>"])
    sub = await js.pull_subscribe(f"{name}.>", durable="d", stream=name)
    delays: list[float] = []
    stop = asyncio.Event()

    async def consume():
        while not stop.is_set():
            try:
                msgs = await fetch(sub)
            except Exception:
                msgs = []
            now = time.monotonic()
            for m in msgs:
                delays.append(now - float(m.data.decode()))
                await m.ack()

    async def produce():
        rng = np.random.default_rng(seed)
        for _ in range(bursts):
            await asyncio.sleep(0.2 + rng.uniform(0, 0.1))
            for _ in range(16):
                await pjs.publish(f"{name}.x", str(time.monotonic()).encode())
        await asyncio.sleep(0.5)
        stop.set()

    await asyncio.gather(consume(), produce())
    await js.delete_stream(name)
    return delays


async def poll_delay(quick: bool) -> dict:
    """Publish -> returned by a poll, ms: nats-py's fetch(32, 0.2) against prompt_fetch(32, 0.2)."""
    variants = {"fetch": lambda sub: sub.fetch(32, timeout=0.2), "prompt_fetch": lambda sub: prompt_fetch(sub, 32, 0.2)}
    got: dict[str, list[float]] = {k: [] for k in variants}
    with EmbeddedServer() as srv:
        cfg = CommonConfig(nats_url=srv.url, run="bench")
        nc, pn = await connect(cfg, "bench-poll"), await connect(cfg, "bench-burst")
        js, pjs = nc.jetstream(timeout=30), pn.jetstream(timeout=30)
        for rep in range(2 if quick else 4):
            for name, fetch in variants.items():
                got[name] += await _poll_delays(js, pjs, f"POLL{rep}{name.upper()}", fetch, 40, seed=rep)
        await nc.close()
        await pn.close()
    out = {}
    for name, d in got.items():
        ms = 1000 * np.array(d)
        out[name] = {"messages": len(d), "p50": round(float(np.percentile(ms, 50)), 2),
                     "p99": round(float(np.percentile(ms, 99)), 2), "max": round(float(ms.max()), 2),
                     "share_over_20ms": round(float((ms > 20).mean()), 4)}
        progress(f"poll delay, {name}: {out[name]}")
    return out


def main() -> None:
    a = parser(__doc__.splitlines()[0]).parse_args()
    rows = asyncio.run(transport(a.quick))
    delays = asyncio.run(poll_delay(a.quick))
    codecs = codec_speed(a.quick)
    finish({
        "bench": "transport",
        "quick": a.quick,
        "chunk_bytes": CHUNK,
        "inflight": WINDOW,
        "sizes": rows,
        "fragment_throughput_ratio": min(r["ratio"] for r in rows.values()),
        "codec_gbps": codecs,
        "slowest_codec_gbps": min(min(v.values()) for v in codecs.values()),
        "poll_delay_ms": delays,
    }, a.out)


if __name__ == "__main__":
    main()
