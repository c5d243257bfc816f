"""A learner that lies within every bound, in a whole run of real processes (issues 29 and 39).

Four learners of the chaos test's tiny model on a real nats-server with the aggregator, the
monitor and the evaluator (the aggregator's merge at its defaults, with ``DILOCO_TRUST=weigh``: a
run open to parties the operator does not control), in two regions whose data differ: ``l0`` and
``l1`` train on the standard library's Python, ``l2`` and ``l3`` on the interpreter's C headers
(``bench.noniid.other_corpus``). Learner ``l0`` is
``bench.byzantine_learner``: the real learner process sending the negation of every outer gradient
it trains (same norm, counters, heartbeats). Every check passes it. The run must say who, and only
who: the aggregator's metrics and ``diloco status`` name ``l0`` (``opposes``, trust 0) and no honest
learner; no honest contribution merges below full weight; the liar's contributions are applied
(acknowledged, counted) at weight 0; the run trains on. What one such learner costs:
bench.byzantine, bench.noniid. An operator's clear of a learner: tests/test_aggregator_service.py.
"""

from __future__ import annotations

import pytest

from bench.byzantine import system_run
from bench.noniid import other_corpus


@pytest.mark.timeout(400)
async def test_a_sign_flipping_learner_is_named_and_weighed_out_and_no_honest_one_is(tmp_path):
    # 600 steps: long enough that most merges hold all four learners (trust judges by the pairs of
    # four), whatever the admission order of the first seconds
    other = other_corpus()
    res = await system_run(str(tmp_path), "sign", steps=600, status=True, corpora={"l2": other, "l3": other})
    trust = res["trust"]
    assert trust is not None and set(trust) == {"l0", "l1", "l2", "l3"}, res
    liar = trust["l0"]
    assert liar["reason"] == "opposes" and liar["trust"] == 0.0, res
    assert res["distrusted"].get("l0", 0) >= 10, res  # merged (acknowledged) at weight 0, counted
    for name in ("l1", "l2", "l3"):  # no honest learner suspected, none of its work below full weight
        assert trust[name]["reason"] == "" and trust[name]["trust"] == 1.0, res
        assert res["downweighted"].get(name, 0) == 0, res
    assert not any('"learner": "l0"' not in ln and '"learner":"l0"' not in ln for ln in res["suspected_lines"]), res
    assert not res["rejected"], res  # it passed every check: nothing was rejected
    assert res["final"] < 0.8 * res["first"], res  # the run trained on (held-out: the standard library's)
    shown = res["status"]
    assert shown["trust"]["l0"]["reason"] == "opposes", shown
    assert "suspects   l0 (opposes, median" in shown["text"] and "0.00 opposes" in shown["text"], shown["text"]
