"""``diloco status``: one snapshot of a run read from JetStream and KV (membership with each
learner's freshest heartbeat time, leader lease, version per fragment, stream sizes, server health).
The connection, argument and error handling it shares with ``diloco metrics`` are in
:mod:`monitor.cli`.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import time
from typing import Any

from bus.codec import CodecError, dumps_json, loads_json
from bus.config import CommonConfig
from bus.subjects import GLOBAL, Subjects
from monitor.metrics_view import fmt_age

from bus.entry import EXIT_UNAVAILABLE
from monitor.cli import CliError, _add_common_args, _describe, _fmt_bytes, _run_cli, open_connection, redact_url


def _version(nc) -> str:
    v = nc.connected_server_version
    try:
        return f"{v.major}.{v.minor}.{v.patch}"
    except Exception:  # noqa: BLE001
        return "unknown"


def unanswered(e: BaseException) -> bool:
    """A request that got no answer, or a connection gone: the server is not there any more (not a
    refusal or an error it answered with)."""
    from nats.errors import ConnectionClosedError
    from nats.errors import TimeoutError as NatsTimeout

    return isinstance(e, (asyncio.TimeoutError, TimeoutError, NatsTimeout, ConnectionClosedError, ConnectionError))


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
        t = heard.get(str(m.get("learner")))
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
    aggregator_heard = asyncio.Event()
    trust_by_agg: dict[str, dict] = {}  # aggregator id -> its metrics' per-learner trust (aggregator.trust)
    aggregators: dict[str, dict] = {}  # aggregator id (a shard worker's) -> aggregator_summary
    sub = agg_sub = None
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

        on_aggregator = trust_listener(trust_by_agg, aggregator_heard, aggregators)

        try:
            sub = await nc.subscribe(f"{s.prefix}.metrics.monitor.*", cb=on_monitor)
            agg_sub = await nc.subscribe(f"{s.prefix}.metrics.aggregator.*", cb=on_aggregator)
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
        if unanswered(e) or not nc.is_connected:  # a server going away: every section would wait 5 s for nothing
            raise CliError(f"the server at {out['server']['url']} does not answer ({_describe(e) or 'timeout'}): "
                           "is the run still running (a stopped `diloco up` takes its server with it)?",
                           EXIT_UNAVAILABLE) from None
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
    out["progress"] = await read_progress(js, s)
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
    if sub is not None:
        if isinstance(out["membership"], dict) and out["membership"].get("members"):
            try:
                await asyncio.wait_for(leader_heard.wait(), timeout=seen_wait)
            except asyncio.TimeoutError:
                pass
            out["membership"]["members"] = freshen_seen(out["membership"]["members"], heard)
        if manifest is not None or (isinstance(out["membership"], dict) and out["membership"].get("members")):
            try:
                await asyncio.wait_for(aggregator_heard.wait(), timeout=max(0.0, seen_wait - (time.time() - now)))
            except asyncio.TimeoutError:
                pass
            # every aggregator process (shard workers each own some fragments), as long as the wait allows
            want = manifest.num_fragments if manifest is not None else 0
            while fragments_covered(aggregators.values()) < want and time.time() - now < seen_wait:
                await asyncio.sleep(0.05)
            out["ts"] = now = time.time()
        out["trust"] = merge_trust(trust_by_agg) if trust_by_agg else None
        out["aggregators"] = [aggregators[k] for k in sorted(aggregators)]
        for x in (sub, agg_sub):
            try:
                if x is not None:
                    await x.unsubscribe()
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


def trust_listener(by_aggregator: dict[str, dict], heard: asyncio.Event, summaries: dict[str, dict] | None = None):
    """A callback for aggregators' metrics messages: each one's per-learner trust records into
    ``by_aggregator`` (by aggregator id), ``heard`` set at the first; with ``summaries``, each
    one's :func:`aggregator_summary` too (its shard workers: one entry each)."""

    async def on_aggregator(m) -> None:
        try:
            msg = loads_json(m.data)
        except CodecError:
            return
        if isinstance(msg, dict) and isinstance(msg.get("trust"), dict):
            by_aggregator[str(msg.get("id"))] = msg["trust"]
            if summaries is not None:
                summaries[str(msg.get("id"))] = aggregator_summary(msg)
            heard.set()

    return on_aggregator


def fragments_covered(summaries) -> int:
    """Fragments owned by the aggregators of ``summaries`` (their ``fragments``: all, N or A-B)."""
    owned: set[int] = set()
    for x in summaries:
        f = str(x.get("fragments") or "")
        a, _, b = f.partition("-")
        if f == "all":
            return 1 << 30
        if a.isdigit() and (b == "" or b.isdigit()):
            owned.update(range(int(a), int(b or a) + 1))
    return len(owned)


def aggregator_summary(msg: dict) -> dict:
    """What ``diloco status`` shows of one aggregator process (a shard worker of ``diloco
    aggregator``, or an aggregator started with its own DILOCO_AGG_FRAGMENTS) from its metrics."""
    versions = [v for v in (msg.get("versions") or {}).values() if isinstance(v, int)]
    rejected = msg.get("rejected") or {}
    return {"id": str(msg.get("id")), "fragments": msg.get("fragments"), "ts": msg.get("ts"),
            "versions": [min(versions), max(versions)] if versions else None,
            "busy": msg.get("busy"), "saturated": bool(msg.get("saturated")), "accepted": msg.get("accepted"),
            "rejected": sum(v for v in rejected.values() if isinstance(v, int)) if isinstance(rejected, dict) else None,
            "buffered": sum((msg.get("buffered") or {}).values()), "replayed": msg.get("replayed"),
            "replay_lost": msg.get("replay_lost")}


async def gather_trust(nc, run: str, wait: float) -> dict[str, dict] | None:
    """Per learner, the least trusting aggregator's trust record (their metrics, listened to for up
    to ``wait`` seconds: until one is heard and 0.5 s more for the others); None if none was heard."""
    by_agg: dict[str, dict] = {}
    heard = asyncio.Event()
    sub = await nc.subscribe(f"{Subjects(run).prefix}.metrics.aggregator.*", cb=trust_listener(by_agg, heard))
    try:
        try:
            await asyncio.wait_for(heard.wait(), timeout=wait)
            await asyncio.sleep(min(0.5, wait))
        except asyncio.TimeoutError:
            pass
    finally:
        await sub.unsubscribe()
    return merge_trust(by_agg) if by_agg else None


def merge_trust(by_aggregator: dict[str, dict]) -> dict[str, dict]:
    """Per learner, the least trusting of the aggregators' records (each owns some fragments)."""
    out: dict[str, dict] = {}
    for trust in by_aggregator.values():
        for learner, rec in trust.items():
            if not isinstance(rec, dict):
                continue
            cur = out.get(learner)
            if cur is None or _rank(rec) < _rank(cur):
                out[learner] = dict(rec)
    return out


def _rank(rec: dict) -> tuple[float, float]:
    score = rec.get("score")
    return (float(rec.get("trust", 1.0)), 1.0 if score is None else float(score))


def trust_cell(rec: dict[str, Any] | None) -> str:
    """The TRUST column: the weight a learner's contributions merge at, and why it is suspected."""
    if not rec:
        return "-"
    if rec.get("reason") and rec.get("weighed") is False:  # observe: suspected, merged in full
        return f"1.00 {rec['reason']} (observed)"
    cell = f"{float(rec.get('trust', 1.0)):.2f}"
    return f"{cell} {rec['reason']}" if rec.get("reason") else cell


def suspicion(name: str, rec: dict) -> str:
    """One suspect with its evidence: the median of its pairwise agreements, its best partner and its
    agreement with itself, each relative to the typical agreement of its fragment (an honest learner
    is near 1, a negation near -1, a random direction near 0 on all three)."""
    ev = rec.get("evidence") or {}
    own = ev.get("own")
    parts = [rec.get("reason", "?"), f"median {ev.get('median')}", f"best {ev.get('best')} ({ev.get('partner')})",
             f"own {own if own is not None else '-'}", f"on {rec.get('suspected_on', '?')}/{rec.get('fragments', '?')} fragments"]
    if rec.get("weighed") is False:
        parts.append("observed only: merged in full")
    else:
        parts.append(f"{rec.get('distrusted', 0)} merged at weight 0")
    return f"{name} ({', '.join(parts)})"


async def read_progress(js, s: Subjects) -> dict[str, Any] | None:
    """{learner: its progress record (``bus.progress``)} (None: a run without the bucket; an
    unreadable record as {"error": ...})."""
    from nats.js.errors import BucketNotFoundError, NoKeysError

    from bus.progress import BadProgress, KIND, progress_from_dict

    try:
        kv = await js.key_value(s.bucket(KIND))
    except BucketNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001
        return {"error": _describe(e)}
    try:
        keys = await kv.keys()
    except NoKeysError:
        return {}
    except Exception as e:  # noqa: BLE001
        return {"error": _describe(e)}
    out: dict[str, Any] = {}
    for k in keys[:4096]:
        try:
            out[k] = progress_from_dict(loads_json((await kv.get(k)).value or b"null")).to_dict()
        except (BadProgress, CodecError, ValueError) as e:
            out[k] = {"error": str(e)}
        except Exception as e:  # noqa: BLE001
            out[k] = {"error": _describe(e)}
    return out


def restarts_cell(rec: dict[str, Any] | None) -> str:
    """``2 (14 lost)``: processes started with this id after its first, and the steps they lost."""
    if not isinstance(rec, dict) or "restarts" not in rec:
        return "-"
    return f"{rec['restarts']} ({rec.get('lost', 0)} lost)" if rec["restarts"] else "0"


def aggregator_lines(aggs: list[dict] | None, now: float, width: int) -> list[str]:
    """The aggregator processes heard (one row per shard worker), or nothing if none was."""
    if not aggs:
        return []
    lines = [f"aggregators {len(aggs)} heard"]
    rows = [("ID", "FRAGMENTS", "VERSIONS", "BUSY", "ACCEPTED", "REJECTED", "BUFFERED", "REPLAYED", "HEARD")]
    for a in aggs:
        v = a.get("versions")
        busy = a.get("busy")
        rows.append((a["id"], str(a.get("fragments") or "?"), f"v{v[0]}..v{v[1]}" if v else "-",
                     (f"{busy:.2f}" if isinstance(busy, (int, float)) else "-") + (" SATURATED" if a.get("saturated") else ""),
                     str(a.get("accepted", "-")), str(a.get("rejected", "-")), str(a.get("buffered", "-")),
                     f"{a.get('replayed') or 0}" + (f" ({a['replay_lost']} lost)" if a.get("replay_lost") else ""),
                     fmt_age(now - a["ts"]) + " ago" if isinstance(a.get("ts"), (int, float)) else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        lines.append(("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths))).rstrip()[:width])
    return lines


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

    lines += aggregator_lines(st.get("aggregators"), now, width)

    ms = st.get("membership")
    if ms is None:
        lines.append("members    no membership bucket: the run has not been created (diloco run create)")
    elif "error" in ms:
        lines.append(f"members    ERROR {ms['error']}")
    else:
        counts = ", ".join(f"{k} {n}" for k, n in ms["counts"].items())
        lines.append(f"members    {len(ms['members'])}: {counts}")
        trust = st.get("trust") or {}
        p_ = st.get("progress")
        prog: dict[str, Any] = p_ if isinstance(p_, dict) else {}
        if ms["members"]:
            rows = [("LEARNER", "REGION", "STATE", "SINCE", "SEEN", "STEP", "RESTARTS", "TRUST", "REASON")]
            for m in ms["members"]:
                rows.append((m["learner"], m["region"], m["state"], fmt_age(now - m["since"]),
                             fmt_age(now - m["last_seen"]), str(m["step"]), restarts_cell(prog.get(m["learner"])),
                             trust_cell(trust.get(m["learner"])), m["reason"]))
            widths = [max(len(r[i]) for r in rows) for i in range(8)]
            for r in rows:
                text = "  " + "  ".join(c.ljust(w) for c, w in zip(r[:8], widths)) + "  " + r[8]
                lines.append(text[:width])
        suspects = sorted(k for k, v in trust.items() if isinstance(v, dict) and v.get("reason"))
        if suspects:
            for i, k in enumerate(suspects):
                lines.append((("suspects   " if i == 0 else "           ") + suspicion(k, trust[k]))[:width])
            lines.append("           (diloco trust clear LEARNER forgets what the aggregator holds against one)"[:width])
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
