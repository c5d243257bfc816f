"""Pure goodput model: failure streams, the four modes, goodput accounting (no I/O, numpy only).

Two engines share the accounting "goodput = seconds of work that reach the model / allocated
seconds" (DESIGN.md section 5):

* :func:`simulate_scale`: the paper's setting (Table 1): N chips in M islands of N/M chips. Chip
  failures are one Poisson process of rate N / MTBI (the superposition of N chips each failing
  at 1/MTBI; no chip is simulated), each failure hitting a uniformly random island. Each mode is
  an event loop over that stream (rules and constants: :class:`ScaleModel`).
* :func:`simulate_trace`: the measured benchmark ``bench.goodput``: M learner processes, an
  explicit kill/start trace, H-step rounds of P fragments, the monitor's detection delay and the
  process start-up (:class:`BenchSystem`); a time-stepped loop (``dt``) with exact event times.

Failures that land on a unit that is already down are absorbed by the stall in progress (the
restart in progress handles the new fault too). Deterministic per seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

YEAR_S = 365.25 * 86400.0
CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
#: The paper's Table 1 as DESIGN.md section 1 transcribes it (goodput %, 1 year MTBI per chip):
#: the target the model is checked against, never an output.
PUBLISHED = {"dp": (72, 57, 38, 27, 18), 4: (96, 93, 89, 82, 73), 8: (98, 96, 94, 88, 80),
             16: (99, 98, 96, 93, 86)}
SCALE_MODES = ("dp", "dp_elastic", "sync", "decoupled")
TRACE_MODES = ("decoupled", "sync", "dp", "dp_static")


@dataclass(frozen=True)
class ScaleModel:
    """Constants of the paper-scale model. Published: ``mtbi_s``, ``H``, ``P``. Fitted once to
    Table 1 (:func:`calibrate`): ``dp_restart_s``, ``dp_overhead``, ``island_restart_s``,
    ``rejoin_per_learner_s``. Chosen (not published): the rest."""

    mtbi_s: float = YEAR_S  # per chip (paper)
    step_s: float = 1.0  # an inner step, and a data-parallel step (chosen)
    H: int = 24  # inner steps per fragment sync (paper default, DESIGN.md section 3)
    P: int = 24  # fragments, staggered (paper default)
    dp_restart_s: float = 62.0  # whole-job restart: reschedule, reload, rebuild collectives (fitted)
    dp_overhead: float = 0.1025  # failure-free share of a lock-step job's time lost to its syncs (fitted)
    dp_ckpt_s: float = 1.0  # dp restarts from a checkpoint at most this old (chosen: every step)
    island_restart_s: float = 2.5  # one island's restart, no checkpoint reload (fitted)
    rejoin_per_learner_s: float = 1.2  # rejoin: global params at a 1/M share of the syncer (fitted)
    elastic_reconfig_s: float = 10.0  # dp_elastic: drop the failed replica, re-form collectives (chosen)
    replica_chips: int = 256  # dp_elastic: chips lost with one failed chip until repaired (chosen)
    repair_s: float = 3600.0  # dp_elastic: a failed replica's repair or replacement (chosen)
    quorum: int = 1  # decoupled: K (merges need K live islands; learners never wait for them)

    def island_down_s(self, M: int) -> float:
        return self.island_restart_s + M * self.rejoin_per_learner_s


def failure_stream(rng: np.random.Generator, rate: float, duration: float, M: int):
    """Sorted failure times of a Poisson process (``rate`` per second) in [0, duration), and the
    island each one hits (uniform over M)."""
    n = int(rng.poisson(rate * duration))
    times = np.sort(rng.uniform(0.0, duration, n))
    return times, rng.integers(0, M, n)


def _absorb(times, stall: float):
    """Failures of one unit that is down ``stall`` s after each effective failure (later ones
    inside the stall are absorbed). Returns (up-period starts, effective failure times)."""
    starts, fails = [], []
    a = 0.0
    for t in times.tolist():
        if t >= a:
            starts.append(a)
            fails.append(t)
            a = t + stall
    return np.array(starts), np.array(fails), a


def _lost_unsent(up: np.ndarray, step: float, H: int, P: int) -> np.ndarray:
    """Work lost by a learner killed ``up`` seconds after it (re)started: the partial step, and per
    staggered fragment the steps since that fragment's last sync (first due at offset_p, or H)."""
    n = np.floor(up / step)
    first = np.array([(p * H // P) or H for p in range(P)], dtype=float)
    unsent = np.where(n[:, None] < first, n[:, None], np.mod(n[:, None] - first, H))
    return (up - n * step) + unsent.sum(axis=1) * step / P


def _renewal(times, stall: float, quantum: float, duration: float) -> tuple[float, int]:
    """Useful seconds of one lock-step unit that loses the work since its last checkpoint
    (``quantum``) on each failure and is down ``stall`` s; and its number of effective failures."""
    starts, fails, a = _absorb(times, stall)
    up = fails - starts
    useful = float(np.sum(up - np.mod(up, quantum))) + max(0.0, duration - a)
    return useful, len(fails)


def _sync_rounds(times, islands, h: float, barrier: float, down: float, duration: float) -> tuple[int, int]:
    """Synchronous DiLoCo: rounds of h s of work + ``barrier`` s. A failed island is down ``down`` s
    and redoes its round; everyone waits for it at the barrier (no eviction). Returns completed
    rounds and stalls."""
    L = h + barrier
    a, rounds, stalls, i, n = 0.0, 0, 0, 0, len(times)
    t_list, isl = times.tolist(), islands.tolist()
    while i < n and t_list[i] < duration:
        t, j = t_list[i], isl[i]
        k = math.floor((t - a) / L)
        rounds += k
        done_at = a + k * L + h  # when the survivors reach the barrier
        back = {j: t + down}  # island -> end of its restart
        ready = {j: t + down + (h if t < done_at else 0.0)}  # -> its round's work is in (redone)
        end = ready[j]
        i += 1
        stalls += 1
        while i < n and t_list[i] < end:
            t2, j2 = t_list[i], isl[i]
            if j2 in back and t2 < back[j2]:
                pass  # absorbed by its restart in progress
            elif (j2 in ready and t2 < ready[j2]) or (j2 not in ready and t2 < done_at):
                back[j2], ready[j2] = t2 + down, t2 + down + h  # its round is lost: redo after restart
            else:
                back[j2] = ready[j2] = t2 + down  # contributed already: back for the next round
            end = max(end, ready[j2])
            i += 1
        rounds += 1  # the interrupted round completes with everyone's work
        a = end + barrier
    rounds += max(0, math.floor((duration - a) / L))
    return rounds, stalls


def simulate_scale(mode: str, chips: int, M: int, model: ScaleModel = ScaleModel(), *,
                   failures: int = 20_000, seed: int = 0) -> dict:
    """Goodput of ``mode`` for ``chips`` chips in M islands, simulated for as long as ``failures``
    chip failures take on average (at least one day). Same seed, chips, M and failures: the same
    failure stream in every mode."""
    if mode not in SCALE_MODES:
        raise ValueError(f"mode must be one of {SCALE_MODES}, got {mode!r}")
    rate = chips / model.mtbi_s
    duration = max(86400.0, failures / rate) if rate > 0 else 86400.0
    rng = np.random.default_rng([seed, int(chips), M])  # one stream for every mode: same failures
    times, islands = failure_stream(rng, rate, duration, M)
    out = {"mode": mode, "chips": int(chips), "M": M, "simulated_s": duration, "failures": len(times)}
    f = model.dp_overhead
    if mode == "dp":
        useful, n = _renewal(times, model.dp_restart_s, model.dp_ckpt_s, duration)
        return {**out, "goodput": (1 - f) * useful / duration, "restarts": n}
    if mode == "dp_elastic":
        useful, n = _renewal(times, model.elastic_reconfig_s, model.step_s, duration)
        # chips of failed replicas wait for repair (overlaps neglected: a tiny share of the chips)
        repairing = min(1.0, len(times) * model.replica_chips * model.repair_s / (chips * duration))
        return {**out, "goodput": (1 - f) * useful / duration * (1 - repairing), "stalls": n,
                "repairing_share": repairing}
    down = model.island_down_s(M)
    if mode == "sync":
        h = model.H * model.step_s
        barrier = model.step_s * f / (1 - f)  # one lock-step sync per round instead of per step
        rounds, n = _sync_rounds(times, islands, h, barrier, down, duration)
        return {**out, "goodput": rounds * h / duration, "stalls": n}
    useful, downs, n_eff = 0.0, [], 0
    for j in range(M):
        starts, fails, a = _absorb(times[islands == j], down)
        up = fails - starts
        useful += float(np.sum(up - _lost_unsent(up, model.step_s, model.H, model.P))) + max(0.0, duration - a)
        downs.append(np.stack([fails, np.minimum(fails + down, duration)], axis=1))
        n_eff += len(fails)
    return {**out, "goodput": useful / (M * duration), "island_restarts": n_eff,
            "below_quorum_share": _below_quorum(downs, M, model.quorum, duration)}


def _below_quorum(downs: list, M: int, K: int, duration: float) -> float:
    """Share of the time fewer than K islands were up (merges wait then; learners do not)."""
    iv = np.concatenate(downs) if downs else np.zeros((0, 2))
    if len(iv) == 0:
        return 0.0
    t = np.concatenate([iv[:, 0], iv[:, 1]])
    d = np.concatenate([np.ones(len(iv)), -np.ones(len(iv))])
    o = np.lexsort((d, t))
    t, depth = t[o], np.cumsum(d[o])
    spans = np.diff(np.append(t, duration))
    return float(np.sum(spans[depth > M - K]) / duration)


def scale_table(model: ScaleModel = ScaleModel(), *, failures: int = 20_000, seed: int = 0,
                chips=CHIPS, Ms=(4, 8, 16)) -> dict:
    """Goodput for dp, dp_elastic, and sync and decoupled at each M, at each chip count."""
    # the one-unit loops are cheap: 10x the failures there (the DP column's noise is the largest)
    rows = {m: [simulate_scale(m, n, 1, model, failures=10 * failures, seed=seed)["goodput"] for n in chips]
            for m in ("dp", "dp_elastic")}
    for M in Ms:
        for m in ("sync", "decoupled"):
            rows[f"{m}_M{M}"] = [simulate_scale(m, n, M, model, failures=failures, seed=seed)["goodput"]
                                 for n in chips]
    return rows


def table_error(rows: dict) -> tuple[float, dict]:
    """Max |simulated - published| in goodput points over DP and decoupled M=4, 8, 16."""
    errs = {}
    for key, pub in PUBLISHED.items():
        sim = rows["dp" if key == "dp" else f"decoupled_M{key}"]
        errs[str(key)] = [round(100 * s - p, 2) for s, p in zip(sim, pub)]
    return max(abs(e) for v in errs.values() for e in v), errs


def dp_goodput(chips, model: ScaleModel) -> np.ndarray:
    """Closed form of the ``dp`` event loop (renewal, absorbed failures, checkpoint every C s):
    (1 - f) * C q / (1 - q) / (1/rate + R), q = exp(-rate C). Used to fit, checked by the loop."""
    lam = np.asarray(chips, dtype=float) / model.mtbi_s
    q = np.exp(-lam * model.dp_ckpt_s)
    return (1 - model.dp_overhead) * model.dp_ckpt_s * q / (1 - q) / (1 / lam + model.dp_restart_s)


def calibrate(model: ScaleModel = ScaleModel(), *, failures: int = 20_000, seed: int = 0) -> ScaleModel:
    """The one calibration of the scale model: minimax grid fits to Table 1 of dp_restart_s and
    dp_overhead (DP column, closed form) and of island_restart_s and rejoin_per_learner_s (the
    M=4, 8, 16 columns, event loop, coarse then fine grid)."""
    pub = np.array(PUBLISHED["dp"], dtype=float)
    best = min((float(np.abs(100 * dp_goodput(CHIPS, replace(model, dp_restart_s=r, dp_overhead=f)) - pub).max()), r, f)
               for r in np.arange(40.0, 90.0, 0.5) for f in np.arange(0.0, 0.2, 0.0025))
    model = replace(model, dp_restart_s=float(best[1]), dp_overhead=round(float(best[2]), 4))

    def err(r, g, n):
        m = replace(model, island_restart_s=float(r), rejoin_per_learner_s=float(g))
        return max(abs(100 * simulate_scale("decoupled", c, M, m, failures=n, seed=seed)["goodput"] - p)
                   for M in (4, 8, 16) for c, p in zip(CHIPS, PUBLISHED[M]))

    _, r0, g0 = min((err(r, g, failures // 4), r, g) for r in np.arange(0.0, 32.0, 2.0) for g in np.arange(0.0, 3.2, 0.4))
    _, r1, g1 = min((err(r, g, failures), r, g) for r in np.arange(max(0.0, r0 - 2), r0 + 2.01, 0.5)
                    for g in np.arange(max(0.0, g0 - 0.4), g0 + 0.41, 0.1))
    return replace(model, island_restart_s=round(float(r1), 2), rejoin_per_learner_s=round(float(g1), 2))


# -- the measured benchmark (bench.goodput) ---------------------------------------------------


@dataclass(frozen=True)
class BenchSystem:
    """Timings of the real system under ``bench.goodput``. A run's JSON carries its own, measured
    per mode (``timings``; bench/goodput_timings.py), and :meth:`measured` puts them in; nothing
    here is fitted to a goodput. The defaults serve runs without timings: from bench/runs.py
    (FAST_MONITOR): ``heartbeat_s``, ``suspect_s``; from bench/goodput.py (dp_static):
    ``static_suspect_s``; from the docs' full run (:data:`DOCS_FULL_RUN`, idle machine, rounded):
    ``startup_s`` (first heartbeat 0.30-0.31 s after the start), ``latency_s`` (mean failure-free
    round overhead 0.06-0.07 s) and ``quorum_lag_s`` (0: the release came 0.71 s after a kill in
    dp, under the 0.75 s that the suspect threshold and the heartbeat give)."""

    startup_s: float = 0.3  # learner process start -> first heartbeat and first step
    latency_s: float = 0.07  # last contribution of a round -> merged version applied by the learners
    quorum_lag_s: float = 0.0  # suspect -> the aggregator stops waiting (monitor tick, KV, polls, load)
    heartbeat_s: float = 0.2
    suspect_s: float = 0.6
    static_suspect_s: float = 30.0
    warmup_s: float = 5.0  # learners run this long before the window (the bench waits for steps)
    release_s: float | None = None  # measured kill -> out of the quorum (bench.goodput's release_s)
    admit_s: float | None = None  # measured start -> counted in the quorum (default: startup + a heartbeat)

    def admit_after_start(self) -> float:
        """A new incarnation's start -> the quorum counts it: measured (``admit_s``), else one
        heartbeat after its first (``rejoining`` -> ``active``: it loaded the current versions)."""
        return self.admit_s if self.admit_s is not None else self.startup_s + self.heartbeat_s

    def detect_s(self, static: bool) -> float:
        """Kill -> out of the quorum: the measured ``release_s`` where a run gives it (fast
        monitor only); else silence since the last heartbeat (mean half an interval), the suspect
        threshold, the monitor's tick (every half interval: mean a quarter), the lag."""
        if self.release_s is not None and not static:
            return self.release_s
        return (self.static_suspect_s if static else self.suspect_s) + 0.75 * self.heartbeat_s + self.quorum_lag_s

    def measured(self, timings: dict | None, mode: str) -> BenchSystem:
        """This system with the timings one ``bench.goodput`` mode measured (its ``timings``;
        bench/goodput_timings.py), medians: the first heartbeat as the start-up (heartbeats begin
        once the global parameters are loaded, and steps follow at once), the admission, and the
        release time as the detection (the monitor's suspect time where fewer than 3 kills gave
        a release sample); the mean lock-step round overhead as the merge latency. A timing with
        no sample keeps its value here."""
        t = {k: (v or {}).get("median") for k, v in (timings or {}).items()}
        out = self
        startup, admit = t.get("startup_s"), t.get("admit_s")
        if startup is not None:
            out = replace(out, startup_s=float(startup))
        if admit is not None:
            out = replace(out, admit_s=float(admit))
        overhead = ((timings or {}).get("round_overhead_s") or {}).get("mean")
        if mode != "decoupled" and overhead is not None:
            out = replace(out, latency_s=max(0.0, float(overhead)))
        if mode in ("sync", "dp"):  # release needs kills the survivors waited on: few in 2 s rounds
            n = ((timings or {}).get("release_s") or {}).get("n", 0)
            release = t.get("release_s") if n >= 3 else t.get("suspect_s")
            if release is not None:
                out = replace(out, release_s=float(release))
        return out


def _t(median: float | None, mean: float | None, n: int) -> dict:
    return {"median": median, "mean": mean, "n": n}


#: bench.goodput's full run of 2026-12-01 02:38 on an idle machine (docs/BENCHMARKS.md, "Goodput
#: under failures"): its parameters (trace = bench.goodput.failure_trace(seed, window, mtbf,
#: repair)), its measured goodput and the timings it measured (median, mean, samples).
DOCS_FULL_RUN = {
    "M": 8, "step_time": 0.2, "H": 10, "P": 2, "window_s": 100.0, "mtbf_s": 30.0, "repair_s": 3.0, "seed": 7,
    "goodput": {"decoupled": 0.8056, "sync": 0.6075, "dp": 0.5431, "dp_static": 0.28},
    "timings": {
        "decoupled": {"startup_s": _t(0.314, 0.3382, 34), "admit_s": _t(0.3143, 0.338, 34),
                      "suspect_s": _t(0.529, 0.5338, 35)},
        "sync": {"startup_s": _t(0.3009, 0.3135, 34), "admit_s": _t(0.301, 0.3135, 34),
                 "suspect_s": _t(0.5409, 0.5385, 35), "release_s": _t(0.7639, 1.5008, 5),
                 "round_overhead_s": _t(0.067, 0.0656, 10)},
        "dp": {"startup_s": _t(0.3118, 0.3173, 34), "admit_s": _t(0.3121, 0.3176, 34),
               "suspect_s": _t(0.5737, 0.556, 35), "release_s": _t(0.7065, 0.6895, 25),
               "round_overhead_s": _t(0.0476, 0.0718, 184)},
        "dp_static": {"startup_s": _t(0.2987, 0.3017, 34), "admit_s": _t(0.2989, 0.3016, 34),
                      "round_overhead_s": _t(0.0464, 0.0604, 188)}}}


def simulate_trace(mode: str, trace, *, M: int, step: float, H: int, P: int, window: float,
                   system: BenchSystem = BenchSystem(), seed: int = 0, dt: float = 0.0025) -> dict:
    """Goodput of ``mode`` under an explicit ``trace`` of (time, 'kill'|'start', learner), as
    ``bench.goodput`` measures it: credited = steps x step / P of every contribution merged inside
    [0, window], over M x window. Also ``stepping``: the share of allocated time spent stepping."""
    if mode not in TRACE_MODES:
        raise ValueError(f"mode must be one of {TRACE_MODES}, got {mode!r}")
    rng = np.random.default_rng(seed)
    lockstep = mode != "decoupled"
    Hm = 1 if mode in ("dp", "dp_static") else H
    first = [0] * P if lockstep else [(p * Hm // P) or Hm for p in range(P)]
    detect = system.detect_s(mode == "dp_static")
    t0 = -system.warmup_s
    # per learner: next step end (None: not stepping), steps since start, unsent steps per fragment,
    # next due step per fragment, process alive, counted in the quorum from, killed at, blocked on a merge
    nxt = [t0 + u + step for u in rng.uniform(0.0, 1.0, M)]
    nsteps, unsent = [0] * M, [[0] * P for _ in range(M)]
    due = [[f or Hm for f in first] for _ in range(M)]
    alive, admit_at, killed = [True] * M, [t0] * M, [-math.inf] * M
    blocked = [False] * M
    pending: list[tuple[int, int]] = []  # sync modes: (learner, steps x fragments) of this round
    credits: list[tuple[float, float]] = []  # (merge time, credited seconds)
    stepped = 0.0
    events = sorted((float(t), k, int(i)) for t, k, i in trace)
    e = 0
    for tick in range(math.ceil((window - t0) / dt) + 1):
        t = t0 + tick * dt
        while e < len(events) and events[e][0] <= t:
            te, kind, i = events[e]
            e += 1
            if kind == "kill" and alive[i]:  # the step in progress and the unsent steps are lost
                alive[i], killed[i], nxt[i], blocked[i] = False, te, None, False
            elif kind == "start" and not alive[i]:  # a new incarnation, from the global parameters
                alive[i], admit_at[i], nxt[i] = True, te + system.admit_after_start(), te + system.startup_s + step
                nsteps[i], unsent[i], due[i] = 0, [0] * P, [f or Hm for f in first]
        for i in range(M):
            while nxt[i] is not None and nxt[i] <= t:
                te = nxt[i]
                nsteps[i] += 1
                if 0.0 <= te <= window:
                    stepped += step
                unsent[i] = [u + 1 for u in unsent[i]]
                ready = [p for p in range(P) if due[i][p] <= nsteps[i]]
                for p in ready:
                    due[i][p] = nsteps[i] + Hm
                nxt[i] = te + step
                if lockstep and ready:  # sends every fragment and waits for the merge
                    pending.append((i, sum(unsent[i])))
                    unsent[i] = [0] * P
                    blocked[i], nxt[i] = True, None
                else:
                    for p in ready:
                        credits.append((te + system.latency_s, unsent[i][p] * step / P))
                        unsent[i][p] = 0
        if lockstep and pending:
            quorum = [i for i in range(M) if _counted(alive[i], t, admit_at[i], killed[i], detect)]
            sent = {i for i, _ in pending}
            if all(i in sent for i in quorum):
                credits.extend((t, s * step / P) for _, s in pending)
                for i in sent:
                    if alive[i] and blocked[i]:
                        blocked[i], nxt[i] = False, t + system.latency_s + step
                pending = []
    credited = sum(c for tm, c in credits if 0.0 <= tm <= window)
    return {"mode": mode, "goodput": credited / (M * window), "stepping": stepped / (M * window)}


def _counted(alive: bool, t: float, admit_at: float, killed: float, detect: float) -> bool:
    """Is the learner in the aggregator's quorum (monitor state ``active``)? A killed learner stays
    in it until it is suspect (``detect`` after the kill: the survivors wait for it until then); a
    new incarnation counts from ``admit_at`` (:meth:`BenchSystem.admit_after_start`)."""
    if alive and t >= admit_at:
        return True
    return t - killed < detect


def infer_startup(trace, stepping: float, *, M: int, step: float, H: int, P: int, window: float,
                  system: BenchSystem = BenchSystem(), hi: float = 10.0) -> float:
    """The learner start-up time under which the simulated decoupled *stepping* share equals a
    measured one (bisection; the share falls as start-up grows). Start-up depends on the machine's
    load during a run, and a run's JSON records it only through that share."""
    lo = 0.0
    for _ in range(12):
        mid = (lo + hi) / 2
        s = simulate_trace("decoupled", trace, M=M, step=step, H=H, P=P, window=window,
                           system=replace(system, startup_s=mid))["stepping"]
        lo, hi = (mid, hi) if s > stepping else (lo, mid)
    return round((lo + hi) / 2, 3)
