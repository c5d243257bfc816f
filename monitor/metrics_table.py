"""Text table of a metrics snapshot for `diloco metrics` (pure): `render_table` and its cell formats.

The fold that builds the snapshot is :mod:`monitor.metrics_view`, which re-exports `render_table`
and `fmt_age`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from monitor.membership import State

if TYPE_CHECKING:
    from monitor.metrics_view import MetricsSnapshot

__all__ = ["fmt_age", "render_table"]


# --------------------------------------------------------------------------- render


def _dash(x: object) -> str | None:
    return "-" if x is None else None


def _fmt_int(n: int | None) -> str:
    return _dash(n) or str(n)


def _fmt_step(n: int | None) -> str:
    """Exact up to 9 digits (the STEP column), SI-abbreviated beyond: never clipped."""
    if n is None:
        return "-"
    return str(n) if n < 10**9 else _fmt_si(float(n))


def _fit(width: int, *candidates: str) -> str:
    """The first candidate that fits in `width` (the last one otherwise)."""
    for text in candidates:
        if len(text) <= width:
            return text
    return candidates[-1]


def _fmt_loss(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return _fit(8, *(f"{x:.{d}f}" for d in (4, 3, 2, 1)), f"{x:.3g}", f"{x:.2g}", f"{x:.1g}", f"{x:.0e}")


def _fmt_si(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return _fit(7, f"{x / scale:.1f}{unit}", f"{x:.1e}")
    return f"{x:.0f}" if x >= 10 or x == 0 else f"{x:.1f}"


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    units = (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
    for unit, scale in units:
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def _fmt_stale(x: float | None) -> str:
    if x is None:
        return "-"
    return _fit(5, str(int(x)) if x.is_integer() else f"{x:.1f}", f"{x:.0f}", f"{x:.0e}")


def fmt_age(seconds: float | None) -> str:
    """Compact age for tables: 4.2s, 37s, 12m, 5h, 3d ('-' when unknown)."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0.0, seconds)
    if s < 10:
        return f"{s:.1f}s"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    if s < 172800:
        return f"{s / 3600:.0f}h"
    return _fit(5, f"{s / 86400:.0f}d", ">999d")


def _clip(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[: max(0, width - 1)] + "~" if width > 0 else ""


# (header, width) of the fixed columns after REGION and LEARNER
_COLUMNS: tuple[tuple[str, int], ...] = (
    ("STATE", 9),
    ("STEP", 9),
    ("LOSS", 8),
    ("TOK/S", 7),
    ("SENT", 9),
    ("RECV", 9),
    ("STALE", 5),
    ("AGE", 5),
)


def _versions_summary(versions: tuple[tuple[int, int], ...]) -> str:
    if not versions:
        return "versions -"
    if len(versions) <= 6:
        return "versions " + " ".join(f"f{f}=v{v}" for f, v in versions)
    vs = [v for _, v in versions]
    return f"versions v{min(vs)}..v{max(vs)} over {len(versions)} fragments"


def _state_order(counts: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
    known = [s.value for s in State]
    d = dict(counts)
    ordered = [(k, d[k]) for k in known if k in d]
    return ordered + sorted((k, n) for k, n in counts if k not in known)


def render_table(snapshot: MetricsSnapshot, width: int = 100, now: float | None = None) -> str:
    """Fixed-width text table of a snapshot; deterministic (no clock, no locale, ASCII layout).

    One row per learner sorted by (region, learner), then one summary line each for the
    aggregator, monitor and evaluator, then the malformed/skipped counters if any. AGE is
    measured against `now` if given, else against the newest message seen, so a learner whose
    AGE keeps growing while others stay near 0 has stopped publishing. Every line fits in
    `width` (ids and long lines are clipped with "~").
    """
    width = max(20, int(width))
    ref = now if now is not None else snapshot.last_ts
    lines: list[str] = []

    title = f"run {snapshot.run}" if snapshot.run is not None else "all runs"
    title += f" | {len(snapshot.learners)} learners | {snapshot.applied} messages"
    lines.append(title)

    rows = sorted(snapshot.learners.values(), key=lambda r: (r.region, r.learner))
    fixed = sum(w + 1 for _, w in _COLUMNS)
    room = max(8, width - fixed - 2)
    region_w = min(max([6] + [len(r.region) for r in rows]), max(4, room // 2))
    learner_w = max(4, room - region_w)
    learner_w = min(learner_w, max([7] + [len(r.learner) for r in rows]))

    def line(cells: list[str]) -> str:
        region, learner, *rest = cells
        parts = [_clip(region, region_w).ljust(region_w), _clip(learner, learner_w).ljust(learner_w)]
        parts += [_clip(cell, w).rjust(w) for cell, (_, w) in zip(rest, _COLUMNS)]
        return " ".join(parts)

    if rows:
        lines.append(line(["REGION", "LEARNER"] + [name for name, _ in _COLUMNS]))
        for r in rows:
            lines.append(
                line(
                    [
                        r.region or "-",
                        r.learner,
                        r.state or "-",
                        _fmt_step(r.step),
                        _fmt_loss(r.loss),
                        _fmt_si(r.tokens_per_s),
                        _fmt_bytes(r.bytes_sent),
                        _fmt_bytes(r.bytes_received),
                        _fmt_stale(r.staleness),
                        fmt_age(None if ref is None else ref - r.ts),
                    ]
                )
            )
    else:
        lines.append("no learner metrics yet")

    agg = snapshot.aggregator
    if agg is not None:
        rejected_total = sum(n for _, n in agg.rejected)
        text = f"aggregator  merges {_fmt_int(agg.merges)}  accepted {_fmt_int(agg.accepted)}  rejected {rejected_total}"
        if agg.rejected:
            text += " (" + ", ".join(f"{k} {n}" for k, n in agg.rejected) + ")"
        lines.append(text + "  " + _versions_summary(agg.versions))
    else:
        lines.append("aggregator  -")

    mon = snapshot.monitor
    if mon is not None and mon.counts:
        lines.append("monitor     " + "  ".join(f"{k} {n}" for k, n in _state_order(mon.counts)))
    else:
        lines.append("monitor     -")

    ev = snapshot.evaluator
    if ev is not None:
        lines.append(f"evaluator   eval_loss {_fmt_loss(ev.eval_loss)} after {_fmt_int(ev.version)} merges")
    else:
        lines.append("evaluator   -")

    if snapshot.malformed:
        detail = ", ".join(f"{k} {n}" for k, n in sorted(snapshot.malformed.items()))
        lines.append(f"malformed   {snapshot.malformed_total} ({detail})")
    if snapshot.skipped:
        detail = ", ".join(f"{k} {n}" for k, n in sorted(snapshot.skipped.items()))
        lines.append(f"skipped     {snapshot.skipped_total} ({detail})")

    return "\n".join(_clip(text, width) for text in lines)
