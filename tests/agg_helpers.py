"""Helpers for aggregator tests: tiny-model settings and a protocol-exact contribution publisher."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

import numpy as np
import orjson

from learner.spec import make_plan
from bus import codec
from bus.protocol import grad_meta, grad_obj_id
from bus.subjects import Subjects
from bus.transport import ChunkPublisher
from learner.config import ModelConfig
from learner.spec import spec_hash

TINY = {"DILOCO_D_MODEL": "16", "DILOCO_N_LAYERS": "1", "DILOCO_N_HEADS": "2", "DILOCO_D_FF": "32",
        "DILOCO_SEQ_LEN": "16", "DILOCO_NUM_FRAGMENTS": "2"}
MODEL = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=16, num_fragments=2)
SPEC = MODEL.spec()
PLAN = make_plan(SPEC, MODEL.num_fragments, MODEL.max_imbalance)
HASH = spec_hash(SPEC)


def env(url: str, run: str, **extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    e.update(TINY)
    e.update({"DILOCO_NATS_URL": url, "DILOCO_RUN": run, "DILOCO_METRICS_INTERVAL": "0.2"})
    e.update(extra)
    return e


class FakeLearner:
    """Publishes outer-gradient fragments exactly as a learner does (real bus, real protocol)."""

    def __init__(self, js, run: str, learner: str, seed: int = 0, scale: float = 1e-3):
        self.js, self.run, self.learner = js, run, learner
        self.inc = uuid.uuid4().hex[:8]
        self.rng = np.random.default_rng(seed)
        self.round = {p: 0 for p in range(PLAN.num_fragments)}
        self.pub = ChunkPublisher(js, max_chunk=4096)
        self.scale = scale
        self.s = Subjects(run)

    async def send(self, p: int, base: int, vector=None, q: str = "fp32", obj_suffix: str = "", blob=None,
                   **over) -> tuple:
        """``blob``: these bytes instead of the encoded vector (a hostile encoding)."""
        self.round[p] += 1
        vec = vector if vector is not None else (self.rng.standard_normal(PLAN.sizes[p]) * self.scale).astype(np.float32)
        meta = grad_meta(run=self.run, model=HASH, learner=self.learner, incarnation=self.inc, fragment=p,
                         round_=self.round[p], base_version=base, inner_steps=10, tokens=10 * 64, region="r")
        meta.update(over)
        oid = grad_obj_id(self.run, self.learner, self.inc, p, self.round[p]) + obj_suffix
        await self.pub.publish(self.s.grad(p, self.learner), oid,
                               codec.encode_array(vec, q) if blob is None else blob, meta)
        return (self.learner, self.inc, p, self.round[p])


async def set_members(js, run: str, states: dict[str, str]) -> None:
    kv = await js.key_value(Subjects(run).bucket("members"))
    for k, st in states.items():
        await kv.put(k, orjson.dumps({"learner": k, "state": st}))


PY = sys.executable


# -- a run whose merges a test replays bit for bit (the crash loop, a killed shard worker) ---------

#: aggregator settings with no membership, one contribution per merge, and every contribution
#: accepted: a test sends what it likes and replays what was merged
REPLAY_AGG = {"DILOCO_REQUIRE_MEMBERSHIP": "false", "DILOCO_QUORUM": "1", "DILOCO_GRACE": "fixed",
              "DILOCO_GRACE_SECONDS": "0.05", "DILOCO_MAX_STALENESS": "100000",
              "DILOCO_NORM_OUTLIER_FACTOR": "1000000", "DILOCO_MERGE": "rda", "DILOCO_LOG_LEVEL": "warning",
              "DILOCO_ACK_WAIT": "3", "DILOCO_EMBEDDED_MONITOR": "false"}  # no membership: nothing for a monitor to do


def replay_settings():
    """``REPLAY_AGG``'s merge settings, with the manifest's max_inner_lr, as the aggregator has them."""
    import dataclasses

    from aggregator.config import AggregatorConfig
    from aggregator.step import MergeSettings

    cfg = AggregatorConfig(require_membership=False, quorum=1, grace="fixed", grace_seconds=0.05,
                           max_staleness=100000, norm_outlier_factor=1e6, merge="rda")
    return dataclasses.replace(MergeSettings.from_config(cfg), max_inner_lr=MODEL.max_inner_lr)


async def merge_events(js, run: str, sent, timeout: float = 90.0) -> dict:
    """Every merge event of ``run``, (fragment, version) -> (applied keys, scale, per_round), read
    until every key of ``sent`` is applied (or ``timeout``); two different merges recorded for one
    version fail the test."""
    import asyncio
    import time

    from nats.js.api import DeliverPolicy

    events: dict[tuple[int, int], tuple] = {}
    sub = await js.subscribe(Subjects(run).event("merge"), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
    t_end = time.monotonic() + timeout
    try:
        while time.monotonic() < t_end:
            try:
                m = await sub.next_msg(timeout=0.5)
            except (asyncio.TimeoutError, Exception):
                applied = {tuple(k) for keys, _, _ in events.values() for k in keys}
                if set(sent) <= applied:
                    break
                continue
            e = orjson.loads(m.data)
            key = (e["fragment"], e["version"])
            rec = ([tuple(k) for k in e["applied"]], e["scale"], e["per_round"])
            assert events.setdefault(key, rec) == rec, "two different merges recorded for the same version"
    finally:
        await sub.unsubscribe()
    return events


async def assert_replay_matches(js, run: str, events: dict, sent: dict) -> None:
    """Nothing sent lost or applied twice, and the global parameters of every fragment equal the
    pure merge step replaying exactly the recorded merges (``sent``: key -> (vector, base))."""
    from aggregator.contribution import Contribution
    from aggregator.step import FragmentState, merge_step
    from bus.fragments import gather
    from bus.subjects import GLOBAL
    from bus.transport import VersionedStore
    from learner.spec import init_params

    applied_lists = [k for keys, _, _ in events.values() for k in keys]
    assert len(applied_lists) == len(set(applied_lists)), "a contribution was applied twice"
    lost = set(sent) - set(applied_lists)
    assert not lost, f"lost: {len(lost)} contributions {sorted(lost)[:5]}"
    assert set(applied_lists) <= set(sent)
    settings = replay_settings()
    store = VersionedStore(js, run, GLOBAL)
    params0 = init_params(SPEC, MODEL.seed)
    for p in range(PLAN.num_fragments):
        st = FragmentState.initial(p, 0, gather(PLAN, params0, p), settings)
        versions = sorted(v for (f, v) in events if f == p)
        assert versions == list(range(1, len(versions) + 1)), "merge events are not contiguous"
        for v in versions:
            keys, scale, per_round = events[(p, v)]
            contribs = [Contribution(run, HASH, lrn, inc, frag, rnd, sent[(lrn, inc, frag, rnd)][1], 10, 640,
                                     sent[(lrn, inc, frag, rnd)][0]) for (lrn, inc, frag, rnd) in keys]
            st = merge_step(st, contribs, settings, scale=scale, per_round=per_round)
        head, blob = await store.get(p)
        assert head.version == st.version
        assert np.array_equal(codec.decode_array(blob), st.params), f"fragment {p} differs from its replay"


def sending_learners(js, run: str, store, stop, sent: dict, pick) -> list:
    """Two learners ("l1", "l2") sending small random outer gradients every 20 ms until ``stop``,
    each against the newest version of its fragment seen (a task follows the global heads of
    ``store``), the fragment of their i-th send ``pick(rng, i)``; every key sent goes into ``sent``
    with (vector, base). Returns the three tasks (the learners first)."""
    import asyncio
    import random

    known = {p: 0 for p in range(PLAN.num_fragments)}

    async def learner(name: str, seed: int) -> None:
        fl = FakeLearner(js, run, name, seed)
        rng = random.Random(seed)
        i = 0
        while not stop.is_set():
            p = pick(rng, i)
            i += 1
            vec = (fl.rng.standard_normal(PLAN.sizes[p]) * 1e-3).astype(np.float32)
            base = known[p]
            sent[await fl.send(p, base=base, vector=vec)] = (vec, base)
            await asyncio.sleep(0.02)

    async def follow() -> None:
        async for h in store.watch(stop):
            known[h.fragment] = max(known[h.fragment], h.version)

    return [asyncio.create_task(learner("l1", 1)), asyncio.create_task(learner("l2", 2)),
            asyncio.create_task(follow())]


async def cancel_until_done(task: asyncio.Task, every: float = 1.0) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling again while it runs on. On Python 3.11
    ``asyncio.wait_for`` can swallow a cancellation that arrives as the wait it guards completes
    (CPython gh-86296, fixed in 3.12), and every NATS fetch waits in one (nats-py's ``next_msg``):
    a service's loop then goes on as if never cancelled, and a test that cancelled it once waited
    for ever (test_full_disk, once in a loaded suite: 120 s, its aggregator stopped only at teardown)."""
    from bus.signals import cancel_all

    await cancel_all([task], every)

