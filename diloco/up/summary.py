"""The end of ``diloco up``: ``OUT/summary.json`` (:func:`build_summary`), its text for the terminal
(:func:`render_summary`) and ``OUT/eval_loss.png`` (:func:`plot_eval`). Pure but for the plot file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diloco.up.plan import ProcSpec
    from diloco.up.progress import RunState


def _merges(e: dict | None) -> int | None:
    """The merges an evaluator record's model holds (``version`` in records of older evaluators)."""
    if not e:
        return None
    m = e.get("merges", e.get("version"))
    return m if isinstance(m, int) else None


def dp_equivalent_bytes(params: int, learners: int, total_inner_steps: int, bytes_per_value: int = 2) -> int:
    """Bytes data-parallel training would move for the same inner steps: a ring all-reduce of every
    gradient in bf16 sends 2 (M-1)/M x params values per worker and step; M workers doing
    ``total/M`` steps each process the same samples as our learners' ``total`` inner steps."""
    if learners < 2:
        return 0
    return int(round(2 * (learners - 1) / learners * params * bytes_per_value * total_inner_steps))


# -- summary (pure) ---------------------------------------------------------------------------------


def build_summary(*, state: RunState, specs: list[ProcSpec], exit_codes: dict[str, int | None], traffic: dict,
                  params: int, wall_time_s: float, train_time_s: float | None, status: str,
                  settings: dict, learner_ended: dict[str, float | None] | None = None) -> dict:
    contributions = state.contributions()
    learners = {}
    total_steps = 0
    link_by_learner: dict[str, int] = {}
    for c in traffic.get("connections", []):
        name = c.get("name", "")
        if name.startswith("learner-"):
            lid = name[len("learner-"):]
            link_by_learner[lid] = link_by_learner.get(lid, 0) + c["in_bytes"] + c["out_bytes"]
    for p in specs:
        if p.role != "learner":
            continue
        m = state.learners.get(p.learner_id, {})
        steps = int(m.get("step") or 0)
        total_steps += steps
        learners[p.learner_id] = {
            "region": p.region, "steps": steps, "contributions": int(contributions.get(p.learner_id, 0)),
            "contributions_sent": int(m.get("contributions") or 0), "last_train_loss": m.get("loss"),
            "resyncs": m.get("resyncs"), "skipped_syncs": m.get("skipped_syncs"),
            "link_bytes": link_by_learner.get(p.learner_id, 0), "exit_code": exit_codes.get(p.name),
        }
    m_count = len(learners)
    evals = state.evals
    initial = evals[0] if evals else None
    final = evals[-1] if evals else None
    agg = state.aggregator or {}
    broker = int(traffic.get("client_bytes", 0))
    learner_link = sum(link_by_learner.values())
    by_role: dict[str, dict[str, int]] = {}  # what crossed the broker, per kind of process (its name's prefix)
    for c in traffic.get("connections", []):
        role = (c.get("name", "") or "unnamed").split("-", 1)[0]
        r = by_role.setdefault(role, {"in_bytes": 0, "out_bytes": 0})
        r["in_bytes"] += c["in_bytes"]
        r["out_bytes"] += c["out_bytes"]
    dp = dp_equivalent_bytes(params, m_count, total_steps)
    return {
        "status": status,
        "run": state.run,
        "settings": settings,
        "params": params,
        "num_learners": m_count,
        "initial_eval_loss": initial["eval_loss"] if initial else None,
        "initial_eval_version": initial.get("version") if initial else None,  # merges (its old name)
        "initial_eval_merges": _merges(initial),
        "final_eval_loss": final["eval_loss"] if final else None,
        "final_eval_versions": final.get("versions") if final else None,
        "eval_loss_ratio": (final["eval_loss"] / initial["eval_loss"]) if initial and final else None,
        "eval_history": [{"t": round(float(e.get("ts", 0)) - state.t0, 3), "eval_loss": e["eval_loss"],
                          "version": e.get("version"), "merges": _merges(e)} for e in evals],
        "merge_history": [{"t": round(t - state.t0, 3), "merges": n} for t, n in state.merge_history],
        "eviction_times": [{"t": round(float(e.get("at", 0)) - state.t0, 3), "learner": e.get("learner")}
                           for e in state.membership if e.get("new") == "evicted"
                           and isinstance(e.get("at"), (int, float))],
        "learners": learners,
        "total_inner_steps": total_steps,
        "versions": agg.get("versions") or {},
        "merges": agg.get("merges"),
        "accepted": agg.get("accepted"),
        "rejected": agg.get("rejected") or {},
        "evictions": state.evictions_while_running(learner_ended or {}),
        "evictions_total": state.evictions,
        "membership_events": len(state.membership),
        "broker_bytes": broker,
        "broker_bytes_source": "sum of in_bytes+out_bytes of every client connection (/connz?state=all)",
        "learner_link_bytes": learner_link,
        "broker_bytes_by_role": dict(sorted(by_role.items())),
        # of the aggregator's outgoing bytes, what its durability wrote (merge records, checkpoints)
        "aggregator_durability_bytes": {k: agg.get(k) for k in ("log_bytes", "checkpoint_bytes", "checkpoints")},
        "servers": traffic.get("servers", {}),
        "dp_equivalent_bytes": dp,
        "broker_over_dp": (broker / dp) if dp else None,
        "dp_over_broker": (dp / broker) if broker and dp else None,
        "dp_over_learner_link": (dp / learner_link) if learner_link and dp else None,
        "wall_time_s": round(wall_time_s, 2),
        "train_time_s": round(train_time_s, 2) if train_time_s is not None else None,
        "exit_codes": exit_codes,
    }


def render_summary(s: dict) -> str:
    def mib(n: float | None) -> str:
        return "-" if n is None else f"{n / 2**20:.1f} MiB"

    status = s["status"] + (f" ({s['signal']} while {s['interrupted_during']})" if s.get("interrupted_during") else "")
    lines = [f"run {s['run']}: {status} in {s['wall_time_s']:.0f}s "
             f"({s['num_learners']} learners, {s['params']:,} params, {s['total_inner_steps']} inner steps)"]
    if s["initial_eval_loss"] is not None:
        lines.append(f"held-out loss  {s['initial_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}"
                     f"  (x{s['eval_loss_ratio']:.3f})")
    vs = s["versions"]
    if vs:
        lines.append("versions       " + " ".join(f"f{k}=v{v}" for k, v in sorted(vs.items(), key=lambda kv: int(kv[0])))
                     + f"  ({s['merges']} merges, {sum(s['rejected'].values())} rejected)")
    lines.append("learner        region  steps  contributions(applied/sent)  link")
    for lid, l in sorted(s["learners"].items()):
        lines.append(f"  {lid:<12} {l['region']:<7} {l['steps']:>5}  {l['contributions']:>6} / {l['contributions_sent']:<6}"
                     f"              {mib(l['link_bytes'])}")
    lines.append(f"evictions      {s['evictions']}")
    ratio = s["dp_over_broker"]
    lines.append(f"broker bytes   {mib(s['broker_bytes'])} (learner links {mib(s['learner_link_bytes'])}); "
                 f"data-parallel bf16 would move {mib(s['dp_equivalent_bytes'])}"
                 + (f": {ratio:.1f}x more" if ratio else ""))
    return "\n".join(lines)


def plot_eval(summary: dict, state: RunState, path: str) -> dict | None:
    """Held-out loss over time (bold, each point's version next to it), each learner's training loss
    (thin), the aggregator's merges so far (grey steps, right axis) and evictions (red dotted lines),
    with the final held-out loss written on the plot, as a PNG. Returns what it drew (None: no
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    drawn: dict = {"learners": 0, "eval_points": 0, "merge_steps": 0, "evictions": 0, "final": None}
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for lid, hist in sorted(state.loss_history.items()):
        if hist:
            ax.plot([t - state.t0 for t, _, _ in hist], [l for _, _, l in hist], lw=0.8, alpha=0.5,
                    label=f"train {lid}")
            drawn["learners"] += 1
    ev = summary["eval_history"]
    if ev:
        ax.plot([e["t"] for e in ev], [e["eval_loss"] for e in ev], "o-", color="black", lw=2, ms=3,
                label="held-out (global model; labels: merges it holds)")
        drawn["eval_points"] = len(ev)
        every = max(1, len(ev) // 12)  # at most about a dozen labels: the merges the model held
        for i, e in enumerate(ev):
            m = e.get("merges", e.get("version"))
            if m is not None and (i % every == 0 or i == len(ev) - 1):
                ax.annotate(f"{m}", (e["t"], e["eval_loss"]), textcoords="offset points",
                            xytext=(0, 5), fontsize=6, ha="center", color="black")
        last = ev[-1]
        m = last.get("merges", last.get("version"))
        drawn["final"] = f"final held-out {last['eval_loss']:.4f}" + (f" (after {m} merges)" if m is not None else "")
        ax.annotate(drawn["final"], (last["t"], last["eval_loss"]), textcoords="offset points", xytext=(-10, 18),
                    ha="right", fontsize=9, fontweight="bold", arrowprops={"arrowstyle": "->", "lw": 0.8})
    for i, e in enumerate(summary.get("eviction_times") or []):
        ax.axvline(e["t"], color="red", ls=":", lw=1, label="eviction" if i == 0 else None)
        drawn["evictions"] += 1
    merges = summary.get("merge_history") or []
    ax2 = None
    if merges:
        ax2 = ax.twinx()
        ax2.step([m["t"] for m in merges], [m["merges"] for m in merges], where="post", color="grey", lw=1,
                 alpha=0.7, label="merges so far (right axis)")
        ax2.set_ylabel("merges so far (aggregator)", color="grey")
        ax2.tick_params(axis="y", colors="grey")
        drawn["merge_steps"] = len(merges)
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"diloco up: run {summary['run']}, {summary['num_learners']} learners")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if ax2 is not None:  # the merges line is on the other axis: one legend for both
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper center")
    drawn["legend"] = list(labels)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return drawn

