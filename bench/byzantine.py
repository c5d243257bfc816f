"""A learner that lies within the bounds (issue 29): what one costs, and whether the run says who.

One learner's contributions pass every check (shape, counters, norm, heartbeats) but lie, in the
four ways of ``simulation.byzantine_attacks``: ``sign`` (the negation of what it trained), ``random`` (a
random direction at an honest norm), ``replay`` (its own earlier rounds again as new ones),
``corrupt`` (it trains on shuffled tokens). The defence is ``aggregator.trust`` (on by default).

**Reference tier** (``simulation.reference``, the algorithm in one process with every decision the
services' own): M learners (8 by default, learner 0 the liar), the ``small`` model at 20 tokens
per parameter, the roles' defaults. For each seed: a clean run, one run per kind, and the clean run
with trust off (what the defence costs a clean run). With ``--undefended``, each kind also with
trust off on the first seed (what the defence buys). ``cost`` = held-out loss / the clean run's of
the same seed - 1; the targets are <= 1% for one liar of 8.

**System tier** (``--tiers system``): real processes (nats-server, aggregator, monitor,
evaluator, 4 learners of the chaos test's tiny model, one of them ``bench.byzantine_learner``),
clean and attacked runs, the final held-out loss, and what the aggregator's metrics say of each
learner (its trust, the reason, the contributions merged at weight 0).

    python -m bench.byzantine --quick --out byz.json          (tiny model, one seed, under a minute)
    python -m bench.byzantine --seeds 3 --jobs 2 --out byz.json          (~25 min on 2 cores)
    python -m bench.byzantine --tiers system --system-kinds sign,random --repeats 2
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import replace

from simulation.byzantine_attacks import KINDS
from bench.common import finish, parser, progress, run_jobs
from bus.procs import popen

SMALL_PARAMS = 119_104


def _configs(M: int, seeds: list[int], kinds: list[str], quick: bool, undefended: bool,
             oracle: bool = False) -> list[tuple[str, object]]:
    from bench.algorithm import budget_steps
    from simulation.reference import TINY_MODEL, RefConfig

    out = []
    for seed in seeds:
        model = dict(TINY_MODEL) if quick else RefConfig().model
        steps = 40 if quick else budget_steps(SMALL_PARAMS, 20, M, RefConfig().batch, model["seq_len"])
        base = RefConfig(M=M, steps=steps, model=model, seed=seed, data_seed=seed, byzantine_seed=seed)
        out.append((f"clean s{seed}", base))
        out.append((f"clean-untrusting s{seed}", replace(base, trust="off")))
        if oracle:  # the floor: the liar's compute is spent and all it sends is dropped
            out.append((f"oracle s{seed}", replace(base, byzantine="sign", byzantine_oracle=True)))
        for k in kinds:
            out.append((f"{k} s{seed}", replace(base, byzantine=k)))
            if undefended and seed == seeds[0]:
                out.append((f"{k}-undefended s{seed}", replace(base, byzantine=k, trust="off")))
    return out


def _one(item: tuple[str, object]) -> dict:
    from aggregator.trust import TrustSettings, summary
    from simulation.reference import Reference

    label, cfg = item
    t0 = time.perf_counter()
    ref = Reference(cfg)  # type: ignore[arg-type]
    r = ref.run()
    trust = summary([st.trust for st in ref.states], TrustSettings(cfg.trust, cfg.trust_rate, cfg.trust_oppose,  # type: ignore[attr-defined]
                                                                   cfg.trust_nil))  # type: ignore[attr-defined]
    kind = "oracle" if cfg.byzantine_oracle else (cfg.byzantine or "clean")  # type: ignore[attr-defined]
    return {"label": label, "kind": kind, "seed": cfg.seed, "trust_mode": cfg.trust,  # type: ignore[attr-defined]
            "eval_loss": round(float(r["eval_loss"]), 5), "merges": r["merges"], "rejected": r["rejected"],
            "wall_s": round(time.perf_counter() - t0, 1),
            "liar": trust.get("learner-0"),
            "honest_min_trust": min((v["trust"] for k, v in trust.items() if k != "learner-0"), default=None),
            "honest_reasons": sorted({v["reason"] for k, v in trust.items() if k != "learner-0" and v["reason"]})}


def reference_tier(M: int, seeds: list[int], kinds: list[str], quick: bool, undefended: bool, jobs: int,
                   oracle: bool = False, only: str = "") -> dict:
    items = _configs(M, seeds, kinds, quick, undefended, oracle)
    if only:  # a subset of the rows by label prefix (e.g. "oracle"), to add to an earlier run
        items = [it for it in items if any(it[0].startswith(x) for x in only.split(","))]
    rows = run_jobs(_one, items, jobs, lambda r: f"{r['label']}: held-out {r['eval_loss']:.4f} ({r['wall_s']} s)")
    return {"M": M, "seeds": seeds, "rows": rows, **costs(rows)}


def costs(rows: list[dict]) -> dict:
    """Per kind (and trust mode): the cost against the clean run of the same seed, each seed and mean."""
    clean = {r["seed"]: r["eval_loss"] for r in rows if r["kind"] == "clean" and r["trust_mode"] != "off"}
    out: dict[str, dict] = {}
    for r in rows:
        if r["seed"] not in clean or (r["kind"] == "clean" and r["trust_mode"] != "off"):
            continue
        key = r["kind"] + ("" if r["trust_mode"] != "off" else "-untrusting" if r["kind"] == "clean" else "-undefended")
        out.setdefault(key, {"per_seed": []})["per_seed"].append(round(r["eval_loss"] / clean[r["seed"]] - 1, 4))
    for v in out.values():
        v["mean"] = round(statistics.fmean(v["per_seed"]), 4)
        v["max"] = max(v["per_seed"])
    return {"cost": out, "clean_loss": {str(k): v for k, v in clean.items()}}


# -- the system tier --------------------------------------------------------------------------------

def aggregator_defaults() -> dict:
    """The aggregator's own defaults for what the chaos harness sets for its faults (quorum 1, a fixed
    0.1 s grace, no staleness or outlier limit): trust judges a contribution by the merge's other
    learners, so a run of per-arrival merges would not be the product's."""
    from aggregator.config import AggregatorConfig, quorum_text

    d = {f.name: f.default for f in AggregatorConfig.__dataclass_fields__.values()}
    return {"DILOCO_QUORUM": quorum_text(d["quorum"]), "DILOCO_GRACE": d["grace"],
            "DILOCO_GRACE_SECONDS": str(d["grace_seconds"]), "DILOCO_MAX_STALENESS": str(d["max_staleness"]),
            "DILOCO_NORM_OUTLIER_FACTOR": str(d["norm_outlier_factor"])}


async def system_run(tmp: str, kind: str, steps: int, learners: int = 4, agg_env: dict | None = None,
                     status: bool = False, corpora: dict[str, str] | None = None) -> dict:
    """One run of real processes, learner ``l0`` lying as ``kind`` ("" for none), every learner
    ``steps`` inner steps; the final held-out loss once every learner finished and its final sync was
    merged, and the aggregator's trust metrics (``DILOCO_TRUST=weigh`` unless ``agg_env`` says
    otherwise: a run open to parties the operator does not control).
    ``corpora``: ``DILOCO_DATA`` per learner (the others train on the standard library): non-IID."""
    import orjson

    from tests.chaos.harness import ChaosRun
    from tests.system import PY

    class Run(ChaosRun):
        def start(self, name: str) -> None:
            data = {"DILOCO_DATA": corpora[name]} if corpora and name in corpora else {}
            if name != "l0" or not kind:
                saved = self.learner_env
                self.learner_env = {**saved, **data}
                try:
                    return super().start(name)
                finally:
                    self.learner_env = saved
            env = self._env(self.proxies[name].url, **self.learner_env, **data, DILOCO_LEARNER_ID=name,
                            DILOCO_NUM_LEARNERS=str(self.n), BYZ_KIND=kind)
            log = open(os.path.join(self.workdir, f"{name}.log"), "ab")
            p = popen([PY, "-m", "bench.byzantine_learner"], env=env, stdout=log, stderr=log)
            log.close()
            self.procs[name] = p
            self.all_pids.add(p.pid)

    # the monitor's default timeouts (3 s suspect, 5 s evict), not the chaos harness's fast ones (0.6 / 1 s):
    # no fault is injected here. On a loaded machine (CI's suite; 1 run in 3 with 8 CPU hogs beside it)
    # trust judged almost nothing (seen 0-4 per learner: the liar not named), most likely because
    # heartbeats late by more than 0.6 s put live learners out of the quorum, so merges held one or two
    # learners (not proven by a log); with these timeouts 3 of 3 passed beside the same hogs
    run = Run(tmp, learners=learners, seed=1, run=f"byz{kind or 'clean'}",
              learner_env={"DILOCO_MAX_STEPS": str(steps)},
              agg_env={**aggregator_defaults(), "DILOCO_TRUST": "weigh", **(agg_env or {})},
              monitor_env={"DILOCO_SUSPECT_AFTER": "3.0", "DILOCO_EVICT_AFTER": "5.0", "DILOCO_LEASE_TTL": "5.0"})
    metrics: dict = {}
    history: list = []  # per metrics message: each fragment's typical agreement, judging, l0's reason

    async def on_agg(m):
        d = orjson.loads(m.data)
        if isinstance(d.get("trust"), dict):
            metrics.update(d)
            history.append({"ts": round(time.time(), 2), "typical": d.get("trust_typical"),
                            "judging": d.get("trust_judging"), "l0": (d["trust"].get("l0") or {}).get("reason")})

    try:
        await run.setup()
        await run.nc.subscribe(f"{run.s.prefix}.metrics.aggregator.*", cb=on_agg)
        loop = asyncio.get_running_loop()
        for name in run.learners:
            await loop.run_in_executor(None, run.procs[name].wait, 1800)
        await run.settle(90)
        await asyncio.sleep(1.5)  # one more metrics message after the last merge
        shown = None
        if status:  # what `diloco status` shows of the run now
            from monitor.status import gather_status, render_status

            st = await gather_status(run.nc, run.run, seen_wait=3.0)
            shown = {"trust": st.get("trust"), "text": render_status(st)}
        finals = [loss for _, loss, v in run.evals if v == run.evals[-1][2]]
        first = min(run.evals, key=lambda e: e[2])[1]
        with open(os.path.join(tmp, "aggregator.log"), "rb") as f:
            agg_log = f.read().decode(errors="replace")
        return {"kind": kind or "clean", "final": round(finals[-1], 4), "first": round(first, 4),
                "trust": metrics.get("trust"), "distrusted": metrics.get("distrusted"),
                "downweighted": metrics.get("downweighted"), "rejected": metrics.get("rejected"),
                "merges": metrics.get("merges"), "status": shown, "history": history,
                "suspected_lines": [ln for ln in agg_log.splitlines() if '"learner_suspected"' in ln][:20]}
    finally:
        await run.close()


async def system_tier(kinds: list[str], repeats: int, steps: int) -> dict:
    rows = []
    for r in range(repeats):
        for kind in [""] + kinds:  # interleaved: the machine's load drifts over all alike
            with tempfile.TemporaryDirectory(prefix="diloco-byz-") as tmp:
                row = await system_run(tmp, kind, steps)
            rows.append(row)
            liar = (row["trust"] or {}).get("l0", {})
            progress(f"system {row['kind']} #{r + 1}: held-out {row['final']} (from {row['first']}); l0 trust "
                     f"{liar.get('trust')} {liar.get('reason')!r}")
    by: dict[str, list[float]] = {}
    for row in rows:
        by.setdefault(row["kind"], []).append(row["final"])
    mean = {k: round(statistics.fmean(v), 4) for k, v in by.items()}
    return {"steps": steps, "repeats": repeats, "rows": rows, "final_loss": by, "mean": mean,
            "relative_to_clean": {k: round(v / mean["clean"] - 1, 4) for k, v in mean.items()}}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tiers", default="reference", help="reference, system or both (comma-separated)")
    p.add_argument("--M", type=int, default=8)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--undefended", action="store_true", help="each kind with trust off too (first seed)")
    p.add_argument("--jobs", type=int, default=1, help="reference runs in parallel processes")
    p.add_argument("--oracle", action="store_true",
                   help="also the floor of any defence that leaves a learner out: its work dropped by an oracle")
    p.add_argument("--only", default="", help="only the rows whose label starts with one of these (comma-separated)")
    p.add_argument("--system-kinds", default="sign")
    p.add_argument("--repeats", type=int, default=1, help="system tier: runs of each kind")
    p.add_argument("--steps", type=int, default=1500, help="system tier: inner steps per learner")
    a = p.parse_args()
    tiers = a.tiers.split(",")
    kinds = [k for k in a.kinds.split(",") if k]
    out: dict = {}
    if "reference" in tiers:
        seeds = [0] if a.quick else list(range(a.seeds))
        out["reference"] = reference_tier(a.M, seeds, kinds, a.quick, a.undefended or a.quick, a.jobs,
                                          a.oracle or a.quick, a.only)
    if "system" in tiers:
        out["system"] = asyncio.run(system_tier([k for k in a.system_kinds.split(",") if k],
                                                a.repeats, 300 if a.quick else a.steps))
    finish(out, a.out)


if __name__ == "__main__":
    main()
