"""Trust on non-IID data (issue 39): does the check tell a liar from an honest island with other data?

Learners in groups, each group on its own corpus (a named **split**, ``SPLITS``), the rest as
``bench.byzantine``'s reference tier: the ``small`` model at 20 tokens per parameter, the roles'
defaults, the held-out loss the mean over every group's held-out batches. Per run: the held-out
loss, its cost against the same seed's run with trust off, the **honest contributions merged below
full weight** (what the trust check took from learners that did not lie), and what the check says
of every learner at the end (its trust, the reason): the liar (learner 0, of the first group) is
**named** when it ends suspected, an honest learner **flagged** when it does.

Splits (all offline, on every machine the project runs on):

* ``iid``: everyone samples the standard library's Python sources (the usual runs);
* ``py+jax``: half the learners on the standard library, half on the ``jax`` package's Python sources
  (two source trees of one language, as a user's regions with other code bases);
* ``py+c``: half on the standard library's Python, half on the interpreter's C headers (two languages);
* ``py+c1``: a region of one: the last learner on the C headers, every other on the whole standard
  library (a learner with data of its own and nobody to agree with but itself).

Kinds: ``""`` (nobody lies), ``simulation.byzantine_attacks.KINDS`` (learner 0 lies), ``oracle`` (learner 0
trains but an oracle drops all it sends: the floor of any defence that leaves a learner out).

    python -m bench.noniid --quick --out noniid.json                 (tiny model, under a minute)
    python -m bench.noniid --M 8 --splits py+jax --kinds ,sign,random --modes weigh,off --jobs 2
    python -m bench.noniid --trace-dir traces/ --modes observe       (every merge's cosines, to study a rule)
    python -m bench.noniid --tiers system --repeats 3                (real processes, 4 learners: IID and non-IID)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import os
import statistics
import sysconfig
import time
from dataclasses import replace

from bench.common import finish, parser, progress, run_jobs

SMALL_PARAMS = 119_104
LIAR = "learner-0"


def split_corpora(name: str, M: int = 8) -> tuple[str, ...]:
    """The corpora of a named split ("" is the standard library's Python sources)."""
    if name == "iid":
        return ()
    if name == "py+c1":  # a region of one: M - 1 learners on Python (each the whole corpus), one on C
        return ("",) * (M - 1) + (sysconfig.get_paths()["include"],)
    if name == "py+jax":
        import jax

        return ("", os.path.dirname(jax.__file__))
    if name == "py+c":
        return ("", sysconfig.get_paths()["include"])
    raise ValueError(f"split must be one of {SPLITS}, got {name!r}")


SPLITS = ("iid", "py+jax", "py+c", "py+c1")


def other_corpus() -> str:
    """The second group's corpus of the system tier and its test: the interpreter's C headers, or
    (a Python installed without them) the jax package's sources."""
    inc = sysconfig.get_paths()["include"]
    if os.path.isdir(inc) and any(name.endswith(".h") for name in os.listdir(inc)):
        return inc
    import jax

    return os.path.dirname(jax.__file__)


async def system_tier(splits: list[str], kinds: list[str], repeats: int, steps: int) -> list[dict]:
    """Real processes (``bench.byzantine.system_run``: 4 learners of the tiny model, l0 lying as
    ``kind``, trust weighing), IID or with l2 and l3 on :func:`other_corpus`: what the aggregator's
    metrics say of every learner."""
    import tempfile

    from bench.byzantine import system_run

    rows = []
    for r in range(repeats):
        for split in splits:
            corpora = None if split == "iid" else {"l2": other_corpus(), "l3": other_corpus()}
            for kind in kinds:
                with tempfile.TemporaryDirectory(prefix="diloco-noniid-") as tmp:
                    res = await system_run(tmp, kind, steps, corpora=corpora)
                trust = res["trust"] or {}
                honest = [x for x in trust if x != "l0" or not kind]
                row = {"split": split, "kind": kind or "clean", "repeat": r, "final": res["final"],
                       "honest_below_full": sum((res["downweighted"] or {}).get(x, 0) for x in honest),
                       "honest_flagged": sorted(x for x in honest if trust[x].get("reason")),
                       "liar_named": bool(kind and (trust.get("l0") or {}).get("reason")),
                       "liar": trust.get("l0") if kind else None, "merges": res["merges"]}
                rows.append(row)
                progress(f"system {split} {row['kind']} #{r + 1}: held-out {row['final']}, honest below full "
                         f"{row['honest_below_full']}, flagged {row['honest_flagged']}, liar named {row['liar_named']}")
    return rows


def configs(M: int, splits: list[str], kinds: list[str], modes: list[str], seeds: list[int], quick: bool,
            record: bool) -> list[tuple[str, object]]:
    from bench.algorithm import budget_steps
    from simulation.reference import TINY_MODEL, RefConfig

    out = []
    for split in splits:
        for seed in seeds:
            model = dict(TINY_MODEL) if quick else RefConfig().model
            steps = 40 if quick else budget_steps(SMALL_PARAMS, 20, M, RefConfig().batch, model["seq_len"])
            base = RefConfig(M=M, steps=steps, model=model, seed=seed, data_seed=seed, byzantine_seed=seed,
                             corpora=split_corpora(split, M), record_trust=record)
            for kind in kinds:
                if kind == "oracle":  # the floor of any defence that leaves a learner out: its work dropped
                    out.append((f"{split} M{M} oracle off s{seed}",
                                replace(base, byzantine="sign", byzantine_oracle=True, trust="off")))
                    continue
                for mode in modes:
                    out.append((f"{split} M{M} {kind or 'clean'} {mode} s{seed}",
                                replace(base, byzantine=kind, trust=mode)))
    return out


def one(item: tuple[str, object], trace_dir: str = "") -> dict:
    import orjson

    from aggregator.trust import TrustSettings, summary
    from simulation.reference import Reference

    label, cfg = item
    t0 = time.perf_counter()
    ref = Reference(cfg)  # type: ignore[arg-type]
    r = ref.run()
    s = TrustSettings(cfg.trust, cfg.trust_rate, cfg.trust_oppose, cfg.trust_nil)  # type: ignore[attr-defined]
    trust = summary([st.trust for st in ref.states], s)
    liar = LIAR if cfg.byzantine and not cfg.byzantine_oracle else None  # type: ignore[attr-defined]
    below = {}  # honest contributions merged below full weight, per learner (from the trace)
    for m in ref.trust_trace:
        for x, f in zip(m["learners"], m["factors"]):
            if x != liar and f < 1.0:
                below[x] = below.get(x, 0) + 1
    if trace_dir:
        os.makedirs(trace_dir, exist_ok=True)
        with open(os.path.join(trace_dir, label.replace(" ", "_") + ".json"), "wb") as f:
            f.write(orjson.dumps({"label": label, "M": cfg.M, "corpora": cfg.corpora,  # type: ignore[attr-defined]
                                  "byzantine": cfg.byzantine, "trace": ref.trust_trace}))  # type: ignore[attr-defined]
    flagged = sorted(x for x, v in trust.items() if x != liar and v["reason"])
    kind = "oracle" if cfg.byzantine_oracle else (cfg.byzantine or "clean")  # type: ignore[attr-defined]
    return {"label": label, "M": cfg.M, "split": label.split()[0], "kind": kind,
            "mode": cfg.trust, "seed": cfg.seed, "eval_loss": round(float(r["eval_loss"]), 5),  # type: ignore[attr-defined]
            "wall_s": round(time.perf_counter() - t0, 1),
            "honest_below_full": sum(below.values()), "honest_below_by": below,
            "honest_flagged": flagged, "liar": trust.get(liar) if liar else None,
            "liar_named": bool(liar and (trust.get(liar) or {}).get("reason")),
            "trust": trust}


def _one(args: tuple) -> dict:
    return one(*args)


def run_all(items: list, jobs: int, trace_dir: str) -> list[dict]:
    return run_jobs(_one, [(it, trace_dir) for it in items], jobs, _line)


def _line(r: dict) -> str:
    return (f"{r['label']}: held-out {r['eval_loss']:.4f}, honest below full {r['honest_below_full']}, flagged "
            f"{r['honest_flagged']}, liar named {r['liar_named']} ({r['wall_s']} s)")


def costs(rows: list[dict]) -> dict:
    """Per (split, M, kind, mode): the held-out loss against the clean run with trust off of the same
    split, M and seed (what the attack and the check cost together; ``clean off`` is 0 by definition)."""
    # the clean run with trust off; else a clean run in which nobody was weighed down (the same run
    # bit for bit: a merge with every factor 1 is the merge without trust)
    off = {(r["split"], r["M"], r["seed"]): r["eval_loss"] for r in rows
           if r["kind"] == "clean" and (r["mode"] != "weigh" or r["honest_below_full"] == 0)}
    off.update({(r["split"], r["M"], r["seed"]): r["eval_loss"] for r in rows if r["kind"] == "clean" and r["mode"] == "off"})
    out: dict[str, dict] = {}
    for r in rows:
        base = off.get((r["split"], r["M"], r["seed"]))
        if base is None:
            continue
        key = f"{r['split']} M{r['M']} {r['kind']} {r['mode']}"
        o = out.setdefault(key, {"per_seed": [], "honest_below_full": [], "liar_named": [], "honest_flagged": []})
        o["per_seed"].append(round(r["eval_loss"] / base - 1, 4))
        o["honest_below_full"].append(r["honest_below_full"])
        o["liar_named"].append(r["liar_named"])
        o["honest_flagged"].append(len(r["honest_flagged"]))
    for o in out.values():
        o["mean"] = round(statistics.fmean(o["per_seed"]), 4)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--M", default="4,8", help="learners (comma-separated)")
    p.add_argument("--splits", default="py+jax", help=f"comma-separated, of {SPLITS}")
    p.add_argument("--kinds", default=",sign,random,replay", help="attack kinds ('' for none), comma-separated")
    p.add_argument("--modes", default="weigh,off", help="trust modes, comma-separated")
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--trace-dir", default="", help="write every merge's cosines per run here")
    p.add_argument("--tiers", default="reference", help="reference, system or both (comma-separated)")
    p.add_argument("--system-splits", default="iid,py+c", help="system tier: iid, or l2 and l3 on another corpus")
    p.add_argument("--system-kinds", default=",sign,random", help="system tier: attack kinds ('' for none)")
    p.add_argument("--repeats", type=int, default=1, help="system tier: runs of each")
    p.add_argument("--steps", type=int, default=600, help="system tier: inner steps per learner")
    a = p.parse_args()
    if "system" in a.tiers.split(","):
        import asyncio

        srows = asyncio.run(system_tier(a.system_splits.split(","), a.system_kinds.split(","),
                                        1 if a.quick else a.repeats, 300 if a.quick else a.steps))
        if "reference" not in a.tiers.split(","):
            finish({"system": srows}, a.out)
            return
    else:
        srows = None
    Ms = [2 if a.quick else int(m) for m in a.M.split(",")][:1 if a.quick else None]
    if a.quick:
        Ms = [4]
    items = []
    for M in Ms:
        items += configs(M, a.splits.split(","), a.kinds.split(",") if not a.quick else ["", "sign"],
                         a.modes.split(","), list(range(a.first_seed, a.first_seed + (1 if a.quick else a.seeds))), a.quick, True)
    rows = run_all(items, a.jobs, a.trace_dir)
    for r in rows:
        r.pop("trust")
    finish({"rows": rows, "cost": costs(rows), **({"system": srows} if srows is not None else {})}, a.out)


if __name__ == "__main__":
    main()
