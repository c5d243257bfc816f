"""Fidelity of the system: the real roles over NATS against the in-process reference, same run.

An embedded NATS server, a monitor, an aggregator (K = M, ``diloco up``'s quorum) and M ``diloco
learner`` processes (``bench.runs.run_learners``) train the built-in model; then ``diloco eval
--once`` gives the held-out loss of the global model. ``simulation.reference`` then runs the same
configuration, with each learner sampling its batches as the process of the same incarnation did,
and ``system_vs_reference`` = |system - reference| / reference on the held-out loss (target <= 0.5%),
the largest over the runs; per mode: ``sync`` (``DILOCO_MODE=sync``: every learner waits for the
merge of its outer gradient, P fragments in step) and ``async`` (the default learner: staggered
fragments, never waiting).

Learners in step: with K = M a learner takes the merged fragment ``DILOCO_FETCH_DELAY`` steps after
its own sync, so the system follows the reference step for step as long as every merge is published
before then, and then the two agree bit for bit. ``DILOCO_SLOWDOWN`` stretches each inner step (the
learners sleep) so that start-up skew and 2 shared cores do not put them out of step. Out of step,
the system is still a correct run, only a different one (another version taken at another step).

    python -m bench.fidelity --quick --modes sync --out fidelity.json      (tiny model, 64 steps, ~20 s)
    python -m bench.fidelity --quick --modes sync --preset lean            (diloco up --preset lean's codecs)
    python -m bench.fidelity --repeat 3 --out fidelity.json                 (small model, 480 steps, ~8 min)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio

from bench.common import finish, parser, progress
from simulation.reference import SMALL_MODEL as SMALL
from simulation.reference import TINY_MODEL as TINY


def settings(quick: bool, mode: str = "sync") -> dict:
    """``sync``: learners in step by construction (each waits for the merge of its outer gradient).
    ``async``: inner steps stretched to about 0.25 s (tiny) or 0.1 s (small), so the learners'
    start-up skew (up to about 1 s here: one of them creates the run) stays under the fetch delay of
    half a round."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    s = ({"model": TINY, "M": 2, "steps": 64, "batch": 8, "H": 16, "P": 4, "fetch_delay": 8, "lr": 3e-3,
          "warmup": 10, "slowdown": 30.0} if quick else
         {"model": SMALL, "M": 2, "steps": 480, "batch": 8, "H": 24, "P": 8, "fetch_delay": 12, "lr": 3e-3,
          "warmup": 24, "slowdown": 12.0})
    s.update({"mode": mode, "eval_batches": 8, "eval_batch_size": 16})
    if mode == "sync":
        s["slowdown"] = 1.0
    return s


#: what ``diloco up --preset lean`` sets, as the reference's fields
LEAN_REFERENCE = {"quantiser": "topk2", "topk_chunk": 4096, "topk_k": 64, "feedback_decay": 0.95, "downlink": "topk4",
                  "downlink_chain": True, "down_k": 256, "outer_lr": 1.0, "outer_momentum": 0.0}


def system_env(s: dict) -> dict:
    m = s["model"]
    preset = {}
    if s.get("preset") == "lean":
        from diloco.up.plan import BANDWIDTH_PRESETS

        preset = dict(BANDWIDTH_PRESETS["lean"])
    return {**preset,"DILOCO_D_MODEL": str(m["d_model"]), "DILOCO_N_LAYERS": str(m["n_layers"]),
            "DILOCO_N_HEADS": str(m["n_heads"]), "DILOCO_D_FF": str(m["d_ff"]), "DILOCO_SEQ_LEN": str(m["seq_len"]),
            "DILOCO_NUM_FRAGMENTS": str(s["P"]), "DILOCO_SYNC_EVERY": str(s["H"]),
            "DILOCO_FETCH_DELAY": str(s["fetch_delay"]), "DILOCO_MODE": s["mode"], "DILOCO_START_WITH": str(s["M"]),
            "DILOCO_BATCH_SIZE": str(s["batch"]), "DILOCO_INNER_LR": str(s["lr"]),
            "DILOCO_WARMUP_STEPS": str(s["warmup"]), "DILOCO_TOTAL_STEPS": str(s["steps"]),
            "DILOCO_SLOWDOWN": str(s["slowdown"]), "DILOCO_EVAL_BATCHES": str(s["eval_batches"]),
            "DILOCO_EVAL_BATCH_SIZE": str(s["eval_batch_size"]),
            # the reference's periods are fixed: with a monitor, Dynamic Local Updates (the default)
            # would follow the learners' paces on a shared machine
            "DILOCO_DYNAMIC_H": "false"}


def reference_config(s: dict, incarnations: tuple[str, ...]):
    from simulation.reference import RefConfig

    return RefConfig(mode="decoupled" if s["mode"] == "async" else "sync", M=s["M"], steps=s["steps"], batch=s["batch"], model=s["model"], lr=s["lr"],
                     warmup=s["warmup"], H=s["H"], P=s["P"], K=s["M"], fetch_delay=s["fetch_delay"],
                     incarnations=incarnations, eval_points=1,
                     eval_batches=s["eval_batches"], eval_batch_size=s["eval_batch_size"],
                     **(LEAN_REFERENCE if s.get("preset") == "lean" else {}))


async def measure(quick: bool, mode: str = "sync", preset: str = "default") -> dict:
    from simulation.reference import run_reference
    from bench.runs import run_learners

    s = {**settings(quick, mode), "preset": preset}
    progress(f"system: M={s['M']} learners x {s['steps']} steps, {s}")
    sys_run = await run_learners(system_env(s), s["M"], s["steps"], label="system", monitor=True, timeout=600)
    if not sys_run["ok"]:
        raise RuntimeError("the system run did not finish")
    names = sorted(sys_run["learners"])
    incs = tuple(sys_run["learners"][n]["incarnation"] for n in names)
    sys_loss = sys_run["eval"]["eval_loss"]
    progress(f"system held-out {sys_loss:.5f}; reference with incarnations {incs}")
    ref = run_reference(reference_config(s, incs))
    agg = sys_run["aggregator"]
    # the evaluator reads each fragment's newest version as published (with a quantised or chained
    # downlink, the learners' reconstruction, not the aggregator's exact parameters)
    ref_loss = ref["eval_loss_published"]
    gap = abs(sys_loss - ref_loss) / ref_loss
    progress(f"reference held-out {ref_loss:.5f} (the aggregator's parameters: {ref['eval_loss']:.5f}): "
             f"system_vs_reference {gap:.5f}")
    return {"settings": s, "system_loss": sys_loss, "reference_loss": ref_loss,
            "reference_aggregator_loss": ref["eval_loss"], "system_vs_reference": gap,
            "system": {"merges": agg.get("merges"), "versions": agg.get("versions"), "rejected": agg.get("rejected"),
                       "staleness_hist": agg.get("staleness_hist"), "wall_s": sys_run["wall_s"],
                       "learner_steps": [sys_run["learners"][n]["step"] for n in names],
                       "learner_loss": [sys_run["learners"][n]["loss"] for n in names]},
            "reference": {"merges": ref["merges"], "versions": ref["versions"], "rejected": ref["rejected"],
                          "staleness_hist": ref["staleness_hist"],
                          "learner_loss": [ln[-1] for ln in ref["train_losses"]]}}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async"])
    p.add_argument("--repeat", type=int, default=1, help="runs per mode (the async figure depends on timing)")
    p.add_argument("--preset", choices=("default", "lean"), default="default",
                   help="lean: diloco up --preset lean's codecs and outer optimizer on both sides")
    a = p.parse_args()
    out: dict = {"runs": [], "preset": a.preset}
    for mode in a.modes:
        gaps = []
        for _ in range(a.repeat):
            r = asyncio.run(measure(a.quick, mode, a.preset))
            out["runs"].append(r)
            gaps.append(r["system_vs_reference"])
        out[f"system_vs_reference_{mode}"] = max(gaps)
        out[f"system_vs_reference_{mode}_all"] = gaps
    out["system_vs_reference"] = max(out[f"system_vs_reference_{m}"] for m in a.modes)
    finish(out, a.out)


if __name__ == "__main__":
    main()
