"""``diloco simulate``: what a configuration buys, before anyone deploys it (issue 42).

Two figures, each from a simulation that exists for its own sake (``simulation/``), neither a
measurement of a deployment:

* **quality**: the in-process reference (:mod:`simulation.reference`: M learners and one aggregator
  on a virtual clock, made of the roles' own functions) trains the built-in ``tiny`` or ``small``
  model with the given M, H, P, mode and steps, and data-parallel (one AdamW on batches of M x b) on
  the same data; the figure is the held-out loss of each and their relative gap. It is the
  algorithm's gap for that small model at that budget, not a prediction for a bigger model or a
  longer run (docs/BENCHMARKS.md has the compute-optimal studies);
* **goodput**: the goodput model (:mod:`simulation.goodput_model`, :func:`simulate_scale`): each
  learner's island fails as a Poisson process of ``--failure-rate`` per hour; data-parallel on the
  same islands stalls all of them for a whole-job restart on any failure, synchronous DiLoCo waits
  for a failed island at its barrier, Decoupled DiLoCo loses only the failed island's restart and
  its unsent steps. Constants not given here are the model's own (``ScaleModel``: fitted once to
  the paper's Table 1 at 150k-2.4M chips, or chosen); the figure is the share of allocated time
  whose work reaches the model.

    diloco simulate --learners 4 --sync-every 24 --failure-rate 0.5
    diloco simulate --quick --json          # a tiny run (seconds plus JAX's compile): one JSON line

Exit codes: 0, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import asdict

#: --quick: the tiny model, few steps, small batches and held-out set: a smoke-size run whose gap is
#: noise, for trying the command and for tests
QUICK = {"steps": 12, "batch": 4, "eval_batches": 1, "eval_batch_size": 4, "failures": 2000}
FULL = {"steps": 200, "batch": 8, "eval_batches": 8, "eval_batch_size": 16, "failures": 20000}
MODES = ("decoupled", "streaming", "sync")
#: the goodput model's row for each reference mode (Streaming DiLoCo's learners never wait either)
GOODPUT_ROW = {"decoupled": "decoupled", "streaming": "decoupled", "sync": "sync"}
GOODPUT_MODES = ("dp", "sync", "decoupled")


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative(text: str) -> float:
    v = float(text)
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def _positive(text: str) -> float:
    v = _non_negative(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return v


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diloco simulate", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--learners", "-M", type=_positive_int, default=2, help="M: learners (islands)")
    p.add_argument("--sync-every", "-H", type=_positive_int, default=None,
                   help="H: inner steps between two syncs of a fragment (default: the learner's DILOCO_SYNC_EVERY default)")
    p.add_argument("--fragments", "-P", type=_positive_int, default=None,
                   help="P: fragments (default: the model's DILOCO_NUM_FRAGMENTS default; --mode sync: 1, the paper's DiLoCo)")
    p.add_argument("--mode", choices=MODES, default="decoupled", help="the DiLoCo variant compared with data-parallel")
    p.add_argument("--quorum", "-K", type=_positive_int, default=None, help="decoupled: merge quorum K (default M)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help=f"inner steps per learner of the quality run (default {FULL['steps']}; --quick {QUICK['steps']})")
    p.add_argument("--model-preset", choices=("tiny", "small"), default=None,
                   help="the built-in model of the quality run (default small; --quick tiny)")
    p.add_argument("--data", default="", help="the quality run's corpus (as DILOCO_DATA; empty: Python's standard library)")
    p.add_argument("--failure-rate", type=_non_negative, default=1.0,
                   help="island failures per learner per hour (goodput)")
    p.add_argument("--step-time", type=_positive, default=None, help="seconds per inner step (goodput; default the model's 1 s)")
    p.add_argument("--restart-s", type=_non_negative, default=None,
                   help="seconds one island takes to restart, before its rejoin (goodput; default the model's fitted 2.5 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--goodput-only", action="store_true", help="skip the quality run (no JAX: instant)")
    p.add_argument("--quick", action="store_true", help="a smoke-size run: tiny model, few steps (its gap is noise)")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    return p


def resolve(a: argparse.Namespace) -> dict:
    """The configuration in force: the flags, then --quick's or the full defaults, then the roles'."""
    from learner.config import LearnerConfig, ModelConfig

    size = QUICK if a.quick else FULL
    H = a.sync_every or LearnerConfig().sync_every  # the roles' defaults (not the environment's)
    P = a.fragments or (1 if a.mode == "sync" else ModelConfig().num_fragments)
    return {"M": a.learners, "H": int(H), "P": int(P), "mode": a.mode, "K": a.quorum or a.learners,
            "steps": a.steps or size["steps"], "model_preset": a.model_preset or ("tiny" if a.quick else "small"),
            "batch": size["batch"], "data": a.data, "seed": a.seed, "quick": a.quick}


def quality(c: dict, size: dict, progress) -> dict:
    """Held-out loss of the mode and of data-parallel on the same model, data and budget."""
    from dataclasses import replace

    from simulation.reference import SMALL_MODEL, TINY_MODEL, RefConfig, Setup, run_reference

    model = dict(TINY_MODEL if c["model_preset"] == "tiny" else SMALL_MODEL)
    cfg = RefConfig(mode=c["mode"], M=c["M"], H=c["H"], P=c["P"], K=c["K"], steps=c["steps"], batch=c["batch"],
                    model=model, seed=c["seed"], corpus=c["data"], eval_points=1,
                    eval_batches=size["eval_batches"], eval_batch_size=size["eval_batch_size"])
    t0 = time.monotonic()
    progress(f"quality: building the {c['model_preset']} model and its data")
    setup = Setup(cfg)
    progress(f"quality: data-parallel, {c['steps']} steps of batch {c['M']} x {c['batch']}")
    dp = run_reference(replace(cfg, mode="dp"), setup)
    progress(f"quality: {c['mode']} DiLoCo, M={c['M']} H={c['H']} P={setup.plan.num_fragments}")
    run = run_reference(cfg, setup)
    gap = (run["eval_loss"] - dp["eval_loss"]) / dp["eval_loss"]
    return {"what": (f"in-process reference (simulation.reference) of the built-in {c['model_preset']} model, "
                     f"{run['params']:,} parameters, {c['steps']} inner steps per learner, the roles' default settings "
                     "(untuned): the algorithm's gap to "
                     "data-parallel for this small model and budget, not a prediction for a larger model or run"),
            "params": run["params"], "tokens": run["tokens"], "P": setup.plan.num_fragments,
            "dp_loss": round(dp["eval_loss"], 5), "loss": round(run["eval_loss"], 5),
            "gap": round(gap, 5), "merges": run.get("merges"), "wall_s": round(time.monotonic() - t0, 2)}


def goodput(c: dict, rate_per_hour: float, step_time: float | None, restart_s: float | None, failures: int) -> dict:
    """Goodput of data-parallel, synchronous and Decoupled DiLoCo on M islands, each failing at
    ``rate_per_hour`` (the goodput model with one failure unit per island)."""
    from dataclasses import replace

    from simulation.goodput_model import ScaleModel, simulate_scale

    model = ScaleModel(mtbi_s=3600.0 / rate_per_hour if rate_per_hour > 0 else math.inf, H=c["H"], P=c["P"],
                       quorum=c["K"])
    if step_time is not None:
        model = replace(model, step_s=step_time)
    if restart_s is not None:
        model = replace(model, island_restart_s=restart_s)
    M = c["M"]
    rows = {m: simulate_scale(m, M, M, model, failures=failures, seed=c["seed"]) for m in GOODPUT_MODES}
    dec = rows["decoupled"]
    return {"what": ("goodput model (simulation.goodput_model.simulate_scale): share of allocated time whose work "
                     "reaches the model, each island failing as a Poisson process; constants not set here are the "
                     "model's (fitted to the paper's Table 1 at 150k-2.4M chips, or chosen); data-parallel "
                     "also loses the model's dp_overhead to its per-step syncs, failures or not"),
            "failure_rate_per_learner_per_hour": rate_per_hour, "row": GOODPUT_ROW[c["mode"]],
            "modes": {m: round(r["goodput"], 4) for m, r in rows.items()},
            "below_quorum_share": round(dec["below_quorum_share"], 4), "failures_simulated": dec["failures"],
            "simulated_h": round(dec["simulated_s"] / 3600.0, 1), "island_down_s": round(model.island_down_s(M), 2),
            "model": {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(model).items()}}


def table(r: dict) -> str:
    c = r["config"]
    k = f", K={c['K']}" if c["mode"] == "decoupled" else ""
    lines = [f"diloco simulate: M={c['M']} learners, H={c['H']}, P={c['P']}, {c['mode']}{k}"]
    q = r.get("quality")
    if q:
        lines += ["",
                  f"quality: in-process reference of the built-in {c['model_preset']} model ({q['params']:,} parameters, "
                  f"{c['steps']} steps per learner, P={q['P']}; {q['wall_s']} s)",
                  "  the roles' default settings, untuned; not a prediction for a larger model or run"
                  + (" (--quick: the gap is noise)" if c["quick"] else ""),
                  f"  {'data-parallel':<20} held-out loss {q['dp_loss']:.4f}",
                  f"  {c['mode'] + ' DiLoCo':<20} held-out loss {q['loss']:.4f}   {100 * q['gap']:+.2f}% vs data-parallel"
                  f" ({q['merges']} merge{'' if q['merges'] == 1 else 's'})"]
    g = r["goodput"]
    names = {"dp": "data-parallel", "sync": "sync DiLoCo", "decoupled": "decoupled DiLoCo"}
    lines += ["",
              f"goodput: {g['failure_rate_per_learner_per_hour']:g} island failures per learner per hour "
              f"(goodput model; {g['failures_simulated']:,} failures over {g['simulated_h']:,} h simulated)"]
    for m, v in g["modes"].items():
        mark = "   <- this configuration" if m == g["row"] else ""
        if m == "dp":
            mark = f"   (of which {100 * g['model']['dp_overhead']:.2f}% lost to per-step syncs, failures or not)"
        lines.append(f"  {names[m]:<20} {100 * v:6.2f}%{mark}")
    if c["mode"] == "decoupled":
        lines.append(f"  fewer than K={c['K']} islands up {100 * g['below_quorum_share']:.2f}% of the time "
                     "(merges wait; learners do not)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.quorum is not None and a.quorum > a.learners:
        p.error(f"--quorum {a.quorum} is more than --learners {a.learners}")
    if a.quorum is not None and a.mode != "decoupled":
        p.error("--quorum applies to --mode decoupled (sync and streaming merge all M)")
    if a.quick and not a.goodput_only and "jax" not in sys.modules:
        # a smoke-size run is mostly XLA compiling its few steps: unoptimised code compiles in half the time
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
    t0 = time.monotonic()
    c = resolve(a)
    size = QUICK if a.quick else FULL

    def progress(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    out: dict = {"command": "simulate", "config": c}
    out["goodput"] = goodput(c, a.failure_rate, a.step_time, a.restart_s, size["failures"])
    out["quality"] = None if a.goodput_only else quality(c, size, progress)
    out["wall_s"] = round(time.monotonic() - t0, 2)
    if a.json:
        import orjson

        print(orjson.dumps(out).decode(), flush=True)
    else:
        print(table(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
