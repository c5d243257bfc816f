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

An unreachable server or a refused login is one line on stderr and exit status 1, after at most
``DILOCO_CONNECT_TIMEOUT`` seconds (10) of attempts (``bus.conn.connect``). Logs (JSON lines on
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
from bus.conn import ConnectFailed, connect, redact_url
from bus.log import setup
from bus.subjects import Subjects
from monitor.metrics_view import ROLES, MetricsSnapshot, filter_msg, fold, render_table

CLEAR = "\x1b[H\x1b[2J"


class CliError(RuntimeError):
    """A failure worth one line on stderr (exit status 1)."""


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
        return await connect(cfg, name=name, **calls)
    except ConnectFailed as e:
        raise CliError(str(e)) from None


def _run_cli(prog: str, coro_fn, a: argparse.Namespace) -> int:
    try:
        cfg = _config(a)
        # logs go to stderr (stdout stays clean for --json); the viewers log nothing at the default level
        setup(cfg.log_level, run=cfg.run, role="cli")
        return asyncio.run(coro_fn(cfg, a))
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except CliError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


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
            try:
                await asyncio.wait_for(stop.wait(), timeout=a.wait)
            except asyncio.TimeoutError:
                pass
            await sub.unsubscribe()
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
    p.add_argument("--once", action="store_true", help="collect for --wait seconds, print one snapshot, exit")
    p.add_argument("--wait", type=float, default=3.0, help="seconds --once collects messages (default 3)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws of the live table")
    p.add_argument("--role", choices=ROLES, help="only messages of this role")
    p.add_argument("--learner", help="only messages of this learner")
    p.add_argument("--region", help="only messages of this region")
    p.add_argument("--serve", metavar="HOST:PORT",
                   help="serve the run's metrics for Prometheus at http://HOST:PORT/metrics instead of the table "
                        "(:9464 listens on every interface)")
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
