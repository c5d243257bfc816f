"""The pure part of ``bench.peers``: a peer's events into the goodput benchmark's records, the
crediting, the recovery timings and the byte accounting (no I/O, no torch).

Both systems are credited by one rule, ``bench.goodput``'s: every contribution that reached the
model inside the measured window earns ``steps x step_s / P`` seconds (a step advances every
fragment; a fragment's share counts once that fragment's outer gradient is in a global version),
and goodput is the credited seconds over ``M x window``. For us a contribution is an applied key
of a merge event; for torchft it is a fragment sync that committed with this replica's
pseudo-gradient in the allreduce (``commit`` and ``part`` in the replica's ``sync`` event). The
first sync of a replica that healed is not credited: the heal copied a peer's parameters and backup,
so what it sends is the peer's pseudo-gradient, and the steps it took before the heal were
overwritten (the replica counts its steps afresh from the heal).

Records shared with ``bench/goodput_timings.py``: a merge is ``(ts, fragment, keys)`` with keys
``(learner, incarnation, fragment, round)``; a torchft incarnation is the replica's process id
and its round the manager step of the sync.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from bench.goodput_timings import round_overhead_samples, summary

Key = tuple[str, str, int, int]
Merge = tuple[float, int, list[Key]]


def parse_events(lines: Iterable[str]) -> list[dict]:
    """JSON lines of ``bench/peer_torchft.py`` (a line cut short by a kill -9 is skipped)."""
    out = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and "e" in d and "t" in d:
            out.append(d)
    return out


def replica_name(i: int | str) -> str:
    return f"replica-{i}"


def torchft_merges(events: Sequence[dict]) -> tuple[list[Merge], dict[Key, int]]:
    """The committed syncs as merges (one per fragment and manager step, at its first commit's
    time) and the inner steps of every credited key."""
    groups: dict[tuple[int, int], tuple[float, list[Key]]] = {}
    steps: dict[Key, int] = {}
    for d in events:
        if d.get("e") != "sync" or not d.get("commit") or not d.get("part") or d.get("heal"):
            continue
        frag, mstep = int(d["frag"]), int(d["mstep"])
        key: Key = (replica_name(d["replica"]), str(d["pid"]), frag, mstep)
        steps[key] = int(d["steps"])
        ts, keys = groups.get((frag, mstep), (float(d["t"]), []))
        keys.append(key)
        groups[(frag, mstep)] = (min(ts, float(d["t"])), keys)
    merges = sorted(((ts, frag, keys) for (frag, _m), (ts, keys) in groups.items()), key=lambda m: m[0])
    return merges, steps


def credit(merges: Sequence[Merge], steps: Mapping[Key, int], t0: float, t1: float, step_s: float,
           P: int) -> tuple[float, int, int]:
    """(credited seconds, credited contributions, applied keys without a step count) of the
    merges at times in [t0, t1]."""
    credited, n, unknown = 0.0, 0, 0
    for ts, _frag, keys in merges:
        if not t0 <= ts <= t1:
            continue
        for k in keys:
            s = steps.get(tuple(k))  # type: ignore[call-overload]
            if s is None:
                unknown += 1
                continue
            n += 1
            credited += s * step_s / P
    return credited, n, unknown


def goodput(credited_s: float, M: int, window_s: float) -> float:
    return credited_s / (M * window_s) if window_s > 0 else 0.0


def resume_samples(kills: Iterable[tuple[float, str, str | None]], merges: Sequence[Merge]) -> list[float]:
    """Per kill (time, learner, its incarnation): the first merge after it with a contribution of
    someone else, minus the kill: when the survivors' work reached the model again."""
    out = []
    for t, learner, _inc in kills:
        for ts, _frag, keys in merges:
            if ts > t and any(k[0] != learner for k in keys):
                out.append(ts - t)
                break
    return out


def first_shared_samples(starts: Iterable[tuple[float, str]], merges: Sequence[Merge],
                         kills: Iterable[tuple[float, str, str | None]] = ()) -> list[float]:
    """Per restart (time, learner): the first merge after it with a contribution of an incarnation
    of that learner not seen before the restart (neither killed nor merged), minus the restart."""
    kills = list(kills)
    out = []
    for t, learner in starts:
        old = {inc for kt, name, inc in kills if name == learner and kt <= t and inc is not None}
        old |= {k[1] for ts, _f, keys in merges if ts <= t for k in keys if k[0] == learner}
        for ts, _frag, keys in merges:
            if ts > t and any(k[0] == learner and k[1] not in old for k in keys):
                out.append(ts - t)
                break
    return out


def loopback_link_bytes(lo_tx_bytes: int) -> int:
    """Bytes through the replicas' links, in + out, from a private namespace's loopback counter:
    every byte one process sends on ``lo`` another receives, and ``tx`` counts it once."""
    return 2 * int(lo_tx_bytes)


def per_outer_step(link_bytes: int, contributions: int, P: int) -> float | None:
    """Bytes of one replica's link per outer step (one sync of every fragment): the replicas' link
    bytes in all over the outer steps they delivered in all (``contributions`` fragment syncs / P)."""
    outer = contributions / P
    return link_bytes / outer if outer > 0 else None


def recovery_timings(kills: Sequence[tuple[float, str, str | None]], starts: Sequence[tuple[float, str]],
                     merges: Sequence[Merge], *, M: int, round_s: float, lockstep: bool) -> dict:
    """The recovery timings of one system's run, as bench/goodput_timings.py summarises samples:
    ``resume_s`` and ``first_shared_s`` (above) and, for a lock-step system, the failure-free round
    overhead (its ``round_overhead_samples``; a decoupled learner never waits for a round)."""
    fails = [t for t, *_ in kills] + [t for t, _ in starts]
    return {"resume_s": summary(resume_samples(kills, merges)),
            "first_shared_s": summary(first_shared_samples(starts, merges, kills)),
            "round_overhead_s": summary(round_overhead_samples(merges, M, round_s, fails) if lockstep else [])}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b not in (None, 0) else None
