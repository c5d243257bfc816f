"""Restart: a learner killed -9 at half its budget and started again, against the same run without a fault.

The real roles on an embedded server, as a user runs them by hand: an aggregator and a monitor with
their defaults, M learners of the small model (``bench.quality``'s settings: batch 8, 64 tokens,
the cosine over the run). In the fault variants ``learner-1`` is killed with SIGKILL when its
metrics say half its budget, and started again ``--gap`` seconds later with the same environment.
Variants (``--variants``):

- ``none``: no fault (the baseline);
- ``resume``: the defaults (``DILOCO_RESUME=true``): the new process continues at the step the
  run holds, with the schedule, budget and data position of that step, a fresh AdamW whose rate
  is ramped up over ``DILOCO_RESUME_WARMUP`` (50) steps;
- ``warmup``: as ``resume`` with ``DILOCO_RESUME_WARMUP=--warmup`` (default 0: no ramp);
- ``over``: ``DILOCO_RESUME=false``: the new process starts its steps, schedule and data over
  (what every restart did before issue 38).

Per run: the held-out loss of the final global model (``diloco eval --once``), the steps trained
by ``learner-1`` in all (the killed process's, at least its last metrics' step and the step of its
newest published outer gradient, plus the new one's: a lower bound by the steps of one 0.2 s metrics
interval), the
new process's ``start_step``, and the seconds from its start to its first inner step and to its
first merged contribution. ``loss_vs_none``: each variant's mean loss against ``none``'s, with
every run's figure beside it (``--repeats`` runs each, interleaved, so the machine's load falls on
every variant alike).

    python -m bench.restart --quick                    (600 steps, none and resume, ~2 min)
    python -m bench.restart --repeats 3 --out r.json   (2400 steps, four variants, ~13 min)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import statistics
import time

from bench.common import finish, parser, progress
from bench.quality import settings
from bench.runs import Cluster

VARIANTS = ("none", "resume", "warmup", "over")
VICTIM = "learner-1"


async def one_run(env: dict, M: int, steps: int, variant: str, gap: float, rewarm: int) -> dict:
    names = [f"learner-{i}" for i in range(M)]
    extra = {"DILOCO_RESUME_WARMUP": str(rewarm)} if variant == "warmup" else {}
    if variant == "over":
        extra = {"DILOCO_RESUME": "false"}
    async with Cluster("restart", env, metrics_interval=0.2) as c:
        c.start("aggregator", "aggregator")
        c.start("monitor", "monitor")
        for n in names:
            c.start(n, "learner", DILOCO_LEARNER_ID=n, DILOCO_NUM_LEARNERS=str(M), DILOCO_START_WITH=str(M), **extra)
        out: dict = {"variant": variant}
        t0 = time.monotonic()
        if variant != "none":
            ok = await c.wait_for(lambda: (c.metrics("learner", VICTIM).get("step") or 0) >= steps // 2, 600, 0.05)
            if not ok:
                raise RuntimeError(f"{VICTIM} did not reach step {steps // 2}: {c.log_tail(VICTIM)}")
            first = c.metrics("learner", VICTIM)
            c.kill(VICTIM)
            out["killed_at"] = first["step"]
            await asyncio.sleep(gap)
            t_start = time.monotonic()
            # (no DILOCO_START_WITH: a process started into a run under way has nobody to wait for)
            c.start(VICTIM + "-again", "learner", DILOCO_LEARNER_ID=VICTIM, DILOCO_NUM_LEARNERS=str(M), **extra)
            inc = first["incarnation"]

            def again() -> dict:
                m = c.metrics("learner", VICTIM)
                return m if m.get("incarnation") != inc else {}

            await c.wait_for(lambda: again().get("step", -1) > again().get("start_step", 0), 300, 0.05)
            out["restart_to_first_step_s"] = round(time.monotonic() - t_start, 2)
            await c.wait_for(lambda: (again().get("work") or {}).get("merged", 0) > 0, 300, 0.05)
            out["restart_to_first_merge_s"] = round(time.monotonic() - t_start, 2)
            out["start_step"] = again().get("start_step")
        waiting = names if variant == "none" else [n for n in names if n != VICTIM] + [VICTIM + "-again"]
        if not await c.wait_exit(waiting, 900):
            raise RuntimeError(f"{variant}: learners did not finish")
        out["wall_s"] = round(time.monotonic() - t0, 1)
        await c.wait_for(lambda: not c.metrics("aggregator", "agg-0").get("buffered"), 10.0)
        await asyncio.sleep(1.0)
        last = c.metrics("learner", VICTIM)
        out["final_step"] = last.get("step")
        if variant == "none":
            out["trained"] = last.get("step")
        else:
            # the killed process trained at least to its last metrics' step and to the step of the
            # newest outer gradient it published (the new one's start_step): the larger, a lower bound
            # (it may have trained a few steps more after its last metrics, 0.2 s apart)
            start = last.get("start_step") or 0
            out["trained"] = max(out["killed_at"], start) + last["step"] - start
        out["restarts"] = last.get("restarts")
        out["eval_loss"] = (await c.eval_once())["eval_loss"]
        return out


def summarize(runs: list[dict], variants: tuple[str, ...], steps: int) -> dict:
    by = {v: [r for r in runs if r["variant"] == v] for v in variants}
    out: dict = {}
    base = statistics.mean(r["eval_loss"] for r in by["none"]) if by.get("none") else None
    for v, rs in by.items():
        losses = [r["eval_loss"] for r in rs]
        s = {"runs": len(rs), "eval_loss": [round(x, 4) for x in losses], "mean": round(statistics.mean(losses), 4),
             "spread": round(max(losses) - min(losses), 4),
             "trained": [r["trained"] for r in rs], "budget": steps}
        if base is not None:
            s["loss_vs_none"] = round(statistics.mean(losses) / base - 1, 4)
            s["each_vs_none"] = [round(x / base - 1, 4) for x in losses]
        for k in ("restart_to_first_step_s", "restart_to_first_merge_s", "start_step", "killed_at"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                s[k] = vals
        out[v] = s
    return out


async def main_async(quick: bool, steps: int, M: int, variants: tuple[str, ...], repeats: int, gap: float,
                     rewarm: int) -> dict:
    env = settings(True, steps)
    env["DILOCO_LOG_LEVEL"] = "warning"
    runs = []
    for rep in range(repeats):
        for v in variants:
            progress(f"repeat {rep + 1}/{repeats}: {v}, M={M} x {steps} steps")
            r = await one_run(env, M, steps, v, gap, rewarm)
            progress(f"  {v}: eval {r['eval_loss']:.4f}, {VICTIM} trained {r['trained']} steps "
                     f"(start {r.get('start_step')}, first merge {r.get('restart_to_first_merge_s')} s)")
            runs.append({**r, "repeat": rep})
    return {"M": M, "steps": steps, "settings": env, "gap_s": gap, "rewarm": rewarm, "repeats": repeats,
            "variants": summarize(runs, variants, steps), "runs": runs}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="each learner's budget (default 2400: 20 tokens per parameter; --quick 600)")
    p.add_argument("--M", type=int, default=2)
    p.add_argument("--variants", default=None, help="comma-separated, of " + ",".join(VARIANTS)
                   + " (default all; --quick none,resume)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--gap", type=float, default=3.0, help="seconds between the kill and the restart")
    p.add_argument("--warmup", type=int, default=0, help="DILOCO_RESUME_WARMUP of the warmup variant")
    a = p.parse_args()
    steps = a.steps or (600 if a.quick else 2400)
    variants = tuple(a.variants.split(",")) if a.variants else (("none", "resume") if a.quick else VARIANTS)
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {bad}, expected some of {VARIANTS}")
    finish(asyncio.run(main_async(a.quick, steps, a.M, variants, a.repeats, a.gap, a.warmup)), a.out)


if __name__ == "__main__":
    main()
