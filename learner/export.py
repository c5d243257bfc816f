"""``diloco export``: the newest global parameters of a run as named arrays, without stopping it.

Works for both kinds of run: a user's tree (its manifest describes the leaves; keys are the leaf
paths, dtypes restored by ``learner.island.load_params``) and the built-in transformer (keys are
its parameter names). The file is an ``.npz`` of float32 arrays plus a ``__diloco__`` record (run,
the version of every fragment, model hash, leaf dtypes). Reading the global versions needs only
read access to the run (the metrics user of ``diloco auth init`` is enough).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np
import orjson

from bus.config import CommonConfig, ConfigError, from_env
from bus.conn import connect
from learner import loop as lp
from learner.config import ModelConfig


class ExportError(RuntimeError):
    """A one-line reason the export cannot be made (no run, no version yet...)."""


async def fetch_run_params(common: CommonConfig, timeout: float = 10.0) -> tuple[dict[str, np.ndarray], dict]:
    """(path -> float32 array, record) of the run's newest global version of every fragment."""
    from bus.runs import read_manifest, tree_of_manifest
    from learner.spec import make_plan
    from learner.startup import fetch_newest, global_reader, StartupError
    from learner.spec import ModelSpec

    nc = await connect(common, "diloco-export")
    try:
        js = nc.jetstream(timeout=10)
        m = await read_manifest(js, common.run)
        if m is None:
            raise ExportError(f"run {common.run!r} has no manifest: nothing to export (is DILOCO_RUN right?)")
        got = tree_of_manifest(m)
        if got is not None:
            tree, plan = got
            dtypes = {leaf.path: leaf.dtype for leaf in tree.synced}
        else:
            spec = ModelSpec.from_dict(m.spec)
            plan = make_plan(spec, m.num_fragments, from_env(ModelConfig).max_imbalance)
            if plan.plan_hash() != m.plan_hash:
                raise ExportError(f"run {common.run!r}: its fragment plan differs from DILOCO_MAX_IMBALANCE's")
            dtypes = {path: "float32" for path, _ in plan.shapes}
        reader = global_reader(js, common.run, plan, m.model_hash)
        try:
            vectors, versions = await fetch_newest(reader, plan, time.monotonic() + timeout, _Quiet())
        except StartupError as e:
            raise ExportError(f"run {common.run!r}: {e} (no global version exists yet?)") from None
        params = lp.params_from_fragments(plan, vectors)
        record = {"run": common.run, "model": m.model_hash, "versions": {str(k): v for k, v in versions.items()},
                  "dtypes": dtypes, "kind": "tree" if got is not None else "builtin", "ts": time.time()}
        return params, record
    finally:
        await nc.close()


def read_params_file(path: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(leaf path -> float32 array, leaf path -> dtype) of an .npz of named float leaves: a file
    ``diloco export`` wrote (its record gives each leaf's dtype) or the user's own ``np.savez(f,
    **{path: array})``. ValueError, one line, if it holds no float leaf or a non-float one."""
    import zipfile

    try:
        f = np.load(path, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a readable .npz of named arrays ({e})") from None
    with f:
        record = orjson.loads(bytes(f["__diloco__"])) if "__diloco__" in f.files else {}
        arrays, dtypes = {}, {}
        for k in f.files:
            if k == "__diloco__":
                continue
            a = f[k]
            if a.dtype.kind != "f":
                raise ValueError(f"{path}: leaf {k} is {a.dtype}, not floating point (only float leaves are synced)")
            arrays[k] = np.ascontiguousarray(a, dtype=np.float32)
            dtypes[k] = str(record.get("dtypes", {}).get(k, a.dtype.name))
    if not arrays:
        raise ValueError(f"{path}: holds no float array (expected leaf path -> array, as `diloco export` writes)")
    return arrays, dtypes


class _Quiet:
    def info(self, *a, **k) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="diloco export", description="write the newest global parameters of a run "
                                "to an .npz file (leaf paths as keys), while it runs")
    p.add_argument("--run", default=None, help="the run (default: DILOCO_RUN)")
    p.add_argument("--out", required=True, help="output .npz file")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a version of every fragment")
    a = p.parse_args(argv if argv is not None else sys.argv[1:])
    try:
        common = from_env(CommonConfig, {**os.environ, "DILOCO_RUN": a.run} if a.run else None)
    except ConfigError as e:
        print(f"diloco export: {e}", file=sys.stderr)
        return 2
    from learner.island import export_params

    try:
        params, record = asyncio.run(fetch_run_params(common, a.timeout))
    except ExportError as e:
        print(f"diloco export: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        print(f"diloco export: cannot read run {common.run!r} at {common.nats_url}: {e!r}", file=sys.stderr)
        return 1
    export_params(params, a.out, record)
    n = sum(v.size for v in params.values())
    print(f"diloco export: {len(params)} arrays, {n} parameters of run {common.run!r} "
          f"(versions {record['versions']}) -> {a.out}")
    return 0
