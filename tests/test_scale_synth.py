"""Replaying learners (bench.replay_learner) against a real aggregator and monitor on a real
nats-server: their contributions are accepted (none rejected) and the versions advance."""

import asyncio
import math
import time

import numpy as np

from aggregator.config import AggregatorConfig
from aggregator.influence import norm_bound
from aggregator.service import AggregatorService
from bench.replay_learner import Replayer, make_blobs
from bus import codec
from bus.config import CommonConfig
from bus.conn import connect
from learner.builtin import create_builtin_run
from learner.config import ModelConfig
from monitor.config import MonitorConfig
from monitor.service import MonitorService

RUN = "synth"
MODEL = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=16, num_fragments=4)


def test_blobs_decode_to_finite_float32_within_the_norm_bound():
    sizes = [1000, 513]
    blobs = make_blobs(sizes, 0.01, 24, "int8", max_chunk=256, seed=1)
    for n, (pos, neg) in zip(sizes, blobs):
        v, w = (np.asarray(codec.decode_array(b.blob)) for b in (pos, neg))
        assert v.dtype == np.float32 and v.shape == (n,) and np.isfinite(v).all()
        assert np.allclose(v, -w)  # replays alternate v, -v: the parameters do not drift
        assert 0 < float(np.linalg.norm(v)) < 0.5 * norm_bound(0.01, n, 24)
        assert len(pos.parts) == math.ceil(pos.size / 256) and b"".join(pos.parts) == pos.blob


async def test_replayed_contributions_are_accepted_and_versions_advance(nats_server):
    common = CommonConfig(nats_url=nats_server.url, run=RUN, metrics_interval=0.5)
    nc = await connect(common, name="create")
    try:
        await create_builtin_run(nc.jetstream(timeout=10), common, MODEL)
    finally:
        await nc.close()
    stop = asyncio.Event()
    mon = MonitorService(common, MonitorConfig(heartbeat_interval=0.2, suspect_after=2.0, evict_after=4.0,
                                               lease_ttl=1.5, monitor_id="mon"))
    agg = AggregatorService(common, AggregatorConfig(downlink_quantiser="int8"))
    ids = ["r-0", "r-1", "r-2"]
    rep = Replayer(common, ids, step_time=0.02, H=8, hb_interval=0.2, seed=3, name="t")
    tasks = [asyncio.create_task(x.run(stop)) for x in (mon, agg, rep)]
    try:
        t_end = time.monotonic() + 20
        while time.monotonic() < t_end and not (agg.stats.accepted >= 60 and len(agg.stats.contributions) == 3):
            assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
            await asyncio.sleep(0.1)
        v0 = {p: st.version for p, st in agg.states.items()}
        await asyncio.sleep(1.0)
        accepted, rejected = agg.stats.accepted, dict(agg.stats.rejected)
        versions = {p: st.version for p, st in agg.states.items()}
        params = [st.params for st in agg.states.values()]
        members = {k: m.state for k, m in mon.members.items()}
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
    assert rep.published >= 60 and rep.failed == 0
    assert rejected == {}, rejected
    assert accepted >= 60 and set(agg.stats.contributions) == set(ids), agg.stats.contributions
    assert all(members.get(i) in ("active", "left") for i in ids), members
    assert all(versions[p] > v0[p] > 0 for p in range(MODEL.num_fragments)), (v0, versions)
    assert agg.stats.merges >= 30
    assert all(np.isfinite(p).all() for p in params)
    assert max(float(np.abs(p).max()) for p in params) < 10.0  # v, -v alternate: no run-away drift
