"""Creating a run: version 0 of every global fragment and the run manifest.

The aggregator owns the initial parameters: it builds them from the model spec and seed with
numpy (``learner.spec.init_params``, bit-identical on every machine), publishes version 0 of every
fragment, and only then writes the manifest (KV ``run``/``manifest``). A learner waits for the
manifest, checks its own model hash against it and fetches the newest version of every fragment,
so all learners start identical. Bootstrapping an existing run checks the hashes and changes
nothing; a crash half-way is finished by the next start (fragments that already have a version are
left alone).
"""

from __future__ import annotations

import asyncio
import time

import orjson
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from bus import codec
from bus.protocol import MANIFEST_KEY, Manifest
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkPublisher, VersionedStore
from learner.fragments import FragmentPlan, gather, plan_fragments
from learner.spec import ModelSpec, init_params, param_shapes, spec_hash


class RunMismatch(RuntimeError):
    """This process's model or fragment plan differs from the run's manifest."""


def make_plan(spec: ModelSpec, num_fragments: int, max_imbalance: float) -> FragmentPlan:
    return plan_fragments(param_shapes(spec), num_fragments, max_imbalance=max_imbalance)


def check_manifest(m: Manifest, spec: ModelSpec, plan: FragmentPlan) -> None:
    """Raise :class:`RunMismatch` saying what differs, or return quietly."""
    if m.model_hash != spec_hash(spec):
        raise RunMismatch(f"model spec hash {spec_hash(spec)} differs from run {m.run!r} ({m.model_hash}): "
                          f"run spec {m.spec}, ours {spec.to_dict()}")
    if m.plan_hash != plan.plan_hash() or m.num_fragments != plan.num_fragments:
        raise RunMismatch(f"fragment plan {plan.plan_hash()} (P={plan.num_fragments}) differs from run "
                          f"{m.run!r} ({m.plan_hash}, P={m.num_fragments}): check DILOCO_NUM_FRAGMENTS "
                          f"and DILOCO_MAX_IMBALANCE")


async def read_manifest(js: JetStreamContext, run: str) -> Manifest | None:
    """The run's manifest, or None while the run (or its manifest) does not exist yet."""
    try:
        kv = await js.key_value(Subjects(run).bucket("run"))
    except (BucketNotFoundError, NotFoundError):
        return None
    try:
        e = await kv.get(MANIFEST_KEY)
    except KeyNotFoundError:
        return None
    if e.value is None:
        return None
    return Manifest.from_dict(orjson.loads(e.value))


async def wait_manifest(js: JetStreamContext, run: str, timeout: float, poll: float = 0.2) -> Manifest:
    """The run's manifest, waiting up to ``timeout`` seconds for an aggregator to create it."""
    t_end = time.monotonic() + timeout
    while True:
        m = await read_manifest(js, run)
        if m is not None:
            return m
        if time.monotonic() > t_end:
            raise TimeoutError(f"run {run!r} has no manifest after {timeout}s: is an aggregator running?")
        await asyncio.sleep(poll)


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
