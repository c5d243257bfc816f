"""The run contract: what every role agrees on before it trains or merges (no role code here).

A run is described by its **manifest** (KV ``run``/``manifest``): the parameter tree (leaf paths,
shapes, dtypes; ``bus.tree``), the fragment plan (``bus.fragments``) with the hashes of both, and
the declared geometry that bounds a contribution. Version 0 of every fragment is written before
the manifest, so a process that reads a manifest finds version 0.

* :func:`read_manifest` / :func:`wait_manifest`: any role, read-only.
* :func:`tree_of_manifest`: the tree and plan of a run made from a user's tree (an island, or
  ``diloco run create --init``); the aggregator and evaluator of such a run need nothing else.
* :func:`create_tree_run`: provision the streams (sized from the tree, ``bus.streams``; the
  ``run_created`` log line says what they reserve on the server, ``reserved_bytes``), claim
  the run with a compare-and-set create of the run bucket's ``creator`` key, publish the initial
  parameters as version 0 and then the manifest. Exactly one of several racing creators writes
  version 0; the others wait for its manifest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

import numpy as np
import orjson
from nats.js import JetStreamContext
from nats.errors import NoRespondersError
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from bus import codec
from bus.config import CommonConfig
from bus.fragments import FragmentPlan, gather, plan_fragments
from bus.protocol import MANIFEST_KEY, Manifest
from bus.streams import Limits, ensure_run, inspect_run, missing_parts, reserved_total
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkPublisher, VersionConflict, VersionedStore
from bus.tree import TreeSpec

CLAIM_KEY = "creator"


class RunMismatch(RuntimeError):
    """This process's model or fragment plan differs from the run's manifest."""


async def read_manifest(js: JetStreamContext, run: str) -> Manifest | None:
    """The run's manifest, or None while the run (or its manifest) does not exist yet.

    One direct get of the manifest's key (buckets are created with direct get, ``bus.streams``):
    answered by the bucket's stream itself, in one round trip, not by the server's JetStream API
    workers (as many as it has cores; stream info waits behind every other API request). A bucket
    without direct get (a run created before) or no bucket at all has no responder: then the key-value
    read (stream info, then a message get through the API)."""
    bucket = Subjects(run).bucket("run")
    try:
        msg = await js.get_last_msg(f"KV_{bucket}", f"$KV.{bucket}.{MANIFEST_KEY}", direct=True)
    except NotFoundError:  # the bucket answered: no manifest yet
        return None
    except NoRespondersError:
        return await _read_manifest_kv(js, bucket)
    if not msg.data or (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE"):
        return None
    return Manifest.from_dict(orjson.loads(msg.data))


async def _read_manifest_kv(js: JetStreamContext, bucket: str) -> Manifest | None:
    try:
        kv = await js.key_value(bucket)
    except (BucketNotFoundError, NotFoundError):
        return None
    try:
        e = await kv.get(MANIFEST_KEY)
    except KeyNotFoundError:
        return None
    if e.value is None:
        return None
    return Manifest.from_dict(orjson.loads(e.value))


async def wait_manifest(js: JetStreamContext, run: str, timeout: float, poll: float = 0.2, log=None) -> Manifest:
    """The run's manifest, waiting up to ``timeout`` seconds for an aggregator to create it. A read
    with no answer is asked again until the deadline; the first is logged (``manifest_read_slow``)
    with what of the server still answers (``bus.conn.probe``)."""
    t_end = time.monotonic() + timeout
    why = ""
    told = False
    while True:
        try:
            m = await read_manifest(js, run)
        except (asyncio.TimeoutError, TimeoutError) as e:
            # one reply late (a loaded server) is not the manifest's absence: ask again until our deadline
            m, why = None, f" (the last read: {e!r})"
            if log is not None and not told:
                told = True
                from bus.conn import probe

                bucket = Subjects(run).bucket("run")
                log.warning("manifest_read_slow", error=repr(e), hint="asking again until DILOCO_MANIFEST_TIMEOUT",
                            **await probe(js._nc, f"KV_{bucket}", direct_subject=f"$KV.{bucket}.{MANIFEST_KEY}"))
        if m is not None:
            return m
        if time.monotonic() > t_end:
            raise TimeoutError(f"run {run!r} has no manifest after {timeout}s{why}: create it (`diloco run create`, "
                               "or start a learner or island that may create it)")
        await asyncio.sleep(poll)


def plan_for(spec: TreeSpec, num_fragments: int, max_imbalance: float) -> FragmentPlan:
    """The run's fragment plan for a tree: from its float leaves' shapes."""
    return plan_fragments(spec.shapes(), min(num_fragments, max(1, spec.num_params)), max_imbalance=max_imbalance)


def run_tree(m: Manifest) -> tuple[TreeSpec, FragmentPlan]:
    """(tree, fragment plan) of any run, from its manifest alone: what the aggregator, the
    evaluator of a user's model and ``diloco export`` need. :class:`RunMismatch` if the manifest
    describes no tree (a run created before manifests carried one) or its plan hash disagrees."""
    raw = m.tree if m.tree is not None else m.spec.get("tree")
    if raw is None:
        raise RunMismatch(f"run {m.run!r} was created by an older version: its manifest describes no parameter "
                          "tree (delete it with `diloco run delete` and create it again)")
    try:
        spec = TreeSpec.from_dict(raw)
    except ValueError as e:
        raise RunMismatch(f"run {m.run!r}: {e}") from None
    mi = m.max_imbalance if m.max_imbalance is not None else float(m.spec.get("max_imbalance", 1.1))
    plan = plan_for(spec, m.num_fragments, mi)
    if plan.plan_hash() != m.plan_hash:
        raise RunMismatch(f"run {m.run!r}: the manifest's plan hash {m.plan_hash} does not match its tree "
                          f"({plan.plan_hash()})")
    return spec, plan


def tree_of_manifest(m: Manifest) -> tuple[TreeSpec, FragmentPlan] | None:
    """(tree, plan) of a run created from a user's tree, or None for a built-in-model run."""
    if m.spec.get("kind") != "tree":
        return None
    return run_tree(m)


async def create_run(js, common: CommonConfig, manifest: Manifest, plan: FragmentPlan,
                     init: Callable[[], Mapping[str, np.ndarray]], *, log=None, claim_timeout: float = 60.0,
                     provision: bool = True) -> bool:
    """Create run ``common.run``: streams sized for ``plan`` (the creator owns the run's limits),
    a claim, version 0 of every fragment from ``init()`` (path -> array, called only by the
    claimant), then ``manifest``. True if we created it; False if it existed or another process
    holds the claim (wait for its manifest, ``wait_manifest``).

    The claim is a compare-and-set create of the run bucket's ``creator`` key, so of several
    processes racing (islands, learners, ``diloco run create``) exactly one writes version 0. A
    claim older than ``claim_timeout`` seconds with no manifest is a creator that died half-way:
    the next creator takes it over (compare-and-set again), keeps the fragments already written
    and writes the others. Raises ``LimitsTooSmall`` if an explicit stream limit cannot hold the run.
    ``provision=False`` (DILOCO_PROVISION=false under strict auth): the streams must exist already
    (:class:`RunMismatch` naming what to do otherwise), and are left as they are."""
    if await read_manifest(js, common.run) is not None:
        return False
    body = orjson.dumps(manifest.to_dict())
    limit = getattr(getattr(js, "_nc", None), "max_payload", None)
    if limit and len(body) > limit:
        # refused before anything is written (the manifest is the run's last write)
        leaves = len((manifest.tree or {}).get("leaves", ())) if isinstance(manifest.tree, dict) else 0
        raise RunMismatch(f"run {common.run!r}: its manifest is {len(body)} bytes (a tree of {leaves} leaves), "
                          f"above the server's max_payload of {limit}: raise max_payload in the server's config "
                          "(up to 64 MiB) or group small leaves into fewer arrays")
    limits = Limits.for_run(common, plan.sizes, common.run)
    if provision:
        await ensure_run(js, common.run, limits, update=True)
    elif missing := await missing_parts(js, common.run):
        raise RunMismatch(f"run {common.run!r} is not provisioned (missing {', '.join(missing)}) and "
                          "DILOCO_PROVISION=false: create it first with `diloco run create --streams-only` "
                          "(admin credentials)")
    kv = await js.key_value(Subjects(common.run).bucket("run"))
    claim = orjson.dumps({"ts": time.time(), "model": manifest.model_hash})
    try:
        await kv.create(CLAIM_KEY, claim)
    except KeyWrongLastSequenceError:
        entry = await kv.get(CLAIM_KEY)
        try:
            age = time.time() - float(orjson.loads(entry.value or b"{}").get("ts", 0.0))
        except (ValueError, TypeError, AttributeError):
            age = float("inf")  # garbage in the claim: nobody can be writing under it
        if age < claim_timeout or await read_manifest(js, common.run) is not None:
            if log is not None:
                log.info("run_claimed_by_another_process", run=common.run)
            return False
        try:
            await kv.update(CLAIM_KEY, claim, last=entry.revision)
        except KeyWrongLastSequenceError:
            return False
        if log is not None:
            log.warning("run_claim_taken_over", run=common.run, claim_age_s=round(age, 1))
    params = init()
    store = VersionedStore(js, common.run, GLOBAL, ChunkPublisher(js, common.max_chunk_bytes,
                                                                   common.inflight_chunks))
    meta = {"model": manifest.model_hash, "plan": plan.plan_hash()}
    for p in range(plan.num_fragments):
        try:
            await store.put(p, 0, codec.encode_array(gather(plan, params, p)), meta)
        except VersionConflict:
            pass  # written by the creator whose claim we took over: version 0 stays as it is
    try:
        await kv.create(MANIFEST_KEY, body)
    except KeyWrongLastSequenceError:
        return False  # a creator we took over from finished after all: its manifest stands
    if log is not None:
        log.info("run_created", run=common.run, params=plan.total_size, fragments=plan.num_fragments,
                 **await reserved_of(js, common.run))
    return True


async def reserved_of(js, run: str) -> dict:
    """What the streams and buckets of ``run`` reserve on the server (their ``max_bytes``):
    ``{"reserved_bytes": total, "reserved": {stream: bytes}}``; empty if the server cannot say."""
    try:
        inspected = await inspect_run(js, run)
    except Exception:  # noqa: BLE001 - informational only: never fails a creation that succeeded
        return {}
    per = {name: v.get("reserved_bytes", 0) for name, v in inspected.items() if isinstance(v, dict)}
    return {"reserved_bytes": reserved_total(inspected), "reserved": per}


async def create_tree_run(js, common: CommonConfig, spec: TreeSpec, plan: FragmentPlan,
                          init: Mapping[str, np.ndarray], max_imbalance: float, *, max_inner_lr: float | None = None,
                          max_tokens_per_step: int | None = None, log=None, provision: bool = True) -> bool:
    """:func:`create_run` of a user's tree with ``init`` (path -> array) as version 0."""
    m = Manifest(run=common.run, model_hash=spec.tree_hash(), spec={"kind": "tree"}, seed=0,
                 num_fragments=plan.num_fragments, plan_hash=plan.plan_hash(), created_at=time.time(),
                 max_inner_lr=max_inner_lr, max_tokens_per_step=max_tokens_per_step, tree=spec.to_dict(),
                 max_imbalance=max_imbalance)
    return await create_run(js, common, m, plan, lambda: init, log=log, provision=provision)
