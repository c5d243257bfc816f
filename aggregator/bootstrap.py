"""Creating a run of the built-in model: version 0 of every global fragment and the run manifest.

(The run contract itself, manifest reading and runs of a user's tree, is ``bus.runs``. This is
the one place the aggregator still knows the built-in model: with DILOCO_MODEL=builtin it makes
version 0 from the seed, because under auth only the aggregator and admin may write version 0.)

The aggregator owns the initial parameters: it builds them from the model spec and seed with
numpy (``learner.spec.init_params``, bit-identical on every machine), publishes version 0 of every
fragment, and only then writes the manifest (KV ``run``/``manifest``). A learner waits for the
manifest, checks its own model hash against it and fetches the newest version of every fragment,
so all learners start identical. Bootstrapping an existing run checks the hashes and changes
nothing; a crash half-way is finished by the next start (fragments that already have a version are
left alone).
"""

from __future__ import annotations

import time

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyWrongLastSequenceError

from bus import codec
from bus.protocol import MANIFEST_KEY, Manifest
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkPublisher, VersionedStore
from bus.fragments import FragmentPlan, gather
from bus.runs import read_manifest
from learner.spec import ModelSpec, check_manifest, init_params, spec_hash


async def bootstrap_run(js: JetStreamContext, run: str, spec: ModelSpec, seed: int, plan: FragmentPlan,
                        publisher: ChunkPublisher | None = None, quantiser: str = "fp32",
                        fragments: range | None = None, max_inner_lr: float | None = None,
                        max_tokens_per_step: int | None = None) -> Manifest:
    """Create version 0 of ``fragments`` (default: all) and the manifest, or check an existing run.

    ``max_inner_lr`` and ``max_tokens_per_step`` are the run's declared geometry (see
    :class:`bus.protocol.Manifest`); an existing run keeps the values it was created with."""
    existing = await read_manifest(js, run)
    if existing is not None:
        check_manifest(existing, spec, plan)
    store = VersionedStore(js, run, GLOBAL, publisher)
    meta = {"model": spec_hash(spec), "plan": plan.plan_hash()}
    params = None
    for p in fragments if fragments is not None else range(plan.num_fragments):
        if await store.head(p) is not None:
            continue
        if params is None:
            params = init_params(spec, seed)
        await store.put(p, 0, codec.encode_array(gather(plan, params, p), quantiser), meta)
    if existing is not None:
        return existing
    m = Manifest(run=run, model_hash=spec_hash(spec), spec=spec.to_dict(), seed=seed,
                 num_fragments=plan.num_fragments, plan_hash=plan.plan_hash(), created_at=time.time(),
                 max_inner_lr=max_inner_lr, max_tokens_per_step=max_tokens_per_step)
    kv = await js.key_value(Subjects(run).bucket("run"))
    try:
        await kv.create(MANIFEST_KEY, orjson.dumps(m.to_dict()))
    except (KeyWrongLastSequenceError, Exception):
        other = await read_manifest(js, run)  # another aggregator won the race: it must agree
        if other is None:
            raise
        check_manifest(other, spec, plan)
        return other
    return m
