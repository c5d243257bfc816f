"""The run contract: what every role agrees on before it trains or merges (no role code here).

A run is described by its **manifest** (KV ``run``/``manifest``): the parameter tree (leaf paths,
shapes, dtypes; ``bus.tree``), the fragment plan (``bus.fragments``) with the hashes of both, and
the declared geometry that bounds a contribution. Version 0 of every fragment is written before
the manifest, so a process that reads a manifest finds version 0.

* :func:`read_manifest` / :func:`wait_manifest`: any role, read-only.
* :func:`tree_of_manifest`: the tree and plan of a run made from a user's tree (an island, or
  ``diloco run create --init``); the aggregator and evaluator of such a run need nothing else.
* :func:`create_tree_run`: provision the streams (sized from the tree, ``bus.streams``), claim
  the run with a compare-and-set create of the run bucket's ``creator`` key, publish the initial
  parameters as version 0 and then the manifest. Exactly one of several racing creators writes
  version 0; the others wait for its manifest.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from bus import codec
from bus.config import CommonConfig
from bus.fragments import FragmentPlan, gather, plan_fragments
from bus.protocol import MANIFEST_KEY, Manifest
from bus.streams import Limits, ensure_run
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkPublisher, VersionConflict, VersionedStore
from bus.tree import TreeSpec

CLAIM_KEY = "creator"


class RunMismatch(RuntimeError):
    """This process's model or fragment plan differs from the run's manifest."""


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


def plan_for(spec: TreeSpec, num_fragments: int, max_imbalance: float) -> FragmentPlan:
    """The run's fragment plan for a tree: from its float leaves' shapes."""
    return plan_fragments(spec.shapes(), min(num_fragments, max(1, spec.num_params)), max_imbalance=max_imbalance)


def tree_manifest_spec(spec: TreeSpec, max_imbalance: float) -> dict:
    """What a tree run's manifest holds under ``spec``: the tree and how its plan is made."""
    return {"kind": "tree", "tree": spec.to_dict(), "max_imbalance": max_imbalance}


def tree_of_manifest(m: Manifest) -> tuple[TreeSpec, FragmentPlan] | None:
    """(tree, plan) of a run created from a user's tree, or None for a built-in-model run."""
    if m.spec.get("kind") != "tree":
        return None
    spec = TreeSpec.from_dict(m.spec["tree"])
    plan = plan_for(spec, m.num_fragments, float(m.spec.get("max_imbalance", 1.1)))
    if plan.plan_hash() != m.plan_hash:
        raise ValueError(f"run {m.run!r}: the manifest's plan hash {m.plan_hash} does not match its tree")
    return spec, plan


async def create_tree_run(js, common: CommonConfig, spec: TreeSpec, plan: FragmentPlan,
                          init: dict[str, np.ndarray], max_imbalance: float, *, max_inner_lr: float | None = None,
                          max_tokens_per_step: int | None = None, log=None) -> bool:
    """Provision the run's streams and publish ``init`` as version 0 of every fragment, then the
    manifest. Returns True if we created it, False if it existed or another writer claimed it.

    The claim is a compare-and-set create of the run bucket's ``creator`` key: exactly one writer
    publishes version 0, the others wait for the manifest (``join_run``)."""
    if await read_manifest(js, common.run) is not None:
        return False
    # the creator owns the run's limits: every stream sized for this tree (LimitsTooSmall if an
    # explicit DILOCO_STREAM_MAX_BYTES cannot hold it; Island() checked that before connecting)
    await ensure_run(js, common.run, Limits.for_run(common, plan.sizes, common.run), update=True)
    kv = await js.key_value(Subjects(common.run).bucket("run"))
    try:
        await kv.create(CLAIM_KEY, orjson.dumps({"ts": time.time(), "model": spec.tree_hash()}))
    except KeyWrongLastSequenceError:
        if log is not None:
            log.info("run_claimed_by_another_island", run=common.run)
        return False
    store = VersionedStore(js, common.run, GLOBAL, ChunkPublisher(js, common.max_chunk_bytes,
                                                                   common.inflight_chunks))
    meta = {"model": spec.tree_hash(), "plan": plan.plan_hash()}
    for p in range(plan.num_fragments):
        try:
            await store.put(p, 0, codec.encode_array(gather(plan, init, p)), meta)
        except VersionConflict:
            pass  # written by an earlier attempt of ours (the claim is ours)
    m = Manifest(run=common.run, model_hash=spec.tree_hash(), spec=tree_manifest_spec(spec, max_imbalance),
                 seed=0, num_fragments=plan.num_fragments, plan_hash=plan.plan_hash(), created_at=time.time(),
                 max_inner_lr=max_inner_lr, max_tokens_per_step=max_tokens_per_step)
    await kv.create(MANIFEST_KEY, orjson.dumps(m.to_dict()))
    if log is not None:
        log.info("run_created", run=common.run, params=spec.num_params, fragments=plan.num_fragments)
    return True
