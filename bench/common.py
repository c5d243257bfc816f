"""Shared benchmark plumbing: --quick / --out arguments and the one-JSON-line-last convention."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import orjson

from learner.loop import peak_rss_mib as _peak_rss_mib


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a run under a minute (fewer sizes/repetitions)")
    p.add_argument("--out", default=None, help="write the results JSON to this file")
    return p


def reference_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of a benchmark of reference runs on a token budget (``simulation.reference``):
    ``--tokens-per-param`` (None: the benchmark's default), ``--batch``, ``--seed``, ``--jobs``."""
    p.add_argument("--tokens-per-param", type=float, default=None, help="budget (default 20; quick 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per learner step")
    p.add_argument("--seed", type=int, default=0, help="the data seed (the batches each learner samples)")
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (processes)")
    return p


def machine() -> dict:
    return {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()}


peak_rss_mib = _peak_rss_mib  # VmHWM: see learner.loop.peak_rss_mib


def rss_mib() -> float:
    """This process's resident set now (VmRSS), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def progress(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_jobs(fn: Callable[[Any], dict], items: list, jobs: int, line: Callable[[dict], str]) -> list[dict]:
    """``fn`` of every item, in order: ``jobs`` > 1 in that many spawned worker processes (which die
    with us; ``fn`` and the items must pickle), else here; each result's ``line`` said as progress."""
    rows: list[dict] = []
    if jobs > 1:
        from bus.procs import process_pool

        with process_pool(jobs) as ex:
            for row in ex.map(fn, items):
                rows.append(row)
                progress(line(row))
    else:
        for it in items:
            rows.append(fn(it))
            progress(line(rows[-1]))
    return rows


def reused_rows(paths: list[str] | None, fields: tuple[str, ...]) -> dict[tuple, dict]:
    """The ``rows`` of earlier results JSONs (``--reuse``), by the values of ``fields`` (None where a
    row lacks one)."""
    old: dict[tuple, dict] = {}
    for path in paths or []:
        with open(path, "rb") as f:
            for r in orjson.loads(f.read()).get("rows", []):
                old[tuple(r.get(k) for k in fields)] = r
    return old


def fetch_delay_of(row: Any) -> int | None:
    """The learners' DILOCO_FETCH_DELAY a reference row ran with (a results row), or will run with (a
    ``RefConfig``), for ``--reuse``: recorded since the fourteenth round; a decoupled or streaming row
    without it ran the default of its day, H/4 (-1). None for the modes that fetch every version
    (data-parallel, sync)."""
    mode, delay = (row.get("mode"), row.get("fetch_delay", -1)) if isinstance(row, dict) else (row.mode, row.fetch_delay)
    return delay if mode in ("decoupled", "streaming") else None


def period_of(row: Any) -> int | None:
    """The sync period H a reference row ran with (a results row), or will run with (a ``RefConfig``),
    for ``--reuse``: recorded since the sixteenth round; a row without it ran 12, the default of its
    day at every M (except rows written by a tree of 2026-12-05 13:07-13:26, when an M rule was the
    default for a while: do not reuse those). None for data-parallel (no period)."""
    mode, h = (row.get("mode"), row.get("H", 12)) if isinstance(row, dict) else (row.mode, row.H)
    return None if mode == "dp" else h


def finish(results: dict, out: str | None) -> None:
    """Write ``results`` to ``out`` (if given) and print them as one JSON line, last."""
    results = {**results, "machine": machine()}
    data = orjson.dumps(results, option=orjson.OPT_SERIALIZE_NUMPY)
    if out:
        with open(out, "wb") as f:
            f.write(data)
    print(data.decode(), flush=True)
