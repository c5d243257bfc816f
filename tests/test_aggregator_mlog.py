"""The merge log (aggregator.mlog): records, replay, the checkpoint policy. Pure: no server."""

import dataclasses

import numpy as np
import pytest

from aggregator.contribution import Contribution
from aggregator.mlog import (CheckpointPolicy, LoggedContribution, MergeRecord, applied_without_replay, log_slots,
                             replay_one, settings_from_dict, settings_to_dict)
from aggregator.step import FragmentState, MergeSettings, merge_step
from aggregator.weights import StalenessPolicy

N = 1000


def _contrib(learner: str, rnd: int, base: int, seed: int, steps: int = 12) -> Contribution:
    vec = (np.random.default_rng(seed).standard_normal(N) * 1e-2).astype(np.float32)
    return Contribution("r", "h", learner, "inc", 0, rnd, base, steps, steps * 64, vec, period=12)


def _logged(c: Contribution) -> LoggedContribution:
    return LoggedContribution(c.learner, c.incarnation, c.fragment, c.round, c.base_version, (7, 8),
                              float(np.sqrt(np.dot(c.vector, c.vector))), 4 * N)


def _rounds(settings: MergeSettings, rounds: int = 6):
    """Merges of two learners, alternately one and two contributions per merge."""
    out = []
    v = 0
    for r in range(1, rounds + 1):
        batch = [_contrib("a", r, v, 10 * r)] + ([_contrib("b", r, max(0, v - 1), 10 * r + 1)] if r % 2 else [])
        v += 1
        out.append(batch)
    return out


SETTINGS = [MergeSettings(momentum=0.5, max_inner_lr=0.01),
            MergeSettings(method="rda", optimizer="nesterov", momentum=0.9,
                          staleness=StalenessPolicy("hinge", 0.3, 2)),
            MergeSettings(optimizer="delayed", delay_n=2, robust="clip", downlink_quantiser="int8"),
            MergeSettings(momentum=0.5, max_inner_lr=0.01, momentum_dtype="bfloat16")]


def test_a_bfloat16_momentum_is_checkpointed_in_two_bytes_a_value_and_read_back_as_it_was():
    s = SETTINGS[3]
    st = FragmentState.initial(0, 0, np.linspace(-1, 1, N, dtype=np.float32), s)
    for batch in _rounds(s, 3):
        st = merge_step(st, batch, s, None, 0.5, 2, inplace=True)
    assert st.opt.momentum.dtype.name == "bfloat16" and st.opt.momentum.any()
    assert st.array_bytes() == 4 * N + 2 * N  # the parameters, then the trace
    back = FragmentState.from_bytes(st.to_bytes())
    assert back.opt.momentum.dtype.name == "bfloat16"
    assert np.array_equal(back.opt.momentum.view(np.uint16), st.opt.momentum.view(np.uint16))
    assert np.array_equal(back.params, st.params)
    assert FragmentState.from_bytes(back.to_bytes()).to_bytes() == back.to_bytes()
    # a float32 state's checkpoint is written as before (no dtypes in its header)
    f32 = FragmentState.initial(0, 0, np.zeros(N, np.float32), SETTINGS[0])
    assert b"dtypes" not in f32.to_bytes()[:200] and f32.array_bytes() == 8 * N


@pytest.mark.parametrize("settings", SETTINGS)
def test_replaying_the_records_gives_the_merged_state_bit_for_bit(settings):
    st = FragmentState.initial(0, 0, np.linspace(-1, 1, N, dtype=np.float32), settings)
    live = FragmentState.from_bytes(st.to_bytes())
    records = []
    for batch in _rounds(settings):
        norms = [float(np.sqrt(np.dot(c.vector, c.vector))) for c in batch]
        scale, per_round = len(batch) / 2, 2
        live = merge_step(live, batch, settings, norms, scale, per_round, inplace=True)
        rec = MergeRecord(0, live.version, tuple(_logged(c) for c in batch), scale, per_round,
                          settings_to_dict(settings), ts=1.5)
        records.append((MergeRecord.from_bytes(rec.to_bytes()), batch))
        assert MergeRecord.from_bytes(rec.to_bytes()) == rec
    replayed = FragmentState.from_bytes(st.to_bytes())
    for rec, batch in records:
        replayed = replay_one(replayed, rec, batch, inplace=True)
    assert replayed.version == live.version == 6
    assert replayed.to_bytes() == live.to_bytes()  # params, optimizer arrays, applied set, norms


def test_in_place_and_copying_merges_agree_bitwise_and_copying_leaves_the_state_alone():
    s = SETTINGS[0]
    a = FragmentState.initial(0, 0, np.linspace(-1, 1, N, dtype=np.float32), s)
    b = FragmentState.from_bytes(a.to_bytes())
    before = a.to_bytes()
    for batch in _rounds(s, 4):
        a2 = merge_step(a, batch, s, None, 0.5, 2)
        assert a.to_bytes() == before  # not modified
        b = merge_step(b, batch, s, None, 0.5, 2, inplace=True)
        a, before = a2, a2.to_bytes()
    assert a.to_bytes() == b.to_bytes()


def test_settings_round_trip_and_a_record_of_another_format_is_refused():
    for s in SETTINGS:
        assert settings_from_dict(settings_to_dict(s)) == s
    rec = MergeRecord(0, 1, (), 1.0, 1, settings_to_dict(SETTINGS[0]))
    import msgpack
    d = msgpack.unpackb(rec.to_bytes())
    d["fmt"] = 99
    with pytest.raises(ValueError, match="format"):
        MergeRecord.from_bytes(msgpack.packb(d))


def test_a_record_must_follow_its_state_and_name_its_contributions():
    s = SETTINGS[0]
    st = FragmentState.initial(0, 3, np.zeros(N, np.float32), s)
    c = _contrib("a", 1, 3, 1)
    with pytest.raises(ValueError, match="does not follow"):
        replay_one(st, MergeRecord(0, 5, (_logged(c),), 1.0, 1, settings_to_dict(s)), [c])
    with pytest.raises(ValueError, match="do not match"):
        replay_one(st, MergeRecord(0, 4, (_logged(_contrib("b", 1, 3, 2)),), 1.0, 1, settings_to_dict(s)), [c])


def test_restarts_in_a_record_are_applied_before_its_merge():
    s = SETTINGS[0]
    st = FragmentState.initial(0, 0, np.zeros(N, np.float32), s)
    for x in (1.0, 2.0, 3.0):
        st.norms.add(0, x)
    c = _contrib("a", 1, 0, 1)
    out = replay_one(FragmentState.from_bytes(st.to_bytes()),
                     MergeRecord(0, 1, (_logged(c),), 1.0, 1, settings_to_dict(s), restarts=((0.5, 0.25),)), [c])
    got = out.norms.to_dict()["norms"][0][1]
    assert got[:2] == [0.5, 0.25] and len(got) == 3  # the restart, then the merge's own norm


def test_trust_clears_in_a_record_are_applied_before_its_merge_and_replay_bit_for_bit():
    """``diloco trust clear``: the live merge applies a clear before merging and logs it with the
    record; a replay of the record applies it at the same point, so the state is the same bit for bit."""
    from aggregator.mlog import with_clears
    from aggregator.trust import TrustSettings

    s = dataclasses.replace(SETTINGS[0], trust=TrustSettings(mode="weigh"))
    rng = np.random.default_rng(3)
    st = FragmentState.initial(0, 0, np.zeros(N, np.float32), s)
    records = []
    live = FragmentState.from_bytes(st.to_bytes())
    for r in range(1, 12):
        common = rng.standard_normal(N) * 1e-2
        batch = [Contribution("r", "h", x, "inc", 0, r, live.version, 12, 12 * 64,
                              ((-1 if x == "l0" else 1) * (common + 1e-2 * rng.standard_normal(N))).astype(np.float32),
                              period=12) for x in ("l0", "l1", "l2", "l3")]
        cleared = (("l0", 5),) if r == 9 else ()
        live = with_clears(live, cleared)
        live = merge_step(live, batch, s, [c.norm for c in (_logged(c) for c in batch)], 1.0, 4, inplace=True)
        rec = MergeRecord(0, live.version, tuple(_logged(c) for c in batch), 1.0, 4, settings_to_dict(s), cleared=cleared)
        assert MergeRecord.from_bytes(rec.to_bytes()) == rec
        records.append((MergeRecord.from_bytes(rec.to_bytes()), batch))
        if r == 8:
            assert live.trust.learners["l0"].reason == "opposes"
    assert live.trust.cleared == {"l0": 5} and live.trust.learners["l0"].seen == 3  # measured afresh since
    replayed = FragmentState.from_bytes(st.to_bytes())
    for rec, batch in records:
        replayed = replay_one(replayed, rec, batch, inplace=True)
    assert replayed.to_bytes() == live.to_bytes()


def test_lost_contributions_advance_the_version_and_count_as_applied_without_moving_the_params():
    s = SETTINGS[0]
    st = FragmentState.initial(0, 0, np.ones(N, np.float32), s)
    c = _contrib("a", 1, 0, 1)
    out = applied_without_replay(st, MergeRecord(0, 1, (_logged(c),), 1.0, 1, settings_to_dict(s)))
    assert out.version == 1 and out.applied.is_duplicate(c) and not st.applied.is_duplicate(c)
    assert np.array_equal(out.params, st.params)


def test_checkpoint_policy_and_slots():
    p = CheckpointPolicy(every=4, seconds=10.0)
    assert not p.due(0, 1e6)  # nothing since the checkpoint: nothing to write
    assert not p.due(3, 9.0)
    assert p.due(4, 0.0) and p.due(1, 10.0)
    assert log_slots(4) > 2 * 4  # the versions a checkpoint may lag (2 x every) always fit
    assert dataclasses.replace(p, every=1).due(1, 0)


def test_a_checkpoint_is_forced_only_when_the_grad_stream_is_about_to_drop_what_a_replay_reads():
    from aggregator.mlog import stream_overtaking

    assert not stream_overtaking(None, 1, 100, 10**9, 10**9)  # nothing logged since the checkpoint
    assert not stream_overtaking(1, 1, 100, 10, 10**9)  # a stream far from its limit drops nothing
    assert stream_overtaking(10, 1, 100, 800, 1000)  # full, and the log points into its oldest quarter
    assert not stream_overtaking(60, 1, 100, 800, 1000)  # full, but the log's chunks are recent
    assert stream_overtaking(5, 9, 100, 10, 10**9)  # already dropped (age or bytes): at once


def test_an_early_checkpoint_pays_once_enough_was_merged_since_the_last():
    from aggregator.mlog import early_checkpoint_pays, grad_backlog_behind

    # keeping up: a quarter of the fragment's share of the stream (16 x 1,200 bytes over 8 equal
    # fragments: a share of 2,400, so 600), so a log that spans half the stream or more is
    # checkpointed and a restart replays it all
    share = 16 * 1200 // 8
    assert not early_checkpoint_pays(2 * 164, 1200, share, behind=False)  # two merges of 100 values
    assert early_checkpoint_pays(600, 1200, share, behind=False)
    assert early_checkpoint_pays(4 * 1200, 1200, 10**9, behind=False)  # a big stream: 4 checkpoints' bytes
    # behind: the stream is full of work not read, every log is at its old end after a merge or two;
    # 4 checkpoints' bytes (STATE writes at most a quarter of the GRAD bytes merged)
    assert not early_checkpoint_pays(1200, 1200, share, behind=True)
    assert not early_checkpoint_pays(4 * 1200 - 1, 1200, share, behind=True)
    assert early_checkpoint_pays(4 * 1200, 1200, share, behind=True)
    assert early_checkpoint_pays(1, 1200, 0, behind=False)  # no byte limit known: the old rule
    # behind: a quarter of the aggregator's part of the stream not delivered yet
    assert grad_backlog_behind(101, 800, 4, 8) and not grad_backlog_behind(100, 800, 4, 8)
    assert not grad_backlog_behind(0, 0, 8, 8)


def test_checkpoint_copies_in_flight_are_bounded_in_count_and_bytes():
    from aggregator.mlog import CHECKPOINT_BYTES_IN_FLIGHT, checkpoint_may_start

    mb = 1 << 20
    assert checkpoint_may_start([], 4 * CHECKPOINT_BYTES_IN_FLIGHT)  # one always may: 1B's 1 GB fragment
    assert not checkpoint_may_start([1024 * mb], 1024 * mb)  # a second copy of 1 GB waits
    assert checkpoint_may_start([100 * mb], 100 * mb)  # 100M in 8 fragments: two of 100 MB at once
    assert not checkpoint_may_start([10 * mb, 10 * mb], 10 * mb)  # never more than two
    assert not checkpoint_may_start([200 * mb], 100 * mb)


async def test_the_log_is_read_by_subject_every_record_a_slot_holds(js):
    """A restart reads a fragment's log subject by subject (a scan of STATE from sequence 1 timed out
    at 1B): the newest message of a slot that holds one, every message of one that holds more (a
    slot shared by two versions after DILOCO_CHECKPOINT_EVERY was lowered), the newest copy of a
    version winning; other fragments' records and other subjects are not read."""
    import structlog
    from nats.js.api import StreamConfig

    from aggregator.durability import read_log
    from aggregator.mlog import MergeRecord, settings_to_dict
    from aggregator.step import MergeSettings
    from bus.subjects import Subjects

    s = Subjects("logrun")
    await js.add_stream(StreamConfig(name=s.stream("state"), subjects=[f"{s.prefix}.state.>"], max_msgs_per_subject=2,
                                     allow_direct=True))
    settings = settings_to_dict(MergeSettings())

    async def put(frag: int, version: int, slot: int, scale: float = 1.0) -> None:
        rec = MergeRecord(frag, version, (), scale, 1, settings)
        await js.publish(s.merge_log(frag, slot), rec.to_bytes())

    for v in range(1, 6):
        await put(0, v, v % 4)  # slot 1 holds versions 1 and 5
    await put(0, 3, 3, scale=0.5)  # a second copy of version 3: the newest wins
    await put(1, 9, 1)  # another fragment's
    await js.publish(f"{s.prefix}.state.0.ckpt", b"not a record")

    log = structlog.get_logger()
    got = await read_log(js, s, 0, log)
    assert sorted(got) == [1, 2, 3, 4, 5] and got[3].scale == 0.5 and got[5].fragment == 0
    assert sorted(await read_log(js, s, 1, log)) == [9]
    assert await read_log(js, s, 2, log) == {}
