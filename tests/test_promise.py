"""The core promise, guarded (issue 37): what a run with the defaults as shipped trains, through real
processes on a real server, with an aggregator slower than its learners.

The failure these tests guard against needs lag: an aggregator whose merges come back many inner
steps after a learner sent its outer gradient. The learners' outer gradients then queue up, each is
merged against a version many rounds newer than its base, and the model ends several times worse
(2.4x data-parallel; two islands 8x worse than one alone). The built-in model's run is too short in CI
to build that backlog by itself on every machine, so its aggregator is made ten times slower
(``DILOCO_AGG_SLOWDOWN``: each intake and merge followed by a pause of 9 times its duration); the
user's MLP steps in a millisecond or two, so its merges are many steps long at any speed. Both tests
fail on main before issue 37 (the learners' sync window off, ``DILOCO_GUARD_WINDOW=0``, and numpy's
threaded BLAS): see docs/BENCHMARKS.md, "The core promise, guarded".
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from bench.dp import train_dp
from bench.runs import SMALL_MODEL, run_learners

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable

#: the sync window as the learners run it; ``DILOCO_GUARD_WINDOW=0`` shows the failure (the tests fail)
WINDOW = os.environ.get("DILOCO_GUARD_WINDOW", "")
WINDOW_ENV = {"DILOCO_SYNC_WINDOW": WINDOW} if WINDOW else {}

#: the lag of the built-in model's test: an aggregator ten times slower than it is
LAG = "10"

STEPS = 480
#: Decoupled (M=2, defaults, aggregator 10x slower) against data-parallel on the same tokens, 480
#: steps of the small model. Measured on the 2-core machine (this test with -s, 2026-12-02), the gap to
#: data-parallel (2.2646): +7.3%, +5.2%, +4.8%, +7.8%, +6.8% (5 runs: mean +6.4%, range 3.0 points);
#: with the window off and numpy's threaded BLAS (main before issue 37): +27.8%, +21.9%. The bound is
#: the worst measured run plus more than the measured range: a return of the failure is far above it.
#: With Muon the default inner optimizer (2026-12-03, both sides Muon): data-parallel 1.9263 (AdamW's
#: 2.2646), decoupled 2.0810, 2.0847, 2.0945: +8.0%, +8.2%, +8.7% (3 runs); the window off: +28.9%,
#: staleness 13 (the failure still far above the bound). With the on-time quorum the default (the
#: seventh round): +9.6%, +8.2%, +9.3% alone, and once +22.0% in a suite run (112 outer gradients
#: merged against ~200): these learners have no monitor, so they never held their steps, and ran up
#: to 16 periods alone between syncs; a busy aggregator also closed rounds before reading a
#: contribution that had come in time. Both fixed (learner.loop.merges_reach, aggregator.quorum.
#: input_clock; docs/BENCHMARKS.md, "Eighth round"): +6.8%, +6.2%, +6.4%, +5.8% with two CPU hogs
#: beside it, staleness at most 1 (4 runs); at 30x lag +7.5% to +8.5% in 5 runs (before the fixes +18%
#: to +90%; once +1.4% with one learner's window shut by a missed head: heads now say what is merged).
MAX_GAP = 0.12
#: the staleness the aggregator saw, in versions: at most 1 in those 5 runs (a contribution is computed
#: from the version that merged its learner's previous round); without the window 11 and 14
MAX_STALENESS = 4


@pytest.mark.timeout(240)
async def test_a_default_run_with_a_lagging_aggregator_trains_as_well_as_data_parallel():
    env = dict(SMALL_MODEL, DILOCO_BATCH_SIZE="8", DILOCO_TOTAL_STEPS=str(STEPS), DILOCO_EVAL_BATCHES="8",
               DILOCO_EVAL_BATCH_SIZE="16")
    dec = await run_learners(env, 2, STEPS, agg={"DILOCO_AGG_SLOWDOWN": LAG},
                             learner={"DILOCO_FINAL_WAIT": "5", **WINDOW_ENV}, timeout=180)
    assert dec["ok"], dec["learners"]
    agg = dec["aggregator"]
    dp = await asyncio.to_thread(train_dp, env, 2, STEPS)
    loss, base = dec["eval"]["eval_loss"], dp["eval_loss"]
    gap = (loss - base) / base
    stale = max((int(k) for k in agg.get("staleness_hist") or {}), default=0)
    detail = (f"decoupled {loss:.4f} vs data-parallel {base:.4f} ({gap:+.1%}); staleness histogram "
              f"{agg.get('staleness_hist')}; refused {agg.get('rejected')}; deferred syncs "
              f"{[x.get('deferred_syncs') for x in dec['learners'].values()]}")
    print(f"guard: {detail}")
    assert gap <= MAX_GAP, detail
    assert stale <= MAX_STALENESS, detail
    assert not (agg.get("rejected") or {}).get("too_stale"), detail


ISLAND_STEPS = 600
#: the islands' aggregator is ten times slower than it is too (``DILOCO_GUARD_ISLAND_LAG``; empty:
#: not slowed): what a loaded machine (CI's suite) does to it. Before the hold (``DILOCO_SYNC_HOLD``,
#: ``DILOCO_GUARD_HOLD=0`` shows it) this failed in the suite at two islands 0.0117 against 0.0098 alone,
#: and at lag 10 / 30 by hand: 0.059 / 0.028
ISLAND_LAG = os.environ.get("DILOCO_GUARD_ISLAND_LAG", LAG)
HOLD_ENV = {"DILOCO_SYNC_HOLD": os.environ["DILOCO_GUARD_HOLD"]} if os.environ.get("DILOCO_GUARD_HOLD") else {}


def _env(url: str, run: str, **extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    e.update({"DILOCO_NATS_URL": url, "DILOCO_RUN": run, "JAX_PLATFORMS": "cpu", "DILOCO_LOG_LEVEL": "warning",
              **extra})
    return e


def _alone(reg, island: str, steps: int) -> float:
    """examples/regression.py's island ``island`` training alone for ``steps`` steps (no run): its
    held-out loss."""
    import optax

    optimizer = optax.adamw(3e-3, weight_decay=0.0)
    train_step = reg.make_train_step(optimizer)
    params = reg.init_params()
    opt_state = optimizer.init(reg.trainable(params))
    for _, batch in zip(range(steps), reg.batches(sum(map(ord, island)))):
        params, opt_state, _ = train_step(params, opt_state, batch)
    hx, hy = reg.make_data(12345, 1024)
    return float(reg.loss_fn(params, hx, hy))


@pytest.mark.timeout(240)
async def test_two_islands_of_a_user_model_are_never_worse_than_one_alone(nats_server, tmp_path):
    """examples/regression.py as the README runs it: the run created from the user's parameters, `DILOCO_MODEL=run
    diloco aggregator` with its defaults and embedded monitor, then two islands through the island API
    (starting together: DILOCO_START_WITH=2). The exported model of the two is at least as good as
    either island training alone for the same steps. This model's steps take a millisecond or two, so a
    merge's round trip is many steps long (the issue's case: two islands 8x worse than one alone), and
    the aggregator is 10x slower (ISLAND_LAG). Measured (this test with -s, 2026-12-02, no lag): two
    islands 0.0054, 0.0046, 0.0054; main before issue 37 (window off, threaded BLAS) 0.0121, 0.0158;
    each alone 0.0098 and 0.0138. With the lag (2026-12-03): without the hold 0.059 (0.028 at lag 30);
    with it (the default) 0.0066, 0.0065 at lag 30. With the on-time quorum the default (2026-12-04, lag 10):
    0.00654, 0.00676, 0.00670."""
    run = "guard"
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import regression as reg
    finally:
        sys.path.pop(0)
    from learner.island import load_params, save_params

    init = tmp_path / "init.npz"
    save_params(reg.init_params(), str(init))
    made = subprocess.run([PY, "-m", "diloco.cli", "run", "create", "--init", str(init)], cwd=ROOT,
                          env=_env(nats_server.url, run), capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    log = tmp_path / "aggregator.log"
    with open(log, "wb") as f:
        agg = subprocess.Popen([PY, "-m", "diloco.cli", "aggregator"], cwd=ROOT, stdout=f, stderr=f,
                               env=_env(nats_server.url, run, DILOCO_MODEL="run", DILOCO_LOG_LEVEL="info",
                                        DILOCO_HEARTBEAT_INTERVAL="0.2",
                                        **({"DILOCO_AGG_SLOWDOWN": ISLAND_LAG} if ISLAND_LAG else {})))
    try:
        for _ in range(300):
            if b"aggregator_started" in log.read_bytes():
                break
            await asyncio.sleep(0.1)
        islands = [subprocess.Popen([PY, "examples/regression.py", "--island", name, "--steps", str(ISLAND_STEPS)],
                                    cwd=ROOT, env=_env(nats_server.url, run, DILOCO_FINAL_WAIT="10",
                                                       DILOCO_START_WITH="2", DILOCO_HEARTBEAT_INTERVAL="0.2",
                                                       **WINDOW_ENV, **HOLD_ENV),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for name in ("a", "b")]
        outs = []
        for p in islands:
            out, err = await asyncio.get_running_loop().run_in_executor(None, p.communicate, None, 180)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
        path = tmp_path / "guard.npz"
        exp = subprocess.run([PY, "-m", "diloco.cli", "export", "--out", str(path)], cwd=ROOT,
                             env=_env(nats_server.url, run), capture_output=True, text=True, timeout=60)
        assert exp.returncode == 0, exp.stderr
    finally:
        agg.terminate()
        agg.wait(30)
    params = load_params(str(path), reg.init_params(seed=99))
    hx, hy = reg.make_data(12345, 1024)
    together = float(reg.loss_fn(params, hx, hy))
    alone = await asyncio.to_thread(lambda: [_alone(reg, name, ISLAND_STEPS) for name in ("a", "b")])
    fates = [re.search(r"rounds sent (\d+), merged (\d+).*", o) for o in outs]
    print(f"guard: two islands {together:.5f}, each alone {np.round(alone, 5)}; {[f.group(0) if f else None for f in fates]}")
    assert together <= min(alone), (f"two islands {together:.5f}, each alone {np.round(alone, 5)}; "
                                     f"islands: {[f.group(0) if f else None for f in fates]}")
