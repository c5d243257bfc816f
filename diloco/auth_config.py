"""What ``diloco auth init`` writes: the server config fragment (the run's account with every user),
the standalone ``nats-server.conf``, one env file per user and ``auth.json`` (:func:`init`).
The overview of the files and the command: :mod:`diloco.auth`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bus.server import DEFAULT_MAX_PAYLOAD, render_config
from bus.subjects import check_token
from diloco.auth_permissions import (
    CONF_NAME,
    ENV_HEADER,
    LEAF_CONF_NAME,
    SERVER_CONF_NAME,
    AuthError,
    Permissions,
    User,
    new_password,
    permissions_of,
    plan_users,
)
from diloco.auth_tls import bcrypt_hasher, make_ca, make_cert, split_hosts

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
    account as a JetStream-less leaf server holds it (:mod:`diloco.auth_leaf`)."""
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


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` with mode 0600 before any secret is written to it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)


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
    #: for more configs of the same users (diloco.auth_leaf: the hub and leaf servers of the leaf topology)
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
        from diloco.auth_leaf import render_leaf_accounts  # it imports this module

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

