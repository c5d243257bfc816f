"""Sparse outer gradients through a real aggregator: merged as their dense decoding would be, and
hostile sparse encodings rejected as malformed (the reason named in the audit event), a poisoned
one as non_finite, with the global state untouched."""

import numpy as np
import orjson
from nats.js.api import DeliverPolicy

from bus import codec, sparse
from bus.subjects import Subjects
from tests.agg_helpers import PLAN, FakeLearner, set_members
from tests.test_aggregator_service import RUN, _start, _until
from tests.test_bus_sparse import _hostile, _join


async def test_sparse_contributions_merge_and_hostile_ones_are_refused(nats_server, js):
    svc, stop, task = await _start(nats_server, quorum=1, grace="fixed", grace_seconds=0.1)
    n = PLAN.sizes[0]
    await set_members(js, RUN, {"good": "active"})
    await _until(lambda: svc.membership.members.get("good") == "active")
    good = FakeLearner(js, RUN, "good")
    rng = np.random.default_rng(3)
    for v, name in enumerate(sparse.SPARSE):
        params0 = svc.states[0].params.copy()
        vec = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        blob = codec.encode_array(vec, name)
        key = await good.send(0, base=v, blob=bytes(blob))
        assert await _until(lambda: svc.published.get(0) == v + 1), dict(svc.stats.rejected)
        assert tuple(svc.states[0].last_merge[0]) == key
        # only the values the blob carries moved (the default outer optimizer is elementwise)
        dense = np.array(codec.decode_array(blob), dtype=np.float32)
        moved = svc.states[0].params - params0
        assert np.count_nonzero(dense) <= sparse.layout(n, sparse.DEFAULT_CHUNK, sparse.DEFAULT_K)[1]
        assert np.all(moved[dense == 0] == 0) or v > 0  # momentum carries earlier moves on
        assert np.count_nonzero(moved[dense != 0]) > 0 and np.all(np.isfinite(moved))
    snapshot = (svc.states[0].version, svc.states[0].params.copy())
    cases = {**{f"topk2 {k}": c for k, c in _hostile("topk2").items()},
             **{f"topk4 {k}": c for k, c in _hostile("topk4").items()}}
    # each fails to decode (before any shape check), whatever the fragment's size
    for blob, _ in cases.values():
        await good.send(0, base=2, blob=bytes(blob))
    poisoned = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    poisoned[n // 2] = np.nan  # a diverged learner: the NaN need not be among the values sent
    await good.send(0, base=2, blob=bytes(codec.encode_array(poisoned, "topk2")))
    # a header declaring far more values than any fragment (under the codec's own cap): refused
    # before anything of that size is allocated
    huge, chunk = 2**28, 65536
    head = {"v": 1, "q": "topk2", "b": chunk, "dt": "<f4", "sh": [huge], "k": 1}
    nc = huge // chunk
    await good.send(0, base=2, blob=_join(head, bytes(4 * nc) + bytes(-(-nc * 2 // 8)) + bytes(-(-nc * 16 // 8))))
    cases["huge"] = (b"", "more than the run's largest fragment")
    want = len(cases)
    assert await _until(lambda: dict(svc.stats.rejected) == {"malformed": want, "non_finite": 1}, 15), \
        dict(svc.stats.rejected)
    assert svc.states[0].version == snapshot[0] and np.array_equal(svc.states[0].params, snapshot[1])
    sub = await js.subscribe(Subjects(RUN).event("reject"), deliver_policy=DeliverPolicy.ALL)
    details = []
    while len(details) < want:
        ev = orjson.loads((await sub.next_msg(timeout=5)).data)
        if ev["reason"] == "malformed":
            details.append(ev.get("detail", ""))
    for (what, (_, reason)) in cases.items():
        assert any(reason in d for d in details), (what, reason, details)
    stop.set()
    await task
