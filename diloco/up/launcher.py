"""``diloco up``'s run, phase by phase (:class:`Launcher`; the order of a run: :mod:`diloco.up`),
and its entry point :func:`main`.

**Signals.** SIGINT and SIGTERM get a plain Python handler (:meth:`Launcher.install_signals`)
from before the first server starts until the outputs are written: it only records the signal,
the phase it came in and wakes the event loop, so it can land at any instant, in synchronous code
too (a server starting, a child being spawned, the plot being drawn), without an exception in the
middle of it. Every phase checks for it (:meth:`Launcher.checkpoint`) and goes straight to the
end: stop the children, then the servers, write ``summary.json`` (status ``interrupted``, the
phase in ``interrupted_during``) and the plot. A signal while the outputs are written is recorded
in ``summary.json`` too (:meth:`Launcher.record_stop`); a second one SIGKILLs the children.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable

from bus.config import CommonConfig, from_env
from diloco.up.children import Child, astop_children
from diloco.up.plan import (
    ProcSpec,
    auth_enabled,
    base_env,
    parse_args,
    plan_processes,
    validate_envs,
    with_credentials,
    with_urls,
)
from diloco.up.progress import RunState, show_progress
from diloco.up.summary import build_summary, plot_eval, render_summary

#: the phase a signal that comes after the children and servers stopped lands in
WRITING = "writing the summary"


class Interrupted(Exception):
    """A signal asked the run to stop: skip to its end (stop everything, write the summary)."""


def final_status(stop_signal: int | None, failure: str | None) -> str:
    """``summary.json``'s status (pure): a signal wins over a failure (the user stopped the run,
    whatever it was doing), a failure over success."""
    return "interrupted" if stop_signal is not None else "failed" if failure else "completed"


def exit_code(stop_signal: int | None, failure: str | None, rc: int = 0) -> int:
    """The launcher's exit status (pure): 130 after SIGINT, 143 after SIGTERM, else ``rc``, at
    least 1 after a failure."""
    if stop_signal is not None:
        return 130 if stop_signal == signal.SIGINT else 128 + int(stop_signal)
    return rc or (1 if failure else 0)


class Launcher:
    def __init__(self, a: argparse.Namespace, environ: dict[str, str]):
        self.a = a
        self.out = os.path.abspath(a.out)
        env = base_env(environ, a.model_preset, a.steps, a.quick, a.learners, bandwidth=a.preset)
        if a.run:
            env["DILOCO_RUN"] = a.run
        env["DILOCO_UP_OUT"] = self.out  # marks every child (and server) of this launch: find them by it
        self.env = env
        self.specs = plan_processes(env, a.learners, a.regions)
        self.auth = auth_enabled(a)
        self.auth_dir = os.path.join(self.out, "auth")
        self.children: list[Child] = []
        self.topology = None
        self.state: RunState | None = None
        self.stop_signal: int | None = None
        self.stopped_during: str | None = None  # the phase (status) the first signal came in
        self.stop_event: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._old_handlers: dict[int, object] = {}
        self.status = "starting"
        self.t_start = time.time()
        self.t_learners: float | None = None
        self.t_learners_done: float | None = None
        self.failure: str | None = None
        tty = sys.stdout.isatty()
        self.progress = a.progress if a.progress != "auto" else ("table" if tty else "line")
        self.progress_interval = a.progress_interval or (1.0 if self.progress == "table" else 2.0)

    # -- helpers ------------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(text, flush=True)

    def write_processes(self) -> None:
        data = {"launcher": os.getpid(),
                "servers": self.topology.pids() if self.topology else {},
                "server_urls": {n: s.url for n, s in self.topology.servers.items()} if self.topology else {},
                "auth": self.auth_dir if self.auth else None,  # the folder of the env files (no secrets here)
                "children": [{"name": c.spec.name, "role": c.spec.role, "region": c.spec.region,
                              "pid": c.proc.pid if c.proc else None, "exit_code": c.poll(),
                              "log": os.path.relpath(c.log_path, self.out)} for c in self.children]}
        tmp = os.path.join(self.out, "processes.json.tmp")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, os.path.join(self.out, "processes.json"))

    def start_child(self, spec: ProcSpec) -> Child:
        c = Child(spec, os.path.join(self.out, "logs", f"{spec.name}.log"), self.out)
        c.start()
        self.children.append(c)
        self.write_processes()
        return c

    def by_role(self, role: str) -> list[Child]:
        return [c for c in self.children if c.spec.role == role]

    def check_central(self) -> str | None:
        """A reason if a central role exited (fatal for the run)."""
        for c in self.children:
            if c.spec.role != "learner" and c.poll() is not None:
                return f"{c.spec.name} exited with code {c.poll()} (see {os.path.relpath(c.log_path)})"
        return None

    def on_signal(self, sig: int) -> None:
        """Record a stop; safe at any instant (a Python signal handler runs between two bytecodes
        of whatever the main thread does): no exception, only flags and a wake-up of the loop."""
        if self.stop_signal is not None:  # second Ctrl-C: no more patience
            for c in self.children:
                c.signal(signal.SIGKILL)
            self.later(self.say, "diloco up: second signal: killed the children")
            return
        self.stop_signal = sig
        self.stopped_during = self.status
        if self.stop_event is not None:
            self.later(self.stop_event.set)

    def later(self, fn: Callable[..., object], *args: object) -> None:
        """``fn(*args)`` on the event loop soon: what a signal handler may not do itself (print:
        a reentrant write to stdout raises; an asyncio.Event is not thread- or signal-safe)."""
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed already: nobody waits for it
                self.loop.call_soon_threadsafe(fn, *args)

    def install_signals(self) -> None:
        """SIGINT and SIGTERM record a stop (:meth:`on_signal`) until :meth:`restore_signals`."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old_handlers[sig] = signal.signal(sig, lambda s, _frame: self.on_signal(s))

    def restore_signals(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old_handlers.clear()

    @property
    def stopping(self) -> bool:
        return self.stop_signal is not None

    def checkpoint(self) -> None:
        """Between two steps of a phase: raise :class:`Interrupted` if a signal came."""
        if self.stop_signal is not None:
            raise Interrupted

    async def sleep(self, seconds: float) -> bool:
        """Sleep unless stopped; True if a stop was requested."""
        try:
            await asyncio.wait_for(self.stop_event.wait(), seconds)
        except asyncio.TimeoutError:
            pass
        return self.stopping

    def show(self, force: bool = False) -> None:
        if self.state is not None:
            show_progress(self.progress, self.state, status=self.status, out=self.out, t_start=self.t_start,
                          say=self.say)

    # -- phases -------------------------------------------------------------------------------------

    async def run(self) -> int:
        from bus.codec import loads_json
        from bus.conn import connect
        from bus.subjects import Subjects
        from diloco.topology import make_topology

        self.loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        if self.stopping:  # a signal before the loop ran
            self.stop_event.set()
        own_handlers = not self._old_handlers  # main() installs them before the loop starts
        if own_handlers:
            self.install_signals()
        store = os.path.join(self.out, "nats-store")
        if previous := previous_run(self.out):
            self.say(f"diloco up: replacing the previous run's output in {self.out} ({previous}); "
                     "pass --out DIR to keep it")
        shutil.rmtree(store, ignore_errors=True)  # a fresh run every time: our own folders only
        shutil.rmtree(os.path.join(self.out, "logs"), ignore_errors=True)
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        for stale in ("summary.json", "eval_loss.png", WATCH_ENV):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.out, stale))
        run = self.env["DILOCO_RUN"]
        self.state = RunState(run=run, t0=self.t_start)
        nc = None
        rc = 0
        try:
            self.checkpoint()
            self.status = "starting the server" + ("s" if self.a.topology == "leaf" else "")
            os.environ["DILOCO_UP_OUT"] = self.out  # the servers inherit the launcher's environment
            auth_conf, leaf_auth, me = "", None, CommonConfig(run=run)
            if self.auth:
                from bus.config import parse_env_file
                from diloco.auth_config import init as auth_init

                learners = [(p.learner_id, p.region) for p in self.specs if p.role == "learner"]
                # plain passwords in the 0600 config: the env files next to it hold them anyway, and a
                # bcrypt check per connection costs the shared cores seconds while every role starts
                creds = auth_init(self.auth_dir, run, learners, force=True, hash_mode="plain")
                if self.a.topology == "leaf":  # the same account and users on the hub and every leaf
                    from diloco.auth_leaf import leaf_auth_from_init

                    leaf_auth = leaf_auth_from_init(creds, run, self.a.regions)
                else:
                    auth_conf = creds.conf.read_text()
                self.specs = with_credentials(self.specs, creds.env_files)
                mine = parse_env_file(creds.env_files["metrics"].read_text())
                me = CommonConfig(run=run, nats_user=mine["DILOCO_NATS_USER"],
                                  nats_password=mine["DILOCO_NATS_PASSWORD"])
            self.topology = make_topology(self.a.topology, self.a.regions, store, os.path.join(self.out, "logs"),
                                          extra_config=auth_conf, leaf_auth=leaf_auth)
            self.topology.start()  # in the main thread: PR_SET_PDEATHSIG follows the spawning thread
            self.checkpoint()
            self.specs = with_urls(self.specs, self.topology.url_for)
            self.write_processes()
            urls = {n: s.url for n, s in self.topology.servers.items()}
            access = ("auth: one user per role" + (" on every server" if leaf_auth else "")
                      + f", credentials in {self.auth_dir}" if self.auth else "auth: off (anonymous access, --no-auth)")
            self.say(f"diloco up: {self.a.topology} topology {urls}; run {run!r}; "
                     f"{self.a.learners} learners over {','.join(self.a.regions)}; "
                     f"{self.env['DILOCO_MAX_STEPS']} steps each; model preset {self.a.model_preset}; "
                     f"bandwidth preset {self.a.preset}; {access}; "
                     f"out {self.out}")
            write_watch_env(self.out, self.topology.hub_url, run, me if self.auth else None)
            watch = f"diloco metrics --dir {self.out}"
            self.say(f"diloco up: logs in {os.path.join(self.out, 'logs')}; watch from another terminal with {watch}")
            async def quiet(*_: object) -> None:  # the launcher's own connection logs nothing
                return None

            nc = await connect(dataclasses.replace(me, nats_url=self.topology.hub_url), name="launcher",
                               error_cb=quiet, disconnected_cb=quiet, reconnected_cb=quiet)
            s = Subjects(run)

            async def on_metrics(msg) -> None:
                with contextlib.suppress(Exception):
                    self.state.on_metrics(loads_json(msg.data))

            async def on_event(msg) -> None:
                with contextlib.suppress(Exception):
                    self.state.on_event(loads_json(msg.data))

            await nc.subscribe(s.metrics_all, cb=on_metrics)
            await nc.subscribe(s.event("membership"), cb=on_event)
            await nc.flush()

            self.status = "starting aggregator, monitor, evaluator"
            for spec in self.specs:
                if spec.role != "learner":
                    self.checkpoint()
                    self.start_child(spec)
            rc = await self.wait_initial_eval()
            self.checkpoint()
            if rc == 0:
                self.status = "starting the learners"
                self.t_learners = time.time()
                for spec in self.specs:
                    if spec.role == "learner":
                        self.checkpoint()
                        self.start_child(spec)
                self.status = "training"
                rc = await self.watch_training()
            self.checkpoint()
            if rc == 0:
                rc = await self.wait_final()
        except Interrupted:
            pass
        except BaseException as e:  # a server that did not start...: the summary says so, then it propagates
            self.failure = self.failure or f"{type(e).__name__}: {e}"
            raise
        finally:
            if self.stop_signal is not None:
                self.say(f"diloco up: {signal.Signals(self.stop_signal).name} while {self.stopped_during}: "
                         "stopping everything (a second one kills the children at once)")
            self.status = "stopping"
            # the aggregator last: it merges what the learners sent until they stopped
            await astop_children([self.by_role("learner") + self.by_role("eval") + self.by_role("monitor"),
                                  self.by_role("aggregator")], self.a.stop_timeout, self.say)
            self.write_processes()
            traffic = {}
            if self.topology is not None:
                with contextlib.suppress(Exception):
                    await asyncio.sleep(0.2)  # let the metrics of stopping processes land
                with contextlib.suppress(Exception):
                    traffic = self.topology.traffic()
            if nc is not None:
                with contextlib.suppress(Exception):
                    await nc.close()
            if self.topology is not None:
                self.topology.stop()
            self.status = WRITING
            self.finish(traffic)
            if own_handlers:
                self.restore_signals()
        return exit_code(self.stop_signal, self.failure, rc)

    async def wait_initial_eval(self) -> int:
        deadline = time.monotonic() + self.a.initial_eval_timeout
        next_show = 0.0
        while not self.state.evals:
            why = self.check_central()
            if why:
                self.failure = why
                self.say(f"diloco up: {why}")
                return 1
            if time.monotonic() > deadline:
                self.failure = f"no held-out loss from the evaluator within {self.a.initial_eval_timeout:.0f}s"
                self.say(f"diloco up: {self.failure}")
                return 1
            if time.monotonic() >= next_show:
                self.status = "waiting for the initial evaluation"
                next_show = time.monotonic() + max(5.0, self.progress_interval)
                if self.progress == "line":
                    self.say(f"[{time.time() - self.t_start:6.1f}s] waiting for the evaluator's initial held-out loss")
            if await self.sleep(0.1):
                return 0
        e = self.state.evals[0]
        self.say(f"diloco up: initial held-out loss {e['eval_loss']:.4f} (version {e.get('version')})")
        return 0

    async def watch_training(self) -> int:
        next_show = 0.0
        while True:
            why = self.check_central()
            if why:
                self.failure = why
                self.say(f"diloco up: {why}")
                return 1
            learners = self.by_role("learner")
            if all(c.poll() is not None for c in learners):
                self.t_learners_done = time.time()
                bad = {c.spec.name: c.poll() for c in learners if c.poll() != 0}
                if bad:
                    self.failure = f"learners failed: {bad}"
                    self.say(f"diloco up: {self.failure}")
                self.write_processes()
                return 0
            if time.monotonic() >= next_show:
                self.show()
                next_show = time.monotonic() + self.progress_interval
            if await self.sleep(0.2):
                return 0

    async def wait_final(self) -> int:
        """After the learners: wait until nothing is buffered and the evaluator scored the final versions."""
        self.status = "final merges and evaluation"
        self.say(f"diloco up: learners done after {self.t_learners_done - self.t_learners:.1f}s; "
                 "waiting for the last merges and evaluation")
        deadline = time.monotonic() + self.a.final_timeout
        t_done = self.t_learners_done
        while time.monotonic() < deadline:
            why = self.check_central()
            if why:
                self.failure = why
                return 1
            agg = self.state.aggregator or {}
            fresh = float(agg.get("ts", 0)) > t_done + 1.0
            if fresh and not agg.get("buffered"):
                want = {str(k): int(v) for k, v in (agg.get("versions") or {}).items()}
                last = self.state.evals[-1] if self.state.evals else {}
                got = {str(k): int(v) for k, v in (last.get("versions") or {}).items()}
                if got == want:
                    return 0
            if await self.sleep(0.2):
                return 0
        self.say("diloco up: the final evaluation did not catch up with the last versions in time; "
                 "reporting the newest one")
        return 0

    def finish(self, traffic: dict) -> None:
        """Write ``summary.json`` and ``eval_loss.png``, print the summary. A signal that comes
        meanwhile is recorded: the summary is written again with status ``interrupted``."""
        from learner.config import ModelConfig
        from learner.spec import count_params

        try:
            params = count_params(from_env(ModelConfig, self.env).spec())
        except Exception:
            params = 0
        exit_codes = {c.spec.name: c.poll() for c in self.children}
        keys = ("DILOCO_D_MODEL", "DILOCO_N_LAYERS", "DILOCO_N_HEADS", "DILOCO_D_FF", "DILOCO_SEQ_LEN",
                "DILOCO_NUM_FRAGMENTS", "DILOCO_BATCH_SIZE", "DILOCO_SYNC_EVERY", "DILOCO_MAX_STEPS",
                "DILOCO_INNER_LR", "DILOCO_QUANTISER", "DILOCO_QUORUM", "DILOCO_MERGE")
        settings = {"topology": self.a.topology, "auth": self.auth, "regions": self.a.regions, "learners": self.a.learners,
                    "model_preset": self.a.model_preset, "preset": self.a.preset, "quick": self.a.quick,
                    "env": {k: self.env[k] for k in keys if k in self.env}}
        train = None
        if self.t_learners is not None:
            train = (self.t_learners_done or time.time()) - self.t_learners
        summary = build_summary(state=self.state, specs=self.specs, exit_codes=exit_codes, traffic=traffic,
                                params=params, wall_time_s=time.time() - self.t_start, train_time_s=train,
                                status=final_status(self.stop_signal, self.failure), settings=settings,
                                learner_ended={c.spec.learner_id: c.ended for c in self.by_role("learner")})
        self.record_stop(summary)
        path = os.path.join(self.out, "summary.json")
        write_json(path, summary)
        plotted = None
        if summary["eval_history"] or any(self.state.loss_history.values()):  # nothing to draw otherwise
            plotted = plot_eval(summary, self.state, os.path.join(self.out, "eval_loss.png"))
        if self.record_stop(summary):  # a signal while the plot was drawn
            write_json(path, summary)
        self.say("")
        self.say(render_summary(summary))
        self.say(f"wrote {path}" + (f" and {os.path.join(self.out, 'eval_loss.png')}" if plotted else ""))
        if self.record_stop(summary):  # a signal while the summary was printed: the file still tells
            write_json(path, summary)

    def record_stop(self, summary: dict) -> bool:
        """Bring ``summary``'s status, failure and phase of the stop up to date; True if it changed."""
        want = {"status": final_status(self.stop_signal, self.failure)}
        if self.failure:
            want["failure"] = self.failure
        if self.stop_signal is not None:
            want["interrupted_during"] = self.stopped_during or WRITING
            want["signal"] = signal.Signals(self.stop_signal).name
        changed = any(summary.get(k) != v for k, v in want.items())
        summary.update(want)
        return changed


WATCH_ENV = "watch.env"


def write_json(path: str, data: dict) -> None:
    """``path`` replaced at once (a reader, or a kill -9, never sees half a file)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


def previous_run(out: str) -> str | None:
    """What a previous `diloco up` left in ``out`` (None if nothing): it is about to be replaced."""
    found = [name for name in ("summary.json", "logs", "nats-store") if os.path.exists(os.path.join(out, name))]
    return ", ".join(found) or None


def write_watch_env(out: str, url: str, run: str, me: CommonConfig | None) -> str:
    """``<out>/watch.env`` (0600): what `diloco metrics --dir` and `diloco status --dir` need to
    watch this run: the hub's URL, the run id and, with auth, the read-only metrics user."""
    from diloco.auth_config import _env_value

    rows = [("DILOCO_NATS_URL", url), ("DILOCO_RUN", run)]
    if me is not None and me.nats_user:
        rows += [("DILOCO_NATS_USER", me.nats_user), ("DILOCO_NATS_PASSWORD", me.nats_password)]
    path = os.path.join(out, WATCH_ENV)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# written by `diloco up`: watch this run with `diloco metrics --dir DIR` (secret: 0600)\n")
        f.write("".join(f"{k}={_env_value(v)}\n" for k, v in rows))
    return path


def main(argv: list[str] | None = None) -> int:
    from bus.server import ServerError

    a = parse_args(list(sys.argv[1:] if argv is None else argv))
    launcher = Launcher(a, dict(os.environ))
    validate_envs(launcher.specs)  # ConfigError -> one line, exit 2 (diloco.cli)
    os.makedirs(launcher.out, exist_ok=True)
    launcher.install_signals()  # before anything starts: a Ctrl-C at any instant ends in a summary
    try:
        return asyncio.run(launcher.run())
    except ServerError as e:
        print(f"diloco up: {e}", file=sys.stderr)
        return exit_code(launcher.stop_signal, str(e))
    finally:
        launcher.restore_signals()

