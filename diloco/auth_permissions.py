"""Who may do what on a run's bus: the permission set of each role and of each learner, the run's
users, and the permission table of docs/security.md. Pure functions of the run id.

Part of ``diloco auth`` (:mod:`diloco.auth`: the command and the overview of what it writes;
:mod:`diloco.auth_config`: the server config fragment, env files and ``auth.json``;
:mod:`diloco.auth_tls`: bcrypt hashes and TLS material). How each permission was derived from what
the role clients put on the wire: :mod:`diloco.auth`'s docstring.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from bus.protocol import MANIFEST_KEY
from bus.subjects import GLOBAL, STATE, Subjects, check_token

API = "$JS.API"
INBOX = "_INBOX.>"
ROLES = ("admin", "aggregator", "monitor", "evaluator", "metrics", "learner")
#: Fixed users, one per role (learners get ``learner-<id>``).
SERVICE_USERS = ("admin", "aggregator", "monitor", "evaluator", "metrics")
KV_KINDS = ("members", "lease", "run", "progress")
LEASE_KEY = "leader"  # monitor.lease.LEASE_KEY (not imported: keep this module free of role code)
CONF_NAME = "nats-auth.conf"
LEAF_CONF_NAME = "nats-auth-leaf.conf"
SERVER_CONF_NAME = "nats-server.conf"
ENV_HEADER = "# diloco auth init:"
#: Event kinds (``diloco.<run>.events.<kind>``) the aggregator publishes; the monitor owns ``membership``.
AGGREGATOR_EVENTS = ("merge", "reject", "recovered")


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
    """A learner: its own gradients, heartbeats, metrics and progress record (``bus.progress``: read
    and written); reads global versions, the manifest and its own membership record (plus the
    members bucket as a whole through the watch: see docs)."""
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
        kv_subject(s, "progress", learner),
        *_kv_read(s, "progress", learner),
    ]
    return Permissions(_uniq(pub), (s.feedback(learner), INBOX))


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
        *_direct_get(grad),  # replaying the merge log reads merged contributions back
        *_kv_read(s, "run"),
        *_kv_read(s, "members"),
        *_watch(kv_stream(s, "members")),
        f"{API}.CONSUMER.INFO.{grad}.*",
        f"{API}.CONSUMER.DURABLE.CREATE.{grad}.*",
        f"{API}.CONSUMER.CREATE.{grad}.*",
        f"{API}.CONSUMER.CREATE.{grad}.*.>",
        f"{API}.CONSUMER.MSG.NEXT.{grad}.*",
        f"$JS.ACK.{grad}.>",
        f"{s.prefix}.feedback.*",  # each learner told of its work rejected or held (aggregator.feedback)
    ]
    # the monitor embedded in `diloco aggregator` (DILOCO_EMBEDDED_MONITOR, on by default) runs with
    # the aggregator's credentials: membership, the lease, heartbeats
    mon = monitor_permissions(run)
    return Permissions(_uniq(pub + list(mon.publish)), _uniq([INBOX, *mon.subscribe]))


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
        *_kv_read(s, "progress"),
        *_watch(kv_stream(s, "members")),
        *_watch(kv_stream(s, "progress")),  # `diloco status` lists every learner id's record
    ]
    return Permissions(_uniq(pub), (s.metrics_all, s.events_all, INBOX))


def admin_permissions(run: str) -> Permissions:
    """``diloco run create|inspect|delete``: stream administration of this run's streams only, no data;
    and ``diloco trust clear`` (the run bucket's ``trust_clear.*`` keys, ``bus.trust_clears``)."""
    s = Subjects(run)
    pub = [f"{API}.INFO", f"{API}.STREAM.NAMES", f"{API}.STREAM.LIST", kv_subject(s, "run", "trust_clear.*")]
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

