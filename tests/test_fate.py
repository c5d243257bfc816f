"""What became of an island's work (learner.fate) and the aggregator's notices (aggregator.feedback): pure."""

from aggregator.feedback import FeedbackQueue
from learner.fate import REJECT_HINTS, WorkLedger


def test_rounds_sent_then_merged_once_each():
    w = WorkLedger()
    for r in range(3):
        w.on_sent(0, r, now=1.0)
    w.on_sent(1, 0, now=1.0)
    assert w.on_head(0, 5, [0, 1], now=2.0) == 2
    assert w.on_head(0, 6, [1], now=2.1) == 0  # listed again by a newer version: counted once
    assert w.on_head(1, 3, [7], now=2.2) == 0  # not a round we sent (another incarnation's)
    st = w.stats()
    assert (st["sent"], st["merged"], st["unresolved"]) == (4, 2, 2)
    assert st["last_merged_version"] == {"0": 5} and w.heads_seen == 3


def test_rejections_resolve_their_rounds_and_warn_once_per_reason():
    w = WorkLedger()
    for r in range(4):
        w.on_sent(2, r, now=0.0)
    assert w.on_rejected("too_stale", [(2, 0), (2, 1)], count=2) is True
    assert w.on_rejected("too_stale", [(2, 2)], count=1) is False
    assert w.on_rejected("norm_bound", [], count=3) is True  # rounds not named: counted all the same
    assert w.rejected == {"too_stale": 3, "norm_bound": 3} and w.rejected_total == 6
    assert set(w.outstanding) == {(2, 3)}
    assert w.stats()["warned"] == ["rejected:too_stale", "rejected:norm_bound"]
    assert "3 too_stale" in w.summary() and "1 not merged" in w.summary()


def test_not_admitted_is_said_once_after_the_wait():
    w = WorkLedger()
    kw = dict(admitted=False, member_state=None, num_fragments=2, admit_after=10.0, unmerged_rounds=3,
              unmerged_seconds=1e9)
    assert w.advice(100.0, **kw) == []  # nothing sent yet
    w.on_sent(0, 0, now=100.0)
    assert w.advice(109.0, **kw) == []
    (a,) = w.advice(110.5, **kw)
    assert a.event == "not_admitted" and "monitor" in a.message
    assert w.advice(200.0, **kw) == []  # once
    assert w.advice(200.0, **{**kw, "admitted": True}) == []


def test_work_not_merged_names_the_likely_cause_and_rearms_after_a_merge():
    def fed(n, **ledger_kw):
        w = WorkLedger(**ledger_kw)
        for r in range(n):
            w.on_sent(r % 2, r // 2, now=0.0)
        return w

    kw = dict(admitted=True, member_state="active", num_fragments=2, admit_after=1e9, unmerged_rounds=3,
              unmerged_seconds=1.0)
    assert fed(5).advice(1.0, **kw) == []  # 3 rounds per fragment: 6
    assert fed(6).advice(0.5, **kw) == []  # ... and a second since the first was sent
    (a,) = fed(6).advice(1.0, **kw)
    assert a.event == "work_not_merged" and "no global version was published" in a.message
    w = fed(6)
    w.heads_seen = 4
    assert "publishes versions without them" in w.advice(1.0, **kw)[0].message
    w = fed(6)
    w.on_rejected("unknown_learner", [], 2)
    assert REJECT_HINTS["unknown_learner"] in w.advice(1.0, **kw)[0].message
    w = fed(6)
    assert "not admitted" in w.advice(1.0, **{**kw, "admitted": False, "member_state": None})[0].message
    # a merge re-arms the warning; six more unmerged rounds, a second after it, bring it back
    w.on_head(0, 1, [0], now=2.0)
    assert w.advice(2.0, **kw) == []
    for r in range(10, 16):
        w.on_sent(r % 2, r, now=2.5)
    assert w.advice(2.5, **kw) == []
    assert [a.event for a in w.advice(3.0, **kw)] == ["work_not_merged"]


def test_feedback_queue_coalesces_per_learner_and_bounds_a_flood():
    q = FeedbackQueue(max_learners=2, max_rounds=2)
    for r in range(5):
        q.rejected("a", "inc1", "too_stale", 0, r)
    q.rejected("a", "inc1", "norm_bound", None, None)
    q.held("a", "inc1")
    q.rejected("b", "x", "unknown_learner", 1, 0)
    q.rejected("c", "y", "unknown_learner", 1, 0)  # a third learner in this pass: dropped, counted
    out = dict(q.take(ts=5.0))
    assert set(out) == {"a", "b"} and q.dropped == 1 and len(q) == 0
    a = out["a"]
    assert a["rejected"] == {"too_stale": 5, "norm_bound": 1} and a["rounds"] == {"too_stale": [[0, 0], [0, 1]]}
    assert a["held"] == 1 and a["incarnation"] == "inc1" and a["ts"] == 5.0
    # a new incarnation replaces the old one's notice: only the newest is told
    q.rejected("a", "old", "duplicate", 0, 0)
    q.rejected("a", "new", "duplicate", 0, 1)
    ((_, m),) = q.take(ts=6.0)
    assert m["incarnation"] == "new" and m["rejected"] == {"duplicate": 1}
