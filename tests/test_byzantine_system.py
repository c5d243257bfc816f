"""A learner that lies within every bound, in a whole run of real processes (issue 29).

Four learners of the chaos test's tiny model on a real nats-server with the aggregator, the
monitor and the evaluator (the aggregator's merge at its defaults: quorum all, adaptive grace;
the harness's fast monitor timings); learner ``l0`` is
``bench.byzantine_learner``: the real learner process sending the negation of every outer gradient
it trains (same norm, counters, heartbeats). Every check passes it. The run must say who: the
aggregator's metrics and ``diloco status`` name ``l0`` with reason ``opposes`` and trust 0, as the
least trusted learner by far; its contributions are applied (acknowledged, counted) at weight 0;
the run trains on. What one such learner costs in held-out loss, against clean runs: bench.byzantine.
"""

from __future__ import annotations

import pytest

from bench.byzantine import system_run


@pytest.mark.timeout(400)
async def test_a_sign_flipping_learner_is_named_and_merges_at_weight_zero(tmp_path):
    # 600 steps: long enough that most merges hold all four learners (trust judges by three others),
    # whatever the admission order of the first seconds (240 steps on an idle machine ended first)
    res = await system_run(str(tmp_path), "sign", steps=600, status=True)
    trust = res["trust"]
    assert trust is not None and set(trust) == {"l0", "l1", "l2", "l3"}, res
    liar = trust["l0"]
    assert liar["reason"] == "opposes" and liar["trust"] == 0.0, res
    assert res["distrusted"].get("l0", 0) >= 10, res  # merged (acknowledged) at weight 0, counted
    # the liar is the least trusted, by far; honest learners are not free of false flags yet (open:
    # over 4 runs, 0-16 of an honest learner's ~150 contributions merged at weight 0 against the
    # liar's 168-264, and once an honest learner ended flagged "opposes"; docs/security.md)
    assert all(liar["score"] < trust[name]["score"] for name in ("l1", "l2", "l3")), res
    honest_zero = max(res["distrusted"].get(name, 0) for name in ("l1", "l2", "l3"))
    assert honest_zero <= 0.1 * res["distrusted"]["l0"], res
    assert not res["rejected"], res  # it passed every check: nothing was rejected
    assert res["final"] < 0.8 * res["first"], res  # the run trained on
    shown = res["status"]
    assert shown["trust"]["l0"]["reason"] == "opposes", shown
    assert "suspects   l0 (opposes" in shown["text"] and "0.00 opposes" in shown["text"], shown["text"]
