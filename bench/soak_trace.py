"""The soak's fault trace (``bench.soak``): a pure, seeded function of its arguments, no I/O.

``fault_trace(seed, duration, kills, learners)`` is every fault of one soak run, sorted by time:

* ``kill``: kill -9 of one target (a learner ``l<i>``, ``aggregator``, ``monitor``, ``evaluator``
  or the nats-server, ``server``), restarted ``repair`` seconds later;
* ``cut``: one learner's link cut (its proxy closes every connection and refuses new ones),
  healed ``repair`` seconds later.

Counts: every kind of target gets at least ``min_per_kind`` kills (default a tenth of the kills,
at least 1), the rest are drawn over the kinds with ``KIND_WEIGHTS``; the learners share their
kind's kills as evenly as they go (the remainder to learners drawn at random). Partitions:
``partitions`` cuts (default a fifth of the kills, at least 1), shared over the learners the same way.

Instants: each target fails on its own (as independent processes do), so its kills are a renewal
process: its up-times are exponential gaps, scaled so that its ``n`` kills, their repairs and a
minimum up-time ``MIN_UP`` after each restart fit ``[0, duration)``. The same for each learner's
cuts. A target is never killed while it is down, nor a link cut twice at once; faults of
*different* targets overlap freely (a learner killed while the server is down, a cut link whose
learner is killed): that is the realistic case. Every instant, restart and heal lies in
``[0, duration)``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

KINDS = ("learner", "aggregator", "monitor", "evaluator", "server")
#: relative weights of the kills beyond each kind's minimum (a learner weight covers all learners)
KIND_WEIGHTS = {"learner": 3.0, "aggregator": 2.0, "server": 2.0, "monitor": 1.0, "evaluator": 1.0}
#: seconds from a kill -9 to the restart (the repair time), uniform
REPAIR = (0.5, 3.0)
#: seconds a link stays cut, uniform: mostly past the eviction timeout of the chaos settings (1 s)
CUT = (1.5, 8.0)
#: seconds a target stays up at least between its restart and its next kill (and a link healed)
MIN_UP = 1.0


@dataclass(frozen=True)
class Fault:
    at: float  # seconds from the start of the fault window
    action: str  # "kill" | "cut"
    target: str  # l<i> | aggregator | monitor | evaluator | server
    repair: float  # seconds until the restart (kill) or the heal (cut)

    @property
    def kind(self) -> str:
        return kind_of(self.target)

    @property
    def end(self) -> float:
        """When the target is started again (kill) or the link healed (cut)."""
        return self.at + self.repair


def kind_of(target: str) -> str:
    return "learner" if target not in KINDS else target


def learner_names(n: int) -> list[str]:
    return [f"l{i}" for i in range(n)]


def _renewal(rng: random.Random, n: int, repairs: list[float], window: float) -> list[float]:
    """Instants of ``n`` failures with these repair times in ``[0, window)``: exponential up-times,
    scaled to the time left after the repairs and ``MIN_UP`` after each restart."""
    free = window - sum(repairs) - n * MIN_UP
    if free <= 0:
        raise ValueError(f"{n} faults of one target with {sum(repairs):.1f} s of repairs do not fit {window:.1f} s")
    gaps = [rng.expovariate(1.0) for _ in range(n + 1)]
    scale = free / sum(gaps)
    out, t = [], 0.0
    for i in range(n):
        t += gaps[i] * scale + (MIN_UP if i else 0.0)
        out.append(t)
        t += repairs[i]
    return out


def _spread(rng: random.Random, n: int, learners: int) -> dict[str, int]:
    """``n`` faults over the learners as evenly as they go (the remainder to learners drawn at random)."""
    names = learner_names(learners)
    out = dict.fromkeys(names, n // learners)
    for name in rng.sample(names, n % learners):
        out[name] += 1
    return {k: v for k, v in out.items() if v}


def kind_counts(rng: random.Random, kills: int, min_per_kind: int) -> dict[str, int]:
    counts = dict.fromkeys(KINDS, min_per_kind)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    for k in rng.choices(kinds, weights, k=kills - min_per_kind * len(KINDS)):
        counts[k] += 1
    return counts


def fault_trace(seed: int, duration: float, kills: int, learners: int, partitions: int | None = None,
                min_per_kind: int | None = None) -> list[Fault]:
    """Every fault of a soak run of ``duration`` seconds, sorted by instant (the module docstring)."""
    if learners < 1:
        raise ValueError("at least one learner")
    min_per_kind = max(1, kills // 10) if min_per_kind is None else min_per_kind
    partitions = max(1, round(kills / 5)) if partitions is None else partitions
    if min_per_kind < 1 or kills < min_per_kind * len(KINDS):
        raise ValueError(f"{kills} kills cannot give each of the {len(KINDS)} kinds {min_per_kind} (every kind appears)")
    if partitions < 0:
        raise ValueError("partitions >= 0")
    rng = random.Random(seed)
    counts = kind_counts(rng, kills, min_per_kind)
    per_target: dict[str, int] = {}
    for k, c in counts.items():
        if k == "learner":
            per_target.update(_spread(rng, c, learners))
        else:
            per_target[k] = c
    faults = []
    for target in sorted(per_target):
        n = per_target[target]
        repairs = [rng.uniform(*REPAIR) for _ in range(n)]
        faults += [Fault(t, "kill", target, r) for t, r in zip(_renewal(rng, n, repairs, duration), repairs)]
    cuts = _spread(rng, partitions, learners)
    for name in sorted(cuts):
        n = cuts[name]
        lengths = [rng.uniform(*CUT) for _ in range(n)]
        faults += [Fault(t, "cut", name, r) for t, r in zip(_renewal(rng, n, lengths, duration), lengths)]
    return sorted(faults, key=lambda f: (f.at, f.action, f.target))


def actions(trace: list[Fault]) -> list[tuple[float, str, str]]:
    """The trace as timed actions, sorted: (instant, kill | start | cut | heal, target)."""
    out = []
    for f in trace:
        out.append((f.at, f.action, f.target))
        out.append((f.end, "start" if f.action == "kill" else "heal", f.target))
    return sorted(out, key=lambda a: a[0])


def summary(trace: list[Fault]) -> dict:
    """Counts per kind of target and per action (for the report)."""
    kills: dict[str, int] = {}
    for f in trace:
        if f.action == "kill":
            kills[f.kind] = kills.get(f.kind, 0) + 1
    return {"kills": sum(kills.values()), "kills_by_kind": {k: kills.get(k, 0) for k in KINDS},
            "partitions": sum(1 for f in trace if f.action == "cut")}
