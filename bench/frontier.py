"""The compression frontier (issue 27): held-out gap to tuned data-parallel against bytes moved, for
each codec family x H, in the in-process reference (``bench.reference``).

The budget is where DiLoCo reaches parity here: 80 tokens per parameter of the built-in ``small``
model (119k parameters), M=2 (``--M``), synchronous DiLoCo (P=1, K=M), at the values tuned by
``bench.algorithm`` (inner peak lr 0.008, warm-up 10% of the compute-optimal steps x 4, outer
Nesterov 0.7 / 0.5). Data-parallel is AdamW on batches of M x b at the same lr and warm-up.

Codec families (uplink / downlink; ``chain``: the downlink sends each version against the previous
reconstruction, error feedback on the way down, ``bus.downlink.encode_chain``; every uplink keeps
its residual, error feedback):

* dense: ``int8/fp32`` Nesterov (the previous best, 38x at H=96), ``int4/int4`` and ``int2/int2``
  chained, and the mixed pairs, at H = 96 to 192;
* sparse: ``topk2`` up (the 64 largest of 4096, 2 bits), ``topk4`` chained down (256 or 128 of 4096,
  4 bits), outer SGD (momentum 0, SparseLoCo's choice: error feedback stands in for the outer
  momentum, and the merged update of sparse contributions stays sparse) or Nesterov, error-feedback
  decay 1 or 0.95, H = 12 to 96; and a denser one (256 up / 512 down) at H=48.

Bytes are counted from the blobs themselves (headers and scales included): a learner's uplink
(its outer gradients) and downlink (one download of every global version); data-parallel's are a
bf16 ring all-reduce, 2 (M-1)/M x N x 2 bytes per worker per step. ``reduction_vs_dp`` = DP bytes /
learner bytes; ``reduction_at_parity_m2`` = the largest among runs within 1% of data-parallel.

    python -m bench.frontier --quick --out frontier.json              (~1 min, the tiny model)
    python -m bench.frontier --out frontier.json --plot docs/frontier.png --jobs 2   (~60 min on 2 cores)

Every finished run is appended to ``--journal`` (JSON lines); ``--reuse FILE`` takes rows of an
earlier journal instead of running them again (the reference is deterministic).
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import time
from dataclasses import asdict, replace

import orjson

from bench.common import finish, parser, progress
from bus.procs import process_pool
from simulation.reference_config import TINY_MODEL, RefConfig

PARITY = 0.01


def _family(label: str, base: RefConfig, H: int, up: str, down: str, chain: bool, outer: str, up_k: int = 64,
            down_k: int = 256, decay: float = 1.0) -> tuple[str, RefConfig]:
    opt = dict(outer_lr=0.7, outer_momentum=0.5) if outer == "nesterov" else dict(outer_lr=1.0, outer_momentum=0.0)
    return (f"{label} H={H}" + (f" decay={decay}" if decay != 1.0 else ""),
            replace(base, H=H, quantiser=up, downlink=down, downlink_chain=chain, topk_k=up_k, down_k=down_k,
                    feedback_decay=decay, **opt))


def grid(quick: bool, M: int) -> tuple[RefConfig, list[tuple[str, RefConfig]]]:
    """(data-parallel, [(label, DiLoCo run)]) of the frontier."""
    if quick:
        base = RefConfig(mode="sync", M=M, steps=300, model=dict(TINY_MODEL), P=1, lr=0.008, warmup=30,
                         eval_points=1)
        return replace(base, mode="dp"), [
            _family("int8/fp32 nesterov", base, 12, "int8", "fp32", False, "nesterov"),
            _family("int2/int2 chain nesterov", base, 12, "int2", "int2", True, "nesterov"),
            _family("topk2/topk4-256 chain sgd", base, 12, "topk2", "topk4", True, "sgd", decay=0.95),
            _family("topk2/topk4-128 chain sgd", base, 24, "topk2", "topk4", True, "sgd", down_k=128, decay=0.95)]
    steps = 9304 if M == 2 else 4652  # 80 tokens per parameter of the small model (bench.algorithm)
    base = RefConfig(mode="sync", M=M, steps=steps, P=1, lr=0.008, warmup=464 if M == 2 else 232, eval_points=4)
    F = _family
    runs = [
        # dense: the previous best, then 4 and 2 bits with error feedback both ways (chained down)
        F("int8/fp32 nesterov", base, 96, "int8", "fp32", False, "nesterov"),
        F("int4/int4 chain nesterov", base, 96, "int4", "int4", True, "nesterov"),
        F("int4/int4 chain nesterov", base, 144, "int4", "int4", True, "nesterov"),
        F("int4/int4 chain nesterov", base, 192, "int4", "int4", True, "nesterov"),
        F("int2/int2 chain nesterov", base, 96, "int2", "int2", True, "nesterov"),
        F("int4/int2 chain nesterov", base, 144, "int4", "int2", True, "nesterov"),
        # sparse (1.56% of the values up, 6.25% down): it needs short H here; decay 0.95 (SparseLoCo's)
        F("topk2/topk4-256 chain sgd", base, 12, "topk2", "topk4", True, "sgd"),
        F("topk2/topk4-256 chain sgd", base, 12, "topk2", "topk4", True, "sgd", decay=0.95),
        F("topk2/topk4-256 chain nesterov", base, 12, "topk2", "topk4", True, "nesterov", decay=0.95),
        F("topk2/topk4-256 chain sgd", base, 24, "topk2", "topk4", True, "sgd", decay=0.95),
        # denser sparse (6.25% up, 12.5% down) at a longer H
        F("topk2-256/topk4-512 chain sgd", base, 48, "topk2", "topk4", True, "sgd", up_k=256, down_k=512,
          decay=0.95),
    ]
    return replace(base, mode="dp"), runs


def _one(args: tuple[str, dict]) -> dict:
    from simulation.reference import run_reference

    label, cfgd = args
    cfg = RefConfig(**cfgd)
    t0 = time.perf_counter()
    r = run_reference(cfg)
    return {"label": label, "eval_loss": r["eval_loss"], "eval_loss_published": r.get("eval_loss_published"),
            "curve": r["curve"],
            "bytes_per_learner": r.get("bytes_per_learner"), "rejected": r.get("rejected", {}),
            "wall_s": round(time.perf_counter() - t0, 1),
            "config": {k: v for k, v in asdict(cfg).items() if k not in ("model",)}}


def dp_bytes(steps: int, params: int, M: int) -> float:
    """One data-parallel worker's bytes over the run: a bf16 ring all-reduce every step."""
    return steps * params * 2 * 2 * (M - 1) / M


def summarise(dp_row: dict, rows: list[dict], params: int, M: int) -> dict:
    dp = dp_row["eval_loss"]
    table = []
    for r in rows:
        # the loss of what learners and the evaluator hold (a quantised downlink's reconstruction);
        # rows of an earlier pass (--earlier) have only the aggregator's exact parameters' loss
        pub = r.get("eval_loss_published")
        loss = pub if pub is not None else r["eval_loss"]
        b = r["bytes_per_learner"]
        total = b["up"] + b["down"]
        dpb = dp_bytes(r["config"]["steps"], params, M)
        table.append({"label": r["label"], "H": r["config"]["H"], "loss": round(loss, 4),
                      "gap": round((loss - dp) / dp, 5), "aggregator_loss": round(r["eval_loss"], 4),
                      "evaluated": "published" if pub is not None else "aggregator",
                      "up_bytes": b["up"], "down_bytes": b["down"],
                      "reduction_vs_dp": round(dpb / total, 1), "wall_s": r["wall_s"]})
    ok = [t for t in table if t["gap"] <= PARITY and t["evaluated"] == "published"]
    best = max(ok, key=lambda t: t["reduction_vs_dp"]) if ok else None
    return {"dp_loss": round(dp, 4), "rows": table,
            f"reduction_at_parity_m{M}": best["reduction_vs_dp"] if best else None,
            "parity_of": best["label"] if best else None}


def plot(summary: dict, path: str, ymax: float = 8.0) -> None:
    """Gap (%) against reduction (log x); dense families blue, sparse orange; hollow: an earlier
    pass evaluated on the aggregator's parameters; points above ``ymax`` drawn at the top edge."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for t in summary["rows"]:
        sparse_fam = t["label"].startswith("topk")
        color = "tab:orange" if sparse_fam else "tab:blue"
        if t["label"].startswith("int8/fp32"):
            color = "tab:gray"
        y = 100 * t["gap"]
        over = y > ymax
        face = color if t["evaluated"] == "published" else "none"
        ax.scatter(t["reduction_vs_dp"], min(y, ymax), s=36, edgecolors=color, facecolors=face,
                   marker="^" if over else "o")
        short = t["label"].replace(" chain", "").replace(" nesterov", " N").replace(" sgd", " S").replace(
            "decay=0.95", "d.95")
        ax.annotate(short + (f" ({y:+.0f}%)" if over else ""), (t["reduction_vs_dp"], min(y, ymax)), fontsize=6,
                    xytext=(4, 2), textcoords="offset points")
    ax.axhline(100 * PARITY, color="tab:red", lw=0.8, ls="--")
    ax.axvline(400, color="tab:green", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_ylim(-1, ymax + 0.5)
    ax.set_xlabel("bytes reduction vs data-parallel bf16 ring all-reduce (x, measured blobs)")
    ax.set_ylabel("held-out loss vs tuned data-parallel (%)")
    ax.set_title("M=2, 80 tokens per parameter, small model (bench.frontier): blue dense, orange sparse;\n"
                 "N Nesterov, S outer SGD, d.95 feedback decay; hollow: aggregator's parameters; "
                 "red 1%, green 400x", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--M", type=int, default=2)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (processes)")
    p.add_argument("--journal", default=None, help="append every finished run here (JSON lines)")
    p.add_argument("--reuse", default=None, help="a journal of an earlier run: take its rows by label")
    p.add_argument("--earlier", default=None, help="a journal of an earlier pass whose rows (by labels not in this "
                                                   "grid) join the table, marked as evaluated on the aggregator's parameters")
    p.add_argument("--only", default=None, help="comma-separated labels to run (with the data-parallel baseline)")
    p.add_argument("--plot", default=None, help="write a PNG of the frontier")
    a = p.parse_args()
    dp, runs = grid(a.quick, a.M)
    if a.only:
        want = set(a.only.split(","))
        runs = [r for r in runs if r[0] in want]
    jobs = [("dp", dp)] + runs
    done: dict[str, dict] = {}
    if a.reuse:
        with open(a.reuse, "rb") as f:
            for line in f:
                row = orjson.loads(line)
                done[row["label"]] = row
    todo = [(label, {k: v for k, v in asdict(c).items()}) for label, c in jobs if label not in done]
    progress(f"{len(jobs)} runs, {len(todo)} to run, {a.jobs} at a time")
    with process_pool(max(1, a.jobs)) as ex:  # spawn workers that die with us
        for row in ex.map(_one, todo):
            done[row["label"]] = row
            progress(f"{row['label']}: held-out {row['eval_loss']:.4f} bytes {row['bytes_per_learner']} "
                     f"({row['wall_s']} s)")
            if a.journal:
                with open(a.journal, "ab") as f:
                    f.write(orjson.dumps(row) + b"\n")
    from simulation.reference_setup import Setup

    params = Setup(replace(dp, steps=2)).params
    rows = [done[label] for label, _ in runs]
    if a.earlier:
        with open(a.earlier, "rb") as f:
            rows += [r for r in map(orjson.loads, f) if r["label"] not in done and r["label"] != "dp"
                     and not r.get("eval_loss_published")]
    summary = summarise(done["dp"], rows, params, a.M)
    for t in summary["rows"]:
        progress(f"{t['label']:<44} {t['loss']:.4f} {100 * t['gap']:+.2f}% {t['reduction_vs_dp']:>8}x")
    if a.plot:
        plot(summary, a.plot)
    finish({"bench": "frontier", "quick": a.quick, "M": a.M, "params": params, **summary}, a.out)


if __name__ == "__main__":
    main()
