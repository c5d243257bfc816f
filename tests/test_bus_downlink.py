"""Quantised downlink: keyframes and deltas (pure), and the reader + aggregator on a real server."""

import asyncio

import numpy as np
import pytest

from bus import codec
from bus.downlink import Keyframe, MissingKeyframe, decode_version, encode_version, is_keyframe_due

RNG = np.random.default_rng(5)


def test_fp32_is_whole_without_keyframes():
    x = RNG.standard_normal(1000).astype(np.float32)
    blob, meta, key = encode_version(x, 7, None, "fp32", 4)
    assert meta == {} and key is None
    np.testing.assert_array_equal(decode_version(blob, meta, None), x)


def test_keyframe_cadence():
    assert is_keyframe_due(1, None, 4)
    k = Keyframe(3, np.zeros(2, np.float32))
    assert [is_keyframe_due(v, k, 4) for v in (4, 5, 6, 7, 8)] == [False, False, False, True, True]
    assert is_keyframe_due(3, k, 4) and is_keyframe_due(2, k, 4)  # republished or rolled back: whole again
    with pytest.raises(ValueError):
        encode_version(np.zeros(2, np.float32), 1, None, "int8", 0)


@pytest.mark.parametrize("q,bound", [("int8", 1 / 127), ("bf16", 1 / 128), ("int4", 1 / 7)])
def test_deltas_against_the_keyframe_reconstruct_within_one_step_and_do_not_accumulate(q, bound):
    """A random walk of 200 versions with keyframes every 16: every reconstruction is within one
    quantisation step of its delta since the keyframe, and keyframes are exact."""
    theta = RNG.standard_normal(4096).astype(np.float32)
    key_pub = key_reader = None
    keys = 0
    for v in range(1, 201):
        theta = theta - np.float32(1e-3) * RNG.standard_normal(4096).astype(np.float32)
        blob, meta, new = encode_version(theta, v, key_pub, q, 16)
        if new is not None:
            keys += 1
            key_pub = new
            assert meta == {"key": v}
            got = decode_version(blob, meta, None)
            np.testing.assert_array_equal(got, theta)
            key_reader = Keyframe(v, got.copy())
            continue
        assert meta == {"ref": key_pub.version}
        got = decode_version(blob, meta, key_reader)
        span = np.abs(theta - key_pub.params).max()
        assert np.abs(got - theta).max() <= bound * span * 1.01 + 1e-7, (v, span)
    assert keys == 13  # versions 1, 17, 33, ..., 193


def test_small_updates_survive_unlike_quantised_parameters():
    """Outer updates far below bf16's resolution of the parameters: quantising the parameters
    loses them all; a bf16 delta against an exact keyframe keeps them."""
    theta = np.full(512, 1.0, np.float32)
    key = None
    for v in range(1, 11):
        theta = theta - np.float32(1e-4)
        blob, meta, new = encode_version(theta, v, key, "bf16", 64)
        key = new or key
    got = decode_version(blob, meta, key)
    np.testing.assert_allclose(got, theta, rtol=0, atol=1e-6)
    rounded = codec.decode_array(codec.encode_array(theta, "bf16"))
    assert np.abs(rounded - theta).max() > 5e-4  # the parameters themselves in bf16: 1.0 - 1e-3 -> 1.0 or so


def test_decode_refuses_missing_wrong_or_malformed_references():
    x = np.arange(8, dtype=np.float32)
    k = Keyframe(2, x.copy())
    blob, meta, _ = encode_version(x + 1, 3, k, "int8", 8)
    with pytest.raises(MissingKeyframe) as e:
        decode_version(blob, meta, None)
    assert e.value.ref == 2
    with pytest.raises(MissingKeyframe):
        decode_version(blob, meta, Keyframe(1, x.copy()))
    for bad in ("2", -1, True, 2.0):
        with pytest.raises(ValueError):
            decode_version(blob, {"ref": bad}, k)
    with pytest.raises(ValueError):
        decode_version(blob, meta, Keyframe(2, np.zeros(9, np.float32)))


# -- the aggregator publishes keyframes and deltas; a reader reconstructs them ----------------------


async def test_aggregator_publishes_keyframes_and_deltas_that_readers_reconstruct(nats_server, js):
    from tests.test_aggregator_service import RUN, _start, _until
    from tests.agg_helpers import FakeLearner
    from bus.global_reader import GlobalReader
    from bus.subjects import GLOBAL
    from bus.transport import VersionedStore

    svc, stop, task = await _start(nats_server, require_membership=False, grace="fixed", grace_seconds=0.02,
                                   quorum=1, downlink_quantiser="int8", keyframe_every=3, max_staleness=100)
    seen = []
    reader = GlobalReader(js, RUN, lambda head, vec: seen.append(head.version) or vec)
    late = GlobalReader(js, RUN, lambda head, vec: vec)
    store = VersionedStore(js, RUN, GLOBAL)
    learner = FakeLearner(js, RUN, "a", 1, scale=1e-2)
    metas = {}
    try:
        head, _ = await reader.newest(0)  # version 0: whole, and not kept (an fp32 downlink never needs it)
        assert head.version == 0 and 0 not in reader.keys
        for v in range(8):
            await learner.send(0, base=v)
            assert await _until(lambda: svc.published.get(0) == v + 1)
            head = await store.head(0)
            assert head.version == v + 1
            metas[head.version] = {k: head.meta[k] for k in ("key", "ref") if k in head.meta}
            got = await reader.read(head)
            exact = svc.states[0].params
            span = np.abs(exact - svc.versions.encoder.keys[0].params).max()
            assert np.abs(got - exact).max() <= span / 127 * 1.01 + 1e-7
        # version 0 is the first keyframe; then keyframes at 3 and 6 (every 3 versions); the rest
        # are deltas against the newest keyframe
        assert metas == {1: {"ref": 0}, 2: {"ref": 0}, 3: {"key": 3}, 4: {"ref": 3}, 5: {"ref": 3},
                         6: {"key": 6}, 7: {"ref": 6}, 8: {"ref": 6}}
        # keyframe 0 fetched once, from the keyframe subjects, by the first delta; keyframes 3 and 6
        # it saw itself
        assert reader.keyframes_fetched == 1
        # a reader that joins now fetches keyframe 6 from the keyframe subjects, then the delta
        head, vec = await late.newest(0)
        assert head.version == 8 and late.keyframes_fetched == 1 and late.keys[0].version == 6
        np.testing.assert_allclose(vec, svc.states[0].params, atol=np.abs(svc.states[0].params).max() / 100)
        # the aggregator's own parameters stay exact float32 (never rounded by the downlink)
        assert svc.states[0].params.dtype == np.float32
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    # a restarted aggregator (keyframes every 4 now) takes keyframe 6 back, still current at
    # version 8: version 9 is a delta against it
    svc, stop, task = await _start(nats_server, require_membership=False, grace="fixed", grace_seconds=0.02,
                                   quorum=1, downlink_quantiser="int8", keyframe_every=4, max_staleness=100)
    try:
        assert svc.versions.encoder.keys[0].version == 6 and svc.versions.encoder.keys[1].version == 0
        await learner.send(0, base=8)
        assert await _until(lambda: svc.published.get(0) == 9)
        head = await store.head(0)
        assert head.version == 9 and head.meta.get("ref") == 6
        got = await reader.read(head)
        assert reader.keyframes_fetched == 1  # still keyframe 0's only: it held keyframe 6
        np.testing.assert_allclose(got, svc.states[0].params, atol=np.abs(svc.states[0].params).max() / 100)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


async def test_reader_builds_version_0_locally_when_its_crc_matches(nats_server, js):
    from bus.global_reader import GlobalReader
    from learner.startup import initial_blobs
    from tests.test_learner_service import PLAN, RUN, SPEC, V0, bootstrap, put_version

    await bootstrap(js)  # version 0 of every fragment from seed 0, as the aggregator makes it
    reader = GlobalReader(js, RUN, lambda head, vec: vec)
    reader.local = initial_blobs(SPEC, PLAN, 0)
    head, vec = await reader.newest(0)
    assert head.version == 0 and reader.local_hits == 1 and reader.bytes_received == 0
    np.testing.assert_array_equal(vec, V0[0])
    # another seed does not match the head's crc: downloaded
    reader.local = initial_blobs(SPEC, PLAN, 1)
    head, vec = await reader.newest(1)
    assert reader.local_hits == 1 and reader.bytes_received > 0
    np.testing.assert_array_equal(vec, V0[1])
    # a later version is always downloaded
    await put_version(js, 2, 3, V0[2] + 1.0)
    before = reader.bytes_received
    reader.local = initial_blobs(SPEC, PLAN, 0)
    head, vec = await reader.newest(2)
    assert head.version == 3 and reader.local_hits == 1 and reader.bytes_received > before


# -- the chained downlink (DILOCO_DOWNLINK_CHAIN) ------------------------------------------------------


def test_chain_views_follow_bit_for_bit_and_a_gap_needs_the_whole_view():
    from bus.downlink import View, decode_chain, encode_chain

    rng = np.random.default_rng(0)
    theta = rng.standard_normal(5000).astype(np.float32)
    view = View(0, theta.copy())
    follower = View(0, theta.copy())
    for v in range(1, 30):
        theta = theta + (rng.standard_normal(5000) * 1e-2).astype(np.float32)
        blob, meta, view = encode_chain(theta, v, view, "topk4", k=256)
        assert meta == {"prev": v - 1, "chain": 1}
        follower = View(v, decode_chain(blob, meta, follower))
        assert np.array_equal(follower.params, view.params)  # the aggregator's view is the follower's
    # error feedback on the way down: the view lags the exact parameters by a bounded residual
    lag = np.abs(theta - view.params)
    assert lag.max() < 0.2, lag.max()
    with pytest.raises(MissingKeyframe) as e:
        decode_chain(blob, meta, View(v - 2, view.params))
    assert e.value.ref == v - 1
    # republished after a restart that kept the view: the view whole; one that lost it: exact whole
    blob2, meta2, same = encode_chain(theta, v, view, "topk4", k=256)
    assert meta2 == {"key": v, "chain": 1} and same is view
    assert np.array_equal(decode_chain(blob2, meta2, None), view.params)
    blob3, meta3, exact = encode_chain(theta, v + 5, view, "topk4", k=256)
    assert meta3 == {"key": v + 5, "chain": 1} and np.array_equal(exact.params, theta)
    with pytest.raises(ValueError):
        decode_chain(blob, {"prev": True, "chain": 1}, view)


async def test_aggregator_chains_versions_that_readers_follow_and_recover(nats_server, js):
    from tests.test_aggregator_service import RUN, _start, _until
    from tests.agg_helpers import FakeLearner
    from bus.global_reader import GlobalReader
    from bus.subjects import GLOBAL
    from bus.transport import VersionedStore

    opts = dict(require_membership=False, grace="fixed", grace_seconds=0.02, quorum=1, downlink_quantiser="topk4",
                downlink_chain=True, downlink_topk_k=256, max_staleness=100)
    from learner.startup import initial_blobs
    from tests.agg_helpers import PLAN, SPEC

    svc, stop, task = await _start(nats_server, **opts)
    reader = GlobalReader(js, RUN, lambda head, vec: vec)
    local = GlobalReader(js, RUN, lambda head, vec: vec)  # a built-in learner: version 0 from the seed
    local.local = local.v0_source = initial_blobs(SPEC, PLAN, 0)
    store = VersionedStore(js, RUN, GLOBAL)
    learner = FakeLearner(js, RUN, "a", 1, scale=1e-2)
    try:
        head, _ = await reader.newest(0)
        assert head.version == 0 and svc.versions.encoder.views[0].version == 0
        head, _ = await local.newest(0)
        assert head.version == 0 and local.local_hits == 1 and local.bytes_received == 0
        sizes = []
        for v in range(6):
            await learner.send(0, base=v)
            assert await _until(lambda: svc.published.get(0) == v + 1)
            head = await store.head(0)
            assert head.version == v + 1 and head.meta.get("prev") == v and head.meta.get("chain") == 1
            got = await reader.read(head)
            assert np.array_equal(got, svc.versions.encoder.views[0].params)  # bit for bit the aggregator's view
            assert np.array_equal(await local.read(head), got)
            sizes.append(head.size)
        # the first delta needed the whole view of version 1 (the reader held version 0 only as the
        # run's whole version, not as a view); every later one was a small delta
        assert reader.views_fetched == 1
        # the built-in learner rebuilt version 0 from the seed instead: nothing whole downloaded
        assert local.views_fetched == 0 and local.views_built == 1 and local.bytes_received == sum(sizes)
        assert max(sizes) < 0.2 * 4 * svc.states[0].params.size
        # the view lags the exact parameters by what is still to send (error feedback)
        assert not np.array_equal(svc.versions.encoder.views[0].params, svc.states[0].params)
        late = GlobalReader(js, RUN, lambda head, vec: vec)
        head, vec = await late.newest(0)
        assert head.version == 6 and late.views_fetched == 1 and np.array_equal(vec, svc.versions.encoder.views[0].params)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
    # a restarted aggregator takes the view back from the keyframe subjects: version 7 is a delta
    # against version 6, and a reader that followed needs nothing whole
    svc, stop, task = await _start(nats_server, **opts)
    try:
        assert svc.versions.encoder.views[0].version == 6
        await learner.send(0, base=6)
        assert await _until(lambda: svc.published.get(0) == 7)
        head = await store.head(0)
        assert head.meta.get("prev") == 6
        got = await reader.read(head)
        assert reader.views_fetched == 1 and np.array_equal(got, svc.versions.encoder.views[0].params)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
