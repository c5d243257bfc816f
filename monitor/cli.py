"""``diloco metrics`` and ``diloco status``: look at a run from any machine that reaches its NATS.

Both read ``DILOCO_NATS_URL``, ``DILOCO_RUN`` and the credential variables (``DILOCO_NATS_USER``,
``DILOCO_NATS_PASSWORD``, ``DILOCO_NATS_CREDS``, ``DILOCO_NATS_NKEY_SEED``, ``DILOCO_TLS_*``);
``--url`` and ``--run`` override the first two.

* ``diloco metrics`` subscribes to ``diloco.<run>.metrics.>`` and redraws a table in place every
  second (:func:`monitor.metrics_view.render_table`); ``--json`` prints every message as a JSON
  line instead; ``--once`` collects for ``--wait`` seconds and prints one snapshot;
  ``--role/--learner/--region`` filter the messages.
* ``diloco status`` prints one snapshot read from JetStream and KV only (no metrics needed):
  membership, leader lease, version per fragment, stream sizes and the server's health.

An unreachable server or a refused login is one line on stderr and exit status 4
(``bus.entry.EXIT_UNAVAILABLE``), at once for a refused connection or login and after at most
``DILOCO_CONNECT_TIMEOUT`` seconds (10) for a server that does not answer (``bus.conn.connect``). Logs (JSON lines on
stderr at ``DILOCO_LOG_LEVEL``) are quiet: the viewers show the connection's state themselves;
``--serve`` logs one line per change of it.
"""

from __future__ import annotations

import argparse
import os
import asyncio
import dataclasses
import math
import shutil
import sys
import time
from typing import Any

from bus.signals import install_stop
from bus.codec import CodecError, dumps_json, loads_json
from bus.config import CommonConfig, ConfigError, from_env, nats_urls, token
from bus.conn import REFUSED_GRACE, ConnectFailed, connect, redact_url
from bus.entry import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNAVAILABLE, EXIT_USAGE
from bus.log import setup
from bus.subjects import Subjects
from monitor.metrics_view import ROLES, MetricsSnapshot, filter_msg, fold, render_table

CLEAR = "\x1b[H\x1b[2J"
#: `--once` waits this many DILOCO_METRICS_INTERVALs for an evaluator (in no roster) before it
#: prints without one: a running evaluator then missed a whole interval's record
EVALUATOR_WINDOW = 2.0


class CliError(RuntimeError):
    """A failure worth one line on stderr; ``code`` is the exit status (``bus.entry``: 1 by default,
    4 for a server out of reach)."""

    def __init__(self, message: str, code: int = EXIT_ERROR):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- shared


def _add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="NATS URL(s), comma-separated (default: $DILOCO_NATS_URL)")
    p.add_argument("--run", help="run id (default: $DILOCO_RUN)")
    p.add_argument("--dir", help="a `diloco up` output folder: the URL, run and credentials of its run "
                                 "(its watch.env; --url and --run still win)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")


def _watch_env(folder: str) -> dict[str, str]:
    """The variables of ``<folder>/watch.env`` (ConfigError, one line, if there is none)."""
    from bus.config import parse_env_file

    path = os.path.join(folder, "watch.env")
    try:
        with open(path) as f:
            return parse_env_file(f.read())
    except OSError as e:
        raise ConfigError(f"--dir={folder!r}: no {path} ({e.strerror}): is it the --out folder of a running "
                          "`diloco up`?") from None


def _config(a: argparse.Namespace) -> CommonConfig:
    over: dict[str, Any] = {}
    environ = None
    if getattr(a, "dir", None):
        environ = {**os.environ, **_watch_env(a.dir)}  # the run's own values win over the shell's
        environ.update(getattr(a, "env_over", None) or {})  # a command's own user (diloco trust clear: the admin)
    for attr, field, parse in (("url", "nats_url", nats_urls()), ("run", "run", token())):
        value = getattr(a, attr)
        if value is not None:
            try:
                over[field] = parse(value)
            except ValueError as e:
                raise ConfigError(f"--{attr}={value!r}: {e}") from None
    return from_env(CommonConfig, environ, **over)


def _describe(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if text.startswith("nats: "):
        text = text[6:]
    return text.strip("'\"")


async def open_connection(cfg: CommonConfig, name: str, log_states: bool = False):
    """A connected client, or :class:`CliError` with the one line of ``bus.conn.ConnectFailed``
    (the URL, what went wrong, what to check) after DILOCO_CONNECT_TIMEOUT seconds of attempts.
    Once connected it reconnects through outages (the live viewer rides out blips).

    ``log_states``: log one line per change of the connection's state (``diloco metrics --serve``);
    otherwise the command shows the state itself (the live table's footer) and logs nothing."""

    async def quiet(*_: object) -> None:
        return None

    calls: dict = {} if log_states else dict(error_cb=quiet, disconnected_cb=quiet, reconnected_cb=quiet)
    try:
        # a one-off command fails at once when nothing listens; the exporter (--serve) waits like a role
        return await connect(cfg, name=name, refused_grace=None if log_states else REFUSED_GRACE, **calls)
    except ConnectFailed as e:
        raise CliError(str(e), EXIT_UNAVAILABLE) from None


def _run_cli(prog: str, coro_fn, a: argparse.Namespace) -> int:
    try:
        cfg = _config(a)
        # logs go to stderr (stdout stays clean for --json); the viewers log nothing at the default level
        setup(cfg.log_level, run=cfg.run, role="cli")
        return asyncio.run(coro_fn(cfg, a))
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CliError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return e.code
    except BrokenPipeError:
        return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{int(n)}B"


# --------------------------------------------------------------------------- diloco metrics


def snapshot_to_dict(snap: MetricsSnapshot) -> dict[str, Any]:
    """JSON-able form of a metrics snapshot (``diloco metrics --once --json``)."""

    def row(r) -> dict[str, Any] | None:
        return None if r is None else dataclasses.asdict(r)

    agg = row(snap.aggregator)
    if agg is not None:
        agg["versions"] = {str(f): v for f, v in snap.aggregator.versions}
        agg["rejected"] = dict(snap.aggregator.rejected)
    mon = row(snap.monitor)
    if mon is not None:
        mon["counts"] = dict(snap.monitor.counts)
    return {
        "run": snap.run,
        "learners": {name: row(snap.learners[name]) for name in sorted(snap.learners)},
        "aggregator": agg,
        "monitor": mon,
        "evaluator": row(snap.evaluator),
        "applied": snap.applied,
        "malformed": dict(snap.malformed),
        "skipped": dict(snap.skipped),
        "last_ts": snap.last_ts,
    }


#: membership states whose learners are expected to report metrics (suspect ones have gone silent)
LIVE_STATES = ("joining", "active", "rejoining")


def expected_learners(states: dict[str, tuple[str, str]], role: str | None = None, learner: str | None = None,
                      region: str | None = None) -> set[str]:
    """The learners ``diloco metrics --once`` waits for: those the members bucket holds as live
    ({learner: (state, region)}), within the ``--role/--learner/--region`` filters."""
    if role not in (None, "learner"):
        return set()
    return {k for k, (state, reg) in states.items()
            if state in LIVE_STATES and (learner is None or k == learner) and (region is None or reg == region)}


def missing_reports(snap: MetricsSnapshot, learners: set[str], roles: set[str]) -> list[str]:
    """What a ``--once`` snapshot still lacks: the expected learners and roles (aggregator,
    monitor) that have not reported yet, sorted; [] when it is complete."""
    have = {"aggregator": snap.aggregator, "monitor": snap.monitor, "evaluator": snap.evaluator}
    return sorted(learners - set(snap.learners)) + sorted(r for r in roles if have.get(r) is None)


async def _roster(nc, run: str, a: argparse.Namespace) -> tuple[set[str], set[str]]:
    """(learners, roles) a ``--once`` snapshot waits for: the members bucket's live learners, the
    monitor if its lease is valid, the aggregator if the run has a manifest. Nothing where the
    bucket cannot be read (the snapshot then takes the whole ``--wait``)."""
    from nats.js.errors import BucketNotFoundError, KeyNotFoundError

    from monitor.lease import LEASE_KEY, parse_lease
    from monitor.store import load_members

    js = nc.jetstream(timeout=2.0)
    s = Subjects(run)
    learners: set[str] = set()
    roles: set[str] = set()
    try:
        members, _, _ = await load_members(await js.key_value(s.bucket("members")), timeout=2.0)
        learners = expected_learners({k: (m.state.value, m.region) for k, m in members.items()},
                                     a.role, a.learner, a.region)
    except (BucketNotFoundError, Exception):  # noqa: BLE001 - no run, no permission: wait the whole --wait
        return set(), set()
    if a.role in (None, "monitor") and a.learner is None and a.region is None:
        try:
            entry = await (await js.key_value(s.bucket("lease"))).get(LEASE_KEY)
            if parse_lease(entry.value, entry.revision).until > time.time():
                roles.add("monitor")
        except (BucketNotFoundError, KeyNotFoundError, Exception):  # noqa: BLE001
            pass
    if a.role in (None, "aggregator") and a.learner is None and a.region is None:
        try:
            from bus.protocol import MANIFEST_KEY

            await (await js.key_value(s.bucket("run"))).get(MANIFEST_KEY)
            roles.add("aggregator")
        except (BucketNotFoundError, KeyNotFoundError, Exception):  # noqa: BLE001
            pass
    return learners, roles


def _bump_malformed(snap: MetricsSnapshot, reason: str) -> MetricsSnapshot:
    bad = dict(snap.malformed)
    bad[reason] = bad.get(reason, 0) + 1
    return dataclasses.replace(snap, malformed=bad)


async def _metrics(cfg: CommonConfig, a: argparse.Namespace) -> int:
    stop = asyncio.Event()
    install_stop(stop)
    nc = await open_connection(cfg, name="cli-metrics", log_states=bool(a.serve))
    started = time.monotonic()
    state: dict[str, Any] = {"snap": MetricsSnapshot(run=cfg.run), "received": None}
    stream_lines = a.json and not a.once

    async def on_msg(m) -> None:
        state["received"] = time.monotonic()
        try:
            msg = loads_json(m.data)
        except CodecError:
            if not stream_lines and a.role is None and a.learner is None and a.region is None:
                state["snap"] = _bump_malformed(state["snap"], "not_json")
            return
        if not filter_msg(msg, role=a.role, learner=a.learner, region=a.region):
            return
        if stream_lines:
            try:
                sys.stdout.write(dumps_json(msg).decode() + "\n")
                sys.stdout.flush()
            except BrokenPipeError:
                stop.set()
            except TypeError:
                pass
        else:
            state["snap"] = fold(state["snap"], msg)

    sub = await nc.subscribe(Subjects(cfg.run).metrics_all, cb=on_msg)
    if a.serve:
        from monitor.prometheus import serve

        try:
            def health() -> tuple[bool, float]:
                return nc.is_connected, time.monotonic() - (state["received"] or started)

            server, _, (host, port) = serve(a.serve, lambda: state["snap"], health)
        except OSError as e:
            print(f"diloco metrics: cannot serve on {a.serve}: {e}", file=sys.stderr)
            await nc.close()
            return 2
        print(f"serving Prometheus metrics of run {cfg.run} on http://{host}:{port}/metrics (Ctrl-C quits)",
              flush=True)
        try:
            await stop.wait()
            return 0
        finally:
            server.shutdown()
            try:
                await nc.close()
            except Exception:
                pass
    try:
        if a.once:
            t_start = time.monotonic()
            deadline = t_start + a.wait
            learners, roles = await _roster(nc, cfg.run, a)
            # the evaluator is in no roster: it has reported, or two metrics intervals passed
            # without it (every role publishes at least once per DILOCO_METRICS_INTERVAL); a snapshot
            # that stopped at the roster alone showed no evaluator row in compose's run, and so did
            # one that waited 1.25 intervals (CI: a loaded machine spaced the evaluator's records
            # 0.5 s apart by up to 0.64 s)
            eval_window = (EVALUATOR_WINDOW * cfg.metrics_interval
                           if a.role in (None, "evaluator") and a.learner is None and a.region is None else 0.0)

            def incomplete() -> bool:
                if missing_reports(state["snap"], learners, roles) or not (learners or roles):
                    return True
                return state["snap"].evaluator is None and time.monotonic() - t_start < eval_window

            # until every live learner (and the monitor, aggregator, evaluator) has reported, at most --wait s
            while not stop.is_set() and incomplete() and time.monotonic() < deadline:
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
            missing = missing_reports(state["snap"], learners, roles)
            await sub.unsubscribe()
            if missing:
                print(f"diloco metrics: not heard from {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''} "
                      f"within --wait {a.wait:g}s (live in the members bucket)", file=sys.stderr)
            if a.json:
                print(dumps_json(snapshot_to_dict(state["snap"])).decode())
            else:
                width = shutil.get_terminal_size((100, 24)).columns
                print(render_table(state["snap"], width=width, now=time.time()))
            return 0
        while not stop.is_set():
            if not stream_lines:
                width = shutil.get_terminal_size((100, 24)).columns
                conn = "connected" if nc.is_connected else "DISCONNECTED, reconnecting"
                footer = f"{redact_url(cfg.nats_url)} ({conn}) | refresh {a.interval:g}s | Ctrl-C quits"
                try:
                    sys.stdout.write(CLEAR + render_table(state["snap"], width=width, now=time.time()) + "\n"
                                     + footer[:width] + "\n")
                    sys.stdout.flush()
                except BrokenPipeError:
                    break
            try:
                await asyncio.wait_for(stop.wait(), timeout=a.interval)
            except asyncio.TimeoutError:
                pass
        return 0
    finally:
        try:
            await nc.close()
        except Exception:
            pass


def cmd_metrics(argv: list[str]) -> int:
    """``diloco metrics``: live table (or JSON lines) of a run's metrics."""
    p = argparse.ArgumentParser(prog="diloco metrics", description="Live table of a run's metrics messages.")
    _add_common_args(p)
    p.add_argument("--once", action="store_true",
                   help="print one snapshot and exit, as soon as every live learner of the members bucket (and "
                        "the monitor, aggregator and evaluator: one metrics interval for an evaluator) has "
                        "reported, or after --wait seconds")
    p.add_argument("--wait", type=float, default=5.0,
                   help="seconds --once waits at most for the reports (default 5)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws of the live table")
    p.add_argument("--role", choices=ROLES, help="only messages of this role")
    p.add_argument("--learner", help="only messages of this learner")
    p.add_argument("--region", help="only messages of this region")
    p.add_argument("--serve", metavar="HOST:PORT",
                   help="serve the run's metrics for Prometheus at http://HOST:PORT/metrics instead of the table "
                        "(:9464 listens on 127.0.0.1 only; 0.0.0.0:9464 on every interface)")
    a = p.parse_args(argv)
    if not (a.wait >= 0 and math.isfinite(a.wait)) or not (a.interval > 0 and math.isfinite(a.interval)):
        p.error("--wait must be >= 0 and --interval > 0")
    if a.serve:
        from monitor.prometheus import parse_listen

        if a.once or a.json:
            p.error("--serve runs until stopped: it takes neither --once nor --json")
        try:
            parse_listen(a.serve)
        except ValueError as e:
            p.error(str(e))
    return _run_cli("diloco metrics", _metrics, a)


# --------------------------------------------------------------------------- diloco status
