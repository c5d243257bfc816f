"""``diloco up``'s live view: what the launcher learns from the ``metrics`` subjects and membership
events (:class:`RunState`, folded message by message) and how it shows it (:func:`show_progress`:
a redrawn table or one line per interval).
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# -- live state from the metrics subjects (pure folding) --------------------------------------------

#: counts an aggregator's processes (the shard workers of ``diloco aggregator``) each report for
#: the fragments they own: summed
_SUMMED = ("merges", "accepted", "log_bytes", "checkpoint_bytes", "checkpoints")
#: per-fragment or per-learner maps: merged (fragments are disjoint; learners' counts add up)
_MAPS = ("versions", "buffered")
_COUNTERS = ("rejected", "contributions")


def combine_aggregators(msgs: list[dict]) -> dict:
    """One aggregator's metrics from those of its processes (one, or a shard worker per range of
    fragments): counts summed, per-fragment maps joined, ``ts`` the oldest (every process has
    reported since then)."""
    if len(msgs) == 1:
        return msgs[0]
    out: dict = {"role": "aggregator", "ts": min(float(m.get("ts", 0)) for m in msgs)}
    for k in _SUMMED:
        vals = [m.get(k) for m in msgs if isinstance(m.get(k), (int, float)) and not isinstance(m.get(k), bool)]
        if vals:
            out[k] = sum(vals)
    for k in _MAPS:
        out[k] = {f: v for m in msgs for f, v in (m.get(k) or {}).items()}
    for k in _COUNTERS:
        total: dict = {}
        for m in msgs:
            for x, n in (m.get(k) or {}).items():
                if isinstance(n, (int, float)):
                    total[x] = total.get(x, 0) + n
        out[k] = total
    return out



@dataclass
class RunState:
    """What the launcher learned from metrics and events; folded message by message."""

    run: str
    learners: dict[str, dict] = field(default_factory=dict)  # id -> last learner metrics
    aggregators: dict[str, dict] = field(default_factory=dict)  # id (shard workers each have one) -> last metrics
    monitor: dict | None = None
    evals: list[dict] = field(default_factory=list)  # evaluator records, in arrival order
    membership: list[dict] = field(default_factory=list)
    loss_history: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)  # id -> (t, step, loss)
    merge_history: list[tuple[float, int]] = field(default_factory=list)  # (t, merges so far), when it moves
    snapshot: Any = None
    t0: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        from monitor.metrics_view import MetricsSnapshot

        self.snapshot = MetricsSnapshot(run=self.run)

    def on_metrics(self, msg: Any) -> None:
        from monitor.metrics_view import fold

        self.snapshot = fold(self.snapshot, msg)
        if not isinstance(msg, dict) or msg.get("run") != self.run:
            return
        role = msg.get("role")
        if role == "learner" and isinstance(msg.get("learner"), str):
            old = self.learners.get(msg["learner"])
            if old is not None and old.get("incarnation") == msg.get("incarnation") and \
                    float(old.get("ts", 0)) > float(msg.get("ts", 0)):
                return
            self.learners[msg["learner"]] = msg
            loss, step = msg.get("loss"), msg.get("step")
            if isinstance(loss, (int, float)) and isinstance(step, int) and math.isfinite(loss):
                hist = self.loss_history.setdefault(msg["learner"], [])
                if not hist or hist[-1][1] != step:
                    hist.append((float(msg.get("ts", time.time())), step, float(loss)))
        elif role == "aggregator":
            ident = str(msg.get("id"))
            old = self.aggregators.get(ident)
            if old is None or float(msg.get("ts", 0)) >= float(old.get("ts", 0)):
                self.aggregators[ident] = msg
                merges = (self.aggregator or {}).get("merges")
                if isinstance(merges, int) and not isinstance(merges, bool) and \
                        (not self.merge_history or self.merge_history[-1][1] != merges):
                    self.merge_history.append((float(msg.get("ts", time.time())), merges))
        elif role == "monitor":
            self.monitor = msg
        elif (role == "evaluator" and isinstance(msg.get("eval_loss"), (int, float))
              and "evaluated_at" not in msg):  # a repeat of the last evaluation is not a new point
            self.evals.append(msg)

    @property
    def aggregator(self) -> dict | None:
        """The aggregator's newest metrics, its shard workers' combined (:func:`combine_aggregators`)."""
        return combine_aggregators(list(self.aggregators.values())) if self.aggregators else None

    def on_event(self, msg: Any) -> None:
        """A membership transition; a republished one (same learner, states and time) counts once."""
        if not isinstance(msg, dict):
            return
        key = (msg.get("learner"), msg.get("old"), msg.get("new"), msg.get("at"))
        if any((e.get("learner"), e.get("old"), e.get("new"), e.get("at")) == key for e in self.membership[-64:]):
            return
        self.membership.append(msg)

    @property
    def evictions(self) -> int:
        return sum(1 for e in self.membership if e.get("new") == "evicted")

    def evictions_while_running(self, ended: dict[str, float | None]) -> int:
        """Evictions of learners whose process was still running (a finished learner falls silent too)."""
        n = 0
        for e in self.membership:
            if e.get("new") != "evicted":
                continue
            end = ended.get(str(e.get("learner")))
            at = e.get("at")
            if end is None or not isinstance(at, (int, float)) or at < end:
                n += 1
        return n

    def versions(self) -> dict[str, int]:
        return dict((self.aggregator or {}).get("versions") or {})

    def contributions(self) -> dict[str, int]:
        return dict((self.aggregator or {}).get("contributions") or {})

    def compact_line(self, now: float | None = None) -> str:
        """One status line: elapsed, per learner step and loss, versions, eval loss, evictions."""
        now = time.time() if now is None else now
        parts = [f"[{now - self.t0:6.1f}s]"]
        for lid in sorted(self.learners):
            m = self.learners[lid]
            loss = m.get("loss")
            parts.append(f"{lid} {m.get('step', 0)}" + (f" {loss:.3f}" if isinstance(loss, (int, float)) else ""))
        vs = list(self.versions().values())
        if vs:
            parts.append(f"fragments v{min(vs)}..v{max(vs)}" if min(vs) != max(vs) else f"fragments v{vs[0]}")
            parts.append(f"merges {(self.aggregator or {}).get('merges', 0)}")
        if self.evals:
            e = self.evals[-1]
            parts.append(f"eval {e['eval_loss']:.3f}" + (f" (from {self.evals[0]['eval_loss']:.3f})"
                                                         if len(self.evals) > 1 else ""))
        if self.evictions:
            parts.append(f"evictions {self.evictions}")
        return " | ".join(parts)



def show_progress(mode: str, state: RunState, *, status: str, out: str, t_start: float,
                  say: Callable[[str], None] = print) -> None:
    """One progress update: ``mode`` table (the terminal redrawn: ``diloco metrics``'s table under a
    head line), line (:meth:`RunState.compact_line`) or none."""
    if mode == "none":
        return
    if mode == "table":
        from monitor.cli import CLEAR
        from monitor.metrics_view import render_table

        width = shutil.get_terminal_size((100, 24)).columns
        head = f"diloco up | {time.time() - t_start:6.1f}s | {status} | out {out}"
        if state.evals:
            head += f" | initial eval {state.evals[0]['eval_loss']:.4f}"
        sys.stdout.write(CLEAR + head[:width] + "\n" + render_table(state.snapshot, width=width) + "\n")
        sys.stdout.flush()
    else:
        say(state.compact_line())
