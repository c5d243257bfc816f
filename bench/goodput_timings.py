"""The system timings of one ``bench.goodput`` mode, from what its tap recorded (pure, no I/O).

The goodput simulator (``simulation/goodput_model.py``, :func:`simulate_trace`) models the failure
accounting of the benchmark; the speed of the machine under it is an input, not a prediction.
These are the timings it needs, measured per mode in the same run (wall-clock seconds, every
process on one host):

* ``startup_s``: a restarted learner's process start -> its first heartbeat (new incarnation).
* ``first_step_s``: a restart -> its first inner step begins: the first heartbeat whose step
  differs from the incarnation's first, minus half a heartbeat interval (the step ended, on
  average, that long before it was reported) and one step time. The simulator's new
  incarnation steps from then.
* ``admit_s``: a restart -> the monitor's transition of that learner to ``active``: from then
  on the quorum of a lock-step round waits for it.
* ``suspect_s``: a kill -> the monitor's transition of that learner out of ``active`` (suspect or
  evicted), as the membership event's ``at`` says. Tells the monitor's part of detection.
* ``release_s``: lock-step modes: a kill -> the first merge after it that leaves the killed
  incarnation out, over the kills whose survivors were already waiting (every key of that merge
  had arrived before the monitor took the dead learner out of ``active``): the time the survivors
  wait for the dead learner to leave the quorum (monitor, members bucket, the aggregator's watch
  and its next look).
* ``round_overhead_s``: lock-step modes: the period of consecutive full merges of a fragment (all
  M learners in both, no kill or restart from 1 s before the first) minus the round's steps:
  publish, merge, publish the version, apply it. Every round pays it, so the simulator takes its
  mean: before the lock-step fix (aggregator/rounds.py) a run could have a tail of rounds a step
  longer (0.23 s against 0.05 s), or all of them after a phase split; since, mean and median agree.

Each figure is given as the median and the mean of its samples, with the sample count (``n``); a
mode with no sample for a figure gives None (the simulator then keeps its default). The simulator
takes the median of the per-event timings (a sample there can catch a second event) and the mean
of the round overhead.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence

Key = tuple[str, str, int, int]  # (learner, incarnation, fragment, round)


def _median(xs: Sequence[float]) -> float | None:
    return round(float(statistics.median(xs)), 4) if xs else None


def summary(xs: Sequence[float]) -> dict:
    """{"median", "mean", "n"} of the samples, rounded to 0.1 ms (None when there is none)."""
    return {"median": _median(xs), "mean": round(float(statistics.fmean(xs)), 4) if xs else None, "n": len(xs)}


def startup_samples(starts: Iterable[tuple[float, str]],
                    first_hb: Mapping[tuple[str, str], float]) -> list[float]:
    """Per restart (time, learner): the first heartbeat of an incarnation of that learner first
    heard after the start, minus the start."""
    out = []
    for t, learner in starts:
        later = [hb for (name, _inc), hb in first_hb.items() if name == learner and hb > t]
        if later:
            out.append(min(later) - t)
    return out


def admit_samples(starts: Iterable[tuple[float, str]],
                  transitions: Iterable[tuple[float, str, str | None, str]]) -> list[float]:
    """Per restart (time, learner): the first transition of that learner to ``active`` after the
    start, minus the start."""
    trans = sorted(transitions, key=lambda x: x[0])
    out = []
    for t, learner in starts:
        hit = next((at for at, name, _old, new in trans if name == learner and at > t and new == "active"), None)
        if hit is not None:
            out.append(hit - t)
    return out


def suspect_samples(kills: Iterable[tuple[float, str]],
                    transitions: Iterable[tuple[float, str, str | None, str]]) -> list[float]:
    """Per kill: the first transition of that learner from ``active`` to suspect or evicted at
    or after the kill, minus the kill. Transitions are (at, learner, old, new)."""
    trans = sorted(transitions, key=lambda x: x[0])
    out = []
    for t, learner in kills:
        hit = next((at for at, name, old, new in trans
                    if name == learner and at >= t and old == "active" and new in ("suspect", "evicted")), None)
        if hit is not None:
            out.append(hit - t)
    return out


def release_samples(kills: Iterable[tuple[float, str, str | None]], merges: Sequence[tuple[float, int, list]],
                    arrivals: Mapping[Key, float],
                    transitions: Iterable[tuple[float, str, str | None, str]]) -> list[float]:
    """Per kill (time, learner, killed incarnation or None if unknown): the first merge after the
    kill without a key of the killed incarnation, minus the kill, when every key of that merge had
    arrived before the monitor took the killed learner out of ``active`` (its first transition to
    suspect or evicted after the kill): the merge then waited on the dead learner only. Merges are
    (ts, fragment, applied keys) in time order; transitions (at, learner, old, new).

    (A fixed idle threshold instead, every key 0.3 s before the merge, dropped kills whose
    survivors had arrived 0.2 s after the kill and waited 0.2 s more for the suspect at 0.4 s:
    both kills of test_goodput_bench's run, about 1 run in 10.)"""
    trans = sorted(transitions, key=lambda x: x[0])
    out = []
    for t, learner, inc in kills:
        if inc is None:
            continue
        left = next((at for at, name, old, new in trans
                     if name == learner and at >= t and old == "active" and new in ("suspect", "evicted")), None)
        if left is None:
            continue
        for ts, _frag, applied in merges:
            if ts <= t or not applied:
                continue
            keys = [tuple(k) for k in applied]
            if any(k[0] == learner and k[1] == inc for k in keys):
                continue
            times = [arrivals.get(k) for k in keys]  # type: ignore[call-overload]
            if all(a is not None for a in times) and max(times) <= left:  # type: ignore[type-var]
                out.append(ts - t)
            break
    return out


def round_overhead_samples(merges: Sequence[tuple[float, int, list]], M: int, round_s: float,
                           failures: Sequence[float] = (), margin: float = 1.0) -> list[float]:
    """Consecutive merges of one fragment that both applied M contributions, with no kill or
    restart (``failures``: their times) from ``margin`` before the first to the second: their
    period minus ``round_s`` (the round's steps). Failure-free rounds only: what failures cost
    is the simulator's to add."""
    last: dict[int, float] = {}
    out = []
    for ts, frag, applied in merges:
        if len(applied) != M:
            last.pop(frag, None)
            continue
        if frag in last and not any(last[frag] - margin <= f <= ts for f in failures):
            out.append(ts - last[frag] - round_s)
        last[frag] = ts
    return out


def mode_timings(*, M: int, round_s: float, lockstep: bool, starts, kills, first_hb, transitions,
                 merges, arrivals, first_step=None, step_s: float = 0.0, heartbeat_s: float = 0.0) -> dict:
    """The timings of one mode (see the module's docstring), each {"median": s, "mean": s, "n": count}.
    ``first_step``: (learner, incarnation) -> wall time of its first heartbeat with a new step."""
    shift = heartbeat_s / 2 + step_s
    samples = {
        "startup_s": startup_samples(starts, first_hb),
        "first_step_s": [x - shift for x in startup_samples(starts, first_step or {})],
        "admit_s": admit_samples(starts, transitions),
        "suspect_s": suspect_samples([(t, n) for t, n, _ in kills], transitions),
        "release_s": release_samples(kills, merges, arrivals, transitions) if lockstep else [],
        "round_overhead_s": round_overhead_samples(
            merges, M, round_s, [t for t, *_ in kills] + [t for t, _ in starts]) if lockstep else [],
    }
    return {k: summary(v) for k, v in samples.items()}
