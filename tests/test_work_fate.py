"""An island tells its user what became of its work, against a real server and aggregator.

* ``diloco aggregator`` embeds a monitor by default: an aggregator and islands, nothing else, train.
* A run that ends before its island is admitted: ``close()`` waits for the last rounds' merges.
* No monitor at all (DILOCO_EMBEDDED_MONITOR=false): the island warns that it is not admitted and
  counts its work rejected as ``unknown_learner``; nothing is merged and the stats say so.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable


def _env(url: str, run: str, **extra) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    e.update(DILOCO_NATS_URL=url, DILOCO_RUN=run, JAX_PLATFORMS="cpu", DILOCO_LOG_LEVEL="warning",
             DILOCO_HEARTBEAT_INTERVAL="0.2", DILOCO_METRICS_INTERVAL="0.5", **extra)
    return e


def _aggregator(url: str, run: str, log, **extra) -> subprocess.Popen:
    # the outlier filter off: this toy (4 weights, Adam converging within ~100 steps) has honest
    # outer gradients whose norms per step change 10x between rounds, and a round refused as an
    # outlier (counted, warned about: the stats are right) is not what these tests are about
    return subprocess.Popen([PY, "-m", "diloco.cli", "aggregator"], cwd=ROOT, stdout=log, stderr=log,
                            env=_env(url, run, DILOCO_MODEL="run", DILOCO_GRACE="fixed", DILOCO_GRACE_SECONDS="0.1",
                                     DILOCO_NORM_OUTLIER_FACTOR="1000000", **extra))


def _model():
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)
    import optax

    params = {"w": jnp.zeros((4, 1)), "b": jnp.zeros((1,))}
    opt = optax.adam(0.05)  # steps of at most the declared max_inner_lr per value (an SGD step is not)

    @jax.jit
    def step(p, s):
        def loss(q):
            return jnp.mean((x @ q["w"] + q["b"] - y) ** 2)

        val, g = jax.value_and_grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, val

    return params, opt.init(params), step


def _train_and_close(*runs, steps: int) -> list:
    """Each ``(island, step, params, opt_state)`` trained ``steps`` steps and closed in a thread of
    its own, as separate processes would be; returns the close codes.

    Not one thread for all: an island whose step holds for its round's merge (DILOCO_SYNC_HOLD) then
    holds the other islands' steps too, and that merge (every active learner in every merge) waits
    for a round another island sends at its next step: a deadlock until DILOCO_SYNC_TIMEOUT (120 s in
    the suite). Nor all trained before any closes: an island done training sends its last deferred
    round only at close(), which waited for the slower island's training, itself held for that round
    (120 s again, seen with threads that closed together)."""
    import threading

    codes: list = [None] * len(runs)
    errors: list = []

    def run(i: int, isl, step, p, s) -> None:
        try:
            for _ in range(steps):
                p, s, loss = step(p, s)
                p = isl.step(p, loss=loss)
            codes[i] = isl.close()
        except Exception as e:  # noqa: BLE001 - reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, *r)) for i, r in enumerate(runs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(150)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return codes


def _island(url: str, run: str, name: str, params, sync_every: int = 12, **env):
    from learner.island import Island

    return Island(params, run=run, learner_id=name, nats_url=url, num_fragments=2, sync_every=sync_every,
                  max_inner_lr=0.05, join_timeout=60,
                  env={"DILOCO_HEARTBEAT_INTERVAL": "0.2", "DILOCO_LOG_LEVEL": "warning", **env})


def _stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()


@pytest.mark.timeout(180)
def test_an_aggregator_and_islands_alone_train_and_a_run_ending_before_admission_is_merged(nats_server, tmp_path):
    """The embedded monitor admits the islands; 600 quick steps (about 2 s alone, so the first
    rounds are sent before admission can finish) are all merged because close() waits for their
    fate. Once admitted, each round waits for its merge (the sync window's hold: a merge's round trip
    is many of these steps), so 12 rounds per fragment, not 50: 10-35 s at load with 50."""
    run = "fate-ok"
    with open(tmp_path / "agg.log", "wb") as log:
        agg = _aggregator(nats_server.url, run, log)
    try:
        params, s0, step = _model()
        a = _island(nats_server.url, run, "a", params, sync_every=48)
        b = _island(nats_server.url, run, "b", params, sync_every=48)
        t0 = time.monotonic()
        assert _train_and_close((a, step, a.params, s0), (b, step, b.params, s0), steps=600) == [0, 0]
        took = time.monotonic() - t0
        print(f"fate: {took:.1f}s; " + "; ".join(f"{isl.learner.id}: {isl.learner.book.counters()}, held "
                                                  f"{isl.learner.held_s:.1f}s" for isl in (a, b)))
        for isl in (a, b):
            st = isl.stats
            assert st["steps"] == 600 and st["sent"] >= 2, st  # (a sync due while one is in flight is skipped)
            assert st["merged"] == st["sent"] and st["rejected_total"] == 0 and st["unresolved"] == 0, (took, st)
            assert st["member_state"] == "left" and st["warned"] == [], st
            assert set(st["last_merged_version"]) == {"0", "1"}
            # no step held in vain for a merge (DILOCO_SYNC_TIMEOUT, 120 s: see _train_and_close)
            assert isl.learner.book.counters()["holds_expired"] == 0, (took, isl.learner.book.counters())
    finally:
        _stop(agg)
    logs = (tmp_path / "agg.log").read_text()
    assert "unknown_learner" not in logs, logs[-3000:]


@pytest.mark.timeout(180)
def test_a_run_that_ends_before_any_monitor_runs_is_merged_once_one_starts(nats_server, tmp_path):
    """The islands' 600 steps end before a monitor exists; while close() waits, the islands keep
    saying they left, so the monitor started then records them and the aggregator merges the
    contributions it held (issue 26: this run's work was thrown away without a word)."""
    import threading

    run = "fate-late"
    with open(tmp_path / "agg.log", "wb") as log:
        agg = _aggregator(nats_server.url, run, log, DILOCO_EMBEDDED_MONITOR="false")
    mon = None
    try:
        params, s0, step = _model()
        isl = _island(nats_server.url, run, "early", params)
        p, s = isl.params, s0
        for _ in range(600):
            p, s, loss = step(p, s)
            p = isl.step(p, loss=loss)
        closing = threading.Thread(target=isl.close)
        closing.start()
        time.sleep(1.0)
        assert isl.stats["merged"] == 0 and isl.stats["member_state"] is None  # nobody admitted it
        with open(tmp_path / "mon.log", "wb") as log:
            mon = subprocess.Popen([PY, "-m", "monitor"], cwd=ROOT, stdout=log, stderr=log,
                                   env=_env(nats_server.url, run))
        closing.join(60)
        st = isl.stats
        assert st["merged"] == st["sent"] > 0 and st["rejected_total"] == 0, st
        assert st["member_state"] == "left" and st["held"] >= 1, st
    finally:
        for proc in (mon, agg):
            if proc is not None:
                _stop(proc)


@pytest.mark.timeout(180)
def test_without_a_monitor_the_island_says_it_is_not_admitted_and_counts_the_rejections(nats_server, tmp_path):
    run = "fate-nomon"
    with open(tmp_path / "agg.log", "wb") as log:
        agg = _aggregator(nats_server.url, run, log, DILOCO_EMBEDDED_MONITOR="false", DILOCO_ADMISSION_WAIT="1")
    try:
        params, s, step = _model()
        isl = _island(nats_server.url, run, "lonely", params, DILOCO_WARN_UNADMITTED_AFTER="1",
                      DILOCO_FINAL_WAIT="10")
        p = isl.params
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # train until the aggregator's rejections reach us
            for _ in range(12):
                p, s, loss = step(p, s)
                p = isl.step(p, loss=loss)
            st = isl.stats
            if st["rejected"].get("unknown_learner") and "not_admitted" in st["warned"]:
                break
            time.sleep(0.02)
        isl.close()
        st = isl.stats
        assert st["merged"] == 0 and st["rejected"].get("unknown_learner", 0) >= 1, st
        assert st["held"] >= 1 and st["member_state"] is None, st
        assert "not_admitted" in st["warned"] and "rejected:unknown_learner" in st["warned"], st
        assert st["rejected_total"] + st["unresolved"] == st["sent"], st
    finally:
        _stop(agg)
