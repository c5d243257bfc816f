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
  mapped form: :mod:`diloco.auth_leaf`); the hub takes ``nats-auth.conf``;
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

This module is the command and re-exports the public names of its parts:
:mod:`diloco.auth_permissions` (permission sets, users, the permission table),
:mod:`diloco.auth_config` (the files :func:`init` writes) and :mod:`diloco.auth_tls` (bcrypt, TLS).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from bus.config import parse_env_file  # noqa: F401 - re-exported (tests and tools import it from here)
from diloco.auth_config import (  # noqa: F401 - re-exported: `diloco auth`'s public names in one place
    InitResult,
    account_name,
    init,
    render_accounts,
    render_env,
    render_tls,
)
from diloco.auth_permissions import (  # noqa: F401 - re-exported
    API,
    CONF_NAME,
    INBOX,
    KV_KINDS,
    LEAF_CONF_NAME,
    ROLES,
    SERVER_CONF_NAME,
    SERVICE_USERS,
    AuthError,
    Permissions,
    User,
    admin_permissions,
    aggregator_permissions,
    evaluator_permissions,
    learner_permissions,
    learner_user,
    matches,
    may_publish,
    may_subscribe,
    metrics_permissions,
    monitor_permissions,
    parse_learners,
    permissions_markdown,
    permissions_of,
    plan_users,
    region_of,
    role_permissions,
    summarize,
)
from diloco.auth_tls import (  # noqa: F401
    BCRYPT_COST,
    bcrypt_hasher,
    make_ca,
    make_cert,
    openssl_binary,
    split_hosts,
)


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
