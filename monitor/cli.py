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

An unreachable server or a refused login is one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import os
import asyncio
import dataclasses
import math
import re
import shutil
import sys
import time
from typing import Any

from bus.signals import install_stop
from bus.codec import CodecError, dumps_json, loads_json
from bus.config import CommonConfig, ConfigError, from_env, nats_urls, token
from bus.conn import connect
from bus.log import setup
from bus.subjects import GLOBAL, Subjects
from monitor.metrics_view import ROLES, MetricsSnapshot, filter_msg, fmt_age, fold, render_table

CLEAR = "\x1b[H\x1b[2J"


class CliError(RuntimeError):
    """A failure worth one line on stderr (exit status 1)."""


# --------------------------------------------------------------------------- shared


def redact_url(url: str) -> str:
    """``nats://user:secret@host`` -> ``nats://***@host`` (URLs end up in error messages)."""
    return re.sub(r"//[^@/,]*@", "//***@", url)


def _add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="NATS URL(s), comma-separated (default: $DILOCO_NATS_URL)")
    p.add_argument("--run", help="run id (default: $DILOCO_RUN)")
    p.add_argument("--dir", help="a `diloco up` output folder: the URL, run and credentials of its run "
                                 "(its watch.env; --url and --run still win)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")


def _watch_env(folder: str) -> dict[str, str]:
    """The variables of ``<folder>/watch.env`` (ConfigError, one line, if there is none)."""
    from bus.auth import parse_env_file

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


async def open_connection(cfg: CommonConfig, name: str, persistent: bool = False, timeout: float = 15.0):
    """A connected client, or :class:`CliError` with the reason after a couple of quick attempts.

    ``persistent``: once the server answered, reconnect forever (the live viewer rides out blips).
    """
    errors: list[BaseException] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    async def quiet() -> None:
        return None

    try:
        nc = await asyncio.wait_for(
            connect(cfg, name=name, max_reconnect_attempts=1, reconnect_time_wait=0.2, connect_timeout=3,
                    error_cb=on_error, disconnected_cb=quiet, reconnected_cb=quiet),
            timeout,
        )
    except BaseException as e:  # noqa: BLE001 - asyncio.TimeoutError, NoServersError, OSError, auth...
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        real = [x for x in errors if type(x).__name__ != "NoServersError"]
        cause = real[-1] if real else e
        raise CliError(f"cannot connect to {redact_url(cfg.nats_url)}: {_describe(cause)}") from None
    if not persistent:
        return nc
    await nc.close()
    return await asyncio.wait_for(
        connect(cfg, name=name, error_cb=on_error, disconnected_cb=quiet, reconnected_cb=quiet), timeout
    )


def _run_cli(prog: str, coro_fn, a: argparse.Namespace) -> int:
    setup("error")  # logs (if any) go to stderr, only errors: stdout stays clean for --json
    try:
        cfg = _config(a)
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
    nc = await open_connection(cfg, name="cli-metrics", persistent=not a.once)
    state = {"snap": MetricsSnapshot(run=cfg.run)}
    stream_lines = a.json and not a.once

    async def on_msg(m) -> None:
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
            server, _, (host, port) = serve(a.serve, lambda: state["snap"])
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


def _version(nc) -> str:
    v = nc.connected_server_version
    try:
        return f"{v.major}.{v.minor}.{v.patch}"
    except Exception:  # noqa: BLE001
        return "unknown"


def heard_from_monitor(msg: Any) -> dict[str, float]:
    """{learner: newest heartbeat time} from a monitor's metrics message (its ``seen`` map); {} when
    the message has none or is malformed (bad entries are skipped, at most 4096 are read)."""
    seen = msg.get("seen") if isinstance(msg, dict) and msg.get("role") == "monitor" else None
    if not isinstance(seen, dict):
        return {}
    out: dict[str, float] = {}
    for k, v in list(seen.items())[:4096]:
        if isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                and v > 0:
            out[k] = float(v)
    return out


def freshen_seen(members: list[dict[str, Any]], heard: dict[str, float]) -> list[dict[str, Any]]:
    """Members with ``last_seen`` moved to a monitor's fresher heartbeat time (``seen_from``: "monitor"),
    or left as the bucket has it ("record"). The bucket is rewritten only every DILOCO_KV_REFRESH (5 s),
    so its ``last_seen`` alone made SEEN read 4-5 s for learners beating every second."""
    out = []
    for m in members:
        t = heard.get(m.get("learner"))
        if t is not None and t > (m.get("last_seen") or 0.0):
            out.append({**m, "last_seen": t, "seen_from": "monitor"})
        else:
            out.append({**m, "seen_from": "record"})
    return out


async def gather_status(nc, run: str, seen_wait: float = 0.0) -> dict[str, Any]:
    """One snapshot of ``run`` from JetStream and KV (pure reads; every section fails alone).

    ``seen_wait > 0``: also listen to the monitors' metrics messages for up to that many seconds
    (until the leader's arrives) and take their fresher heartbeat times (:func:`freshen_seen`)."""
    from nats.js.errors import BucketNotFoundError, KeyNotFoundError

    from bus.protocol import MANIFEST_KEY, Manifest
    from bus.streams import inspect_run
    from bus.transport import VersionedStore
    from monitor.lease import LEASE_KEY, parse_lease
    from monitor.membership import count_states, member_to_dict
    from monitor.service import load_members

    js = nc.jetstream(timeout=5.0)
    s = Subjects(run)
    heard: dict[str, float] = {}
    leader_heard = asyncio.Event()
    sub = None
    if seen_wait > 0:
        async def on_monitor(m) -> None:
            try:
                msg = loads_json(m.data)
            except CodecError:
                return
            for k, v in heard_from_monitor(msg).items():
                heard[k] = max(heard.get(k, 0.0), v)
            if isinstance(msg, dict) and msg.get("leader") is True:
                leader_heard.set()

        try:
            sub = await nc.subscribe(f"{s.prefix}.metrics.monitor.*", cb=on_monitor)
        except Exception:  # noqa: BLE001 - not allowed or not connected: the records alone
            sub = None
    now = time.time()
    info = getattr(nc, "_server_info", {}) or {}
    url = nc.connected_url
    out: dict[str, Any] = {
        "run": run,
        "ts": now,
        "server": {
            "url": redact_url(url.geturl()) if url is not None else None,
            "version": info.get("version") or _version(nc),
            "name": info.get("server_name"),
            "id": info.get("server_id"),
            "jetstream": bool(info.get("jetstream")),
            "max_payload": nc.max_payload,
            "connected": nc.is_connected,
        },
    }

    try:
        t0 = time.monotonic()
        await nc.flush(timeout=5)
        out["server"]["rtt_ms"] = round((time.monotonic() - t0) * 1000, 2)
        acct = await js.account_info()
        lim = acct.limits
        out["jetstream"] = {
            "memory": acct.memory, "storage": acct.storage, "streams": acct.streams, "consumers": acct.consumers,
            "domain": acct.domain,
            "limits": {k: getattr(lim, k, None) for k in ("max_memory", "max_storage", "max_streams", "max_consumers")},
            "api": {"total": getattr(acct.api, "total", None), "errors": getattr(acct.api, "errors", None)},
        }
    except Exception as e:  # noqa: BLE001 - e.g. JetStream not enabled for this account
        out["jetstream"] = {"error": _describe(e)}

    try:
        kv = await js.key_value(s.bucket("members"))
        members, revs, bad = await load_members(kv)
        out["membership"] = {
            "counts": count_states(members),
            "members": [{**member_to_dict(members[k]), "revision": revs.get(k)} for k in sorted(members)],
            "unreadable": bad,
        }
    except BucketNotFoundError:
        out["membership"] = None
    except Exception as e:  # noqa: BLE001
        out["membership"] = {"error": _describe(e)}
    if sub is not None:
        if isinstance(out["membership"], dict) and out["membership"].get("members"):
            try:
                await asyncio.wait_for(leader_heard.wait(), timeout=seen_wait)
            except asyncio.TimeoutError:
                pass
            out["membership"]["members"] = freshen_seen(out["membership"]["members"], heard)
            out["ts"] = now = time.time()
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001
            pass

    try:
        lkv = await js.key_value(s.bucket("lease"))
        entry = await lkv.get(LEASE_KEY)
        lease = parse_lease(entry.value, entry.revision)
        out["leader"] = {"id": lease.holder, "until": lease.until, "valid": lease.until > now}
    except (BucketNotFoundError, KeyNotFoundError):
        out["leader"] = None
    except Exception as e:  # noqa: BLE001
        out["leader"] = {"error": _describe(e)}

    manifest = None
    try:
        rkv = await js.key_value(s.bucket("run"))
        entry = await rkv.get(MANIFEST_KEY)
        manifest = Manifest.from_dict(loads_json(entry.value))  # type: ignore[arg-type]
        out["manifest"] = manifest.to_dict()
    except (BucketNotFoundError, KeyNotFoundError):
        out["manifest"] = None
    except Exception as e:  # noqa: BLE001 - CodecError, malformed manifest
        out["manifest"] = {"error": _describe(e)}

    if manifest is not None:
        store = VersionedStore(js, run, GLOBAL)
        versions: dict[str, int | None] = {}
        for f in range(manifest.num_fragments):
            try:
                h = await store.head(f)
                versions[str(f)] = None if h is None else h.version
            except Exception:  # noqa: BLE001 - a bad head record
                versions[str(f)] = None
        out["versions"] = versions
    else:
        out["versions"] = None

    try:
        out["streams"] = await inspect_run(js, run)
    except Exception as e:  # noqa: BLE001
        out["streams"] = {"error": _describe(e)}
    return out


def render_status(st: dict[str, Any], width: int = 120) -> str:
    """Text form of :func:`gather_status` output (deterministic given ``st``)."""
    now = st.get("ts") or 0.0
    lines = [f"run        {st['run']}"]
    srv = st["server"]
    rtt = srv.get("rtt_ms")
    lines.append(
        f"server     {srv.get('url')}  nats-server {srv.get('version')}"
        + (f"  name {srv['name']}" if srv.get("name") else "")
        + f"  max_payload {_fmt_bytes(srv.get('max_payload'))}"
        + (f"  rtt {rtt:.1f}ms" if isinstance(rtt, (int, float)) else "")
    )
    js = st.get("jetstream") or {}
    if "error" in js:
        lines.append(f"jetstream  ERROR {js['error']}")
    else:
        lines.append(
            f"jetstream  {js.get('streams')} streams, {js.get('consumers')} consumers, "
            f"storage {_fmt_bytes(js.get('storage'))}, memory {_fmt_bytes(js.get('memory'))}"
            + (f", domain {js['domain']}" if js.get("domain") else "")
        )

    leader = st.get("leader")
    if leader is None:
        lines.append("leader     none (no monitor has taken the lease)")
    elif "error" in leader:
        lines.append(f"leader     ERROR {leader['error']}")
    elif leader["valid"]:
        lines.append(f"leader     {leader['id']} (lease valid for {fmt_age(leader['until'] - now)})")
    else:
        lines.append(f"leader     {leader['id'] or '?'} (lease EXPIRED {fmt_age(now - leader['until'])} ago)")

    ms = st.get("membership")
    if ms is None:
        lines.append("members    no membership bucket: the run has not been created (diloco run create)")
    elif "error" in ms:
        lines.append(f"members    ERROR {ms['error']}")
    else:
        counts = ", ".join(f"{k} {n}" for k, n in ms["counts"].items())
        lines.append(f"members    {len(ms['members'])}: {counts}")
        if ms["members"]:
            rows = [("LEARNER", "REGION", "STATE", "SINCE", "SEEN", "STEP", "REASON")]
            for m in ms["members"]:
                rows.append((m["learner"], m["region"], m["state"], fmt_age(now - m["since"]),
                             fmt_age(now - m["last_seen"]), str(m["step"]), m["reason"]))
            widths = [max(len(r[i]) for r in rows) for i in range(6)]
            for r in rows:
                text = "  " + "  ".join(c.ljust(w) for c, w in zip(r[:6], widths)) + "  " + r[6]
                lines.append(text[:width])
        for key, why in ms.get("unreadable", {}).items():
            lines.append(f"  unreadable record {key}: {why}"[:width])

    man = st.get("manifest")
    vers = st.get("versions")
    if man is None:
        lines.append("versions   no run manifest yet (the aggregator writes it when it creates version 0)")
    elif "error" in man:
        lines.append(f"versions   ERROR reading the manifest: {man['error']}")
    else:
        vals = [v for v in (vers or {}).values() if v is not None]
        head = (f"versions   {man['num_fragments']} fragments, model {str(man['model_hash'])[:12]}, "
                f"plan {str(man['plan_hash'])[:12]}")
        if vals:
            head += f", v{min(vals)}..v{max(vals)}"
        lines.append(head)
        cells = [f"f{f}={'-' if v is None else f'v{v}'}" for f, v in (vers or {}).items()]
        line = " "
        for c in cells:
            if len(line) + len(c) + 1 > width:
                lines.append(line)
                line = " "
            line += " " + c
        if line.strip():
            lines.append(line)

    streams = st.get("streams") or {}
    if "error" in streams:
        lines.append(f"streams    ERROR {streams['error']}")
    else:
        lines.append("streams")
        w = max([len(k) for k in streams] + [4])
        for name, info in streams.items():
            if info is None:
                lines.append(f"  {name.ljust(w)}  missing")
            else:
                lines.append(f"  {name.ljust(w)}  {info['messages']:>9} msgs  {_fmt_bytes(info['bytes']):>9}")
    return "\n".join(lines)


async def _status(cfg: CommonConfig, a: argparse.Namespace) -> int:
    nc = await open_connection(cfg, name="cli-status")
    try:
        st = await gather_status(nc, cfg.run, seen_wait=a.wait)
    finally:
        try:
            await nc.close()
        except Exception:
            pass
    if a.json:
        print(dumps_json(st).decode())
    else:
        print(render_status(st, width=max(60, shutil.get_terminal_size((120, 24)).columns)))
    return 0


def cmd_status(argv: list[str]) -> int:
    """``diloco status``: one snapshot of a run from JetStream and KV."""
    p = argparse.ArgumentParser(
        prog="diloco status",
        description="One snapshot of a run: membership, leader, version per fragment, streams, server health.",
    )
    _add_common_args(p)
    p.add_argument("--wait", type=float, default=2.5,
                   help="seconds to wait for the leading monitor's metrics message, whose heartbeat times are "
                        "fresher than the members bucket's (rewritten every DILOCO_KV_REFRESH); 0: the bucket "
                        "only (default 2.5)")
    a = p.parse_args(argv)
    if not (a.wait >= 0 and math.isfinite(a.wait)):
        p.error("--wait must be >= 0")
    return _run_cli("diloco status", _status, a)
