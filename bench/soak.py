"""Soak: a long run of real processes under a seeded trace of kill -9 and link cuts (issue 29).

The chaos harness's run (``tests/chaos/harness.py``: file-backed nats-server, aggregator, monitor,
evaluator, N learners training the tiny JAX model, each learner behind its own TCP proxy), driven
by a time-based fault trace instead of trials (``bench.soak_trace.fault_trace``, pure and seeded):
kill -9 of learners, the aggregator, the monitor, the evaluator and the nats-server at random
instants, each restarted after a repair time, and cuts of one learner's link, healed later. The
next fault never waits for the run to recover from the last; faults of different targets overlap.

A process that exits on its own (a role started while the server is still down gives up after
``DILOCO_CONNECT_TIMEOUT``, for example) is restarted one second later, as compose's
``restart: unless-stopped`` would; each such exit is reported (``unplanned_exits``: exit code and
the last lines of its log).

Audit (``harness.LiveAudit``): GRAD's complete objects (contributions JetStream acknowledged) and
EVENTS' merge and reject events are read *while the run goes*: both streams are bounded, so a long
run's first contributions are gone by its end. After the trace the run must recover (versions
advance, every learner active), the learners stop, the aggregator drains, and then:

* ``none_lost``: every acknowledged contribution is applied or rejected with a reason;
* ``none_applied_twice``: no contribution in two versions' merge events;
* ``versions_monotonic``: no fragment's version went back (every head publication seen live);
* ``audit_complete``: the audit saw every message of both streams (no sequence discarded unread);
* ``loss_fell_half``: the held-out loss of the newest version evaluated is at most half that of
  version 0;
* ``rss_flat_aggregator`` / ``rss_flat_server``: memory stays flat. RSS (``VmRSS``) of every
  process is sampled during the fault window; a kill -9 restarts a process with a fresh heap, so
  only *settled* samples count (``SETTLE_S`` or more after their incarnation started), and the
  figure is the median of the settled samples of the window's last quarter over that of its second
  quarter, per kind of process: at most ``RSS_FLAT``. Null (not judged) for a window under
  ``RSS_MIN_WINDOW_S`` (a quick run's) or under ``RSS_MIN_SAMPLES`` settled samples in a quarter.
  Also per incarnation, in order (``plateaus_mib``): the median of its samples ``PLATEAU_AGE_S`` or
  more after its start, to see whether each restart comes back bigger;
* ``no_fragment_stalled``: no fragment published versions with bit-identical content (the crc
  its head carries) for ``STALL_S`` or more: merges that moved nothing while versions advanced (a
  lower bound on a stall: momentum still moves a fragment a little after its last real update);
* ``recovered_at_end``, ``every_kind_killed``, ``no_orphans``.

It exits 1 if an invariant is false (null is not false).

    python -m bench.soak --quick --out soak_quick.json       (10 kills over 1 minute)
    python -m bench.soak --minutes 6 --kills 25               (a medium run)
    python -m bench.soak --out soak.json                      (30 minutes, 100 kills)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import os
import statistics
import sys
import tempfile
import time

from bench.common import finish, parser, progress
from bench.soak_trace import KINDS, Fault, actions, fault_trace, kind_of, summary
from tests.chaos.harness import ChaosRun, LiveAudit, rss_mib
from tests.system import member_states

LOSS_FALL = 0.5  # the final held-out loss is at most half that of version 0
SETTLE_S = 20.0  # RSS samples this long after their process started count for flatness
RSS_FLAT = 1.25  # flat: median of the last quarter's settled samples <= this x the second quarter's
PLATEAU_AGE_S = 60.0  # an incarnation's plateau: the median of its samples at least this old
RSS_MIN_WINDOW_S = 300.0  # memory over a shorter window says nothing about a leak: not judged
STALL_S = 60.0  # a fragment whose versions keep the same content this long has stopped training
RSS_MIN_SAMPLES = 5  # settled samples each compared quarter needs to be judged
RESTART_UNPLANNED_S = 1.0  # a process that exited on its own is started again after this long
QUICK = (1.0, 10)  # minutes of faults, kills
FULL = (30.0, 100)


class Soak:
    def __init__(self, workdir: str, trace: list[Fault], duration: float, learners: int, seed: int,
                 learner_env: dict | None = None, agg_env: dict | None = None):
        self.trace, self.duration = trace, duration
        self.run = ChaosRun(workdir, learners=learners, seed=seed, run="soak", learner_env=learner_env,
                            agg_env=agg_env)
        self.workdir = workdir
        self.interval = min(10.0, max(2.0, duration / 60))  # RSS sampling period
        self.status_every = min(30.0, max(10.0, duration / 20))
        self.down: set[str] = set()  # targets down by the trace (killed, not restarted yet)
        self.started_at: dict[int, tuple[str, float]] = {}  # pid -> (target, monotonic start)
        self.samples: list[tuple[float, str, int, float]] = []  # (seconds into the window, target, pid, MiB)
        self.done: list[dict] = []  # every action as executed
        self.unplanned: list[dict] = []
        self.server_start: asyncio.Task | None = None
        self.t0 = 0.0  # monotonic start of the fault window
        self.audit: LiveAudit | None = None

    # -- helpers ------------------------------------------------------------------------------------

    def now(self) -> float:
        return time.monotonic() - self.t0

    def targets(self) -> list[str]:
        return ["server", "aggregator", "monitor", "evaluator", *self.run.learners]

    def note_started(self, target: str) -> None:
        pid = self.run.pid_of(target)
        if pid is not None:
            self.started_at[pid] = (target, time.monotonic())

    def log_tail(self, target: str, lines: int = 6) -> list[str]:
        """The last lines of ``target``'s log, from its last traceback if there is one near the end."""
        path = os.path.join(self.workdir, "nats.log" if target == "server" else f"{target}.log")
        try:
            with open(path, "rb") as f:
                f.seek(max(0, os.path.getsize(path) - 16384))
                tail = [ln.decode(errors="replace")[:400] for ln in f.read().splitlines()]
        except OSError:
            return []
        tb = [i for i, ln in enumerate(tail) if ln.startswith("Traceback")]
        return tail[tb[-1]:][-60:] if tb else tail[-lines:]

    async def _start_server(self) -> None:
        for attempt in range(3):
            try:
                await self.run.start_target("server")
                self.note_started("server")
                return
            except Exception as e:  # not healthy in time: say so and try again
                self.unplanned.append({"t": round(self.now(), 1), "target": "server", "start_failed": repr(e)[:300],
                                       "attempt": attempt + 1, "log": self.log_tail("server")})
                progress(f"t={self.now():.1f}s server start failed ({e!r}); again")
        raise RuntimeError("the nats-server did not start three times in a row")

    # -- the fault window ---------------------------------------------------------------------------

    async def act(self, at: float, action: str, target: str) -> None:
        late = self.now() - at
        pid = self.run.pid_of(target)
        if action == "kill":
            if target == "server" and self.server_start is not None:
                await self.server_start  # still recovering its store: killed once it is up
                late = self.now() - at
                pid = self.run.pid_of(target)
            self.down.add(target)
            await self.run.kill_target(target)
            progress(f"t={self.now():.1f}s kill -9 {target} (pid {pid})")
        elif action == "start":
            if target == "server":
                self.server_start = asyncio.create_task(self._start_server())
                self.server_start.add_done_callback(lambda _t: self.down.discard("server"))
            else:
                await self.run.start_target(target)
                self.note_started(target)
                self.down.discard(target)
            progress(f"t={self.now():.1f}s start {target}")
        elif action == "cut":
            self.run.proxies[target].cut()
            progress(f"t={self.now():.1f}s cut {target}'s link")
        else:
            self.run.proxies[target].heal()
            progress(f"t={self.now():.1f}s heal {target}'s link")
        self.done.append({"t": round(at, 2), "action": action, "target": target, "late_s": round(late, 2)})

    async def supervise(self) -> None:
        """Restart a process that exited on its own (not killed by the trace), as a supervisor would."""
        while True:
            await asyncio.sleep(1.0)
            for target in self.targets():
                if target in self.down:
                    continue
                if target == "server":
                    p = self.run.server.proc
                    if self.server_start is not None and not self.server_start.done():
                        continue
                    exited = p is None or p.poll() is not None
                    code = None if p is None else p.returncode
                else:
                    p = self.run.procs[target]
                    exited, code = p.poll() is not None, p.returncode
                if not exited:
                    continue
                self.unplanned.append({"t": round(self.now(), 1), "target": target, "exit_code": code,
                                       "log": self.log_tail(target)})
                progress(f"t={self.now():.1f}s {target} exited on its own (code {code}); restarting it")
                await asyncio.sleep(RESTART_UNPLANNED_S)
                now_p = self.run.server.proc if target == "server" else self.run.procs[target]
                if target in self.down or now_p is not p:
                    continue  # the trace killed or started it meanwhile: its own restart follows
                if target == "server":
                    self.server_start = asyncio.create_task(self._start_server())
                else:
                    await self.run.start_target(target)
                    self.note_started(target)

    async def sample(self) -> None:
        last_status = -1e9
        while True:
            t = self.now()
            for target in self.targets():
                pid = self.run.pid_of(target)
                mib = rss_mib(pid) if pid is not None else None
                if pid is not None and mib is not None:
                    self.samples.append((round(t, 1), target, pid, round(mib, 1)))
            if t - last_status >= self.status_every:
                last_status = t
                await self.status(t)
            await asyncio.sleep(self.interval)

    async def status(self, t: float) -> None:
        run = self.run
        loss = run.evals[-1][1] if run.evals else float("nan")
        rss = {k: next((m for _, tg, _, m in reversed(self.samples) if tg == k), None) for k in ("aggregator", "server")}
        try:
            members = await asyncio.wait_for(member_states(run.js, run.run), 3)
        except Exception:
            members = {}
        a = self.audit
        acked = len(a.published) if a else 0
        resolved = len(a.published & (set(a.applied()) | set(a.rejected))) if a else 0
        progress(f"t={t:.0f}s versions={run.total_version()} loss={loss:.3f} rss_mib agg={rss['aggregator']} "
                 f"server={rss['server']} acked={acked} resolved={resolved} "
                 f"members={','.join(f'{k}:{v}' for k, v in sorted(members.items()))}")

    async def execute(self) -> dict:
        run = self.run
        t_setup = time.monotonic()
        await run.setup()
        self.audit = LiveAudit(run.js, run.s)
        self.audit.start()
        for target in self.targets():
            self.note_started(target)
        await run.warm_up()
        progress(f"warmed up in {time.monotonic() - t_setup:.0f}s; {len(self.trace)} faults over {self.duration:.0f}s")
        self.t0 = time.monotonic()
        v_start = run.total_version()
        helpers = [asyncio.create_task(self.sample()), asyncio.create_task(self.supervise())]
        try:
            for at, action, target in actions(self.trace):
                await asyncio.sleep(max(0.0, at - self.now()))
                await self.act(at, action, target)
            if self.server_start is not None:
                await self.server_start
            await asyncio.sleep(max(0.0, self.duration - self.now()))
            t_window = self.now()
            v_window = run.total_version()

            async def recovered():
                return run.total_version() > v_window + len(run.learners) and await run.all_active()

            ok = await run.wait_until(recovered, 180)
            t_recovered = self.now()
            progress(f"t={self.now():.1f}s after the last fault: {'recovered' if ok else 'NOT recovered'} "
                     f"(versions {v_window} -> {run.total_version()})")
            await self.await_loss(60.0)
        finally:
            for h in helpers:
                h.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)
        t_drain = self.now()
        await asyncio.get_running_loop().run_in_executor(None, run.stop_learners)
        settled = await self.audit.settle(120.0)
        await self.audit.stop()
        self.audit.expire_partials()
        progress(f"t={self.now():.1f}s learners stopped, audit {'settled' if settled else 'NOT settled'}")
        return {"ok_recovered": ok, "settled": settled, "v_start": v_start, "v_window": v_window,
                "seconds": {"warm_up": round(self.t0 - t_setup, 1), "window": round(t_window, 1),
                            "recovery": round(t_recovered - t_window, 1), "loss_wait": round(t_drain - t_recovered, 1),
                            "drain": round(self.now() - t_drain, 1)}}

    async def await_loss(self, timeout: float) -> None:
        """Give training up to ``timeout`` after the recovery to show the fall (a cut learner's
        backlog of stale outer gradients is a transient), as the chaos harness's drain does."""
        first = self.first_eval()
        if first is None:
            return
        mark = time.time()
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if any(ts > mark and loss <= LOSS_FALL * first[1] for ts, loss, _ in self.run.evals):
                return
            await asyncio.sleep(0.5)

    def first_eval(self) -> tuple[float, float, int] | None:
        return min(self.run.evals, key=lambda e: e[2]) if self.run.evals else None

    # -- the report ---------------------------------------------------------------------------------

    def loss_report(self) -> dict:
        evals = self.run.evals
        if not evals:
            return {"version0": None, "final": None, "fall": None}
        first = self.first_eval()
        final = max(evals, key=lambda e: (e[2], e[0]))
        assert first is not None
        t_win = time.time() - self.now()  # wall time of the window's start
        series, last = [], -1e9
        for ts, loss, v in evals:  # about 60 points over the run
            if ts - last >= max(1.0, self.duration / 60):
                series.append([round(ts - t_win, 1), round(loss, 4), v])
                last = ts
        return {"version0": round(first[1], 4), "first_version": first[2], "final": round(final[1], 4),
                "final_version": final[2], "fall": round(1 - final[1] / first[1], 4),
                "evaluations": len(evals), "series": series}

    def rss_report(self) -> dict:
        out = {}
        for kind in KINDS:
            rows = [(t, tg, pid, m) for t, tg, pid, m in self.samples if kind_of(tg) == kind]
            settled = [(t, m) for t, tg, pid, m in rows
                       if pid in self.started_at and t + self.t0 - self.started_at[pid][1] >= SETTLE_S]
            quarters, counts = [], []
            for q in range(4):
                lo, hi = q * self.duration / 4, (q + 1) * self.duration / 4
                vals = [m for t, m in settled if lo <= t < hi or (q == 3 and t >= hi)]
                quarters.append(round(statistics.median(vals), 1) if vals else None)
                counts.append(len(vals))
            judged = self.duration >= RSS_MIN_WINDOW_S and min(counts[1], counts[3]) >= RSS_MIN_SAMPLES
            ratio = round(quarters[3] / quarters[1], 3) if quarters[1] and quarters[3] else None
            incs: dict[int, dict] = {}
            for t, tg, pid, m in rows:
                inc = incs.setdefault(pid, {"target": tg, "pid": pid, "samples": []})
                inc["samples"].append([t, m])
            for pid, inc in incs.items():
                s = inc["samples"]
                born = self.started_at[pid][1] - self.t0 if pid in self.started_at else s[0][0]
                old = [m for t, m in s if t - born >= PLATEAU_AGE_S]
                inc.update(first_s=s[0][0], last_s=s[-1][0], min_mib=min(m for _, m in s),
                           max_mib=max(m for _, m in s), median_mib=round(statistics.median(m for _, m in s), 1),
                           plateau_mib=round(statistics.median(old), 1) if old else None)
            longest = max(incs.values(), key=lambda i: i["last_s"] - i["first_s"], default=None)
            rep = {"incarnations": len(incs), "settled_samples": len(settled), "quarter_medians_mib": quarters,
                   "quarter_samples": counts, "last_over_second_quarter": ratio, "judged": judged,
                   "longest_incarnation": None if longest is None else {
                       k: longest[k] for k in ("target", "pid", "first_s", "last_s", "min_mib", "max_mib", "median_mib")}
                   | {"slope_mib_per_min": _slope(longest["samples"])}}
            # like with like across restarts: each incarnation's RSS once it is PLATEAU_AGE_S old, in order
            rep["plateaus_mib"] = [[inc["first_s"], inc["plateau_mib"]] for inc in incs.values()
                                   if inc["plateau_mib"] is not None]
            if kind in ("aggregator", "server"):
                rep["series"] = [{k: inc[k] for k in ("pid", "first_s", "last_s", "plateau_mib", "samples")}
                                 for inc in incs.values()]
            out[kind] = rep
        return out


def unchanged_spans(heads: list[tuple[float, int, int, int | None]], t0: float) -> dict[str, dict]:
    """Per fragment, from the heads seen live (monotonic time, fragment, version, crc of the version's
    blob): versions published with the same content as the one before (a merge that did not move
    the fragment), the longest run of them in seconds, and the run still going at the end. A
    fragment that stops moving while its versions advance is training stalled, whatever the audit
    says (every contribution applied, at weight 0)."""
    out: dict[str, dict] = {}
    by_f: dict[int, list] = {}
    for t, f, v, crc in heads:
        by_f.setdefault(f, []).append((t, v, crc))
    for f, rows in sorted(by_f.items()):
        rows.sort(key=lambda r: r[1])
        same = 0
        longest = 0.0
        run_start: float | None = None  # when the current run of unchanged versions began
        for (t0_, v0, c0), (t1, v1, c1) in zip(rows, rows[1:]):
            if v1 > v0 and c0 is not None and c1 == c0:
                same += 1
                if run_start is None:
                    run_start = t0_
                longest = max(longest, t1 - run_start)
            else:
                run_start = None
        out[str(f)] = {"versions": len(rows), "unchanged_versions": same, "longest_unchanged_s": round(longest, 1),
                       "unchanged_at_end_s": round(rows[-1][0] - run_start, 1) if run_start is not None else 0.0,
                       "unchanged_since_s": None if run_start is None else round(run_start - t0, 1)}
    return out


def _slope(samples: list) -> float | None:
    """Least-squares slope of MiB over minutes."""
    if len(samples) < 3:
        return None
    ts = [t / 60 for t, _ in samples]
    ms = [m for _, m in samples]
    mt, mm = statistics.fmean(ts), statistics.fmean(ms)
    den = sum((t - mt) ** 2 for t in ts)
    return round(sum((t - mt) * (m - mm) for t, m in zip(ts, ms)) / den, 3) if den else None


async def soak(minutes: float, kills: int, seed: int, learners: int, partitions: int | None = None,
               keep: str | None = None, agg_env: dict | None = None) -> dict:
    duration = minutes * 60
    trace = fault_trace(seed, duration, kills, learners, partitions)
    t_start = time.monotonic()
    tmp = tempfile.TemporaryDirectory(prefix="diloco-soak-") if keep is None else None
    workdir = tmp.name if tmp is not None else keep
    assert workdir is not None
    os.makedirs(workdir, exist_ok=True)
    s = Soak(workdir, trace, duration, learners, seed, agg_env=agg_env)
    try:
        phases = await s.execute()
    finally:
        await s.run.close()
        if tmp is not None:
            tmp.cleanup()
    assert s.audit is not None
    c = s.audit.counts()
    loss = s.loss_report()
    rss = s.rss_report()
    unchanged = unchanged_spans(s.run.head_crc, s.t0)
    executed = [a for a in s.done if a["action"] == "kill"]
    killed = {k: sum(1 for a in executed if kind_of(a["target"]) == k) for k in KINDS}
    inv = {
        "none_lost": c["lost"] == 0,
        "none_applied_twice": c["applied_twice"] == 0,
        "versions_monotonic": s.run.versions_monotonic(),
        "audit_complete": phases["settled"] and not any(c["audit_gaps"].values()),
        "loss_fell_half": loss["fall"] is not None and loss["fall"] >= 1 - LOSS_FALL,
        "rss_flat_aggregator": _flat(rss["aggregator"]),
        "rss_flat_server": _flat(rss["server"]),
        "no_fragment_stalled": all(u["longest_unchanged_s"] < STALL_S for u in unchanged.values()),
        "recovered_at_end": phases["ok_recovered"],
        "every_kind_killed": all(killed.values()),
        "no_orphans": s.run.report.invariants.get("no_orphans", False),
    }
    lost = sorted(s.audit.lost())[:20]
    return {
        "bench": "soak", "seed": seed, "learners": learners, "minutes": minutes,
        "trace": summary(trace), "kills_executed": killed, "partitions_executed": sum(1 for a in s.done
                                                                                     if a["action"] == "cut"),
        "max_late_s": max((a["late_s"] for a in s.done), default=0.0),
        "unplanned_exits_by_target": _by_target(s.unplanned), "unplanned_exits": s.unplanned,
        "contributions": c, "lost_examples": [list(k) for k in lost],
        "versions": {"at_window_start": phases["v_start"], "at_window_end": phases["v_window"],
                     "at_end": s.run.total_version(),
                     "per_fragment": {str(f): v for f, v in sorted(s.run.newest.items())},
                     "heads_seen": len(s.run.heads)},
        "unchanged_fragments": unchanged,
        "loss": loss, "rss": rss,
        "settings": {"rss_settle_s": SETTLE_S, "rss_flat": RSS_FLAT, "rss_interval_s": s.interval,
                     "rss_min_window_s": RSS_MIN_WINDOW_S, "rss_min_samples": RSS_MIN_SAMPLES,
                     "loss_fall": LOSS_FALL, "stall_s": STALL_S, "learner": s.run.learner_env,
                     "aggregator_extra": s.run.agg_env},
        "seconds": {**phases["seconds"], "total": round(time.monotonic() - t_start, 1)},
        "invariants": inv,
        "passed": all(v is not False for v in inv.values()),
        "faults": s.done,
    }


def _by_target(unplanned: list[dict]) -> dict[str, dict[str, int]]:
    """Exits not caused by the trace, per target and per last log line (the exception, if any)."""
    out: dict[str, dict[str, int]] = {}
    for u in unplanned:
        why = (u.get("log") or [u.get("start_failed", "?")])[-1][:200]
        out.setdefault(u["target"], {})
        out[u["target"]][why] = out[u["target"]].get(why, 0) + 1
    return out


def _flat(rep: dict) -> bool | None:
    """Memory flat (True), grown (False), or not judged (None: a window under ``RSS_MIN_WINDOW_S``,
    or under ``RSS_MIN_SAMPLES`` settled samples in a quarter compared)."""
    if not rep["judged"] or rep["last_over_second_quarter"] is None:
        return None
    return rep["last_over_second_quarter"] <= RSS_FLAT


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=None, help="length of the fault window (30; --quick: 1)")
    p.add_argument("--kills", type=int, default=None, help="kill -9 over every kind of target (100; --quick: 10)")
    p.add_argument("--partitions", type=int, default=None, help="cuts of a learner's link (default: kills / 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--learners", type=int, default=3, help="learner processes (3: what 2 cores sustain)")
    p.add_argument("--keep", default=None, help="keep the run's logs and store in this folder")
    p.add_argument("--aggregator-env", action="append", default=[], metavar="DILOCO_X=V",
                   help="a setting of the aggregator beyond the chaos harness's (repeatable; to compare variants)")
    a = p.parse_args()
    agg_env = dict(kv.split("=", 1) for kv in a.aggregator_env)
    if any(not k.startswith("DILOCO_") for k in agg_env):
        p.error("--aggregator-env takes DILOCO_NAME=VALUE")
    minutes, kills = QUICK if a.quick else FULL
    minutes = minutes if a.minutes is None else a.minutes
    kills = kills if a.kills is None else a.kills
    res = asyncio.run(soak(minutes, kills, a.seed, a.learners, a.partitions, a.keep, agg_env))
    finish(res, a.out)
    sys.exit(0 if res["passed"] else 1)


if __name__ == "__main__":
    main()
