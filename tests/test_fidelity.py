"""The system against the in-process reference (bench.fidelity): real roles over a real NATS server,
learners in step (DILOCO_MODE=sync, DILOCO_START_WITH=M), then simulation.reference on the same run with
the learners' incarnations. The two compute the same thing: the held-out losses agree (they agreed
bit for bit in every run so far; the target is 0.5%)."""

import asyncio

import pytest


@pytest.mark.timeout(240)
def test_the_system_trains_what_the_reference_trains():
    from bench.fidelity import measure

    r = asyncio.run(measure(quick=True, mode="sync"))
    assert r["system"]["learner_steps"] == [r["settings"]["steps"]] * r["settings"]["M"]
    assert r["system"]["rejected"] in ({}, None) and r["reference"]["rejected"] == {}
    # in step: every fragment merged once per round of H steps, in both
    rounds = r["settings"]["steps"] // r["settings"]["H"]
    assert sorted(r["system"]["versions"].values()) == r["reference"]["versions"] == [rounds] * r["settings"]["P"]
    assert r["system_vs_reference"] <= 0.005, r


@pytest.mark.timeout(240)
def test_the_lean_preset_trains_in_the_system_what_it_trains_in_the_reference():
    """diloco up --preset lean's codecs (sparse 2-bit up with error feedback, chained sparse 4-bit
    down, outer SGD) through the real roles: the evaluator's model is the learners' reconstruction,
    which the reference rebuilds the same way (bit for bit in the runs so far)."""
    from bench.fidelity import measure

    r = asyncio.run(measure(quick=True, mode="sync", preset="lean"))
    assert r["system"]["learner_steps"] == [r["settings"]["steps"]] * r["settings"]["M"]
    assert r["system"]["rejected"] in ({}, None) and r["reference"]["rejected"] == {}
    assert r["system_vs_reference"] <= 0.005, r
    # the reconstruction is not the aggregator's parameters (what is not sent yet stays there)
    assert r["reference_loss"] != r["reference_aggregator_loss"]
