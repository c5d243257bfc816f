"""The aggregator's quorum as a lever on the asynchrony cost (issue 40, item 3): Decoupled DiLoCo
closing each round of a fragment on K of its M learners (``DILOCO_QUORUM``; the default K = M, all
active), at equal step times and with a speed spread, in the in-process reference
(``simulation.reference``); synchronous DiLoCo and data-parallel at equal speeds beside them.

Every run trains one built-in model (``--size``, default ``small``; ``--quick``: ``tiny``) for
``--tokens-per-param`` x its parameters tokens at the roles' defaults, K the only change. The quorums
(``--quorums``): all (M), M/2, 2 and 1 (those within 1..M), and auto (``DILOCO_QUORUM=auto``: rounds
that close on time, ``aggregator.quorum``). The speeds: ``equal`` (every step 1.0 virtual seconds, no
transfer time), ``spread`` (learner i steps in 1 + 0.06 i, every contribution and every version
0.5 s in flight: the unequal speeds of learners sharing a machine or of mixed hardware), and
``budget`` (the spread, with the run's inner steps shared in proportion to speed, each learner's
schedule spanning its own share: all finish together; ``RefConfig.learner_steps``), ``dlu`` (the
spread with Dynamic Local Updates at those speeds, ``DILOCO_DYNAMIC_H``: a slower learner syncs
after proportionally fewer steps, v / v_max x H of them, a real number: rounds of floor and ceil of
it; ``RefConfig.learner_periods``), ``budget_dlu`` (both) and ``dlu_floor`` (the periods rounded
down to whole steps, as until the nineteenth round).

Keys: ``gap_k<K>_m<M>_<speeds>`` = (decoupled - data-parallel) / data-parallel;
``async_cost_k<K>_m<M>_<speeds>`` = (decoupled - synchronous) / synchronous (the cost of asynchrony,
synchronous at equal speeds: the best case); ``best_k_m<M>_<speeds>``: the K of the lowest loss;
``k_all`` in a key is K = M, ``k_auto`` the on-time quorum. A figure of one run is one run:
``--seed`` repeats it on other data; ``--reuse FILE.json`` takes the rows an earlier run holds.

    python -m bench.quorum --quick --out quorum.json                        (~1 min)
    python -m bench.quorum --M 2 4 8 --jobs 2 --out quorum.json             (30 runs, ~25 min on 2 cores)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import time
from dataclasses import replace
from typing import Any

import orjson

from aggregator.quorum import AUTO
from bench.common import fetch_delay_of, finish, parser, period_of, progress, reference_options, run_jobs

SPEEDS = ("equal", "spread", "budget", "dlu", "budget_dlu", "dlu_floor")
QUORUMS = ("all", "half", "2", "1", "auto")


def quorums(M: int, which: tuple[str, ...] = QUORUMS) -> list[int]:
    """The K tried at M: all, M/2, 2 and 1 (distinct, within 1..M), largest first, then auto."""
    named = {"all": M, "half": M // 2, "2": 2, "1": 1}
    ks = sorted({named[w] for w in which if w in named and 1 <= named[w] <= M}, reverse=True)
    return ks + ([AUTO] if "auto" in which else [])


def timing(speeds: str, M: int, steps: int, H: int) -> dict[str, Any]:
    from bench.algorithm import out_of_step, periods_by_speed, steps_by_speed

    if speeds == "equal":
        return {}
    t = out_of_step(M)
    if speeds in ("budget", "budget_dlu"):
        t["learner_steps"] = steps_by_speed(steps * M, t["step_times"])
    if speeds in ("dlu", "budget_dlu", "dlu_floor"):
        t["learner_periods"] = periods_by_speed(H, t["step_times"], whole=speeds == "dlu_floor")
    return t


def configs(size: str, Ms: list[int], speeds: list[str], tokens_per_param: float, batch: int, seed: int,
            quick: bool, which: tuple[str, ...] = QUORUMS, jitter: float = 0.0, lock: float = 0.0) -> list:
    from bench.algorithm import budget_steps
    from bench.size_trend import SIZES, params_of
    from simulation.reference import RefConfig

    n = params_of(size)
    model = SIZES[size]
    out = []
    for M in Ms:
        steps = budget_steps(n, tokens_per_param, M, batch, model["seq_len"])
        base = RefConfig(M=M, steps=steps, batch=batch, model=model, data_seed=seed, eval_points=3 if quick else 8)
        out.append(("equal", replace(base, mode="dp")))
        out.append(("equal", replace(base, mode="sync")))
        for sp in speeds:
            for K in quorums(M, which):
                out.append((sp, replace(base, mode="decoupled", K=None if K == M else K, step_jitter=jitter, phase_lock=lock,
                                        **timing(sp, M, steps, base.H))))
    return out


def item_row(item: tuple[str, Any]) -> dict:
    """The identity fields of the row ``one(item)`` gives."""
    from simulation.reference_setup import inner_rate

    speeds, cfg = item
    return {"M": cfg.M, "mode": cfg.mode, "K": cfg.K or cfg.M, "speeds": speeds, "steps": cfg.steps,
            "seed": cfg.data_seed, "lr": inner_rate(cfg),
            "fetch_delay": fetch_delay_of(cfg), "H": period_of(cfg),
            "periods": [round(x, 4) for x in cfg.learner_periods] if cfg.learner_periods else None,
            **({"jitter": cfg.step_jitter} if cfg.step_jitter else {}),
            **({"phase_lock": cfg.phase_lock} if cfg.phase_lock else {})}


def one(item: tuple[str, Any]) -> dict:
    from simulation.reference import run_reference

    t0 = time.monotonic()
    r = run_reference(item[1])
    return {**item_row(item), "eval_loss": float(r["eval_loss"]),
            "staleness_max": max((int(k) for k in r.get("staleness_hist", {})), default=None),
            "merges": r.get("merges"), "seconds": round(time.monotonic() - t0, 1)}


def kname(K: int, M: int) -> str:
    return "k_all" if K == M else "k_auto" if K == AUTO else f"k{K}"


def key(r: dict) -> tuple:
    """A row's identity (what --reuse matches; rows of before the rate was recorded match nothing: the
    default rate changed with them, nor do Dynamic Local Updates rows of before their periods were
    recorded: whole steps then)."""
    periods = r.get("periods")
    return (r["M"], r["mode"], r["K"], r["speeds"], r["steps"], r["seed"], r.get("lr"), fetch_delay_of(r),
            period_of(r), tuple(periods) if periods else None, r.get("jitter", 0.0), r.get("phase_lock", 0.0))


def summary(rows: list[dict]) -> dict:
    out: dict = {}
    for M in sorted({r["M"] for r in rows}):
        dp = next((r["eval_loss"] for r in rows if r["M"] == M and r["mode"] == "dp"), None)
        sync = next((r["eval_loss"] for r in rows if r["M"] == M and r["mode"] == "sync"), None)
        for sp in SPEEDS:
            dec = {r["K"]: r["eval_loss"] for r in rows if r["M"] == M and r["mode"] == "decoupled" and r["speeds"] == sp}
            for K, v in sorted(dec.items(), reverse=True):
                if dp:
                    out[f"gap_{kname(K, M)}_m{M}_{sp}"] = round((v - dp) / dp, 4)
                if sync:
                    out[f"async_cost_{kname(K, M)}_m{M}_{sp}"] = round((v - sync) / sync, 4)
            if dec:
                best = min(dec, key=lambda k: dec[k])
                out[f"best_k_m{M}_{sp}"] = "auto" if best == AUTO else best
    return out


def main() -> None:
    from bench.size_trend import SIZES

    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--size", default=None, choices=list(SIZES), help="the model (default small; quick: tiny)")
    p.add_argument("--M", type=int, nargs="+", default=None, help="learner counts (default: 2 4 8; quick: 2)")
    p.add_argument("--speeds", nargs="+", default=["equal", "spread"], choices=SPEEDS)
    p.add_argument("--quorums", nargs="+", default=list(QUORUMS), choices=QUORUMS)
    reference_options(p)
    p.add_argument("--reuse", nargs="+", default=None, help="JSON files of earlier runs: their rows are not run again")
    p.add_argument("--jitter", type=float, default=0.0,
                   help="the asynchronous runs' step times drawn around their learner's, with this coefficient of "
                        "variation (RefConfig.step_jitter; 0: exact)")
    p.add_argument("--phase-lock", type=float, default=0.0,
                   help="the asynchronous runs' phase lock (RefConfig.phase_lock, learner.loop.phase_shift; 0: off)")
    a = p.parse_args()
    size = a.size or ("tiny" if a.quick else "small")
    Ms = a.M or ([2] if a.quick else [2, 4, 8])
    tpp = a.tokens_per_param or (2.0 if a.quick else 20.0)
    items = configs(size, Ms, a.speeds, tpp, a.batch, a.seed, a.quick, tuple(a.quorums), a.jitter, a.phase_lock)
    old: dict = {}
    for path in a.reuse or []:
        with open(path, "rb") as f:
            old.update({key(r): r for r in orjson.loads(f.read()).get("rows", [])})
    todo = [it for it in items if key(item_row(it)) not in old]
    reused = [old[key(item_row(it))] for it in items if key(item_row(it)) in old]
    progress(f"{len(todo)} runs ({len(reused)} reused): {size}, M {Ms}, speeds {a.speeds}, quorums {a.quorums}, "
             f"{tpp} tokens/param, data seed {a.seed}")
    rows = reused + run_jobs(one, todo, a.jobs, lambda r: f"M={r['M']} {r['mode']} K={r['K']} {r['speeds']}: "
                                                          f"{r['eval_loss']:.4f} ({r['seconds']} s)")
    finish({"size": size, "tokens_per_param": tpp, "seed": a.seed, "quick": a.quick, "rows": rows, **summary(rows)},
           a.out)


if __name__ == "__main__":
    main()
