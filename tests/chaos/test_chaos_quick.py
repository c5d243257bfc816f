"""Quick chaos subset (default test command): one trial of every fault, then every invariant."""

import pytest

from tests.chaos.harness import FAULTS, ChaosRun, table


@pytest.mark.timeout(400)
async def test_one_of_each_fault_keeps_every_invariant(tmp_path):
    # each learner step followed by a sleep as long (DILOCO_SLOWDOWN=2): the faults and their
    # recoveries take the same seconds, the learners half the CPU (the run trains until drained,
    # so its CPU is its seconds times its learners: 46 of the test's 73 CPU seconds)
    run = ChaosRun(str(tmp_path), learners=3, seed=1, learner_env={"DILOCO_SLOWDOWN": "2"})
    try:
        await run.setup()
        await run.warm_up()
        for fault in FAULTS:
            await run.trial(fault)
        await run.drain_and_check()
    finally:
        await run.close()
    print(table(run.report), run.report.details)
    assert all(run.report.invariants.values()), (table(run.report), run.report.details)
