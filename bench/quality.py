"""Quality: held-out loss of Decoupled DiLoCo (M learners through the real bus) against data-parallel.

Decoupled: an embedded server, one aggregator and M real JAX learner processes, each running
``steps`` inner steps of batch b on its own data shard, all with the roles' defaults (the aggregator:
rounds that close on time, mean merge, outer Nesterov once per round; the learners: staggered
fragments, int8 outer gradients with error feedback, rebase on arrival, one download per fragment
and round, a final sync at the step budget); then ``diloco eval --once`` on the final global model.
``--variants`` (comma-separated, ``bench.runs.AGG_VARIANTS``) runs the aggregator variants one after
the other, by default ``defaults`` (the on-time quorum) and ``k1`` (K = 1 and the grace window;
``--quick`` without ``--steps``: ``defaults`` only, to stay under a minute).
Data-parallel: one process, the same model, the same version-0 parameters (same seed), the same
inner optimizer (DILOCO_INNER_OPTIMIZER: Muon by default), settings and schedule, batches of M x b
(b from each of the M shards) for the same number of steps, so both saw the same number of tokens
(``bench/dp.py``); the same held-out batches.
``--dp-lrs 0.004,0.008,0.016`` trains data-parallel at each peak learning rate too, ``--dp-inner muon``
with each inner optimizer named (``DILOCO_INNER_OPTIMIZER``) too: the best of them is the *tuned*
data-parallel baseline (the learners keep their own settings; ``--learner-env`` sets theirs).

``loss_gap`` = (decoupled - best data-parallel) / best data-parallel held-out loss, of the first
variant. Targets: <= 1% at M=2, <= 3% at M=4 (about 20 tokens per parameter).
``--corpus PATH`` trains on another corpus (``DILOCO_DATA``: a text file or a folder of them).
``--slowdown X`` stretches each learner step X times (``DILOCO_SLOWDOWN``): the small model's steps
take about 17 ms here, so a merge's round trip through the bus is several steps long, which a
model whose steps take seconds never sees. ``--spread S`` makes learner i's steps (1 + S x i) times
the slowdown's (the reference's speed spread is S = 0.06): learners of unequal speeds set by their
pacing, not by how the machine's cores are shared (give a slowdown that leaves cores idle).
The slowdown multiplies each step's measured time, the machine's scheduling noise with it: with
eight learners on two cores their steps jitter, and their rounds drift apart. ``--step-time T``
(``DILOCO_MIN_STEP_TIME``) gives every step one pace of T seconds instead (learner i's (1 + S x i)
T with ``--spread``), as on hardware of that speed; the JSON reports each learner's steps'
coefficient of variation (``learner_step_cv``).

    python -m bench.quality --quick --out quality.json     (small model, 80 steps, ~40 s)
    python -m bench.quality --quick --M 2 --steps 2400     (small model, 20 tokens per parameter)
    python -m bench.quality --out quality.json             (default model, ~7 min)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio

from bench.common import finish, parser, progress
from bench.dp import dp_rate, train_dp
from bench.runs import AGG_VARIANTS, SMALL_MODEL, aggregator_settings, learner_settings, run_learners


def settings(quick: bool, steps: int, corpus: str | None = None) -> dict:
    """The run's DILOCO_* settings: the model, the batch, the schedule's length (the cosine ends with
    the run), the evaluation; everything else is the roles' defaults."""
    env = dict(SMALL_MODEL, DILOCO_BATCH_SIZE="8") if quick else {"DILOCO_BATCH_SIZE": "16"}
    env.update({"DILOCO_TOTAL_STEPS": str(steps), "DILOCO_EVAL_BATCHES": "8", "DILOCO_EVAL_BATCH_SIZE": "16"})
    if corpus:
        env["DILOCO_DATA"] = corpus
    return env


def reuse(path: str | None, env: dict, M: int, steps: int) -> dict | None:
    """The data-parallel result of an earlier quality JSON with the same settings (it does not
    depend on the bus or the aggregator, and takes the longest), or None."""
    if not path:
        return None
    import orjson

    with open(path, "rb") as f:
        old = orjson.loads(f.read())
    if old.get("settings") == env and old.get("M") == M and old.get("steps") == steps and \
            old.get("dp", {}).get("lr") == dp_rate(env, M):  # the default rate moved with M (thirteenth round)
        progress(f"data-parallel: reusing {path} (same settings)")
        return {**old["dp"], "reused_from": path}
    progress(f"data-parallel: {path} has other settings, training again")
    return None


async def main_async(quick: bool, steps: int, M: int, reuse_dp: str | None = None,
                     variants: tuple[str, ...] = ("defaults", "k1"), corpus: str | None = None,
                     dp_lrs: tuple[float, ...] = (), slowdown: float = 1.0, agg_slowdown: float = 1.0,
                     agg_env: dict | None = None, learner_env: dict | None = None,
                     keep_logs: str | None = None, dp_inner: tuple[str, ...] = (), monitor: bool = False,
                     spread: float = 0.0, step_time: float = 0.0) -> dict:
    env = settings(quick, steps, corpus)
    runs = {}
    slow = {"DILOCO_SLOWDOWN": str(slowdown)} if slowdown != 1.0 else {}
    if step_time > 0:
        slow["DILOCO_MIN_STEP_TIME"] = str(step_time)
    # (--spread alone: the slowdown 1 spread, as before --step-time)
    base = dict(slow) or {"DILOCO_SLOWDOWN": str(slowdown)}
    paced = {i: {k: str(round(float(x) * (1 + spread * i), 4)) for k, x in base.items()} for i in range(M)} if spread else {}
    if paced:
        slow = {}  # (each learner's own, in ``paced``)
    for v in variants:
        progress(f"decoupled ({v}): M={M} learners x {steps} steps, settings {env} {slow}")
        lag = {"DILOCO_AGG_SLOWDOWN": str(agg_slowdown)} if agg_slowdown != 1.0 else {}
        dec = await run_learners(env, M, steps, label=f"decoupled {v}",
                                 agg={**aggregator_settings(v, M), **lag, **(agg_env or {})},
                                 learner={**learner_settings(v), **slow, **(learner_env or {})},
                                 keep_logs=f"{keep_logs}/{v}" if keep_logs else None, monitor=monitor,
                                 per_learner=paced)
        progress(f"decoupled ({v}) eval {dec['eval']['eval_loss']:.4f} ({dec['wall_s']} s)")
        agg = dec["aggregator"]
        runs[v] = {"loss": dec["eval"]["eval_loss"], "aggregator": aggregator_settings(v, M),
                   "wall_s": dec["wall_s"], "merges": agg.get("merges"), "rejected": agg.get("rejected"),
                   "staleness_hist": agg.get("staleness_hist"), "versions": agg.get("versions"),
                   "staleness_max": max((int(k) for k in agg.get("staleness_hist") or {}), default=0),
                   "agg_busy": agg.get("busy"), "queue_wait_max": agg.get("queue_wait_max"),
                   "deferred_syncs": [x.get("deferred_syncs") for x in dec["learners"].values()],
                   "learner_contributions": [x["contributions"] for x in dec["learners"].values()],
                   "learner_steps": [x["step"] for x in dec["learners"].values()],
                   # each learner's steps' coefficient of variation: how steady its pace was
                   "learner_step_cv": [x.get("step_cv") for x in dec["learners"].values()],
                   "learner_step_s": [round((x.get("step_seconds_total") or 0) / max(1, x["step"] or 1), 4)
                                      for x in dec["learners"].values()],
                   "learner_bytes_received": [x["bytes_received"] for x in dec["learners"].values()],
                   # what the server counted for each learner's connection, both ways (bench.bandwidth)
                   "learner_bytes": round(sum(x["connz_in"] + x["connz_out"] for x in dec["learners"].values())
                                          / max(1, len(dec["learners"])))}
    progress(f"data-parallel: batch {M} x b, {steps} steps")
    dp = reuse(reuse_dp, env, M, steps) or await asyncio.to_thread(train_dp, env, M, steps, progress)
    progress(f"data-parallel eval {dp['eval_loss']:.4f} ({dp['train_seconds']} s)")
    sweep = {str(dp["lr"]): dp["eval_loss"]}
    for lr in dp_lrs:
        if str(lr) in sweep:
            continue
        r = await asyncio.to_thread(train_dp, {**env, "DILOCO_INNER_LR": str(lr)}, M, steps, progress)
        progress(f"data-parallel lr={lr} eval {r['eval_loss']:.4f} ({r['train_seconds']} s)")
        sweep[str(lr)] = r["eval_loss"]
    for kind in dp_inner:  # data-parallel with another inner optimizer (at its default rate): "kind@lr"
        r = await asyncio.to_thread(train_dp, {**env, "DILOCO_INNER_OPTIMIZER": kind}, M, steps, progress)
        progress(f"data-parallel {kind} eval {r['eval_loss']:.4f} ({r['train_seconds']} s)")
        sweep[f"{kind}@{r['lr']}"] = r["eval_loss"]
    best = min(sweep, key=lambda k: sweep[k])
    best_lr, best_inner = best.split("@")[-1], best.split("@")[0] if "@" in best else dp.get("inner", "adamw")
    b = sweep[best]
    for r in runs.values():
        r["loss_gap"] = (r["loss"] - b) / b
        r["loss_gap_same_lr"] = (r["loss"] - dp["eval_loss"]) / dp["eval_loss"]
    d = runs[variants[0]]["loss"]
    return {"M": M, "steps": steps, "settings": env, "slowdown": slowdown, "step_time": step_time, "spread": spread,
            "agg_slowdown": agg_slowdown,
            "agg_env": agg_env or {}, "learner_env": learner_env or {}, "corpus": corpus or "(stdlib)",
            "params": dp["params"],
            "tokens": dp["tokens"], "tokens_per_param": round(dp["tokens"] / dp["params"], 2),
            "variant": variants[0], "decoupled_loss": d, "dp_loss": b, "dp_best_lr": float(best_lr),
            "dp_best_inner": best_inner,
            "dp_sweep": sweep, "loss_gap": (d - b) / b, "decoupled": runs, "dp": dp}


def kv(s: str) -> dict:
    """'K=V,K=V' -> {K: V}."""
    return dict(x.split("=", 1) for x in s.split(",") if x.strip())


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--M", type=int, default=4)
    p.add_argument("--reuse-dp", default=None, help="take the data-parallel result from this earlier quality JSON "
                                                     "if its settings are the same")
    p.add_argument("--variants", default=None,
                   help="comma-separated aggregator variants, the first gives loss_gap (default defaults,k1; "
                        "--quick: defaults): " + ",".join(AGG_VARIANTS))
    p.add_argument("--corpus", default=None, help="DILOCO_DATA for every process: a text file or a folder of them")
    p.add_argument("--slowdown", type=float, default=1.0,
                   help="DILOCO_SLOWDOWN of the learners: steps this many times longer, so that the bus's round "
                        "trip is a smaller share of a step (as with a real model's steps)")
    p.add_argument("--dp-lrs", default="", help="comma-separated peak learning rates for data-parallel too; the best "
                                                "is the baseline of loss_gap")
    p.add_argument("--dp-inner", default="", help="comma-separated inner optimizers (adamw, muon) to train "
                                                   "data-parallel with too; the best is the baseline of loss_gap")
    p.add_argument("--agg-slowdown", type=float, default=1.0,
                   help="DILOCO_AGG_SLOWDOWN of the aggregator: an aggregator this many times slower (a lagging one)")
    p.add_argument("--agg-env", default="", help="extra aggregator settings, K=V,K=V (e.g. DILOCO_TRUST=off)")
    p.add_argument("--learner-env", default="", help="extra learner settings, K=V,K=V")
    p.add_argument("--keep-logs", default=None, help="copy every process's log to this folder (one per variant)")
    p.add_argument("--monitor", action="store_true",
                   help="run a membership monitor, as a user's run has (the aggregator then admits learners, and "
                        "an admitted learner holds its steps when its sync waited a period; the learners follow each "
                        "other's paces, DILOCO_DYNAMIC_H): without it every learner is accepted, holds once one "
                        "of its rounds was merged, and keeps H")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="DILOCO_MIN_STEP_TIME of the learners: each step takes at least this many seconds, one "
                        "steady pace (as on hardware of that speed) where --slowdown stretches the machine's "
                        "scheduling noise with the step")
    p.add_argument("--spread", type=float, default=0.0,
                   help="learner i's steps (1 + SPREAD x i) times the --slowdown's and --step-time's (0.06: the "
                        "reference's spread)")
    a = p.parse_args()
    if a.spread < 0:
        p.error(f"--spread must be >= 0, got {a.spread}")
    if a.step_time < 0:
        p.error(f"--step-time must be >= 0, got {a.step_time}")
    steps = a.steps or (80 if a.quick else 300)
    if a.corpus:
        import os

        if not os.path.exists(a.corpus):
            p.error(f"--corpus {a.corpus}: no such file or folder")
    lrs = tuple(float(x) for x in a.dp_lrs.split(",") if x.strip())
    variants = a.variants or ("defaults" if a.quick and a.steps is None else "defaults,k1")
    r = asyncio.run(main_async(a.quick, steps, a.M, a.reuse_dp, tuple(variants.split(",")), a.corpus, lrs,
                               a.slowdown, a.agg_slowdown, kv(a.agg_env), kv(a.learner_env), a.keep_logs,
                               tuple(x for x in a.dp_inner.split(",") if x.strip()), a.monitor, a.spread, a.step_time))
    finish({"bench": "quality", "quick": a.quick, "monitor": a.monitor, **r}, a.out)


if __name__ == "__main__":
    main()
