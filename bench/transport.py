"""Fragment transport throughput against raw nats-py JetStream publish of the same bytes.

For 1, 16 and 64 MiB fragments: publisher -> JetStream -> pull consumer -> assembled fragment,
through :class:`bus.transport.ChunkPublisher` and :class:`ChunkConsumer` (chunking, headers, crc32,
dedupe ids, assembly), against raw ``js.publish_async`` of the same bytes in messages of the same
size with the same in-flight window, pulled with ``fetch`` and acked. Both run against the same
embedded server in the same process, interleaved, so the ratio is fair on a noisy shared machine.

Also encode/decode GB/s of every quantiser (``codec_gbps``, GB of float32 input per second).

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
from bus import codec, quant
from bus.config import CommonConfig
from bus.conn import connect
from bus.server import EmbeddedServer
from bus.streams import ensure_run
from bus.subjects import Subjects
from bus.transport import ChunkConsumer, ChunkPublisher, ack_all

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
        await ensure_run(js, "bench")
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


def codec_speed(quick: bool) -> dict:
    n = (4 if quick else 16) * MiB
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    out = {}
    for q in quant.QUANTISERS:
        enc, dec = [], []
        for _ in range(2 if quick else 4):
            t0 = time.perf_counter()
            blob = codec.encode_array(x, q)
            t1 = time.perf_counter()
            codec.decode_array(blob)
            t2 = time.perf_counter()
            enc.append(t1 - t0)
            dec.append(t2 - t1)
        gb = x.nbytes / 1e9
        out[q] = {"encode": round(gb / min(enc), 3), "decode": round(gb / min(dec), 3)}
        progress(f"codec {q}: {out[q]}")
    return out


def main() -> None:
    a = parser(__doc__.splitlines()[0]).parse_args()
    rows = asyncio.run(transport(a.quick))
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
    }, a.out)


if __name__ == "__main__":
    main()
