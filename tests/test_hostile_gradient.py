"""One hostile outer gradient, early and late, against a whole run of real processes.

A learner's host may be buggy or compromised and still speak with its own identity (auth does
not help). Here a publisher that uses the id of the first learner admitted (another incarnation,
exactly the protocol a learner speaks) sends, to every fragment:

* at version 0/1 (the fragment's first merges, before any norm history exists): every value 1e6;
  a vector just under the geometric norm bound; a claim of 2**62 tokens for one step; a vector
  of the right size in a 2-D shape;
* half-way through the learners' budget: every value 1e6 again, and a vector just under the bound
  (far above the median, so the merge clips it).

Then the learners finish their step budget. The attacked run's final held-out loss must be within
the noise of clean runs of the same settings (measured: MAX_FINAL below); the rejections are counted by
reason and the clipped ones by the aggregator's ``clipped`` metric.
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import orjson
import pytest

from aggregator.influence import norm_bound
from bus import codec
from bus.protocol import grad_meta, grad_obj_id
from bus.subjects import Subjects
from bus.transport import ChunkPublisher
from learner.config import ModelConfig
from bus.fragments import plan_fragments
from learner.spec import param_shapes, spec_hash
from tests.chaos.harness import LEARNER, MODEL, ChaosRun
from tests.system import member_states

STEPS = 1500  # inner steps per learner
MODEL_CFG = ModelConfig(d_model=int(MODEL["DILOCO_D_MODEL"]), n_layers=int(MODEL["DILOCO_N_LAYERS"]),
                        n_heads=int(MODEL["DILOCO_N_HEADS"]), d_ff=int(MODEL["DILOCO_D_FF"]),
                        seq_len=int(MODEL["DILOCO_SEQ_LEN"]), num_fragments=int(MODEL["DILOCO_NUM_FRAGMENTS"]))
SPEC = MODEL_CFG.spec()
PLAN = plan_fragments(param_shapes(SPEC), MODEL_CFG.num_fragments, max_imbalance=MODEL_CFG.max_imbalance)
H = int(LEARNER["DILOCO_SYNC_EVERY"])
LR = float(MODEL["DILOCO_MAX_INNER_LR"])
# Noise: over 28 clean runs of these settings (2026-11) the final held-out loss had mean 1.54 and
# standard deviation 0.244 (1.20-1.99; the runs are asynchronous and timed by the machine), over 28
# attacked runs mean 1.49 and standard deviation 0.205 (docs/RELIABILITY.md, "Ten runs in a row");
# 5 clean runs of today's learner (2026-12-03, `_run(tmp, attack=False)`): 1.19-1.46. The attacked
# run must end within 3 standard deviations of a clean run above the clean mean: 2.27. (Until
# 2026-12-03 the test ran a clean run beside the attacked one and allowed 3 standard deviations of
# a difference of two runs, 0.96, above it: a bound of 2.16-2.95 at the cost of half the suite's
# largest test.) Unprotected, one such vector ended a run at a loss of 1.9 million (issue 12).
CLEAN_MEAN, CLEAN_SD = 1.54, 0.244
MAX_FINAL = CLEAN_MEAN + 3 * CLEAN_SD


class Attacker:
    """Speaks as an admitted learner (a new incarnation of it), exactly the learner's protocol."""

    def __init__(self, js, run: str, learner: str):
        self.js, self.run, self.learner = js, run, learner
        self.inc = uuid.uuid4().hex[:12]
        self.round = {p: 0 for p in range(PLAN.num_fragments)}
        self.pub = ChunkPublisher(js)

    async def send(self, p: int, base: int, vector: np.ndarray, steps: int = H, tokens: int | None = None) -> None:
        self.round[p] += 1
        tokens = tokens if tokens is not None else steps * int(LEARNER["DILOCO_BATCH_SIZE"]) * SPEC.seq_len
        meta = grad_meta(run=self.run, model=spec_hash(SPEC), learner=self.learner, incarnation=self.inc, fragment=p,
                         round_=self.round[p], base_version=base, inner_steps=steps, tokens=tokens, region="r")
        oid = grad_obj_id(self.run, self.learner, self.inc, p, self.round[p])
        await self.pub.publish(Subjects(self.run).grad(p, self.learner), oid, codec.encode_array(vector), meta)

    async def volley(self, versions: dict[int, int], early: bool) -> None:
        rng = np.random.default_rng(7 if early else 8)
        for p in range(PLAN.num_fragments):
            n, base = PLAN.sizes[p], versions.get(p, 0)
            under = rng.standard_normal(n).astype(np.float32)
            under *= np.float32(0.95 * norm_bound(LR, n, H) / float(np.linalg.norm(under)))
            await self.send(p, base, np.full(n, 1e6, np.float32))  # norm_bound
            await self.send(p, base, under)  # accepted, bounded (clipped once a median exists)
            if early:
                await self.send(p, base, under / 10, steps=1, tokens=2**62)  # bad_counters
                await self.send(p, base, np.zeros((2, n // 2), np.float32))  # wrong_shape


async def _run(tmp, attack: bool, agg_env: dict | None = None, steps: int = STEPS) -> dict:
    """One run of 3 learners x ``steps`` inner steps (``attack``: with the hostile volleys); the
    final held-out loss once every learner finished and its final sync was merged."""
    run = ChaosRun(str(tmp), learners=3, seed=1, run="hostile" if attack else "clean",
                   learner_env={"DILOCO_MAX_STEPS": str(steps)}, agg_env=agg_env)
    try:
        await run.setup()
        if attack:
            # the first merges: as soon as any learner is admitted, speaking as that learner
            active: list[str] = []

            async def any_active():
                active[:] = [k for k, st in (await member_states(run.js, run.run)).items() if st == "active"]
                return bool(active)
            assert await run.wait_until(any_active, 120), "no learner joined"
            attacker = Attacker(run.js, run.run, active[0])
            newest = {f: v for f, v in run.heads}
            await attacker.volley(newest, early=True)
            early_versions = dict(newest)
        # late: when every learner is past half its budget (their metrics tell), speaking as the one
        # furthest from the end (a learner that finished is evicted, and its id then rejected first
        # as inactive_learner: validation checks membership before norms)
        seen: dict[str, int] = {}

        async def on_metrics(m):
            d = orjson.loads(m.data)
            seen[d.get("learner", "?")] = int(d.get("step", 0))
        sub = await run.nc.subscribe(f"{run.s.prefix}.metrics.learner.*", cb=on_metrics)
        assert await run.wait_until(
            lambda: _ready(len(seen) >= run.n and min(seen.values()) >= steps // 2), 180), seen
        await sub.unsubscribe()
        if attack:
            attacker.learner = min(seen, key=seen.get)
            await attacker.volley({f: v for f, v in run.heads}, early=False)
        for name in run.learners:
            await asyncio.get_running_loop().run_in_executor(None, run.procs[name].wait, 180)
        assert await run.settle(60)  # the final syncs are merged and evaluated
        stats = await _aggregator_metrics(run)
        finals = [loss for _, loss, v in run.evals if v == run.evals[-1][2]]
        return {"final": finals[-1], "first": min(run.evals, key=lambda e: e[2])[1], "stats": stats,
                "evals": [(round(t, 2), round(loss, 4), v) for t, loss, v in run.evals],
                "early_versions": early_versions if attack else None}
    finally:
        await run.close()


async def _ready(x: bool) -> bool:
    return x


async def _aggregator_metrics(run: ChaosRun) -> dict:
    sub = await run.nc.subscribe(f"{run.s.prefix}.metrics.aggregator.*")
    try:
        return orjson.loads((await sub.next_msg(timeout=5)).data)
    finally:
        await sub.unsubscribe()


@pytest.mark.timeout(400)
async def test_hostile_gradient_early_and_late_leaves_loss_within_noise(tmp_path):
    hostile = await _run(tmp_path / "hostile", attack=True)
    rej, clipped = hostile["stats"]["rejected"], hostile["stats"]["clipped"]
    print({"hostile": hostile["final"], "first": hostile["first"], "rejected": rej, "clipped": clipped,
           "early_versions": hostile["early_versions"]})
    P = PLAN.num_fragments
    assert rej.get("norm_bound", 0) == 2 * P, rej
    assert rej.get("bad_counters", 0) == P and rej.get("wrong_shape", 0) == P, rej
    assert clipped >= P, "the late near-bound vectors were not clipped"
    assert hostile["final"] < 0.8 * hostile["first"], hostile["evals"]
    assert hostile["final"] <= MAX_FINAL, (f"attacked run ended at {hostile['final']:.3f}, above clean runs' "
                                           f"{CLEAN_MEAN} + 3 x {CLEAN_SD} (if clean runs moved, measure them again: "
                                           "_run(tmp, attack=False))", hostile["evals"])
