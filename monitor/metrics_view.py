"""Pure core of `diloco metrics`: fold metrics messages into a snapshot and render a text table.

The CLI shell subscribes to a run's metrics subjects, decodes each message with orjson, drops
those `filter_msg` rejects, folds the rest with `fold`, and redraws `render_table(snapshot)`
in place every refresh. Nothing here reads a clock or raises on bad input: a message that is
not what we expect is counted in `snapshot.malformed` by reason, so a buggy or hostile
publisher shows up on screen instead of crashing the viewer.

Messages are JSON objects with at least `role` ("learner" | "aggregator" | "monitor" |
"evaluator"), `run` and `ts` (wall-clock seconds). Role fields (all optional, a message may
update only some of them; missing fields keep their previous value):

- learner: `learner` (required), `region`, `state`, `step`, `loss`, `tokens_per_s`,
  `bytes_sent`, `bytes_received`, `staleness` (versions behind, of its last contribution)
- aggregator: `versions` ({fragment: version}), `merges`, `accepted`, `rejected` ({reason: n})
- monitor: `counts` ({state: n})
- evaluator: `eval_loss`, `merges` (the merges of every fragment the evaluated model holds; `version` in
  older records)

`loss` and `eval_loss` may be NaN or infinite (a diverged run is worth seeing); every other
number must be finite and non-negative. Strings must be printable: a metrics publisher must
never be able to send terminal escape sequences to the operator's screen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from monitor.metrics_table import fmt_age, render_table

__all__ = [
    "ROLES",
    "AggregatorRow",
    "EvaluatorRow",
    "LearnerRow",
    "MetricsSnapshot",
    "MonitorRow",
    "filter_msg",
    "fmt_age",
    "fold",
    "fold_all",
    "render_table",
]

ROLES: tuple[str, ...] = ("learner", "aggregator", "monitor", "evaluator")

_MAX_TS = 1e11  # year ~5100: anything beyond is a unit mistake (ms or ns instead of s)
_MAX_COUNT = 2**63
_MAX_ID_LEN = 128
_MAX_STATE_LEN = 32
_MAX_MAP_ENTRIES = 4096


@dataclass(frozen=True)
class LearnerRow:
    """Latest known metrics of one learner; None where never reported."""

    learner: str
    region: str = ""
    state: str | None = None
    step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    bytes_sent: int | None = None
    bytes_received: int | None = None
    staleness: float | None = None
    ts: float = 0.0


@dataclass(frozen=True)
class AggregatorRow:
    """Latest aggregator metrics. `versions` and `rejected` are sorted (key, value) pairs."""

    versions: tuple[tuple[int, int], ...] = ()
    merges: int | None = None
    accepted: int | None = None
    rejected: tuple[tuple[str, int], ...] = ()
    ts: float = 0.0


@dataclass(frozen=True)
class MonitorRow:
    """Latest membership counts from the monitor, as sorted (state, n) pairs."""

    counts: tuple[tuple[str, int], ...] = ()
    ts: float = 0.0


@dataclass(frozen=True)
class EvaluatorRow:
    """Latest held-out evaluation."""

    eval_loss: float | None = None
    version: int | None = None
    ts: float = 0.0


@dataclass(frozen=True)
class MetricsSnapshot:
    """Everything the live table shows. Immutable by convention: `fold` returns a new one.

    - `run`: when set, messages of other runs are skipped (counted in `skipped["other_run"]`).
    - `malformed`: reason -> count of messages dropped as malformed or absurd.
    - `skipped`: reason -> count of well-formed messages not applied ("other_run"; "stale",
      older than what we already show for that sender, e.g. replayed from a stream;
      "too_many_learners", beyond `max_learners`, which bounds the viewer's memory).
    - `last_ts`: newest `ts` applied; the default reference for the AGE column.
    """

    run: str | None = None
    learners: Mapping[str, LearnerRow] = field(default_factory=dict)
    #: per aggregator process (the shard workers of one `diloco aggregator` each have an id)
    aggregators: Mapping[str, AggregatorRow] = field(default_factory=dict)
    monitor: MonitorRow | None = None
    evaluator: EvaluatorRow | None = None
    applied: int = 0
    malformed: Mapping[str, int] = field(default_factory=dict)
    skipped: Mapping[str, int] = field(default_factory=dict)
    last_ts: float | None = None
    max_learners: int = 1024

    @property
    def aggregator(self) -> AggregatorRow | None:
        """The aggregator: its processes' rows combined (each owns some fragments: versions joined,
        counts summed), so a counter never goes back when another shard worker reports."""
        rows = list(self.aggregators.values())
        if len(rows) <= 1:
            return rows[0] if rows else None
        rejected: dict[str, int] = {}
        for r in rows:
            for k, n in r.rejected:
                rejected[k] = rejected.get(k, 0) + n

        def total(name: str) -> int | None:
            vals = [getattr(r, name) for r in rows if getattr(r, name) is not None]
            return sum(vals) if vals else None

        return AggregatorRow(versions=tuple(sorted(v for r in rows for v in r.versions)), merges=total("merges"),
                             accepted=total("accepted"), rejected=tuple(sorted(rejected.items())),
                             ts=max(r.ts for r in rows))

    @property
    def malformed_total(self) -> int:
        return sum(self.malformed.values())

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())


# --------------------------------------------------------------------------- validation


class _Bad(Exception):
    """Internal: message rejected with a reason code."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _text(msg: Mapping[str, Any], name: str, max_len: int, required: bool = False) -> str | None:
    value = msg.get(name)
    if value is None:
        if required:
            raise _Bad(f"missing_{name}")
        return None
    if not isinstance(value, str) or not 0 < len(value) <= max_len or not value.isprintable():
        raise _Bad(f"bad_{name}")
    return value


def _count(msg: Mapping[str, Any], name: str) -> int | None:
    value = msg.get(name)
    if value is None:
        return None
    return _as_count(value, f"bad_{name}")


def _as_count(value: object, reason: str) -> int:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _MAX_COUNT:
        raise _Bad(reason)
    return value


def _nonneg(msg: Mapping[str, Any], name: str) -> float | None:
    value = msg.get(name)
    if value is None:
        return None
    if not _is_real(value) or not math.isfinite(value) or value < 0 or value >= _MAX_COUNT:
        raise _Bad(f"bad_{name}")
    return float(value)


def _loss(msg: Mapping[str, Any], name: str) -> float | None:
    value = msg.get(name)
    if value is None:
        return None
    if not _is_real(value):
        raise _Bad(f"bad_{name}")
    return float(value)


def _str_count_map(msg: Mapping[str, Any], name: str) -> tuple[tuple[str, int], ...] | None:
    value = msg.get(name)
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) > _MAX_MAP_ENTRIES:
        raise _Bad(f"bad_{name}")
    out = []
    for key, n in value.items():
        if not isinstance(key, str) or not 0 < len(key) <= _MAX_STATE_LEN * 2 or not key.isprintable():
            raise _Bad(f"bad_{name}")
        out.append((key, _as_count(n, f"bad_{name}")))
    return tuple(sorted(out))


def _versions(msg: Mapping[str, Any]) -> tuple[tuple[int, int], ...] | None:
    value = msg.get("versions")
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) > _MAX_MAP_ENTRIES:
        raise _Bad("bad_versions")
    out: dict[int, int] = {}
    for key, ver in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 9:
            frag = int(key)
        elif isinstance(key, int) and not isinstance(key, bool) and key >= 0:
            frag = key
        else:
            raise _Bad("bad_versions")
        if frag in out:
            raise _Bad("bad_versions")
        out[frag] = _as_count(ver, "bad_versions")
    return tuple(sorted(out.items()))


def _header(msg: object) -> tuple[str, str, float]:
    if not isinstance(msg, Mapping):
        raise _Bad("not_an_object")
    role = msg.get("role")
    if role is None:
        raise _Bad("missing_role")
    if role not in ROLES:
        raise _Bad("bad_role")
    run = _text(msg, "run", _MAX_ID_LEN, required=True)
    ts = msg.get("ts")
    if ts is None:
        raise _Bad("missing_ts")
    if not _is_real(ts) or not math.isfinite(ts) or not 0 <= ts < _MAX_TS:
        raise _Bad("bad_ts")
    assert run is not None
    return role, run, float(ts)


def _bump(counter: Mapping[str, int], reason: str) -> dict[str, int]:
    out = dict(counter)
    out[reason] = out.get(reason, 0) + 1
    return out


# --------------------------------------------------------------------------- fold
# Each role folder returns the updated snapshot, or a skip reason (str) for a well-formed
# message that must not be applied; it raises _Bad for a malformed one.


def _fold_learner(snap: MetricsSnapshot, msg: Mapping[str, Any], ts: float) -> MetricsSnapshot | str:
    learner = _text(msg, "learner", _MAX_ID_LEN, required=True)
    assert learner is not None
    update: dict[str, Any] = {
        "region": _text(msg, "region", _MAX_ID_LEN),
        "state": _text(msg, "state", _MAX_STATE_LEN),
        "step": _count(msg, "step"),
        "loss": _loss(msg, "loss"),
        "tokens_per_s": _nonneg(msg, "tokens_per_s"),
        "bytes_sent": _count(msg, "bytes_sent"),
        "bytes_received": _count(msg, "bytes_received"),
        "staleness": _nonneg(msg, "staleness"),
    }
    old = snap.learners.get(learner)
    if old is None:
        if len(snap.learners) >= snap.max_learners:
            return "too_many_learners"
        old = LearnerRow(learner=learner)
    elif ts < old.ts:
        return "stale"
    row = replace(old, ts=ts, **{k: v for k, v in update.items() if v is not None})
    learners = dict(snap.learners)
    learners[learner] = row
    return replace(snap, learners=learners)


def _fold_aggregator(snap: MetricsSnapshot, msg: Mapping[str, Any], ts: float) -> MetricsSnapshot | str:
    update: dict[str, Any] = {
        "versions": _versions(msg),
        "merges": _count(msg, "merges"),
        "accepted": _count(msg, "accepted"),
        "rejected": _str_count_map(msg, "rejected"),
    }
    ident = str(msg.get("id", ""))
    have = snap.aggregators.get(ident)
    if have is not None and ts < have.ts:
        return "stale"
    row = replace(have or AggregatorRow(), ts=ts, **{k: v for k, v in update.items() if v is not None})
    return replace(snap, aggregators={**snap.aggregators, ident: row})


def _fold_monitor(snap: MetricsSnapshot, msg: Mapping[str, Any], ts: float) -> MetricsSnapshot | str:
    counts = _str_count_map(msg, "counts")
    old = snap.monitor or MonitorRow()
    if snap.monitor is not None and ts < old.ts:
        return "stale"
    row = replace(old, ts=ts, counts=old.counts if counts is None else counts)
    return replace(snap, monitor=row)


def _fold_evaluator(snap: MetricsSnapshot, msg: Mapping[str, Any], ts: float) -> MetricsSnapshot | str:
    # merges held by the evaluated model ("version" is its old name)
    update: dict[str, Any] = {"eval_loss": _loss(msg, "eval_loss"),
                              "version": _count(msg, "merges" if "merges" in msg else "version")}
    old = snap.evaluator or EvaluatorRow()
    if snap.evaluator is not None and ts < old.ts:
        return "stale"
    row = replace(old, ts=ts, **{k: v for k, v in update.items() if v is not None})
    return replace(snap, evaluator=row)


_FOLDERS = {
    "learner": _fold_learner,
    "aggregator": _fold_aggregator,
    "monitor": _fold_monitor,
    "evaluator": _fold_evaluator,
}


def fold(snapshot: MetricsSnapshot, msg: object) -> MetricsSnapshot:
    """Apply one decoded metrics message; never raises. Malformed input is counted, not applied.

    A message is applied atomically: one bad field drops the whole message (reason
    "bad_<field>"), so a row never mixes a sane and an absurd update. Messages older than
    the row they would update are skipped as "stale" (replays, reordering across subjects).
    """
    try:
        role, run, ts = _header(msg)
        assert isinstance(msg, Mapping)
        if snapshot.run is not None and run != snapshot.run:
            return replace(snapshot, skipped=_bump(snapshot.skipped, "other_run"))
        new = _FOLDERS[role](snapshot, msg, ts)
    except _Bad as bad:
        return replace(snapshot, malformed=_bump(snapshot.malformed, bad.reason))
    except Exception:  # noqa: BLE001 - the viewer must survive any input
        return replace(snapshot, malformed=_bump(snapshot.malformed, "unreadable"))
    if isinstance(new, str):  # well-formed but not applied: the skip reason
        return replace(snapshot, skipped=_bump(snapshot.skipped, new))
    last_ts = ts if snapshot.last_ts is None else max(snapshot.last_ts, ts)
    return replace(new, applied=new.applied + 1, last_ts=last_ts)


def fold_all(snapshot: MetricsSnapshot, msgs: Iterable[object]) -> MetricsSnapshot:
    """`fold` every message in order."""
    for msg in msgs:
        snapshot = fold(snapshot, msg)
    return snapshot


def filter_msg(
    msg: object,
    role: str | None = None,
    learner: str | None = None,
    region: str | None = None,
) -> bool:
    """True if `msg` passes the CLI filters (`--role/--learner/--region`); never raises.

    Filters combine with AND; a filter on a field the message lacks rejects it, so
    `--learner l3` shows only l3's rows (no aggregator or monitor lines). None = no filter.
    """
    if not isinstance(msg, Mapping):
        return False
    for name, wanted in (("role", role), ("learner", learner), ("region", region)):
        if wanted is not None and msg.get(name) != wanted:
            return False
    return True
