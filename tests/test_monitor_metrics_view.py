"""Tests of the pure metrics view (monitor/metrics_view.py): fold, filter, render."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from monitor.metrics_view import (
    AggregatorRow,
    EvaluatorRow,
    LearnerRow,
    MetricsSnapshot,
    filter_msg,
    fold,
    fold_all,
    render_table,
)

T = 1_700_000_000.0


def learner_msg(learner="l0", region="us-east", ts=T, **fields):
    return {"role": "learner", "run": "r1", "ts": ts, "learner": learner, "region": region, **fields}


RUN = [
    learner_msg(
        "l1", "us-east", T, state="active", step=1200, loss=2.34567, tokens_per_s=12345.0,
        bytes_sent=1_500_000, bytes_received=3 * 2**30, staleness=1,
    ),
    learner_msg("l0", "us-east", T + 1, state="active", step=1300, loss=2.1, tokens_per_s=900.0,
                bytes_sent=512, bytes_received=2048, staleness=0),
    learner_msg("z9", "eu-west", T + 2, state="suspect", step=800, loss=3.0),
    {"role": "aggregator", "run": "r1", "ts": T + 2, "versions": {"0": 7, "1": 9}, "merges": 12,
     "accepted": 30, "rejected": {"stale": 3, "evicted": 1}},
    {"role": "monitor", "run": "r1", "ts": T + 2,
     "counts": {"suspect": 1, "active": 2, "evicted": 0, "joining": 0, "rejoining": 0}},
    {"role": "evaluator", "run": "r1", "ts": T + 3, "eval_loss": 2.25, "version": 17},
]


def test_fold_builds_rows_per_role():
    snap = fold_all(MetricsSnapshot(run="r1"), RUN)
    assert snap.applied == 6 and snap.malformed == {} and snap.skipped == {}
    assert snap.last_ts == T + 3
    assert set(snap.learners) == {"l0", "l1", "z9"}
    assert snap.learners["l1"] == LearnerRow(
        learner="l1", region="us-east", state="active", step=1200, loss=2.34567,
        tokens_per_s=12345.0, bytes_sent=1_500_000, bytes_received=3 * 2**30, staleness=1.0, ts=T,
    )
    assert snap.aggregator == AggregatorRow(
        versions=((0, 7), (1, 9)), merges=12, accepted=30,
        rejected=(("evicted", 1), ("stale", 3)), ts=T + 2,
    )
    assert dict(snap.monitor.counts)["active"] == 2
    assert snap.evaluator == EvaluatorRow(eval_loss=2.25, version=17, ts=T + 3)


def test_the_shard_workers_of_an_aggregator_fold_into_one_row_whose_counts_never_go_back():
    def agg(ident, ts, versions, merges, rejected):
        return {"role": "aggregator", "run": "r1", "ts": ts, "id": ident, "versions": versions, "merges": merges,
                "accepted": merges, "rejected": rejected}

    snap = fold_all(MetricsSnapshot(run="r1"), [
        agg("agg-0-s0", T, {"0": 7, "1": 9}, 16, {"stale": 2}),
        agg("agg-0-s1", T + 1, {"2": 4}, 4, {"stale": 1, "evicted": 1}),
        agg("agg-0-s0", T + 2, {"0": 8, "1": 9}, 17, {"stale": 2}),
        agg("agg-0-s0", T + 0.5, {"0": 7, "1": 8}, 15, {}),  # older than what it shows: stale
    ])
    assert snap.aggregator == AggregatorRow(versions=((0, 8), (1, 9), (2, 4)), merges=21, accepted=21,
                                            rejected=(("evicted", 1), ("stale", 3)), ts=T + 2)
    assert snap.skipped == {"stale": 1}


def test_fold_is_pure():
    empty = MetricsSnapshot()
    one = fold(empty, RUN[0])
    two = fold(one, RUN[0] | {"ts": T + 5, "step": 5000})
    assert empty.learners == {} and empty.applied == 0
    assert one.learners["l1"].step == 1200 and two.learners["l1"].step == 5000


def test_partial_updates_keep_previous_fields():
    snap = fold_all(MetricsSnapshot(), [RUN[0], {"role": "learner", "run": "r1", "ts": T + 1, "learner": "l1", "step": 1300}])
    row = snap.learners["l1"]
    assert row.step == 1300 and row.loss == 2.34567 and row.region == "us-east" and row.ts == T + 1


def test_older_messages_are_skipped_as_stale():
    snap = fold_all(MetricsSnapshot(), [learner_msg(ts=T + 5, step=50), learner_msg(ts=T + 1, step=10)])
    assert snap.learners["l0"].step == 50
    assert snap.skipped == {"stale": 1} and snap.applied == 1
    agg = {"role": "aggregator", "run": "r1", "merges": 3}
    snap = fold_all(snap, [agg | {"ts": T + 5}, agg | {"ts": T, "merges": 1}])
    assert snap.aggregator.merges == 3 and snap.skipped == {"stale": 2}


def test_other_runs_are_skipped_only_when_the_snapshot_has_a_run():
    msg = learner_msg() | {"run": "r2"}
    assert fold(MetricsSnapshot(run="r1"), msg).skipped == {"other_run": 1}
    assert "l0" in fold(MetricsSnapshot(), msg).learners


def test_learner_count_is_bounded():
    snap = MetricsSnapshot(max_learners=2)
    snap = fold_all(snap, [learner_msg(f"l{i}") for i in range(5)] + [learner_msg("l0", ts=T + 1)])
    assert set(snap.learners) == {"l0", "l1"} and snap.skipped == {"too_many_learners": 3}
    assert snap.learners["l0"].ts == T + 1  # known learners still update


def test_nan_loss_is_shown_not_dropped():
    snap = fold(MetricsSnapshot(), learner_msg(loss=math.nan))
    assert math.isnan(snap.learners["l0"].loss) and snap.malformed == {}
    assert " nan " in render_table(snap)


def test_integral_floats_are_accepted_for_counters():
    snap = fold(MetricsSnapshot(), learner_msg(step=12.0, bytes_sent=1e6))
    assert snap.learners["l0"].step == 12 and isinstance(snap.learners["l0"].step, int)
    assert snap.learners["l0"].bytes_sent == 1_000_000


@pytest.mark.parametrize(
    "msg, reason",
    [
        ("not json", "not_an_object"),
        (None, "not_an_object"),
        ([1, 2], "not_an_object"),
        ({"run": "r1", "ts": T}, "missing_role"),
        ({"role": "trainer", "run": "r1", "ts": T}, "bad_role"),
        ({"role": ["learner"], "run": "r1", "ts": T}, "bad_role"),
        ({"role": "learner", "ts": T, "learner": "l0"}, "missing_run"),
        ({"role": "learner", "run": "r1", "learner": "l0"}, "missing_ts"),
        (learner_msg(ts=math.nan), "bad_ts"),
        (learner_msg(ts=-1), "bad_ts"),
        (learner_msg(ts=T * 1000), "bad_ts"),  # milliseconds, not seconds
        (learner_msg(ts="now"), "bad_ts"),
        ({"role": "learner", "run": "r1", "ts": T}, "missing_learner"),
        (learner_msg(learner=""), "bad_learner"),
        (learner_msg(learner="x" * 200), "bad_learner"),
        (learner_msg(learner="l0\x1b[2J"), "bad_learner"),  # terminal escape injection
        (learner_msg(region=3), "bad_region"),
        (learner_msg(state="ok\n"), "bad_state"),
        (learner_msg(step=-1), "bad_step"),
        (learner_msg(step=1.5), "bad_step"),
        (learner_msg(step=True), "bad_step"),
        (learner_msg(step=2**64), "bad_step"),
        (learner_msg(loss="low"), "bad_loss"),
        (learner_msg(tokens_per_s=-5.0), "bad_tokens_per_s"),
        (learner_msg(tokens_per_s=math.inf), "bad_tokens_per_s"),
        (learner_msg(bytes_sent=-1), "bad_bytes_sent"),
        (learner_msg(bytes_received=math.nan), "bad_bytes_received"),
        (learner_msg(staleness=-2), "bad_staleness"),
        ({"role": "aggregator", "run": "r1", "ts": T, "versions": {"a": 1}}, "bad_versions"),
        ({"role": "aggregator", "run": "r1", "ts": T, "versions": {"0": -1}}, "bad_versions"),
        ({"role": "aggregator", "run": "r1", "ts": T, "versions": [1, 2]}, "bad_versions"),
        ({"role": "aggregator", "run": "r1", "ts": T, "merges": -3}, "bad_merges"),
        ({"role": "aggregator", "run": "r1", "ts": T, "rejected": {"stale": -1}}, "bad_rejected"),
        ({"role": "aggregator", "run": "r1", "ts": T, "rejected": {"\x07": 1}}, "bad_rejected"),
        ({"role": "monitor", "run": "r1", "ts": T, "counts": "3 active"}, "bad_counts"),
        ({"role": "evaluator", "run": "r1", "ts": T, "version": -1}, "bad_version"),
        ({"role": "evaluator", "run": "r1", "ts": T, "eval_loss": [1]}, "bad_eval_loss"),
    ],
)
def test_malformed_messages_are_counted_not_raised_nor_applied(msg, reason):
    base = fold_all(MetricsSnapshot(), RUN)
    snap = fold(base, msg)
    assert snap.malformed == {reason: 1}
    assert snap.applied == base.applied and snap.last_ts == base.last_ts
    assert snap.learners == base.learners and snap.aggregator == base.aggregator
    assert snap.monitor == base.monitor and snap.evaluator == base.evaluator
    assert f"malformed   1 ({reason} 1)" in render_table(snap, width=200)


def test_one_bad_field_drops_the_whole_message():
    snap = fold(MetricsSnapshot(), learner_msg(step=10, loss=1.0))
    snap = fold(snap, learner_msg(ts=T + 1, step=20, loss=0.5, bytes_sent=-1))
    assert snap.learners["l0"].step == 10 and snap.learners["l0"].loss == 1.0


def test_unhashable_or_odd_values_never_raise():
    weird = [
        {"role": {"a": 1}, "run": "r1", "ts": T},
        {"role": "learner", "run": {"x": 1}, "ts": T, "learner": "l0"},
        learner_msg(learner=["l0"]),
        {"role": "aggregator", "run": "r1", "ts": T, "versions": {"0": [1]}},
        {"role": "aggregator", "run": "r1", "ts": T, "rejected": {1: 1}},
        {"role": "monitor", "run": "r1", "ts": T, "counts": {"active": "2"}},
    ]
    snap = fold_all(MetricsSnapshot(), weird)
    assert snap.malformed_total == len(weird) and snap.applied == 0


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=4), kids, max_size=3),
    max_leaves=8,
)
msg_keys = st.sampled_from(
    ["role", "run", "ts", "learner", "region", "state", "step", "loss", "tokens_per_s", "bytes_sent",
     "bytes_received", "staleness", "versions", "merges", "accepted", "rejected", "counts",
     "eval_loss", "version"]
)
messages = st.one_of(
    json_values,
    st.dictionaries(msg_keys, json_values, max_size=8),
    st.builds(
        lambda role, extra: {"role": role, "run": "r1", "ts": T, "learner": "l0"} | extra,
        st.sampled_from(["learner", "aggregator", "monitor", "evaluator"]),
        st.dictionaries(msg_keys, json_values, max_size=4),
    ),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(messages, max_size=12), st.integers(20, 160))
def test_fold_and_render_never_raise_and_account_for_every_message(msgs, width):
    snap = fold_all(MetricsSnapshot(run="r1"), msgs)
    assert snap.applied + snap.malformed_total + snap.skipped_total == len(msgs)
    text = render_table(snap, width=width)
    assert all(len(line) <= width for line in text.splitlines())
    assert text.isascii() or all(ch.isprintable() for ch in text.replace("\n", ""))


# --------------------------------------------------------------------------- filter


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, [True] * 6),
        ({"role": "learner"}, [True, True, True, False, False, False]),
        ({"role": "aggregator"}, [False, False, False, True, False, False]),
        ({"learner": "l0"}, [False, True, False, False, False, False]),
        ({"region": "us-east"}, [True, True, False, False, False, False]),
        ({"role": "learner", "region": "eu-west"}, [False, False, True, False, False, False]),
        ({"role": "monitor", "learner": "l0"}, [False] * 6),
    ],
)
def test_filter_msg(kwargs, expected):
    assert [filter_msg(m, **kwargs) for m in RUN] == expected


def test_filter_msg_never_raises_on_garbage():
    assert filter_msg("x") is False
    assert filter_msg(None, role="learner") is False
    assert filter_msg({"role": ["x"]}, role="learner") is False


# --------------------------------------------------------------------------- render


def test_render_table_golden():
    snap = fold_all(MetricsSnapshot(run="r1"), RUN)
    text = render_table(snap, width=100, now=T + 4)
    expected = "\n".join(
        [
            "run r1 | 3 learners | 6 messages",
            "REGION  LEARNER     STATE      STEP     LOSS   TOK/S      SENT      RECV STALE   AGE",
            "eu-west z9        suspect       800   3.0000       -         -         -     -  2.0s",
            "us-east l0         active      1300   2.1000     900      512B    2.0KiB     0  3.0s",
            "us-east l1         active      1200   2.3457   12.3k    1.4MiB    3.0GiB     1  4.0s",
            "aggregator  merges 12  accepted 30  rejected 4 (evicted 1, stale 3)  versions f0=v7 f1=v9",
            "monitor     joining 0  active 2  suspect 1  evicted 0  rejoining 0",
            "evaluator   eval_loss 2.2500 after 17 merges",
        ]
    )
    assert text == expected


def test_render_rows_sorted_by_region_then_learner_and_is_deterministic():
    shuffled = [RUN[i] for i in (5, 2, 0, 4, 1, 3)]
    a = render_table(fold_all(MetricsSnapshot(run="r1"), RUN), now=T + 4)
    b = render_table(fold_all(MetricsSnapshot(run="r1"), shuffled), now=T + 4)
    assert a == b
    rows = [line.split()[:2] for line in a.splitlines()[2:5]]
    assert rows == [["eu-west", "z9"], ["us-east", "l0"], ["us-east", "l1"]]


def test_render_age_defaults_to_newest_message():
    snap = fold_all(MetricsSnapshot(), [learner_msg("a", ts=T), learner_msg("b", ts=T + 30)])
    lines = render_table(snap).splitlines()
    assert lines[2].endswith(" 30s") and lines[3].endswith(" 0.0s")


def test_render_empty_snapshot():
    text = render_table(MetricsSnapshot())
    assert text.splitlines() == [
        "all runs | 0 learners | 0 messages",
        "no learner metrics yet",
        "aggregator  -",
        "monitor     -",
        "evaluator   -",
    ]


def test_render_many_fragments_are_summarised_and_narrow_width_is_respected():
    versions = {str(i): 100 + i for i in range(24)}
    snap = fold_all(
        MetricsSnapshot(),
        [
            {"role": "aggregator", "run": "r1", "ts": T, "versions": versions, "merges": 1},
            learner_msg("a-very-long-learner-identifier-0001", "asia-southeast-1-long-region"),
            "junk",
        ],
    )
    wide = render_table(snap, width=200)
    assert "versions v100..v123 over 24 fragments" in wide
    assert "skipped" not in wide and "malformed   1 (not_an_object 1)" in wide
    for width in (20, 40, 60, 80):
        assert all(len(line) <= width for line in render_table(snap, width=width).splitlines())


def test_render_formats_big_numbers():
    snap = fold(MetricsSnapshot(), learner_msg(tokens_per_s=2.5e6, bytes_sent=5 * 2**40, step=10**9, loss=12345.0))
    row = render_table(snap, width=200).splitlines()[2]
    assert "2.5M" in row and "5.0TiB" in row and " 1.0G " in row and " 12345.00 " in row
    assert "~" not in row
    row = render_table(fold(snap, learner_msg(ts=T + 1, step=999_999_999)), width=200).splitlines()[2]
    assert " 999999999 " in row


@pytest.mark.parametrize(
    "fields",
    [
        {"loss": -123.456789, "staleness": 123456, "tokens_per_s": 9e18, "bytes_sent": 2**63 - 1},
        {"loss": -1.5e300, "staleness": 0.25, "tokens_per_s": 0.5, "bytes_received": 0},
        {"loss": 1e-9, "step": 2**63 - 1, "ts": 1.0},  # AGE of decades
    ],
)
def test_extreme_values_are_never_clipped_in_the_table(fields):
    snap = fold(MetricsSnapshot(), learner_msg(**fields))
    assert snap.malformed == {}
    text = render_table(snap, width=200, now=T)
    assert "~" not in text, text


def test_unexpected_errors_while_reading_a_message_are_counted_as_unreadable():
    class Exploding(dict):
        def get(self, key, default=None):
            if key == "ts":
                raise RuntimeError("boom")
            return super().get(key, default)

    snap = fold(MetricsSnapshot(), Exploding(learner_msg()))
    assert snap.malformed == {"unreadable": 1} and snap.learners == {}
