"""Broker topologies for ``diloco up``: one server, or a hub with one leaf-node server per region.

``single``
    one :class:`~bus.server.EmbeddedServer` with JetStream; every process connects to it.

``leaf``
    a **hub** server that runs JetStream (in the JetStream *domain* ``hub``) and listens for leaf
    nodes, plus one **leaf** server per region that dials the hub and has no JetStream of its own.
    A region's learners connect to their own leaf; the aggregator, monitor and evaluator to the hub.
    Core NATS traffic (heartbeats, metrics, inboxes, acks) crosses the leaf link by interest, as
    usual.

Why the domain and the mappings (measured with nats-server 2.15, see tests/test_topology.py):
a hub without a domain does **not** propagate interest in ``$JS.API.>`` over a leaf connection,
so a client on a JetStream-less leaf gets "no responders" for every stream request. With
``jetstream { domain: hub }`` the hub exports its API as ``$JS.hub.API.>`` (and KV writes as
``$JS.hub.API.$KV.>``, since ``$KV.>`` is not propagated either), and the leaf maps the plain
names onto them::

    mappings { "$JS.API.>": "$JS.hub.API.>", "$KV.>": "$JS.hub.API.$KV.>", "$OBJ.>": "$JS.hub.API.$OBJ.>" }

so that unmodified clients (``nc.jetstream()`` without a domain, KV ``put``/``update``/``watch``,
direct get, pull consumers, acks, dedupe headers) work through the leaf exactly as on the hub.
The production configs in ``deploy/nats/`` use the same design; ``docs/deploy.md`` explains it.

With auth (``leaf_auth``, a :class:`diloco.auth_leaf.LeafAuth`; ``diloco up`` passes one unless
``--no-auth``), every server carries the run's account ``DILOCO_<run>`` and its per-role users, and
the mappings move *into* that account on the leaves (top-level mappings belong to the global
account, which then has no clients)::

    # hub
    accounts { DILOCO_<run>: { jetstream: enabled, users: [ ... ] } }
    leafnodes { listen: ..., authorization { users: [
        { user: leaf-<region>, password: ..., account: DILOCO_<run> } ] } }
    # leaf of <region>
    jetstream: disabled
    accounts { DILOCO_<run>: { mappings { "$JS.API.>": "$JS.hub.API.>", ... }, users: [ ... ] } }
    leafnodes { remotes: [ { urls: [ "nats-leaf://leaf-<region>:<password>@hub:port" ], account: DILOCO_<run> } ] }

Anonymous clients are refused everywhere, and a leaf server without credentials by the hub.
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bus.server import EmbeddedServer, ServerError, free_port

if TYPE_CHECKING:  # diloco.auth_leaf imports this module
    from diloco.auth_leaf import LeafAuth

#: JetStream domain of the hub; leaves map the plain JetStream API names onto it.
HUB_DOMAIN = "hub"
TOPOLOGIES = ("single", "leaf")


def leaf_mappings(domain: str = HUB_DOMAIN) -> dict[str, str]:
    """Subject mappings a JetStream-less leaf needs so plain ``$JS.API``/``$KV`` reach the hub's domain."""
    return {
        "$JS.API.>": f"$JS.{domain}.API.>",
        "$KV.>": f"$JS.{domain}.API.$KV.>",
        "$OBJ.>": f"$JS.{domain}.API.$OBJ.>",
    }


def hub_extra_config(js_store_dir: str, leaf_port: int, domain: str = HUB_DOMAIN, leaf_host: str = "127.0.0.1", *,
                     accounts: str = "", leafnode_authorization: str = "") -> str:
    """Config text appended to the hub's generated config (a later ``jetstream`` block replaces the first).

    With auth: ``accounts``, the run's ``accounts { }`` block (:attr:`diloco.auth_leaf.LeafAuth.hub_accounts`),
    and ``leafnode_authorization``, the ``authorization { }`` of the leafnode listener that binds
    each region's leaf user to the run's account (``LeafAuth.leafnode_authorization``)."""
    if bool(accounts) != bool(leafnode_authorization):
        raise ServerError("hub_extra_config: accounts and leafnode_authorization go together "
                          "(a leaf link without an account binding would join no account's clients)")
    auth = "".join(f"  {ln}\n" for ln in leafnode_authorization.strip().splitlines())
    return (
        "jetstream {\n"
        f'  store_dir: "{js_store_dir}"\n'
        f"  domain: {domain}\n"
        "  max_memory_store: 1GB\n"
        "  max_file_store: 20GB\n"
        "}\n"
        + (accounts if accounts.endswith("\n") or not accounts else accounts + "\n")
        + f'leafnodes {{\n  listen: "{leaf_host}:{leaf_port}"\n{auth}}}\n'
    )


def with_userinfo(url: str, user: str, password: str) -> str:
    """``nats-leaf://host:port`` -> ``nats-leaf://user:password@host:port`` (both percent-encoded)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" in rest:
        raise ServerError(f"leaf remote URL {url!r}: expected scheme://host:port without credentials")
    q = urllib.parse.quote
    return f"{scheme}://{q(user, safe='')}:{q(password, safe='')}@{rest}"


def leaf_extra_config(hub_leaf_urls: list[str], domain: str = HUB_DOMAIN, *, accounts: str = "",
                      account: str | None = None, credentials: tuple[str, str] | None = None) -> str:
    """Config text appended to a leaf's generated config: no JetStream, mappings, remote to the hub.

    With auth: ``accounts``, the leaf's ``accounts { }`` block, whose ``account`` holds the users
    and the mappings (:attr:`diloco.auth_leaf.LeafAuth.leaf_accounts`); the remote binds ``account``
    and dials the hub as ``credentials`` = (user, password) (``LeafAuth.credentials(region)``).
    Without: the mappings at the top level (the global account), anonymous clients."""
    if accounts or account:
        if not (accounts and account):
            raise ServerError("leaf_extra_config: accounts and account go together")
        if f"{account}:" not in accounts or "mappings" not in accounts:
            raise ServerError(f"leaf_extra_config: the accounts block must define {account} with the "
                              "leaf mappings inside it (diloco.auth_leaf.render_leaf_accounts)")
    if credentials is not None:
        hub_leaf_urls = [with_userinfo(u, *credentials) for u in hub_leaf_urls]
    urls = ", ".join(f'"{u}"' for u in hub_leaf_urls)
    bind = f", account: {account}" if account else ""
    if accounts:
        top = accounts if accounts.endswith("\n") else accounts + "\n"
    else:
        maps = ", ".join(f'"{k}": "{v}"' for k, v in leaf_mappings(domain).items())
        top = f"mappings {{ {maps} }}\n"
    return (
        "jetstream: disabled\n"
        + top
        + f"leafnodes {{\n  remotes: [ {{ urls: [ {urls} ]{bind} }} ]\n}}\n"
    )


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@dataclass
class Topology:
    """A set of running servers and which URL each region's processes use.

    ``servers`` maps a server name (``nats``, ``hub``, ``leaf-<region>``) to its EmbeddedServer.
    """

    kind: str
    regions: list[str]
    store_dir: str
    log_dir: str | None = None
    #: Config text for the ``single`` server (``diloco.auth``'s accounts fragment). The leaf topology
    #: refuses it: its servers take the run's account from ``leaf_auth``.
    extra_config: str = ""
    servers: dict[str, EmbeddedServer] = field(default_factory=dict)
    _leaf_of: dict[str, str] = field(default_factory=dict)
    #: The run's account and users for the hub and every leaf (``leaf`` topology only; None: anonymous).
    leaf_auth: LeafAuth | None = None

    # -- URLs ----------------------------------------------------------------------------------

    @property
    def hub_name(self) -> str:
        return "nats" if self.kind == "single" else "hub"

    @property
    def hub(self) -> EmbeddedServer:
        return self.servers[self.hub_name]

    @property
    def hub_url(self) -> str:
        return self.hub.url

    def url_for(self, region: str | None) -> str:
        """The client URL for a process of ``region`` (None: a central role, on the hub)."""
        if region is None or self.kind == "single":
            return self.hub_url
        return self.servers[self._leaf_of[region]].url

    def server_for(self, region: str | None) -> str:
        if region is None or self.kind == "single":
            return self.hub_name
        return self._leaf_of[region]

    def pids(self) -> dict[str, int]:
        return {n: s.proc.pid for n, s in self.servers.items() if s.proc is not None}

    # -- life ----------------------------------------------------------------------------------

    def _log(self, name: str) -> str | None:
        return os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None

    def start(self, timeout: float = 20.0) -> "Topology":
        if self.kind not in TOPOLOGIES:
            raise ServerError(f"topology {self.kind!r}: expected one of {', '.join(TOPOLOGIES)}")
        try:
            if self.kind == "single":
                srv = EmbeddedServer(store_dir=os.path.join(self.store_dir, "nats"), server_name="diloco",
                                     log_file=self._log("nats-server"), extra_config=self.extra_config)
                self.servers["nats"] = srv
                srv.start(timeout)
                return self
            if self.extra_config:
                raise ServerError("the leaf topology takes the run's accounts from leaf_auth "
                                  "(diloco.auth_leaf.LeafAuth), not from extra_config")
            auth = self.leaf_auth
            if auth is not None and set(self.regions) - set(auth.regions):
                raise ServerError(f"leaf_auth has no leaf credentials for region(s) "
                                  f"{', '.join(sorted(set(self.regions) - set(auth.regions)))}")
            hub_store = os.path.join(self.store_dir, "hub")
            leaf_port = free_port()
            hub_auth = ({"accounts": auth.hub_accounts, "leafnode_authorization": auth.leafnode_authorization}
                        if auth else {})
            hub = EmbeddedServer(store_dir=hub_store, server_name="diloco-hub", log_file=self._log("nats-hub"),
                                 extra_config=hub_extra_config(os.path.join(hub_store, "jetstream"), leaf_port,
                                                               **hub_auth))
            self.servers["hub"] = hub
            hub.start(timeout)
            for region in self.regions:
                name = f"leaf-{region}"
                leaf_auth = ({"accounts": auth.leaf_accounts, "account": auth.account,
                              "credentials": auth.credentials(region)} if auth else {})
                leaf = EmbeddedServer(store_dir=os.path.join(self.store_dir, name), server_name=f"diloco-{name}",
                                      log_file=self._log(f"nats-{name}"),
                                      extra_config=leaf_extra_config([f"nats-leaf://127.0.0.1:{leaf_port}"],
                                                                     **leaf_auth))
                self.servers[name] = leaf
                self._leaf_of[region] = name
                leaf.start(timeout)
            self.wait_leaves(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_leaves(self, timeout: float = 20.0) -> None:
        """Block until the hub reports one leaf connection per region, or raise :class:`ServerError`."""
        deadline = time.monotonic() + timeout
        want = len(self.regions)
        got = -1
        while time.monotonic() < deadline:
            try:
                got = int(_get_json(f"{self.hub.monitor_url}/leafz").get("leafnodes", 0))
            except Exception:
                got = -1
            if got >= want:
                return
            time.sleep(0.05)
        hint = " (a refused leaf link says 'Authorization Violation' in the leaf's log)" if self.leaf_auth else ""
        raise ServerError(f"only {got} of {want} leaf nodes connected to the hub after {timeout}s{hint}")

    def stop(self) -> None:
        """Stop the leaves first, then the hub (SIGTERM, SIGKILL after 10 s); remove temp config dirs."""
        for name in sorted(self.servers, key=lambda n: n == self.hub_name):
            try:
                self.servers[name].close()
            except Exception:
                pass

    # -- accounting ----------------------------------------------------------------------------

    def traffic(self) -> dict:
        """Bytes per server (``/varz``) and per client connection, open and closed (``/connz?state=all``).

        ``client_bytes`` sums in+out over every client connection of every server: the bytes that
        crossed the broker to or from a process, each counted once per direction (server-to-server
        hops of the leaf topology are not client traffic and are reported per server only).
        """
        servers: dict[str, dict] = {}
        conns: list[dict] = []
        for name, srv in self.servers.items():
            try:
                v = srv.varz()
                servers[name] = {"in_bytes": int(v.get("in_bytes", 0)), "out_bytes": int(v.get("out_bytes", 0)),
                                 "in_msgs": int(v.get("in_msgs", 0)), "out_msgs": int(v.get("out_msgs", 0))}
                cz = srv.connz(state="all", limit="100000")
            except Exception as e:  # a dead server: report what we can
                servers[name] = {"error": repr(e)}
                continue
            for c in cz.get("connections") or []:
                conns.append({"server": name, "name": c.get("name", ""), "cid": c.get("cid"),
                              "in_bytes": int(c.get("in_bytes", 0)), "out_bytes": int(c.get("out_bytes", 0))})
        return {"servers": servers, "connections": conns,
                "client_bytes": sum(c["in_bytes"] + c["out_bytes"] for c in conns)}


def make_topology(kind: str, regions: list[str], store_dir: str, log_dir: str | None = None,
                  extra_config: str = "", *, leaf_auth: LeafAuth | None = None) -> Topology:
    """``extra_config``: appended to the single server's config (e.g. ``diloco.auth``'s accounts);
    ``leaf_auth``: the run's account and users on the hub and every leaf (the leaf topology's auth)."""
    if leaf_auth is not None and kind != "leaf":
        raise ServerError("leaf_auth is for the leaf topology; the single server takes extra_config")
    return Topology(kind=kind, regions=list(regions), store_dir=store_dir, log_dir=log_dir,
                    extra_config=extra_config, leaf_auth=leaf_auth)
