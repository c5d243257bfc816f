"""A learner that lies within every bound, and regions whose data differ, in whole runs of real
processes (issues 29 and 39).

Four learners of the chaos test's tiny model on a real nats-server with the aggregator, the
monitor and the evaluator (the aggregator's merge at its defaults, with ``DILOCO_TRUST=weigh``: a
run open to parties the operator does not control).

* One liar: ``l0`` is ``bench.byzantine_learner``, the real learner process sending the negation of
  every outer gradient it trains (same norm, counters, heartbeats). Every check passes it. The run
  must say who, and only who: the aggregator's metrics and ``diloco status`` name ``l0``
  (``opposes``, trust 0) and no honest learner; no honest contribution merges below full weight;
  the liar's contributions are applied (acknowledged, counted) at weight 0; the run trains on.
* Two regions, nobody lying: ``l2`` and ``l3`` train on the interpreter's C headers
  (``bench.noniid.other_corpus``), ``l0`` and ``l1`` on the standard library's Python. Different
  is not hostile: nobody is suspected and nothing merges below full weight, although the check
  judged (it was not merely blind).

With two regions of two and a liar in one of them, the check judges only while the regions' outer
gradients share a direction (docs/security.md: the region's honest learner is then without a
partner, and by direction alone indistinguishable from the liar): that case is measured in
``bench.noniid``, not asserted here. An operator's clear: tests/test_aggregator_service.py.
"""

from __future__ import annotations

import pytest

from bench.byzantine import system_run
from bench.noniid import other_corpus


@pytest.mark.timeout(400)
async def test_a_sign_flipping_learner_is_named_and_weighed_out_and_no_honest_one_is(tmp_path):
    # 600 steps: long enough that most merges hold all four learners (trust judges by the pairs of
    # four), whatever the admission order of the first seconds
    res = await system_run(str(tmp_path), "sign", steps=600, status=True)
    trust = res["trust"]
    assert trust is not None and set(trust) == {"l0", "l1", "l2", "l3"}, res
    liar = trust["l0"]
    assert liar["reason"] == "opposes" and liar["trust"] == 0.0, res
    assert res["distrusted"].get("l0", 0) >= 10, res  # merged (acknowledged) at weight 0, counted
    for name in ("l1", "l2", "l3"):  # no honest learner suspected, none of its work below full weight
        assert trust[name]["reason"] == "" and trust[name]["trust"] == 1.0, res
        assert res["downweighted"].get(name, 0) == 0, res
    assert all('"l0"' in ln for ln in res["suspected_lines"]), res["suspected_lines"]
    assert not res["rejected"], res  # it passed every check: nothing was rejected
    assert res["final"] < 0.8 * res["first"], res  # the run trained on
    shown = res["status"]
    assert shown["trust"]["l0"]["reason"] == "opposes", shown
    assert "suspects   l0 (opposes, median" in shown["text"] and "0.00 opposes" in shown["text"], shown["text"]


@pytest.mark.timeout(400)
async def test_two_regions_whose_data_differ_are_not_suspected(tmp_path):
    other = other_corpus()
    res = await system_run(str(tmp_path), "", steps=600, corpora={"l2": other, "l3": other})
    trust = res["trust"]
    assert trust is not None and set(trust) == {"l0", "l1", "l2", "l3"}, res
    assert not any(rec["reason"] for rec in trust.values()), trust
    assert not any((res["downweighted"] or {}).values()), res
    assert not res["suspected_lines"], res["suspected_lines"]
    # the check judged on some fragment at some point: it was not merely blind all run
    assert any(any((h["judging"] or {}).values()) for h in res["history"]), res["history"][-3:]
    assert res["final"] < 0.8 * res["first"], res
