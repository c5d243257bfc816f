"""Helpers for aggregator tests: tiny-model settings and a protocol-exact contribution publisher."""

from __future__ import annotations

import os
import sys
import uuid

import numpy as np
import orjson

from learner.spec import make_plan
from bus import codec
from bus.protocol import grad_meta, grad_obj_id
from bus.subjects import Subjects
from bus.transport import ChunkPublisher
from learner.config import ModelConfig
from learner.spec import spec_hash

TINY = {"DILOCO_D_MODEL": "16", "DILOCO_N_LAYERS": "1", "DILOCO_N_HEADS": "2", "DILOCO_D_FF": "32",
        "DILOCO_SEQ_LEN": "16", "DILOCO_NUM_FRAGMENTS": "2"}
MODEL = ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=16, num_fragments=2)
SPEC = MODEL.spec()
PLAN = make_plan(SPEC, MODEL.num_fragments, MODEL.max_imbalance)
HASH = spec_hash(SPEC)


def env(url: str, run: str, **extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    e.update(TINY)
    e.update({"DILOCO_NATS_URL": url, "DILOCO_RUN": run, "DILOCO_METRICS_INTERVAL": "0.2"})
    e.update(extra)
    return e


class FakeLearner:
    """Publishes outer-gradient fragments exactly as a learner does (real bus, real protocol)."""

    def __init__(self, js, run: str, learner: str, seed: int = 0, scale: float = 1e-3):
        self.js, self.run, self.learner = js, run, learner
        self.inc = uuid.uuid4().hex[:8]
        self.rng = np.random.default_rng(seed)
        self.round = {p: 0 for p in range(PLAN.num_fragments)}
        self.pub = ChunkPublisher(js, max_chunk=4096)
        self.scale = scale
        self.s = Subjects(run)

    async def send(self, p: int, base: int, vector=None, q: str = "fp32", obj_suffix: str = "", blob=None,
                   **over) -> tuple:
        """``blob``: these bytes instead of the encoded vector (a hostile encoding)."""
        self.round[p] += 1
        vec = vector if vector is not None else (self.rng.standard_normal(PLAN.sizes[p]) * self.scale).astype(np.float32)
        meta = grad_meta(run=self.run, model=HASH, learner=self.learner, incarnation=self.inc, fragment=p,
                         round_=self.round[p], base_version=base, inner_steps=10, tokens=10 * 64, region="r")
        meta.update(over)
        oid = grad_obj_id(self.run, self.learner, self.inc, p, self.round[p]) + obj_suffix
        await self.pub.publish(self.s.grad(p, self.learner), oid,
                               codec.encode_array(vec, q) if blob is None else blob, meta)
        return (self.learner, self.inc, p, self.round[p])


async def set_members(js, run: str, states: dict[str, str]) -> None:
    kv = await js.key_value(Subjects(run).bucket("members"))
    for k, st in states.items():
        await kv.put(k, orjson.dumps({"learner": k, "state": st}))


PY = sys.executable
