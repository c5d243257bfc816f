"""A run whose regions sit behind emulated WAN links: the leaf topology inside :mod:`bench.netns`.

The hub ``nats-server`` (JetStream, domain ``hub``) runs in the hub namespace with the aggregator,
monitor and evaluator; every region has its own leaf ``nats-server`` (no JetStream; the mappings of
:mod:`diloco.topology`) in its namespace, dialling the hub through its link: the veth pair (rate,
``tc tbf``) and the relay (delay, loss; :mod:`bench.relay`). A region's learners connect to their
leaf on the namespace's loopback, so everything they send the hub crosses their link.

:class:`WanCluster` is a :class:`bench.runs.Cluster` (metrics tap, ``wait_for``, ``eval_once``) whose
``__aenter__`` must run on a thread inside the hub namespace (``WanNet.call(None, asyncio.run, ...)``),
so that its NATS tap is on the hub's loopback. With ``auth`` (the default) every server has the
run's account and per-role users, as ``diloco up --topology leaf`` runs it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
import urllib.request

import orjson

from bench.netns import WanNet, in_netns
from bench.relay import Relay
from bench.runs import PY, Cluster
from bus.config import CommonConfig
from bus.procs import popen
from bus.server import DEFAULT_MAX_PAYLOAD, find_binary, render_config
from bus.signals import terminate_all
from diloco.topology import hub_extra_config, leaf_extra_config

CLIENT_PORT, HTTP_PORT, LEAF_PORT, RELAY_PORT = 4222, 8222, 7422, 7500
LOCAL_URL = f"nats://127.0.0.1:{CLIENT_PORT}"


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as r:
        return orjson.loads(r.read())


def _js_answers(user: str | None = None, password: str | None = None) -> bool:
    """A JetStream account-info request through the local server is answered (a leaf: by the hub)."""
    import nats

    async def ask() -> bool:
        nc = await nats.connect(LOCAL_URL, connect_timeout=2, allow_reconnect=False, user=user, password=password)
        try:
            await nc.request("$JS.API.INFO", b"", timeout=1)
            return True
        except Exception:
            return False
        finally:
            await nc.close()

    return asyncio.run(ask())


class WanCluster(Cluster):
    """``async with WanCluster(net, run, env) as c`` (on a thread in the hub namespace).

    ``learners``: [(learner id, region)] of the run. With ``auth`` (the default) every server
    carries the run's account and per-role users as ``diloco up`` makes them (:func:`diloco.auth.init`,
    :mod:`diloco.auth_leaf`): the leaf links are bound to the account, anonymous clients are refused,
    and every process started here gets its own user's credentials (the tap reads as ``metrics``)."""

    def __init__(self, net: WanNet, run: str = "bench", env: dict | None = None, metrics_interval: float = 0.5,
                 learners: list[tuple[str, str]] | None = None, auth: bool = True):
        super().__init__(run, env, metrics_interval)
        self.net = net
        self.learners = list(learners or [])
        self.auth = auth
        self.creds: dict[str, dict[str, str]] = {}  # user -> its env file's DILOCO_* values
        self.servers: dict[str, subprocess.Popen] = {}
        self.relays: list[Relay] = []
        self.region_of: dict[str, str | None] = {}

    # -- servers -------------------------------------------------------------------------------------

    def _server(self, name: str, region: str | None, extra: str) -> None:
        conf = os.path.join(self.dir, f"{name}.conf")
        with open(conf, "w") as f:
            f.write(render_config(host="127.0.0.1", port=CLIENT_PORT, http_port=HTTP_PORT,
                                  store_dir=os.path.join(self.dir, name, "jetstream"),
                                  max_payload=DEFAULT_MAX_PAYLOAD, server_name=f"diloco-{name}", extra=extra))
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        self.servers[name] = popen(self.net.cmd(region, [find_binary(), "-c", conf]), stdout=log, stderr=log)
        log.close()

    def http(self, region: str | None, path: str) -> dict:
        """GET the monitoring endpoint ``path`` of the hub (None) or of ``region``'s leaf."""
        return in_netns(self.net.ns_of(region), _get_json, f"http://127.0.0.1:{HTTP_PORT}{path}")

    def _wait(self, pred, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if pred():
                    return
            except Exception as e:
                last = e
            for n, p in self.servers.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{n} exited {p.returncode}: {self.log_tail(n)}")
            time.sleep(0.1)
        raise RuntimeError(f"{what} after {timeout}s ({last!r})")

    def leaves_connected(self) -> int:
        return int(self.http(None, "/leafz").get("leafnodes", 0))

    async def __aenter__(self) -> "WanCluster":
        self._tmp = tempfile.TemporaryDirectory(prefix="diloco-wan-")
        self.dir = self._tmp.name
        try:
            await asyncio.to_thread(self._start_servers)
            self.url = LOCAL_URL
            me = self.creds.get("metrics", {})
            await self.open_tap(CommonConfig(nats_url=self.url, run=self.run, nats_user=me.get("DILOCO_NATS_USER"),
                                             nats_password=me.get("DILOCO_NATS_PASSWORD")))
        except BaseException:
            self._stop_servers()
            self._tmp.cleanup()
            raise
        return self

    def _start_servers(self) -> None:
        net = self.net
        hub_auth: dict = {}
        la = None
        if self.auth:
            from diloco.auth import init as auth_init
            from bus.config import parse_env_file
            from diloco.auth_leaf import leaf_auth_from_init

            made = auth_init(os.path.join(self.dir, "auth"), self.run, self.learners, force=True, hash_mode="plain")
            self.creds = {u: parse_env_file(f.read_text()) for u, f in made.env_files.items()}
            la = leaf_auth_from_init(made, self.run, net.regions)
            hub_auth = {"accounts": la.hub_accounts, "leafnode_authorization": la.leafnode_authorization}
        self._server("hub", None, hub_extra_config(os.path.join(self.dir, "hub", "jetstream"), LEAF_PORT, **hub_auth))
        self._wait(lambda: self.http(None, "/healthz?js-enabled-only=true") is not None, 20, "the hub is not up")
        for i, (region, link) in enumerate(zip(net.regions, net.links)):
            hub_addr = net.plan.addrs(i)[0]
            relay = Relay((hub_addr, RELAY_PORT), ("127.0.0.1", LEAF_PORT), link.delay_ms / 1000, link.loss, seed=i)
            relay.serve_in_thread(start=lambda body: in_netns(net.plan.hub_ns, body, daemon=True))
            self.relays.append(relay)
            leaf_auth = ({"accounts": la.leaf_accounts, "account": la.account, "credentials": la.credentials(region)}
                         if la is not None else {})
            self._server(f"leaf-{region}", region,
                         leaf_extra_config([f"nats-leaf://{hub_addr}:{RELAY_PORT}"], **leaf_auth))
        self._wait(lambda: self.leaves_connected() >= len(net.regions), 30,
                   f"not every one of {len(net.regions)} leaves connected to the hub")
        for region in net.regions:  # the hub's interest in its JetStream API has reached the leaf
            probe = self.creds.get("metrics", {})  # the read-only user may ask for account info
            self._wait(lambda: in_netns(net.ns_of(region), _js_answers, probe.get("DILOCO_NATS_USER"),
                                        probe.get("DILOCO_NATS_PASSWORD")), 30,
                       f"the hub's JetStream does not answer through the leaf of {region}")

    def _stop_servers(self) -> None:
        terminate_all([p for n, p in self.servers.items() if n != "hub"], 10)
        terminate_all([p for n, p in self.servers.items() if n == "hub"], 10)
        for r in self.relays:
            r.close()

    def close_servers(self) -> None:  # Cluster.__aexit__: after the processes and the tap
        self._stop_servers()

    # -- processes ---------------------------------------------------------------------------------------

    def start(self, name: str, module: str, region: str | None = None, **extra: str) -> subprocess.Popen:
        """Start role ``module`` as ``name`` in ``region``'s namespace (None: the hub's)."""
        log = open(os.path.join(self.dir, f"{name}.log"), "ab")
        argv = ["diloco.cli", "aggregator"] if module == "aggregator" else [module]
        user = f"learner-{extra['DILOCO_LEARNER_ID']}" if module == "learner" else module
        env = self.env(**{**self.creds.get(user, {}), **extra, "DILOCO_NATS_URL": LOCAL_URL})
        p = popen(self.net.cmd(region, [PY, "-m", *argv]), env=env, stdout=log, stderr=log)
        log.close()
        self.procs[name] = p
        self.region_of[name] = region
        return p

    def connz(self) -> dict[str, tuple[int, int]]:
        """{connection name: (in, out) bytes} over the hub and every leaf: what each client moved."""
        out: dict[str, tuple[int, int]] = {}
        for region in [None, *self.net.regions]:
            try:
                d = self.http(region, "/connz?state=all&limit=4096")
            except Exception:
                continue
            for c in d.get("connections", []):
                name = c.get("name") or f"cid{c.get('cid')}"
                i, o = out.get(name, (0, 0))
                out[name] = (i + int(c.get("in_bytes", 0)), o + int(c.get("out_bytes", 0)))
        return out

    def permission_violations(self) -> dict[str, int]:
        """Lines of each server's log that report a permissions violation (0 everywhere: every role
        did its job within its user's permissions, on the hub and through the leaves)."""
        out = {}
        for name in self.servers:
            try:
                with open(os.path.join(self.dir, f"{name}.log"), errors="replace") as f:
                    out[name] = sum(1 for line in f if "permissions violation" in line.lower())
            except OSError:
                out[name] = 0
        return out

    def leafz(self) -> dict:
        """The hub's view of its leaf connections: per remote, the bytes in and out."""
        d = self.http(None, "/leafz")
        return {lf.get("name", ""): {"in_bytes": lf.get("in_bytes"), "out_bytes": lf.get("out_bytes"),
                                     "rtt": lf.get("rtt")} for lf in d.get("leafs") or []}


def run_in_hub(net: WanNet, coro_fn, *args):
    """``asyncio.run(coro_fn(*args))`` on a thread inside the hub namespace; its result."""
    return net.call(None, lambda: asyncio.run(coro_fn(*args)))


__all__ = ["WanCluster", "run_in_hub", "LOCAL_URL", "PY"]
