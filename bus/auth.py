"""Access control for a run: one NATS account, one user per role and per learner, least privilege, TLS.

``diloco auth init`` writes into an output folder (default ``./diloco-auth``):

* ``nats-auth.conf`` (0600): a server config fragment, appended to the server config
  (``diloco nats --config-extra nats-auth.conf``, ``EmbeddedServer(extra_config=...)``, or an
  ``include`` in a hand-written config). It holds one account ``DILOCO_<run>`` with JetStream
  enabled and one user per role (``admin``, ``aggregator``, ``monitor``, ``evaluator``,
  ``metrics``) and per learner (``learner-<id>``), each with allow-lists for publish and subscribe
  (everything not listed is denied), and with ``--tls`` the server's ``tls { }`` block;
* ``nats-server.conf``: a complete server config that includes the fragment (listen address,
  loopback-only monitoring, JetStream store): ``nats-server -c nats-server.conf`` or the official
  ``nats`` image in compose;
* with ``--leaf``, ``nats-auth-leaf.conf`` (0600): the same account and users for the JetStream-less
  leaf servers of a hub-and-leaves deployment (mappings inside the account, permissions in their
  mapped form: :mod:`bus.auth_leaf`); the hub takes ``nats-auth.conf``;
* ``<user>.env`` (0600): the ``DILOCO_*`` variables that start that user's process with env alone
  (``DILOCO_RUN``, ``DILOCO_NATS_USER``/``PASSWORD``, ``DILOCO_LEARNER_ID``, ``DILOCO_TLS_CA``...);
* ``auth.json``: the users, their roles and permissions (no secrets), for tools and review;
* with ``--tls``: ``tls/ca.pem`` (+ ``ca.key``), ``tls/server.pem`` (+ key) for 127.0.0.1,
  localhost and ``--hosts``, and with ``--client-certs`` one client certificate per user (the server
  then requires one: mutual TLS). Made with the ``openssl`` command, no Python dependency.

Passwords are 32 random URL-safe characters. With ``--hash bcrypt`` (the default when this Python
can make bcrypt hashes: stdlib ``crypt`` up to 3.12 or the ``bcrypt`` package) the server config
holds only bcrypt hashes, which ``nats-server`` verifies natively; the plain passwords are only in
the env files.

The permission sets are pure functions of the run id (:func:`role_permissions`), derived from what
each role's client calls put on the wire (nats-py 2.16, nats-server 2.15), checked against a real
server in ``tests/test_auth.py``:

* a JetStream publish is a request: the ack comes back on ``_INBOX.>`` (every user subscribes
  there; nobody may publish there, so nobody can forge a reply);
* a KV put/create/update/delete is a publish on ``$KV.<bucket>.<key>``; a KV get is
  ``$JS.API.STREAM.MSG.GET.KV_<bucket>`` (or ``$JS.API.DIRECT.GET.KV_<bucket>.$KV.<bucket>.<key>``
  for buckets with direct get); a KV watch is an ordered push consumer
  (``$JS.API.CONSUMER.CREATE.KV_<bucket>``, then ``CONSUMER.INFO``, flow control replies on
  ``$JS.FC.KV_<bucket>.>``);
* a versioned-object read is ``$JS.API.DIRECT.GET.<stream>[.<subject>]``; a watch of heads an
  ordered consumer on the GLOBAL stream (``STREAM.NAMES`` first, to find the stream);
* the aggregator's durable pull consumer: ``CONSUMER.INFO``, ``CONSUMER.DURABLE.CREATE``,
  ``CONSUMER.MSG.NEXT`` on the GRAD stream and acks on ``$JS.ACK.DILOCO_<run>_GRAD.>``.

A denied publish is not an exception in nats-py: the server answers ``-ERR 'Permissions Violation
for Publish to ...'`` (the connection's error callback gets it) and a request simply times out.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bus.config import parse_env_file  # noqa: F401 - re-exported (tests and tools import it from here)
from bus.protocol import MANIFEST_KEY
from bus.server import DEFAULT_MAX_PAYLOAD, render_config
from bus.subjects import GLOBAL, STATE, Subjects, check_token

API = "$JS.API"
INBOX = "_INBOX.>"
ROLES = ("admin", "aggregator", "monitor", "evaluator", "metrics", "learner")
#: Fixed users, one per role (learners get ``learner-<id>``).
SERVICE_USERS = ("admin", "aggregator", "monitor", "evaluator", "metrics")
KV_KINDS = ("members", "lease", "run")
LEASE_KEY = "leader"  # monitor.lease.LEASE_KEY (not imported: keep this module free of role code)
CONF_NAME = "nats-auth.conf"
LEAF_CONF_NAME = "nats-auth-leaf.conf"
SERVER_CONF_NAME = "nats-server.conf"
ENV_HEADER = "# diloco auth init:"
#: Event kinds (``diloco.<run>.events.<kind>``) the aggregator publishes; the monitor owns ``membership``.
AGGREGATOR_EVENTS = ("merge", "reject")
BCRYPT_COST = 11


class AuthError(RuntimeError):
    """Bad arguments or a failed tool (openssl); the message is one line saying what to do."""


# -- permission sets (pure) ------------------------------------------------------------------------


@dataclass(frozen=True)
class Permissions:
    """Allow-lists: every subject not matched by one of these is denied."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def to_dict(self) -> dict:
        return {"publish": {"allow": list(self.publish)}, "subscribe": {"allow": list(self.subscribe)}}


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more (case-sensitive)."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return i == len(p) - 1 and len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def may_publish(perms: Permissions, subject: str) -> bool:
    return any(matches(p, subject) for p in perms.publish)


def may_subscribe(perms: Permissions, subject: str) -> bool:
    """Whether a subscription on ``subject`` (possibly a wildcard) is allowed: some allow pattern covers it."""
    return any(_covers(p, subject) for p in perms.subscribe)


def _covers(pattern: str, sub: str) -> bool:
    """Every subject matched by ``sub`` is matched by ``pattern``."""
    p, s = pattern.split("."), sub.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return i == len(p) - 1 and len(s) > i
        if i >= len(s):
            return False
        if tok == "*":
            if s[i] == ">":
                return False
            continue
        if tok != s[i]:
            return False
    return len(p) == len(s)


def _uniq(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def kv_stream(s: Subjects, kind: str) -> str:
    """The stream behind KV bucket ``kind`` of the run (``KV_diloco_<run>_<kind>``)."""
    return f"KV_{s.bucket(kind)}"


def kv_subject(s: Subjects, kind: str, key: str = ">") -> str:
    return f"$KV.{s.bucket(kind)}.{key}"


def data_streams(s: Subjects) -> list[str]:
    return [s.stream("grad"), s.stream(GLOBAL), s.stream(STATE), s.stream("events")]


def run_streams(s: Subjects) -> list[str]:
    """Every stream of the run, KV buckets included."""
    return data_streams(s) + [kv_stream(s, k) for k in KV_KINDS]


def _stream_info(s: Subjects) -> list[str]:
    # read-only: ensure_run/wait for the run, `diloco status`, KV bucket binding (js.key_value)
    return [f"{API}.STREAM.INFO.{name}" for name in run_streams(s)] + [f"{API}.STREAM.NAMES"]


def _direct_get(stream: str) -> list[str]:
    """Read messages of ``stream`` by sequence (``DIRECT.GET.<stream>``) or last-by-subject (``.<subject>``)."""
    return [f"{API}.DIRECT.GET.{stream}", f"{API}.DIRECT.GET.{stream}.>"]


def _kv_read(s: Subjects, kind: str, key: str | None = None) -> list[str]:
    """KV get of ``key`` (None: any key).

    Buckets without direct get are read with ``STREAM.MSG.GET.KV_<bucket>``, which cannot be
    narrowed to a key; with direct get (``KeyValueConfig(direct=True)``) the key is in the subject.
    """
    stream = kv_stream(s, kind)
    out = [f"{API}.STREAM.MSG.GET.{stream}"]
    if key is None:
        out += _direct_get(stream)
    else:
        out.append(f"{API}.DIRECT.GET.{stream}.{kv_subject(s, kind, key)}")
    return out


def _watch(stream: str) -> list[str]:
    """An ordered push consumer (KV watch, heads watch): create (legacy and named forms), info, flow control."""
    return [
        f"{API}.CONSUMER.CREATE.{stream}",
        f"{API}.CONSUMER.CREATE.{stream}.>",
        f"{API}.CONSUMER.INFO.{stream}.*",
        f"$JS.FC.{stream}.>",
    ]


def _provision(s: Subjects) -> list[str]:
    """Create or update (never delete) the run's streams and buckets: what ``ensure_run`` does."""
    return [f"{API}.STREAM.{op}.{name}" for name in run_streams(s) for op in ("CREATE", "UPDATE")]


def learner_permissions(run: str, learner: str) -> Permissions:
    """A learner: its own gradients, heartbeats and metrics; reads global versions, the manifest and
    its own membership record (plus the members bucket as a whole through the watch: see docs)."""
    s = Subjects(run)
    check_token("learner", learner)
    pub = [
        f"{s.prefix}.grad.*.{learner}",
        s.heartbeat(learner),
        s.metrics("learner", learner),
        *_stream_info(s),
        *_direct_get(s.stream(GLOBAL)),
        *_watch(s.stream(GLOBAL)),
        *_kv_read(s, "run", MANIFEST_KEY),
        *_kv_read(s, "members", learner),
        *_watch(kv_stream(s, "members")),
    ]
    return Permissions(_uniq(pub), (INBOX,))


def evaluator_permissions(run: str) -> Permissions:
    """The evaluator: reads global versions and the manifest, publishes its metrics."""
    s = Subjects(run)
    pub = [
        f"{s.prefix}.metrics.evaluator.*",
        *_stream_info(s),
        *_direct_get(s.stream(GLOBAL)),
        *_watch(s.stream(GLOBAL)),
        *_kv_read(s, "run", MANIFEST_KEY),
    ]
    return Permissions(_uniq(pub), (INBOX,))


def aggregator_permissions(run: str, provision: bool = True) -> Permissions:
    """The aggregator: the only writer of global versions, aggregator state, merge events and the manifest.

    It consumes the GRAD stream through its durable pull consumers (``agg_<lo>_<hi>``) and acks
    there; it follows membership. ``provision``: it may also create and update (not delete) the
    run's streams and buckets, as ``ensure_run`` does at its start (the run's owner)."""
    s = Subjects(run)
    grad = s.stream("grad")
    pub = [
        s.versioned_all(GLOBAL),
        s.versioned_all(STATE),
        *(s.event(kind) for kind in AGGREGATOR_EVENTS),
        f"{s.prefix}.metrics.aggregator.*",
        kv_subject(s, "run"),
        *_stream_info(s),
        *(_provision(s) if provision else []),
        *_direct_get(s.stream(GLOBAL)),
        *_direct_get(s.stream(STATE)),
        *_kv_read(s, "run"),
        *_kv_read(s, "members"),
        *_watch(kv_stream(s, "members")),
        f"{API}.CONSUMER.INFO.{grad}.*",
        f"{API}.CONSUMER.DURABLE.CREATE.{grad}.*",
        f"{API}.CONSUMER.CREATE.{grad}.*",
        f"{API}.CONSUMER.CREATE.{grad}.*.>",
        f"{API}.CONSUMER.MSG.NEXT.{grad}.*",
        f"$JS.ACK.{grad}.>",
    ]
    return Permissions(_uniq(pub), (INBOX,))


def monitor_permissions(run: str) -> Permissions:
    """The monitor: the only writer of membership (KV members), the leader lease and membership events;
    it hears every heartbeat and follows global heads."""
    s = Subjects(run)
    pub = [
        s.event("membership"),
        f"{s.prefix}.metrics.monitor.*",
        kv_subject(s, "members"),
        kv_subject(s, "lease"),
        *_stream_info(s),
        *_direct_get(s.stream(GLOBAL)),
        *_watch(s.stream(GLOBAL)),
        *_kv_read(s, "members"),
        *_kv_read(s, "lease"),
        *_watch(kv_stream(s, "members")),
    ]
    return Permissions(_uniq(pub), (s.heartbeat_all, INBOX))


def metrics_permissions(run: str) -> Permissions:
    """``diloco metrics``, ``diloco status`` and the ``diloco up`` dashboard: subscribe to metrics and
    events; JetStream reads only; publishes no data subject."""
    s = Subjects(run)
    pub = [
        f"{API}.INFO",
        *_stream_info(s),
        *_direct_get(s.stream(GLOBAL)),
        *_kv_read(s, "members"),
        *_kv_read(s, "lease"),
        *_kv_read(s, "run"),
        *_watch(kv_stream(s, "members")),
    ]
    return Permissions(_uniq(pub), (s.metrics_all, s.events_all, INBOX))


def admin_permissions(run: str) -> Permissions:
    """``diloco run create|inspect|delete``: stream administration of this run's streams only, no data."""
    s = Subjects(run)
    pub = [f"{API}.INFO", f"{API}.STREAM.NAMES", f"{API}.STREAM.LIST"]
    for name in run_streams(s):
        pub += [f"{API}.STREAM.{op}.{name}" for op in ("INFO", "CREATE", "UPDATE", "DELETE", "PURGE")]
        pub += [f"{API}.CONSUMER.{op}.{name}" for op in ("LIST", "NAMES")]
        pub += [f"{API}.CONSUMER.{op}.{name}.*" for op in ("INFO", "DELETE")]
    return Permissions(_uniq(pub), (INBOX,))


def role_permissions(role: str, run: str, ident: str | None = None, *, provision: bool = True) -> Permissions:
    """The permissions of ``role`` in ``run`` (``ident``: the learner id, for ``learner``)."""
    Subjects(run)  # validates the run id
    if role == "learner":
        if not ident:
            raise ValueError("role learner needs a learner id")
        return learner_permissions(run, ident)
    builders: dict[str, Callable[[str], Permissions]] = {
        "admin": admin_permissions,
        "monitor": monitor_permissions,
        "evaluator": evaluator_permissions,
        "metrics": metrics_permissions,
    }
    if role == "aggregator":
        return aggregator_permissions(run, provision)
    if role not in builders:
        raise ValueError(f"role {role!r}: expected one of {', '.join(ROLES)}")
    return builders[role](run)


# -- users (pure) ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class User:
    """A NATS user of the run: ``name`` (what ``DILOCO_NATS_USER`` holds), its role and learner id."""

    name: str
    role: str
    learner: str | None = None
    region: str | None = None

    @property
    def env_name(self) -> str:
        return f"{self.name}.env"


def learner_user(learner: str) -> str:
    return f"learner-{check_token('learner', learner)}"


def region_of(learner: str) -> str | None:
    """``us-0`` -> ``us``, ``eu-west-12`` -> ``eu-west``; None when the id is not ``<region>-<n>``."""
    m = re.fullmatch(r"(.+)-(\d+)", learner)
    return m.group(1) if m else None


def parse_learners(spec: str, regions: str | None = None) -> list[tuple[str, str | None]]:
    """(learner id, region) pairs from ``--learners`` and ``--regions``.

    ``spec`` is a comma-separated list of ids (``us-0,us-1,eu-0``; the region is the part before
    the last ``-<n>``), or a count N spread round-robin over ``regions`` (``4`` with ``us,eu`` ->
    ``us-0, eu-0, us-1, eu-1``; without regions: ``learner-0..N-1``)."""
    spec = spec.strip()
    if re.fullmatch(r"\d+", spec):
        n = int(spec)
        if not 1 <= n <= 10_000:
            raise ValueError(f"--learners {spec}: expected 1..10000 learners")
        regs = [r.strip() for r in (regions or "").split(",") if r.strip()]
        for r in regs:
            check_token("region", r)
        if len(set(regs)) != len(regs):
            raise ValueError(f"--regions {regions}: a region is listed twice")
        if not regs:
            return [(f"learner-{i}", None) for i in range(n)]
        return [(f"{regs[i % len(regs)]}-{i // len(regs)}", regs[i % len(regs)]) for i in range(n)]
    if regions:
        raise ValueError("--regions goes with a learner count (--learners N), not with a list of ids")
    ids = [x.strip() for x in spec.split(",") if x.strip()]
    if not ids:
        raise ValueError("--learners: expected a count or a comma-separated list of learner ids")
    for x in ids:
        try:
            check_token("learner", x)
        except ValueError as e:
            raise ValueError(f"--learners: {e}") from None
    dup = sorted({x for x in ids if ids.count(x) > 1})
    if dup:
        raise ValueError(f"--learners: {', '.join(dup)} listed twice")
    return [(x, region_of(x)) for x in ids]


def plan_users(learners: Sequence[tuple[str, str | None]]) -> list[User]:
    """Every user of a run: the fixed role users, then one per learner."""
    users = [User(name, name) for name in SERVICE_USERS]
    users += [User(learner_user(lid), "learner", lid, region) for lid, region in learners]
    return users


def permissions_of(user: User, run: str, *, provision: bool = True) -> Permissions:
    return role_permissions(user.role, run, user.learner, provision=provision)


def new_password() -> str:
    """32 URL-safe random characters (192 bits)."""
    return secrets.token_urlsafe(24)


# -- rendering (pure) ------------------------------------------------------------------------------


def account_name(run: str) -> str:
    return f"DILOCO_{check_token('run', run)}"


def _q(s: str) -> str:
    """A double-quoted NATS config string (no variable expansion inside quotes)."""
    if any(c in s for c in '"\\\n\r'):
        raise ValueError(f"cannot quote {s!r} in a NATS config")
    return f'"{s}"'


def _list(items: Sequence[str], indent: str) -> str:
    inner = ",\n".join(f"{indent}  {_q(x)}" for x in items)
    return f"[\n{inner}\n{indent}]"


def render_accounts(run: str, users: Sequence[User], secrets_: dict[str, str], *,
                    provision: bool = True, jetstream: bool = True, mappings: dict[str, str] | None = None,
                    permissions: Callable[[Permissions], Permissions] | None = None) -> str:
    """The ``accounts { }`` block: one JetStream-enabled account for ``run`` with every user.

    ``secrets_`` maps a user name to what the config holds: a bcrypt hash or the plain password.
    ``jetstream=False``, ``mappings`` and ``permissions`` (applied to each user's permissions): the
    account as a JetStream-less leaf server holds it (:mod:`bus.auth_leaf`)."""
    lines = ["accounts {", f"  {account_name(run)}: {{"]
    lines += ["    jetstream: enabled"] if jetstream else []
    if mappings:
        lines += ["    mappings {", *(f"      {_q(k)}: {_q(v)}" for k, v in mappings.items()), "    }"]
    lines += ["    users: ["]
    for u in users:
        p = permissions_of(u, run, provision=provision)
        p = permissions(p) if permissions else p
        ind = "          "
        lines += [
            "      {",
            f"        # role {u.role}" + (f", learner {u.learner}" if u.learner else ""),
            f"        user: {_q(u.name)}",
            f"        password: {_q(secrets_[u.name])}",
            "        permissions: {",
            f"          publish: {{ allow: {_list(p.publish, ind)} }}",
            f"          subscribe: {{ allow: {_list(p.subscribe, ind)} }}",
            "        }",
            "      }",
        ]
    lines += ["    ]", "  }", "}"]
    return "\n".join(lines) + "\n"


def render_tls(cert_file: str, key_file: str, ca_file: str, verify: bool, timeout: float = 5.0) -> str:
    """The server's ``tls { }`` block (``verify``: clients must present a certificate of the CA)."""
    lines = ["tls {", f"  cert_file: {_q(cert_file)}", f"  key_file: {_q(key_file)}", f"  ca_file: {_q(ca_file)}"]
    if verify:
        lines.append("  verify: true")
    lines += [f"  timeout: {timeout:g}", "}"]
    return "\n".join(lines) + "\n"


def _env_value(v: str) -> str:
    return v if re.fullmatch(r"[A-Za-z0-9_./:@,+=-]*", v) else shlex.quote(v)


def render_env(user: User, run: str, password: str, *, url: str | None = None, tls_ca: str | None = None,
               tls_cert: str | None = None, tls_key: str | None = None, provision: bool = True) -> str:
    """``<user>.env``: KEY=VALUE lines that ``set -a; . file`` and compose ``env_file:`` both read."""
    rows: list[tuple[str, str]] = [("DILOCO_RUN", run)]
    if url:
        rows.append(("DILOCO_NATS_URL", url))
    rows += [("DILOCO_NATS_USER", user.name), ("DILOCO_NATS_PASSWORD", password)]
    if user.learner:
        rows.append(("DILOCO_LEARNER_ID", user.learner))
        if user.region:
            rows.append(("DILOCO_REGION", user.region))
    if tls_ca:
        rows.append(("DILOCO_TLS_CA", tls_ca))
    if tls_cert and tls_key:
        rows += [("DILOCO_TLS_CERT", tls_cert), ("DILOCO_TLS_KEY", tls_key)]
    if user.role == "learner":
        rows.append(("DILOCO_CREATE_RUN", "false"))  # a learner may not write version 0: admin creates the run
    if user.role == "aggregator" and not provision:
        rows.append(("DILOCO_PROVISION", "false"))  # --strict: only admin creates the run
    head = (f"{ENV_HEADER} user {user.name} (role {user.role}) of run {run}. Secret: keep it 0600.\n"
            f"# Start the process with: set -a; . ./{user.env_name}; set +a; diloco {_command(user.role)}\n")
    return head + "".join(f"{k}={_env_value(v)}\n" for k, v in rows)


def _command(role: str) -> str:
    return {"admin": "run create", "metrics": "status", "evaluator": "eval"}.get(role, role)


# parse_env_file: bus.config (every role reads DILOCO_ENV_FILE with it); kept importable from here


def _short_stream(s: Subjects, name: str) -> str:
    for kind in KV_KINDS:
        if name == kv_stream(s, kind):
            return f"kv {kind}"
    prefix = f"DILOCO_{s.run}_"
    return name[len(prefix):] if name.startswith(prefix) else name


def summarize(perms: Permissions, run: str) -> dict[str, list[str]]:
    """Publish allow-list grouped for people: ``{"data": [subjects], "<API op>": [streams]}``.

    ``$JS.API.<OP>.<stream>[.<rest>]`` becomes ``{OP: [stream]}`` (``kv members[<key>]`` when the
    entry names one key), ``$JS.FC``/``$JS.ACK`` become ``FC``/``ACK``; anything else is data."""
    s = Subjects(run)
    streams = {name: _short_stream(s, name) for name in run_streams(s)}
    out: dict[str, list[str]] = {"data": []}
    for entry in perms.publish:
        toks = entry.split(".")
        if entry.startswith(("$JS.API.", "$JS.FC.", "$JS.ACK.")):
            idx = next((i for i, tk in enumerate(toks) if tk in streams), None)
            if idx is not None:
                op = ".".join(toks[2:idx]) if toks[1] == "API" else toks[1]
                short = streams[toks[idx]]
                rest = toks[idx + 1:]
                if rest[:1] == ["$KV"] and len(rest) == 3 and rest[2] not in ("*", ">"):
                    short += f"[{rest[2]}]"
                items = out.setdefault(op, [])
                if short not in items:
                    items.append(short)
                continue
            if toks[1] == "API":
                out.setdefault(".".join(toks[2:]), [])
                continue
        out["data"].append(entry)
    return out


def permissions_markdown(provision: bool = True) -> str:
    """The permission table of docs/security.md (run ``<run>``, learner ``<id>``)."""
    run, lid = "RUNX", "LIDX"
    rows = ["| user (role) | publishes (data, KV writes) | subscribes | JetStream API (streams) |",
            "| --- | --- | --- | --- |"]
    for u in plan_users([(lid, None)]):
        p = permissions_of(u, run, provision=provision)
        summ = summarize(p, run)
        data = summ.pop("data")
        every = [_short_stream(Subjects(run), n) for n in run_streams(Subjects(run))]
        api = "; ".join(op + (": all" if v == every else f": {', '.join(v)}" if v else "")
                        for op, v in summ.items())
        cells = [", ".join(f"`{x}`" for x in data) or "none", ", ".join(f"`{x}`" for x in p.subscribe), api]
        name = f"`{u.name}` ({u.role})"
        rows.append("| " + " | ".join([name, *cells]) + " |")
    return "\n".join(rows).replace(run, "<run>").replace(lid, "<id>")


# -- bcrypt ----------------------------------------------------------------------------------------


def bcrypt_hasher() -> Callable[[str], str] | None:
    """A function password -> bcrypt hash (``$2b$11$...``), or None if this Python cannot make one."""
    try:
        import bcrypt  # type: ignore[import-not-found]

        return lambda pw: bcrypt.hashpw(pw.encode(), bcrypt.gensalt(BCRYPT_COST)).decode()
    except ImportError:
        pass
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt  # stdlib until Python 3.12; bcrypt only where libcrypt supports $2b$
        salt = crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=2**BCRYPT_COST)
        probe = crypt.crypt("probe", salt)
        if not probe or not probe.startswith("$2"):
            return None
        return lambda pw: crypt.crypt(pw, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=2**BCRYPT_COST))
    except Exception:
        return None


# -- TLS with the openssl command ------------------------------------------------------------------


def openssl_binary() -> str:
    found = shutil.which("openssl")
    if not found:
        raise AuthError("--tls needs the openssl command (apt-get install openssl), or bring your own "
                        "certificates and write the tls { } block by hand (see docs/security.md)")
    return found


def _run_openssl(args: list[str]) -> None:
    p = subprocess.run([openssl_binary(), *args], capture_output=True, text=True, timeout=60)
    if p.returncode != 0:
        raise AuthError(f"openssl {args[0]} failed: {(p.stderr or p.stdout).strip()[:400]}")


def split_hosts(hosts: Iterable[str]) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) for a server certificate; always 127.0.0.1, ::1 and localhost."""
    dns, ips = ["localhost"], ["127.0.0.1", "::1"]
    for h in hosts:
        h = h.strip()
        if not h:
            continue
        try:
            ip = str(ipaddress.ip_address(h))
            if ip not in ips:
                ips.append(ip)
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9*]([A-Za-z0-9.*-]{0,251}[A-Za-z0-9])?", h):
                raise AuthError(f"--hosts {h!r}: expected a DNS name or an IP address") from None
            if h not in dns:
                dns.append(h)
    return dns, ips


def _cert_config(cn: str, kind: str, dns: Sequence[str] = (), ips: Sequence[str] = ()) -> str:
    ext = {
        "ca": ["basicConstraints = critical,CA:TRUE,pathlen:0", "keyUsage = critical,keyCertSign,cRLSign",
               "subjectKeyIdentifier = hash"],
        "server": ["basicConstraints = critical,CA:FALSE", "keyUsage = critical,digitalSignature",
                   "extendedKeyUsage = serverAuth", "subjectKeyIdentifier = hash",
                   "authorityKeyIdentifier = keyid", "subjectAltName = @alt"],
        "client": ["basicConstraints = critical,CA:FALSE", "keyUsage = critical,digitalSignature",
                   "extendedKeyUsage = clientAuth", "subjectKeyIdentifier = hash",
                   "authorityKeyIdentifier = keyid"],
    }[kind]
    text = f"[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = {cn}\n[ext]\n" + "\n".join(ext) + "\n"
    if kind == "server":
        alt = [f"DNS.{i + 1} = {d}" for i, d in enumerate(dns)] + [f"IP.{i + 1} = {a}" for i, a in enumerate(ips)]
        text += "[alt]\n" + "\n".join(alt) + "\n"
    return text


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 before any secret is written to it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


def make_ca(tls_dir: Path, cn: str, days: int) -> tuple[Path, Path]:
    """A self-signed EC P-256 CA: (ca.pem, ca.key)."""
    tls_dir.mkdir(parents=True, exist_ok=True)
    cert, key = tls_dir / "ca.pem", tls_dir / "ca.key"
    with tempfile.TemporaryDirectory() as tmp:
        cnf = Path(tmp) / "ca.cnf"
        cnf.write_text(_cert_config(cn, "ca"))
        _run_openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)])
        os.chmod(key, 0o600)
        _run_openssl(["req", "-new", "-x509", "-config", str(cnf), "-extensions", "ext", "-key", str(key),
                      "-sha256", "-days", str(days), "-set_serial", f"0x{secrets.token_hex(16)}", "-out", str(cert)])
    return cert, key


def make_cert(tls_dir: Path, name: str, ca: tuple[Path, Path], kind: str, days: int,
              dns: Sequence[str] = (), ips: Sequence[str] = ()) -> tuple[Path, Path]:
    """A certificate signed by ``ca`` (``kind`` server: with the SANs; client: CN = user): (pem, key)."""
    cert, key = tls_dir / f"{name}.pem", tls_dir / f"{name}.key"
    with tempfile.TemporaryDirectory() as tmp:
        cnf, csr = Path(tmp) / "c.cnf", Path(tmp) / "c.csr"
        cnf.write_text(_cert_config(name, kind, dns, ips))
        _run_openssl(["genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key)])
        os.chmod(key, 0o600)
        _run_openssl(["req", "-new", "-config", str(cnf), "-key", str(key), "-out", str(csr)])
        _run_openssl(["x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-sha256",
                      "-days", str(days), "-set_serial", f"0x{secrets.token_hex(16)}", "-extfile", str(cnf),
                      "-extensions", "ext", "-out", str(cert)])
    return cert, key


# -- diloco auth init ------------------------------------------------------------------------------


@dataclass
class InitResult:
    out: Path
    conf: Path
    users: list[User]
    env_files: dict[str, Path]
    hashed: bool
    tls: dict[str, str] = field(default_factory=dict)
    #: user name -> what the server config holds (bcrypt hash, or the password with --hash plain):
    #: for more configs of the same users (bus.auth_leaf: the hub and leaf servers of the leaf topology)
    stored: dict[str, str] = field(default_factory=dict, repr=False)


def init(out: str | os.PathLike, run: str, learners: Sequence[tuple[str, str | None]], *, url: str | None = None,
         tls: bool = False, client_certs: bool = False, hosts: Iterable[str] = (), days: int = 825,
         hash_mode: str = "auto", provision: bool = True, path_prefix: str | None = None,
         force: bool = False, listen: str = "0.0.0.0:4222", store_dir: str = "/data",
         password: Callable[[], str] = new_password, leaf: bool = False) -> InitResult:
    """Write the config fragment, env files, ``auth.json`` and TLS material into ``out``.

    ``path_prefix``: the folder as the server and the processes will see it (e.g. a container
    mount); default: ``out``'s absolute path. ``listen`` and ``store_dir`` go into the standalone
    ``nats-server.conf`` (for compose or a host install). ``leaf``: also ``nats-auth-leaf.conf``, the
    account for leaf servers. Refuses to overwrite an existing output unless ``force``."""
    check_token("run", run)
    if not re.fullmatch(r"[^\s:]*:\d{1,5}", listen):
        raise AuthError(f"--listen {listen!r}: expected HOST:PORT, e.g. 0.0.0.0:4222")
    out_dir = Path(out).resolve()
    conf = out_dir / CONF_NAME
    if conf.exists() and not force:
        raise AuthError(f"{conf} exists: pass --force to replace every credential in {out_dir}")
    if client_certs and not tls:
        raise AuthError("--client-certs needs --tls")
    if hash_mode not in ("auto", "bcrypt", "plain"):
        raise AuthError(f"--hash {hash_mode!r}: expected auto, bcrypt or plain")
    hasher = bcrypt_hasher() if hash_mode != "plain" else None
    if hash_mode == "bcrypt" and hasher is None:
        raise AuthError("--hash bcrypt: this Python cannot make bcrypt hashes (pip install bcrypt), "
                        "or use --hash plain (passwords in a 0600 file)")
    if not out_dir.exists():
        out_dir.mkdir(parents=True, mode=0o700)
    seen = Path(path_prefix) if path_prefix else out_dir
    users = plan_users(learners)
    passwords = {u.name: password() for u in users}
    stored = {n: (hasher(p) if hasher else p) for n, p in passwords.items()}

    tls_paths: dict[str, str] = {}
    text = [f"# diloco auth init: run {run}. Secret (0600). Append to the nats-server config.\n",
            render_accounts(run, users, stored, provision=provision)]
    if tls:
        tdir = out_dir / "tls"
        if tdir.exists():
            shutil.rmtree(tdir)
        ca = make_ca(tdir, f"diloco {run} CA", days)
        dns, ips = split_hosts(hosts)
        make_cert(tdir, "server", ca, "server", days, dns, ips)
        if client_certs:
            for u in users:
                make_cert(tdir, u.name, ca, "client", days)
        tls_paths = {"ca": str(seen / "tls" / "ca.pem"), "cert": str(seen / "tls" / "server.pem"),
                     "key": str(seen / "tls" / "server.key")}
        text.append(render_tls(tls_paths["cert"], tls_paths["key"], tls_paths["ca"], verify=client_certs))
    _write_private(conf, "".join(text))
    leaf_conf = out_dir / LEAF_CONF_NAME
    if leaf:
        from bus.auth_leaf import render_leaf_accounts  # it imports this module

        _write_private(leaf_conf, f"# diloco auth init: run {run}, for the leaf servers (the hub takes {CONF_NAME}). "
                                  "Secret (0600).\n" + render_leaf_accounts(run, users, stored, provision=provision))
    elif leaf_conf.exists():  # a previous init's (--force): its credentials are gone
        leaf_conf.unlink()
    host, _, port = listen.rpartition(":")
    server_conf = out_dir / SERVER_CONF_NAME
    server_conf.write_text(
        f"# diloco auth init: a complete nats-server config for run {run} (nats-server -c {SERVER_CONF_NAME}).\n"
        + render_config(host=host or "0.0.0.0", port=int(port), http_port=8222, store_dir=store_dir,
                        max_payload=DEFAULT_MAX_PAYLOAD, extra=f"include {_q(CONF_NAME)}"))

    env_files: dict[str, Path] = {}
    for stale in out_dir.glob("*.env"):  # users of a previous init (--force) lose their credentials
        if stale.read_text(errors="replace").startswith(ENV_HEADER):
            stale.unlink()
    for u in users:
        kw: dict = {}
        if tls:
            kw["tls_ca"] = tls_paths["ca"]
            if client_certs:
                kw["tls_cert"] = str(seen / "tls" / f"{u.name}.pem")
                kw["tls_key"] = str(seen / "tls" / f"{u.name}.key")
        path = out_dir / u.env_name
        _write_private(path, render_env(u, run, passwords[u.name], url=url, provision=provision, **kw))
        env_files[u.name] = path

    summary = {
        "run": run, "account": account_name(run), "config": CONF_NAME, "server_config": SERVER_CONF_NAME,
        "leaf_config": LEAF_CONF_NAME if leaf else None,
        "hashed": hasher is not None,
        "provision_by_aggregator": provision, "tls": bool(tls), "mutual_tls": bool(client_certs),
        "users": [{"user": u.name, "role": u.role, "learner": u.learner, "region": u.region, "env": u.env_name,
                   "permissions": permissions_of(u, run, provision=provision).to_dict()} for u in users],
    }
    (out_dir / "auth.json").write_text(json.dumps(summary, indent=2) + "\n")
    return InitResult(out_dir, conf, users, env_files, hasher is not None, tls_paths, stored)


def _cmd_init(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="diloco auth init",
        description="Write a NATS config fragment with one account for the run, one least-privilege user per "
                    "role and per learner, one env file per user and, with --tls, a CA and certificates.")
    p.add_argument("--run", default=os.environ.get("DILOCO_RUN", "default"), help="run id (default $DILOCO_RUN)")
    p.add_argument("--learners", required=True, help="learner ids (us-0,us-1,eu-0) or a count N (with --regions)")
    p.add_argument("--regions", default=None, help="with --learners N: regions to spread them over (us,eu)")
    p.add_argument("--out", default="diloco-auth", help="output folder (default ./diloco-auth)")
    p.add_argument("--url", default=None, help="DILOCO_NATS_URL written into every env file (e.g. tls://host:4222)")
    p.add_argument("--tls", action="store_true", help="generate a CA and a server certificate; write tls { }")
    p.add_argument("--client-certs", action="store_true", help="with --tls: a certificate per user, required by "
                   "the server (mutual TLS)")
    p.add_argument("--hosts", default="", help="extra server certificate names/IPs, comma-separated "
                   "(127.0.0.1, ::1 and localhost are always in)")
    p.add_argument("--days", type=int, default=825, help="certificate validity in days")
    p.add_argument("--hash", dest="hash_mode", choices=["auto", "bcrypt", "plain"], default="auto",
                   help="how the server config holds passwords (auto: bcrypt when this Python can)")
    p.add_argument("--strict", action="store_true", help="only admin may create/update streams (the aggregator "
                   "env gets DILOCO_PROVISION=false; run `diloco run create` as admin first)")
    p.add_argument("--path-prefix", default=None, help="the output folder as the server/processes see it "
                   "(container mount); default: its absolute path")
    p.add_argument("--listen", default="0.0.0.0:4222", help="client address of the standalone nats-server.conf")
    p.add_argument("--store-dir", default="/data", help="JetStream store of the standalone nats-server.conf")
    p.add_argument("--leaf", action="store_true", help=f"also write {LEAF_CONF_NAME}: the same users for the "
                   "JetStream-less leaf servers of a hub with leaf nodes (docs/deploy.md)")
    p.add_argument("--force", action="store_true", help="replace an existing output (new passwords for everyone)")
    p.add_argument("--keep", action="store_true", help="an existing output is kept as it is (exit 0): a one-shot "
                   "set-up step that may run on every start (compose's auth service)")
    a = p.parse_args(argv)
    if a.keep and a.force:
        p.error("--keep and --force contradict each other")
    if a.keep:
        if (Path(a.out) / "auth.json").exists():  # written last: the output is complete
            print(f"kept the existing credentials in {Path(a.out).resolve()} (--keep)")
            return 0
        a.force = True  # nothing there, or what an interrupted init left: written anew
    try:
        learners = parse_learners(a.learners, a.regions)
        if a.days < 1:
            raise AuthError("--days: expected >= 1")
        r = init(a.out, a.run, learners, url=a.url, tls=a.tls, client_certs=a.client_certs,
                 hosts=a.hosts.split(","), days=a.days, hash_mode=a.hash_mode, provision=not a.strict,
                 path_prefix=a.path_prefix, force=a.force, listen=a.listen, store_dir=a.store_dir, leaf=a.leaf)
    except (AuthError, ValueError) as e:
        print(f"diloco auth init: {e}", file=sys.stderr)
        return 2
    print(f"wrote {r.conf} (account {account_name(a.run)}, {len(r.users)} users, passwords "
          f"{'bcrypt-hashed' if r.hashed else 'in plain text, file mode 0600'}"
          f"{', TLS' if a.tls else ''}{' with client certificates' if a.client_certs else ''})")
    print(f"env files: {', '.join(p.name for p in r.env_files.values())}")
    if a.leaf:
        print(f"leaf servers: {r.out / LEAF_CONF_NAME} (the hub: {r.conf}; docs/deploy.md, leaf nodes)")
    print(f"start the server: diloco nats --config-extra {r.conf}   (or: nats-server -c {r.out / SERVER_CONF_NAME})")
    print(f"start a role:     set -a; . {r.env_files['aggregator']}; set +a; diloco aggregator")
    return 0


def _cmd_permissions(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="diloco auth permissions", description="Print the permission table per role.")
    p.add_argument("--strict", action="store_true")
    a = p.parse_args(argv)
    print(permissions_markdown(provision=not a.strict))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``diloco auth init ...`` | ``diloco auth permissions``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {"init": _cmd_init, "permissions": _cmd_permissions}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in cmds:
        print("usage: diloco auth {init,permissions} [options]\n\n"
              "  init         write a NATS accounts config, per-role users, env files and TLS material\n"
              "  permissions  print the permission table per role (markdown)",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
