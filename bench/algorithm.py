"""Quality of the algorithm at a compute-optimal budget: data-parallel, synchronous DiLoCo, Streaming and
Decoupled DiLoCo in one process (``simulation.reference``), both sides tuned.

For each M (2 and 4; ``--M``): every run trains the built-in ``small`` model (119k parameters) on the
same data shards for ``tokens_per_param`` x parameters tokens in total (20 by default: compute
optimal); data-parallel as one AdamW on batches of M x b.

1. data-parallel: sweep the peak learning rate (1e-3, 2e-3, 4e-3, doubling on while the largest
   is the best), then the warm-up (5% or 10% of the steps) at the best; the best held-out loss is
   the baseline (``dp_best``).
2. synchronous DiLoCo (P=1, int8 outer gradients with error feedback) at H=24 and data-parallel's
   best learning rate and warm-up: sweep the outer learning rate and momentum (0.7/0, 1.0/0,
   0.7/0.5, 0.7/0.9, 1.0/0.5), then half the inner learning rate, then H (12, 48), each at the best
   so far.
3. at the tuned values: Streaming DiLoCo (P=8 staggered fragments, K=M), and Decoupled DiLoCo with
   learners out of step (step times 1.0, 1.06, 1.12, ... and 0.5 step of upload and of download delay)
   with the quorum K=M (``diloco up``'s setting) and with K=1 (per-arrival merges).

4. the headline configurations (tuned data-parallel, tuned synchronous DiLoCo, Decoupled K=M with the
   better fetch policy) on two more data seeds (the batches each learner samples).

5. bandwidth at parity (M=2): the tuned synchronous configuration with lighter quantisers (uplink and
   downlink int8 or int4), then data-parallel and synchronous DiLoCo at 4x and 8x the tuned H on 2x
   and 4x the budget (``gap_vs_budget_m2``: the gap of each H against tokens, the compute-optimal
   point from the sweep above).
Keys: ``loss_gap_m2`` / ``loss_gap_m4`` = (decoupled K=M - data-parallel) / data-parallel, both the
mean over the 3 seeds (targets <= 1% and <= 2%); ``decoupled_vs_sync_m2`` / ``_m4`` = (decoupled K=M -
synchronous at the same H) / synchronous, means over the seeds (target <= 0.5%);
``reference_speed_vs_dp``: tokens per second of the reference's synchronous run over data-parallel's,
measured side by side (target >= 0.9). ``--plot FILE.png``: held-out loss against tokens.

    python -m bench.algorithm --quick --out algorithm.json           (~1 min, a tiny budget)
    python -m bench.algorithm --out algorithm.json --plot docs/quality.png     (~75 min on 2 cores; --reuse)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from dataclasses import replace

from bench.common import fetch_delay_of, finish, parser, progress
from simulation.reference import TINY_MODEL as QUICK_MODEL
from simulation.reference import RefConfig, Setup, run_reference, same_setup


class Runner:
    """Runs configurations, sharing the compiled step between runs of one setup; keeps every result."""

    def __init__(self, reuse: list[dict] | None = None, journal: str | None = None):
        self.setups: list[tuple[RefConfig, Setup]] = []
        self.rows: list[dict] = []
        self.journal = journal  # every new row is appended here (JSON lines): --reuse it after a crash
        # rows of an earlier run of this benchmark (--reuse): the reference is deterministic, so a
        # configuration run before gives the same figures bit for bit
        self.reuse = {(r["M"], r["label"]): r for r in (reuse or []) if isinstance(r, dict) and "label" in r}

    def __call__(self, cfg: RefConfig, label: str, **tags) -> dict:
        old = self.reuse.get((cfg.M, label))
        delay = fetch_delay_of(cfg)
        if old is not None and fetch_delay_of(old) == delay:  # (an older file's decoupled rows ran H/4)
            self.rows.append({**old, "reused": True})
            progress(f"M={cfg.M} {label}: held-out {old['loss']:.4f} (reused)")
            return self.rows[-1]
        setup = next((s for c, s in self.setups if same_setup(c, cfg)), None)
        if setup is None:
            setup = Setup(cfg)
            self.setups = [(cfg, setup)]  # one at a time: keep memory flat
        r = run_reference(cfg, setup)
        row = {"label": label, "mode": cfg.mode, "M": cfg.M, "loss": round(r["eval_loss"], 5),
               "uplink": cfg.quantiser, "downlink": cfg.downlink, "fetch_delay": delay, **tags,
               "wall_s": r["wall_s"], "tokens_per_s": r["tokens_per_s"], "curve": r["curve"],
               "merges": r.get("merges"), "staleness_hist": r.get("staleness_hist"), "rejected": r.get("rejected")}
        self.rows.append(row)
        if self.journal:
            import orjson

            with open(self.journal, "ab") as f:
                f.write(orjson.dumps(row) + b"\n")
        progress(f"M={cfg.M} {label}: held-out {r['eval_loss']:.4f} ({r['wall_s']} s)")
        return row


def reduction_vs_dp(row: dict) -> float | None:
    """Bytes a data-parallel worker moves (ring all-reduce of bf16 gradients, 2 (M-1)/M x N x 2 bytes
    per step) over the bytes a learner of ``row`` moves (each parameter up once per H steps at the
    uplink's bits, and down once per round: one version per fragment per round with K = M or the
    one-download-per-round fetch; M versions with K = 1 and fetch=every), scales included; headers
    and keyframes of a quantised downlink are left out (they add under 2% at the figures here)."""
    from bus.quant import bits_per_value

    if row.get("mode") == "dp" or not row.get("H"):
        return None
    M = row["M"]
    downloads = M if (row.get("K") == 1 and row.get("fetch") == "every") else 1
    learner = (bits_per_value(row.get("uplink", "int8")) + downloads * bits_per_value(row.get("downlink", "fp32"))) / 8
    return row["H"] * 2 * (M - 1) / M * 2 / learner


def out_of_step(M: int) -> dict:
    """The reference's timing of learners out of step: learner m steps in 1 + 0.06 m virtual seconds,
    every contribution and every version half a step in flight (``RefConfig`` fields)."""
    return {"step_times": tuple(round(1.0 + 0.06 * m, 2) for m in range(M)), "up_delay": 0.5, "down_delay": 0.5}


def steps_by_speed(total: int, step_times: tuple[float, ...]) -> tuple[int, ...]:
    """``total`` inner steps shared among learners in proportion to their speeds (1 / step time), so
    that all of them finish at about the same time; the largest remainders round up and every
    learner has at least 1, so the sum is ``total`` unless a share rounds below 1."""
    rates = [1.0 / t for t in step_times]
    exact = [total * r / sum(rates) for r in rates]
    out = [max(1, int(x)) for x in exact]
    for i in sorted(range(len(out)), key=lambda i: int(exact[i]) - exact[i])[:max(0, total - sum(out))]:
        out[i] += 1
    return tuple(out)


def periods_by_speed(H: int, step_times: tuple[float, ...], whole: bool = False) -> tuple[float, ...]:
    """Dynamic Local Updates at fixed speeds (``learner.loop.dynamic_period``): each learner syncs
    every v / v_max x H steps (a real number: rounds of floor and ceil of it; at least ceil(H / 4)),
    so every round lasts as long as the fastest's. ``whole``: rounded down to whole steps, as Liu et
    al. and the roles until the nineteenth round did (``bench.quorum``'s ``dlu_floor``)."""
    import math

    from learner.loop import dynamic_period

    rates = [1.0 / t for t in step_times]
    exact = [dynamic_period(H, r, [x for j, x in enumerate(rates) if j != i]) for i, r in enumerate(rates)]
    return tuple(float(math.floor(x + 1e-9)) for x in exact) if whole else tuple(exact)


def budget_steps(params: int, tokens_per_param: float, M: int, batch: int, seq_len: int) -> int:
    """Inner steps per learner for ``tokens_per_param`` x params tokens over M learners."""
    return max(1, round(tokens_per_param * params / (M * batch * seq_len)))


def model_budget(model: dict, tokens_per_param: float, Ms: list[int], batch: int) -> dict[int, int]:
    """{M: inner steps per learner} for the built-in ``model`` (a ``RefConfig.model`` dict) at
    ``tokens_per_param`` x its parameters tokens."""
    probe = Setup(RefConfig(M=1, steps=2, model=model))
    return {M: budget_steps(probe.params, tokens_per_param, M, batch, probe.spec.seq_len) for M in Ms}


def study(M: int, quick: bool, tokens_per_param: float, batch: int, run: Runner) -> dict:
    model = QUICK_MODEL if quick else RefConfig().model
    probe = Setup(RefConfig(M=M, steps=2, model=model, P=1))
    steps = budget_steps(probe.params, tokens_per_param, M, batch, probe.spec.seq_len)
    del probe
    base = RefConfig(M=M, steps=steps, batch=batch, model=model, P=1, eval_points=10 if not quick else 3,
                     warmup=max(5, steps // 20), quantiser="int8")
    progress(f"M={M}: {steps} inner steps per learner, batch {batch}")
    # 1. data-parallel: the peak learning rate, then the warm-up at the best one
    dp_lrs = [1e-3, 3e-3] if quick else [1e-3, 2e-3, 4e-3]

    def dp(lr: float) -> dict:
        return run(replace(base, mode="dp", lr=lr), f"dp lr={lr} warmup={base.warmup}", lr=lr, warmup=base.warmup)

    dps = [dp(lr) for lr in dp_lrs]
    while not quick and min(dps, key=lambda r: r["loss"])["lr"] == max(r["lr"] for r in dps) and len(dps) < 6:
        dps.append(dp(2 * max(r["lr"] for r in dps)))  # the best is the largest tried: go on up
    best_lr = min(dps, key=lambda r: r["loss"])["lr"]
    if not quick:
        w = max(5, steps // 10)
        dps.append(run(replace(base, mode="dp", lr=best_lr, warmup=w), f"dp lr={best_lr} warmup={w}", lr=best_lr,
                       warmup=w))
    dp_best = min(dps, key=lambda r: r["loss"])

    def sync(H: int, ilr: float, olr: float, mom: float) -> dict:
        return run(replace(base, mode="sync", lr=ilr, warmup=dp_best["warmup"], H=H, outer_lr=olr,
                           outer_momentum=mom),
                   f"sync H={H} inner={ilr} outer={olr}/{mom}", H=H, lr=ilr, outer_lr=olr, momentum=mom)

    # 2. synchronous DiLoCo at H=24 and data-parallel's learning rate: the outer learning rate and
    # momentum; then half the inner learning rate, then H, each at the best so far
    pairs = ((0.7, 0.0), (1.0, 0.5)) if quick else ((0.7, 0.0), (1.0, 0.0), (0.7, 0.5), (0.7, 0.9), (1.0, 0.5))
    syncs = [sync(24, dp_best["lr"], olr, mom) for olr, mom in pairs]
    best = min(syncs, key=lambda r: r["loss"])
    if not quick:
        syncs.append(sync(24, dp_best["lr"] / 2, best["outer_lr"], best["momentum"]))
        best = min(syncs, key=lambda r: r["loss"])
        syncs += [sync(H, best["lr"], best["outer_lr"], best["momentum"]) for H in (12, 48)]
    best = min(syncs, key=lambda r: r["loss"])
    tuned = replace(base, lr=best["lr"], warmup=dp_best["warmup"], H=best["H"], outer_lr=best["outer_lr"],
                    outer_momentum=best["momentum"])
    tags = {"H": best["H"], "lr": best["lr"], "outer_lr": best["outer_lr"], "momentum": best["momentum"]}
    # 3. streaming and decoupled at the tuned values, with the learners' default fetch (one download
    # per round, from DILOCO_FETCH_DELAY steps after the sync) and with every version downloaded as it comes
    P = 4 if quick else 8
    dec = dict(mode="decoupled", P=P, **out_of_step(M))
    fam: dict[tuple[str, str], dict] = {}
    for fetch in ("round", "every"):
        f, sfx = ({}, "") if fetch == "round" else ({"fetch": "every"}, " fetch=every")
        t = {**tags, "P": P, "fetch": fetch}
        fam["streaming", fetch] = run(replace(tuned, mode="streaming", P=P, **f), f"streaming P={P}{sfx}", **t)
        fam["k_m", fetch] = run(replace(tuned, **dec, **f), f"decoupled K={M} P={P}{sfx}", K=M, **t)
        fam["k1", fetch] = run(replace(tuned, **dec, **f, K=1), f"decoupled K=1 P={P}{sfx}", K=1, **t)
    dec_q = min((fam["k_m", f] for f in ("round", "every")), key=lambda r: r["loss"])
    dec_fetch = dec_q.get("fetch", "round")
    # 4. the headline runs again on other data seeds (the sampling of batches): the spread of one
    # configuration over seeds is the noise any gap above is measured against
    seeds = (0,) if quick else (0, 1, 2)
    cfgs = {"dp": replace(base, mode="dp", lr=dp_best["lr"], warmup=dp_best["warmup"]),
            "sync": replace(tuned, mode="sync"),
            "decoupled": replace(tuned, **dec, **({"fetch": "every"} if dec_fetch == "every" else {}))}
    first = {"dp": dp_best, "sync": best, "decoupled": dec_q}
    seeded: dict[str, list[float]] = {k: [first[k]["loss"]] for k in cfgs}
    for s in seeds[1:]:
        for k, c in cfgs.items():
            seeded[k].append(run(replace(c, data_seed=s), f"{first[k]['label']} data_seed={s}", seed=s)["loss"])
    mean = {k: sum(v) / len(v) for k, v in seeded.items()}
    # 5. bandwidth at parity (M=2, the target's): lighter quantisers at the tuned synchronous
    # configuration; then the gap of a longer H against the run's length (2x and 4x the budget,
    # data-parallel at its tuned lr with the warm-up scaled alike)
    budgets: list[dict] = []
    if M == 2:
        quants = (("int4", "int4"),) if quick else (("int8", "int8"), ("int4", "fp32"), ("int4", "int8"),
                                                   ("int4", "int4"))
        for up, down in quants:
            run(replace(tuned, mode="sync", quantiser=up, downlink=down), f"{best['label']} up={up} down={down}",
                **tags)
        plan = ((2, (best["H"], 4 * best["H"])),) if quick else (
            (2, (best["H"], 4 * best["H"], 8 * best["H"])), (4, (4 * best["H"], 8 * best["H"])))
        for mult, Hs in plan:
            longer = replace(base, steps=steps * mult, warmup=dp_best["warmup"] * mult)
            d = run(replace(longer, mode="dp", lr=dp_best["lr"]), f"{dp_best['label']} x{mult} budget",
                    lr=dp_best["lr"], budget=mult)
            for H in Hs:
                x = run(replace(longer, mode="sync", lr=best["lr"], H=H, outer_lr=best["outer_lr"],
                                outer_momentum=best["momentum"]), f"sync H={H} x{mult} budget",
                        **{**tags, "H": H}, budget=mult)
                budgets.append({"tokens_per_param": round(tokens_per_param * mult, 1), "H": H,
                                "dp": d["loss"], "sync": x["loss"], "gap": (x["loss"] - d["loss"]) / d["loss"]})
        for x in run.rows:  # the same H at the compute-optimal budget, from the sweep above
            if x["M"] == M and x.get("mode") == "sync" and x.get("lr") == best["lr"] and "seed" not in x \
                    and "budget" not in x and x.get("uplink") == "int8" and x.get("downlink") == "fp32" \
                    and x.get("outer_lr") == best["outer_lr"] and x.get("momentum") == best["momentum"]:
                budgets.append({"tokens_per_param": tokens_per_param, "H": x["H"], "dp": dp_best["loss"],
                                "sync": x["loss"], "gap": (x["loss"] - dp_best["loss"]) / dp_best["loss"]})
        budgets.sort(key=lambda b: (b["H"], b["tokens_per_param"]))
    family = [best] + list(fam.values())
    top = min(family, key=lambda r: r["loss"])
    return {"M": M, "steps": steps, "batch": batch, "dp_best": dp_best, "sync_best": best,
            "streaming": fam["streaming", dec_fetch], "decoupled_k_m": dec_q, "decoupled_k1": fam["k1", dec_fetch],
            "family": {f"{k} {f}": r["loss"] for (k, f), r in fam.items()}, "seeds": list(seeds),
            "seeded_losses": seeded, "seeded_mean": mean,
            "loss_gap": (mean["decoupled"] - mean["dp"]) / mean["dp"],
            "loss_gap_sync": (mean["sync"] - mean["dp"]) / mean["dp"],
            "decoupled_vs_sync": (mean["decoupled"] - mean["sync"]) / mean["sync"],
            "seed_gaps_vs_dp": [(d - b) / b for d, b in zip(seeded["decoupled"], seeded["dp"])],
            "seed_gaps_vs_sync": [(d - b) / b for d, b in zip(seeded["decoupled"], seeded["sync"])],
            "best_single_run_gap": (top["loss"] - dp_best["loss"]) / dp_best["loss"], "best_single_run": top["label"],
            "decoupled_k1_vs_sync": (fam["k1", dec_fetch]["loss"] - best["loss"]) / best["loss"],
            "streaming_vs_sync": (fam["streaming", dec_fetch]["loss"] - best["loss"]) / best["loss"],
            "gap_vs_budget": budgets}


def speed(quick: bool, M: int, batch: int) -> dict:
    """Tokens per second of the reference (synchronous DiLoCo, M learners) and of data-parallel on
    the same total batch, side by side, alternating (A B A B), after a warm-up run of each."""
    model = QUICK_MODEL if quick else RefConfig().model
    steps = 60 if quick else 240
    cfg = RefConfig(M=M, steps=steps, batch=batch, model=model, P=1, eval_points=1, warmup=10)
    s_ref, s_dp = Setup(cfg), Setup(replace(cfg, mode="dp"))
    rates: dict[str, list[float]] = {"reference": [], "dp": []}
    for rep in range(3):
        for mode, s in (("reference", s_ref), ("dp", s_dp)):
            r = run_reference(replace(cfg, mode="sync" if mode == "reference" else "dp"), s)
            if rep:
                rates[mode].append(r["tokens_per_s"])
    ratio = [a / b for a, b in zip(rates["reference"], rates["dp"])]
    return {"reference_tokens_per_s": rates["reference"], "dp_tokens_per_s": rates["dp"], "ratios": ratio,
            "reference_speed_vs_dp": min(ratio)}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        for key, style in (("dp_best", "k-"), ("sync_best", "b-"), ("streaming", "g--"), ("decoupled_k_m", "r-"),
                           ("decoupled_k1", "r:")):
            row = r[key]
            xs = [c[0] / 1e6 for c in row["curve"]]
            ax.plot(xs, [c[1] for c in row["curve"]], style, label=f"{row['label']} ({row['loss']:.3f})")
        ax.set_title(f"M={r['M']}, {r['steps']} steps per learner")
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("held-out loss")
        lo = min(min(c[1] for c in r[k]["curve"]) for k in ("dp_best", "sync_best"))
        ax.set_ylim(lo - 0.05, lo + 0.8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--M", type=int, nargs="+", default=None, help="learner counts (default: 2 4; quick: 2)")
    p.add_argument("--tokens-per-param", type=float, default=None, help="budget (default 20; quick 2)")
    p.add_argument("--batch", type=int, default=8, help="sequences per learner step")
    p.add_argument("--plot", default=None, help="write the loss-vs-tokens plot here")
    p.add_argument("--no-speed", action="store_true", help="skip reference_speed_vs_dp")
    p.add_argument("--speed-only", action="store_true", help="only reference_speed_vs_dp")
    p.add_argument("--reuse", nargs="+", default=None,
                   help="earlier --out JSON files or their .rows.jsonl journals: their runs are not run again")
    a = p.parse_args()
    Ms = a.M or ([2] if a.quick else [2, 4])
    if a.speed_only:
        finish(speed(a.quick, Ms[0], a.batch), a.out)
        return
    tpp = a.tokens_per_param or (2.0 if a.quick else 20.0)
    reuse = None
    if a.reuse:
        import orjson

        reuse = []
        for path in a.reuse:
            with open(path, "rb") as f:
                data = f.read()
            if path.endswith(".jsonl"):
                reuse += [orjson.loads(line) for line in data.splitlines() if line.strip()]
                continue
            old = orjson.loads(data)
            # the rows of every run, then the studies' rows (which carry their curves) over them
            reuse += old.get("sweep_rows") or old.get("sweep", [])
            reuse += [r for st in old.get("studies", []) for r in st.values() if isinstance(r, dict) and "curve" in r]
    run = Runner(reuse, journal=f"{a.out}.rows.jsonl" if a.out else None)
    results = [study(M, a.quick, tpp, a.batch, run) for M in Ms]
    for row in run.rows:
        red = reduction_vs_dp(row)
        if red is not None:
            row["reduction_vs_dp"] = round(red, 2)
    out: dict = {"tokens_per_param": tpp, "studies": results,
                 "sweep": [{k: v for k, v in r.items() if k != "curve"} for r in run.rows], "sweep_rows": run.rows}
    for r in results:
        # bandwidth at parity: the largest reduction among DiLoCo-family runs (seed 0) whose held-out
        # loss is within 1% of tuned data-parallel's
        dp = r["dp_best"]["loss"]
        ok = [x for x in run.rows if x["M"] == r["M"] and x.get("reduction_vs_dp") and "seed" not in x
              and "budget" not in x and x["loss"] <= 1.01 * dp]
        best = max(ok, key=lambda x: x["reduction_vs_dp"]) if ok else None
        r["parity"] = {"reduction_vs_dp": best["reduction_vs_dp"], "of": best["label"]} if best else None
        out[f"reduction_at_parity_m{r['M']}"] = best["reduction_vs_dp"] if best else None
        out[f"loss_gap_m{r['M']}"] = round(r["loss_gap"], 5)
        out[f"decoupled_vs_sync_m{r['M']}"] = round(r["decoupled_vs_sync"], 5)
        out[f"decoupled_k1_vs_sync_m{r['M']}"] = round(r["decoupled_k1_vs_sync"], 5)
        if r["gap_vs_budget"]:
            out[f"gap_vs_budget_m{r['M']}"] = [{**b, "gap": round(b["gap"], 5)} for b in r["gap_vs_budget"]]
    if not a.no_speed:
        out.update(speed(a.quick, Ms[0], a.batch))
    if a.plot:
        plot(results, a.plot)
    finish(out, a.out)


if __name__ == "__main__":
    main()
