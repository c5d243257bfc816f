"""Hostile and malformed input on the subjects the learner consumes, and bad configuration.

The aggregator's gradient subjects are covered in tests/test_aggregator_service.py (17 kinds,
each counted by reason, global state unchanged); heartbeats (flood, garbage, NaN, future
timestamps, forged subjects) in tests/test_monitor_service.py; absurd metrics in
tests/test_monitor_metrics_view.py. Here: forged and broken global versions against a learner,
and a bad value of every configuration variable.
"""

import asyncio
import dataclasses
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from diloco.cli import load_role_configs
from bus.config import ROLE_CONFIGS, ConfigError, env_name, from_env
from bus.subjects import GLOBAL
from bus.transport import Head
from learner.spec import spec_hash
from tests.test_learner_service import PLAN, S, SPEC, V0, bootstrap, configs, put_version


async def test_learner_rejects_forged_and_broken_global_versions_and_keeps_training(nats_server, js):
    from learner.service import Learner

    await bootstrap(js)
    common, model, cfg = configs(nats_server, learner_id="h", step_time=0.02, sync_every=4, max_steps=100000)
    learner = Learner(common, model, cfg)
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    try:
        t_end = time.monotonic() + 20
        while learner.book.step < 5 and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        assert learner.book.step >= 5
        await js.publish(S.versioned_head(GLOBAL, 0), os.urandom(64))  # garbage head
        # (the learner reads heads on an ordered consumer that starts from the newest head of each
        # subject: one still being created under load, or re-created after a gap, never reads a head
        # replaced at once; it failed so at load 12. Wait until the garbage head was read before the
        # next head of its subject replaces it)
        while learner.metrics()["rejected_globals"].get("bad_head") != 1 and time.monotonic() < t_end:
            await asyncio.sleep(0.05)
        forged = Head(0, 10**9, 1, 10, 0, (1,), {"model": spec_hash(SPEC)})  # future version, foreign seqs
        await js.publish(S.versioned_head(GLOBAL, 0), forged.to_bytes())
        await put_version(js, 1, 5, V0[1], model="0" * 16)  # another model's fragment
        await put_version(js, 2, 6, np.zeros(PLAN.sizes[2] + 1, np.float32))  # wrong size
        await put_version(js, 3, 7, np.full(PLAN.sizes[3], np.nan, np.float32))  # non-finite
        await asyncio.sleep(1.0)
        await put_version(js, 0, 1, V0[0] + 0.25)  # then a genuine new version
        while learner.book.versions()[0] != 1 and time.monotonic() < t_end + 10:
            await asyncio.sleep(0.05)
        m = learner.metrics()
        assert learner.book.versions() == {0: 1, 1: 0, 2: 0, 3: 0}, "a forged version was taken"
        assert m["rejected_globals"] == {"bad_head": 1, "unreadable": 1, "bad_blob": 3}, m["rejected_globals"]
        assert all(np.isfinite(learner.backend.get_fragment(p)).all() for p in range(4))
        step = learner.book.step
        await asyncio.sleep(0.5)
        assert learner.book.step > step, "training stopped"
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


def _bad_value(f: dataclasses.Field) -> str | None:
    """A value the field's parser must refuse, derived from its default's type and parser."""
    parse = f.metadata["parse"]
    for candidate in ("not-a-number", "-5", "1e999", "maybe", "a.b c", "x" * 5000, ""):
        try:
            parse(candidate)
        except ValueError:
            return candidate
    return None  # free text: every string is acceptable


def _all_fields():
    load_role_configs()
    seen = set()
    for role, cls in ROLE_CONFIGS.items():
        for f in dataclasses.fields(cls):
            if "parse" in f.metadata and f.name not in seen:
                seen.add(f.name)
                yield role, cls, f


def test_every_variable_refuses_a_bad_value_with_one_line():
    checked = 0
    for role, cls, f in _all_fields():
        bad = _bad_value(f)
        if bad is None:
            continue
        name = env_name(f.name)
        with pytest.raises(ConfigError) as e:
            from_env(cls, {name: bad})
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{name}=") and "expected" in msg, (name, msg)
        checked += 1
    assert checked >= 60, checked


@pytest.mark.parametrize("role, var, value", [
    ("learner", "DILOCO_SYNC_EVERY", "0"),
    ("aggregator", "DILOCO_QUORUM", "many"),
    ("monitor", "DILOCO_EVICT_AFTER", "-1"),
])
def test_roles_exit_at_start_with_one_line(role, var, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env[var] = value
    p = subprocess.run([sys.executable, "-m", role], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and var in lines[0] and "expected" in lines[0], p.stderr
