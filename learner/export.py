"""``diloco export``: the newest global parameters of a run as named arrays, without stopping it.

Works for both kinds of run: a user's tree (its manifest describes the leaves; keys are the leaf
paths, dtypes restored by ``learner.island.load_params``) and the built-in transformer (keys are
its parameter names). The file is an ``.npz`` of float32 arrays plus a ``__diloco__`` record (run,
the version of every fragment, model hash, leaf dtypes). Reading the global versions needs only
read access to the run (the metrics user of ``diloco auth init`` is enough).

Every failure is one line on stderr: an unreachable server (after DILOCO_CONNECT_TIMEOUT, or
``--timeout`` if shorter), no manifest or no version within ``--timeout``, an ``--out`` whose
folder does not exist (checked before connecting; the folder is not created, so a mistyped path
fails instead of leaving a stray tree). The file is written beside its final name and renamed.
When every fragment is still at version 0 (the initial parameters: nothing merged yet) it warns,
and ``--require-merged`` makes that a failure (exit 5, nothing written).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time

import numpy as np
import orjson

from bus.config import CommonConfig, ConfigError, from_env
from bus.conn import REFUSED_GRACE, ConnectFailed, connect, redact_url
from bus.entry import EXIT_ERROR, EXIT_NOT_MERGED, EXIT_UNAVAILABLE, EXIT_USAGE
from learner import loop as lp
from learner.config import ModelConfig


class ExportError(RuntimeError):
    """A one-line reason the export cannot be made (no run, no version yet...)."""


async def fetch_run_params(common: CommonConfig, timeout: float = 10.0) -> tuple[dict[str, np.ndarray], dict]:
    """(path -> float32 array, record) of the run's newest global version of every fragment, all
    within ``timeout`` seconds (reaching the server takes at most DILOCO_CONNECT_TIMEOUT of them):
    ExportError (one line) otherwise, ``bus.conn.ConnectFailed`` when the server cannot be reached."""
    from bus.runs import read_manifest, tree_of_manifest
    from learner.spec import make_plan
    from learner.startup import fetch_newest, global_reader, StartupError
    from learner.spec import ModelSpec

    deadline = time.monotonic() + timeout
    nc = await connect(common, "diloco-export", timeout=min(common.connect_timeout, timeout), refused_grace=REFUSED_GRACE)
    try:
        js = nc.jetstream(timeout=max(0.5, min(10.0, deadline - time.monotonic())))
        try:
            m = await asyncio.wait_for(read_manifest(js, common.run), max(0.1, deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError):
            raise ExportError(f"run {common.run!r}: its manifest could not be read within {timeout:g}s "
                              "(--timeout; may this user read the run?)") from None
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
            vectors, versions = await asyncio.wait_for(fetch_newest(reader, plan, deadline, _Quiet()),
                                                       max(0.1, deadline - time.monotonic()) + 1.0)
        except StartupError as e:
            raise ExportError(f"run {common.run!r}: {e} within {timeout:g}s (--timeout; no global version exists "
                              "yet?)") from None
        except (asyncio.TimeoutError, TimeoutError):
            raise ExportError(f"run {common.run!r}: no version of every fragment read within {timeout:g}s "
                              "(--timeout)") from None
        params = lp.params_from_fragments(plan, vectors)
        record = {"run": common.run, "model": m.model_hash, "versions": {str(k): v for k, v in versions.items()},
                  "dtypes": dtypes, "kind": "tree" if got is not None else "builtin", "ts": time.time()}
        return params, record
    finally:
        await nc.close()


def check_out_path(path: str) -> str | None:
    """None if ``path`` can be written (its folder exists and is writable, it is no folder itself),
    else one line saying why. The folder is not created: a mistyped path fails, as ``cp`` does."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--out {path}: is a folder (expected a file name, e.g. {os.path.join(path, 'model.npz')})"
    if not os.path.isdir(folder):
        return f"--out {path}: the folder {os.path.dirname(path) or folder} does not exist (create it first)"
    if not os.access(folder, os.W_OK):
        return f"--out {path}: the folder {os.path.dirname(path) or folder} is not writable"
    return None


def write_atomically(params: dict[str, np.ndarray], path: str, record: dict) -> None:
    """The .npz at ``path`` (leaf paths as keys, ``__diloco__`` the record), written to a temporary
    file beside it and renamed: a reader never sees half a file, and a failed write leaves none."""
    from learner.island import export_params

    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        export_params(params, tmp, record)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


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
    p = argparse.ArgumentParser(
        prog="diloco export", description="write the newest global parameters of a run to an .npz file (leaf paths "
        "as keys), while it runs. Exit codes: 0 written, 1 failed (one line on stderr), 2 bad configuration or "
        f"--out, {EXIT_UNAVAILABLE} server out of reach, {EXIT_NOT_MERGED} "
        "--require-merged and nothing merged yet")
    p.add_argument("--run", default=None, help="the run (default: DILOCO_RUN)")
    p.add_argument("--out", required=True, help="output .npz file (its folder must exist)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds the whole export may take: reaching the server (at most DILOCO_CONNECT_TIMEOUT of "
                        "them), the manifest and a version of every fragment (default 10)")
    p.add_argument("--require-merged", action="store_true",
                   help=f"fail (exit {EXIT_NOT_MERGED}, nothing written) when every fragment is still at version 0, "
                        "the initial parameters: no merged work yet (without it: a warning)")
    a = p.parse_args(argv if argv is not None else sys.argv[1:])
    if not (a.timeout > 0 and math.isfinite(a.timeout)):
        p.error("--timeout must be > 0")
    try:
        common = from_env(CommonConfig, {**os.environ, "DILOCO_RUN": a.run} if a.run else None)
        from_env(ModelConfig)  # a bad model variable: one line now, not after connecting
    except ConfigError as e:
        print(f"diloco export: {e}", file=sys.stderr)
        return 2
    from bus.log import setup

    setup(common.log_level, run=common.run, role="export")  # logs on stderr; unknown variables warned
    why = check_out_path(a.out)
    if why is not None:
        print(f"diloco export: {why}", file=sys.stderr)
        return 2
    try:
        params, record = asyncio.run(fetch_run_params(common, a.timeout))
    except ConnectFailed as e:
        print(f"diloco export: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except ExportError as e:
        print(f"diloco export: {e}", file=sys.stderr)
        return EXIT_ERROR
    except ConfigError as e:
        print(f"diloco export: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:
        print(f"diloco export: cannot read run {common.run!r} at {redact_url(common.nats_url)}: {e!r}",
              file=sys.stderr)
        return 1
    if all(v == 0 for v in record["versions"].values()):
        note = (f"run {common.run!r}: every fragment is at version 0, the initial parameters: no merged work yet "
                "(is an aggregator running, are learners contributing?)")
        if a.require_merged:
            print(f"diloco export: {note}; nothing written (--require-merged)", file=sys.stderr)
            return EXIT_NOT_MERGED
        print(f"diloco export: warning: {note}", file=sys.stderr)
    try:
        write_atomically(params, a.out, record)
    except OSError as e:
        print(f"diloco export: cannot write {a.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    n = sum(v.size for v in params.values())
    print(f"diloco export: {len(params)} arrays, {n} parameters of run {common.run!r} "
          f"(versions {record['versions']}) -> {a.out}")
    return 0
