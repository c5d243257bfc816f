"""The system against the in-process reference (bench.fidelity): real roles over a real NATS server,
learners in step (DILOCO_MODE=sync, DILOCO_START_WITH=M), then bench.reference on the same run with
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
