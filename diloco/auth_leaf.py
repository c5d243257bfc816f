"""Access control on the leaf topology: the run's account and users on the hub and on every leaf server.

:mod:`diloco.auth` makes one account ``DILOCO_<run>`` with one least-privilege user per role and per
learner, for one server. The leaf topology (:mod:`diloco.topology`: a hub with JetStream in the domain
``hub``, one JetStream-less leaf server per region) carries the same account on every server:

* **hub**: the account exactly as :func:`diloco.auth.render_accounts` writes it (JetStream enabled,
  every user), and, in its ``leafnodes { }`` block, one *leaf user* per region (``leaf-<region>``)
  bound to that account (:func:`render_leafnode_authorization`): a leaf link that authenticates as
  it joins the run's account and nothing else;
* **each leaf**: the same users with the same permissions (a client's password and permissions
  are checked by the server it connects to), no JetStream, and the mappings of
  :func:`diloco.topology.leaf_mappings` *inside* the account (:func:`render_leaf_accounts`): top-level
  mappings apply to the global account, which has no users here. Its remote dials the hub as
  ``leaf-<region>`` with ``account: DILOCO_<run>`` (:func:`diloco.topology.leaf_extra_config`).

There is no ``no_auth_user``: every server refuses anonymous clients, and the hub's leafnode
listener refuses a leaf server without its region's credentials.

Measured with nats-server 2.15 (``tests/test_auth_leaf.py``): a leaf server checks a client's publish
permissions on the subject *after* the account's mappings: a learner's ``$JS.API.STREAM.INFO.<s>``
is allowed only if ``$JS.hub.API.STREAM.INFO.<s>`` is, and the unmapped entry alone is refused
("Permissions Violation for Publish to $JS.hub.API..."). So on a leaf each allow entry that a
mapping rewrites is listed in its mapped form (:func:`leaf_permissions`: the same operations on
the same streams, nothing more); entries no mapping touches (data subjects, ``$JS.FC``,
``$JS.ACK``) stay as they are. The leaf link is not restricted inside the account: the hub trusts
its leaf servers as it trusts itself.

For a deployment by hand, ``diloco auth init --leaf`` writes the leaf servers' account next to the
hub's (``nats-auth-leaf.conf`` beside ``nats-auth.conf``). ``deploy/nats/`` holds both with
``CHANGE_ME_*`` placeholder passwords (:func:`deploy_fragments`; ``python -m diloco.auth_leaf --deploy
deploy/nats`` rewrites them, ``tests/test_topology.py`` checks they are current), included by
``hub.conf``, ``cluster-*.conf`` and ``leaf-*.conf``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bus.subjects import check_token
from diloco.auth_config import InitResult, _q, account_name, render_accounts
from diloco.auth_permissions import (
    CONF_NAME,
    LEAF_CONF_NAME,
    Permissions,
    User,
    _uniq,
    new_password,
    parse_learners,
    plan_users,
)
from diloco.topology import HUB_DOMAIN, leaf_mappings

#: Run, learners and regions of the checked-in production configs (deploy/nats/).
DEPLOY_RUN = "exp1"
DEPLOY_LEARNERS = "us-0,us-1,eu-0,eu-1"
DEPLOY_REGIONS = ("us", "eu")
#: The account fragments deploy/nats/*.conf include (hub and gateway clusters, leaf servers): the
#: names of what ``diloco auth init --leaf`` writes, so its output replaces them as they are.
DEPLOY_FILES = {"hub": CONF_NAME, "leaf": LEAF_CONF_NAME}


def leaf_user(region: str) -> str:
    """The user a region's leaf server authenticates as on the hub's leafnode listener."""
    return f"leaf-{check_token('region', region)}"


def mapped_subject(subject: str, mappings: Mapping[str, str]) -> str:
    """``subject`` (or a pattern) as a mapping of the form ``"<a>.>": "<b>.>"`` rewrites it; else unchanged."""
    for src, dst in mappings.items():
        if not (src.endswith(".>") and dst.endswith(".>")):
            raise ValueError(f"mapping {src} -> {dst}: only prefix mappings (a.> -> b.>) are supported")
        if subject.startswith(src[:-1]) and len(subject) > len(src) - 1:
            return dst[:-1] + subject[len(src) - 1:]
    return subject


def leaf_permissions(perms: Permissions, domain: str = HUB_DOMAIN) -> Permissions:
    """``perms`` as a leaf server must hold them: publish entries in their mapped form (see above)."""
    maps = leaf_mappings(domain)
    return Permissions(_uniq(mapped_subject(p, maps) for p in perms.publish), perms.subscribe)


def render_leaf_accounts(run: str, users: Sequence[User], secrets_: Mapping[str, str], *,
                         domain: str = HUB_DOMAIN, provision: bool = True) -> str:
    """The ``accounts { }`` block of a leaf server: the run's users (their publish permissions in the
    mapped form), no JetStream, the mappings inside the account."""
    return render_accounts(run, users, dict(secrets_), provision=provision, jetstream=False,
                           mappings=leaf_mappings(domain), permissions=lambda p: leaf_permissions(p, domain))


def render_leafnode_authorization(run: str, secrets_: Mapping[str, str]) -> str:
    """The hub's ``authorization { }`` for its ``leafnodes { }`` block: one user per region (``secrets_``:
    region -> what the config holds, a bcrypt hash or the password), each bound to the run's account."""
    acct = account_name(run)
    rows = [f"    {{ user: {_q(leaf_user(r))}, password: {_q(s)}, account: {acct} }}" for r, s in secrets_.items()]
    return "authorization {\n  users: [\n" + "\n".join(rows) + "\n  ]\n}\n"


@dataclass(frozen=True)
class LeafAuth:
    """What the servers of a leaf topology need for one run's account (:meth:`diloco.topology.Topology.start`).

    ``hub_accounts`` / ``leaf_accounts``: the ``accounts { }`` blocks of the hub and of every leaf;
    ``leafnode_authorization``: the hub's leafnode users; ``link_passwords``: region -> the plain
    password its leaf server dials the hub with."""

    run: str
    hub_accounts: str = field(repr=False)
    leaf_accounts: str = field(repr=False)
    leafnode_authorization: str = field(repr=False)
    link_passwords: dict[str, str] = field(repr=False)

    @property
    def account(self) -> str:
        return account_name(self.run)

    @property
    def regions(self) -> list[str]:
        return list(self.link_passwords)

    def credentials(self, region: str) -> tuple[str, str]:
        """(user, password) of ``region``'s leaf link."""
        if region not in self.link_passwords:
            raise KeyError(f"region {region!r}: no leaf credentials (regions: {', '.join(self.link_passwords)})")
        return leaf_user(region), self.link_passwords[region]


def make_leaf_auth(run: str, users: Sequence[User], stored: Mapping[str, str], regions: Iterable[str], *,
                   domain: str = HUB_DOMAIN, provision: bool = True,
                   hasher: Callable[[str], str] | None = None,
                   password: Callable[[], str] = new_password) -> LeafAuth:
    """The run's account for the hub and the leaves, and a new leaf-link password per region.

    ``users``/``stored``: the run's users and what the server config holds for each (as
    :func:`diloco.auth.init` made them: ``InitResult.users``/``.stored``); ``hasher``: how the hub holds
    the leaf-link passwords (None: in plain text, as the launcher's configs do)."""
    regs = list(dict.fromkeys(regions))
    for r in regs:
        check_token("region", r)
    if not regs:
        raise ValueError("the leaf topology needs at least one region")
    missing = [u.name for u in users if u.name not in stored]
    if missing:
        raise ValueError(f"no stored secret for {', '.join(missing)}")
    links = {r: password() for r in regs}
    return LeafAuth(
        run=run,
        hub_accounts=render_accounts(run, users, dict(stored), provision=provision),
        leaf_accounts=render_leaf_accounts(run, users, stored, domain=domain, provision=provision),
        leafnode_authorization=render_leafnode_authorization(
            run, {r: (hasher(p) if hasher else p) for r, p in links.items()}),
        link_passwords=links,
    )


def leaf_auth_from_init(result: InitResult, run: str, regions: Iterable[str], *, domain: str = HUB_DOMAIN,
                        provision: bool = True) -> LeafAuth:
    """:func:`make_leaf_auth` for the users :func:`diloco.auth.init` just wrote (their env files stay valid)."""
    return make_leaf_auth(run, result.users, result.stored, regions, domain=domain, provision=provision)


# -- the production configs (deploy/nats/) -------------------------------------------------------


def placeholder(name: str) -> str:
    """``CHANGE_ME_<NAME>``: the password placeholder of user ``name`` in deploy/nats/."""
    return "CHANGE_ME_" + name.upper().replace("-", "_").replace(".", "_")


def deploy_fragments(run: str = DEPLOY_RUN, learners: str = DEPLOY_LEARNERS,
                     domain: str = HUB_DOMAIN) -> dict[str, str]:
    """File name -> text of the account fragments deploy/nats/*.conf include, with placeholder passwords."""
    users = plan_users(parse_learners(learners))
    stored = {u.name: placeholder(u.name) for u in users}
    def head(name: str, what: str) -> str:
        return (f"# {what}: the account of run {run}, one least-privilege user per role and per learner.\n"
                f"# Generated by `python -m diloco.auth_leaf --deploy deploy/nats`, with CHANGE_ME_* placeholder\n"
                f"# passwords. Replace this file with the {name} that\n"
                f"#   diloco auth init --run {run} --learners {learners} --leaf\n"
                "# writes (bcrypt-hashed passwords; the processes' env files beside it hold them).\n")
    return {
        DEPLOY_FILES["hub"]: (head(DEPLOY_FILES["hub"], "Included by hub.conf and cluster-*.conf")
                              + render_accounts(run, users, stored)),
        DEPLOY_FILES["leaf"]: (head(DEPLOY_FILES["leaf"], "Included by leaf-*.conf") +
                               "# The same users as nats-auth.conf, without JetStream, with the hub-domain mappings\n"
                               "# inside the account and the permissions in their mapped form (diloco/auth_leaf.py).\n"
                               + render_leaf_accounts(run, users, stored, domain=domain)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diloco.auth_leaf",
                                description="Rewrite the account fragments of the production NATS configs.")
    p.add_argument("--deploy", required=True, help="folder of the production configs (deploy/nats)")
    a = p.parse_args(argv)
    for name, text in deploy_fragments().items():
        (Path(a.deploy) / name).write_text(text)
        print(f"wrote {Path(a.deploy) / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
