"""Beyond one machine: the leaf-node topology on loopback, the gateway alternative, and the production
configs under deploy/ (validated with ``nats-server -t``)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bus.server import EmbeddedServer, free_port, render_config, validate_config_file
from diloco.topology import HUB_DOMAIN, hub_extra_config, leaf_extra_config, leaf_mappings, make_topology

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"


# -- the production configs -----------------------------------------------------------------------


def deploy_configs() -> list[Path]:
    return sorted(DEPLOY.rglob("*.conf"))


def test_deploy_has_the_documented_configs():
    names = {p.name for p in deploy_configs()}
    assert {"compose.conf", "hub.conf", "leaf-us.conf", "leaf-eu.conf", "cluster-us.conf", "cluster-eu.conf",
            "nats-auth.conf", "nats-auth-leaf.conf"} <= names


@pytest.mark.parametrize("path", deploy_configs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_deploy_config_is_valid(path):
    ok, out = validate_config_file(str(path))
    assert ok, out


def _mappings(text: str) -> dict[str, str]:
    block = re.search(r"mappings\s*\{(.*?)\}", text, re.S)
    assert block, "no mappings block"
    return dict(re.findall(r'"([^"]+)"\s*:\s*"([^"]+)"', block.group(1)))


def _with_includes(path: Path) -> str:
    """The config text with each ``include "file"`` replaced by that file (relative to the config's folder)."""
    return re.sub(r'^\s*include\s+"([^"]+)"\s*$', lambda m: (path.parent / m.group(1)).read_text(),
                  path.read_text(), flags=re.M)


@pytest.mark.parametrize("region", ["us", "eu"])
def test_deploy_leaf_matches_the_tested_design(region):
    """The production leaves use exactly the mappings, hub domain and account binding the loopback tests
    below (and tests/test_auth.py's leaf broker) exercise: the mappings inside the run's account, the
    remote bound to it, the hub's leaf user of the region bound to it as well."""
    from diloco.auth import account_name
    from diloco.auth_leaf import DEPLOY_RUN, leaf_user

    acct = account_name(DEPLOY_RUN)
    leaf = _with_includes(DEPLOY / "nats" / f"leaf-{region}.conf")
    assert _mappings(leaf) == leaf_mappings(HUB_DOMAIN)
    assert re.search(rf"^accounts\s*\{{\s*{acct}:\s*\{{\s*mappings", leaf, re.M)  # inside the account
    assert re.search(r"^jetstream:\s*disabled", leaf, re.M)
    assert "nats-leaf://" in leaf and re.search(rf"^\s*account:\s*{acct}\b", leaf, re.M)
    assert "no_auth_user" not in leaf
    hub = _with_includes(DEPLOY / "nats" / "hub.conf")
    assert re.search(rf"^\s*domain:\s*{HUB_DOMAIN}\b", hub, re.M)
    assert re.search(r"leafnodes\s*\{", hub)
    assert re.search(rf"\{{\s*user:\s*{leaf_user(region)},\s*password:\s*\S+,\s*account:\s*{acct}\s*\}}", hub)
    assert "no_auth_user" not in hub


def test_deploy_accounts_are_what_bus_auth_generates():
    """deploy/nats/nats-auth*.conf are diloco.auth's account for the deploy run (placeholder passwords): the
    users and permissions of `diloco auth init --leaf`. Regenerate: python -m diloco.auth_leaf --deploy deploy/nats"""
    from diloco.auth_leaf import deploy_fragments

    for name, text in deploy_fragments().items():
        assert (DEPLOY / "nats" / name).read_text() == text, f"{name}: python -m diloco.auth_leaf --deploy deploy/nats"
    for name in ("hub.conf", "cluster-us.conf", "cluster-eu.conf"):
        assert 'include "nats-auth.conf"' in (DEPLOY / "nats" / name).read_text(), name


def test_rendered_loopback_configs_are_valid(tmp_path):
    hub = render_config(host="127.0.0.1", port=free_port(), http_port=free_port(), store_dir=str(tmp_path / "js"),
                        max_payload=8 << 20, server_name="hub",
                        extra=hub_extra_config(str(tmp_path / "js"), free_port()))
    leaf = render_config(host="127.0.0.1", port=free_port(), http_port=free_port(), store_dir=str(tmp_path / "l"),
                         max_payload=8 << 20, server_name="leaf",
                         extra=leaf_extra_config(["nats-leaf://127.0.0.1:7422"]))
    for name, text in (("hub.conf", hub), ("leaf.conf", leaf)):
        p = tmp_path / name
        p.write_text(text)
        ok, out = validate_config_file(str(p))
        assert ok, out


# -- the loopback leaf topology -------------------------------------------------------------------


@pytest.fixture
def leaf_topology(tmp_path):
    topo = make_topology("leaf", ["us", "eu"], str(tmp_path / "store"), str(tmp_path))
    topo.start()
    try:
        yield topo
    finally:
        topo.stop()


async def test_leaf_clients_reach_the_hub_jetstream(leaf_topology):
    """Everything the roles do with JetStream works from a JetStream-less leaf: streams and KV of a run,
    dedupe, compare-and-set, direct get, pull consumers with acks; core messages cross by interest."""
    from nats.js.errors import KeyWrongLastSequenceError

    from bus.config import CommonConfig
    from bus.conn import connect
    from bus.streams import Limits, ensure_run
    from bus.subjects import Subjects

    topo = leaf_topology
    assert topo.url_for("us") != topo.url_for("eu") != topo.hub_url
    assert not topo.servers["leaf-us"].varz().get("jetstream", {}).get("config")  # no JetStream on leaves
    cfg = CommonConfig(run="leaf")
    us = await connect(CommonConfig(nats_url=topo.url_for("us"), run="leaf"), name="t-us")
    eu = await connect(CommonConfig(nats_url=topo.url_for("eu"), run="leaf"), name="t-eu")
    hub = await connect(CommonConfig(nats_url=topo.hub_url, run="leaf"), name="t-hub")
    try:
        js = us.jetstream(timeout=10)
        s = Subjects("leaf")
        await ensure_run(js, "leaf", Limits.from_config(cfg))
        await ensure_run(eu.jetstream(timeout=10), "leaf", Limits.from_config(cfg))  # idempotent from a 2nd leaf
        hub_js = hub.jetstream(timeout=10)  # the streams live on the hub
        assert s.stream("grad") in [si.config.name for si in await hub_js.streams_info()]

        a1 = await js.publish(s.grad(0, "us-0"), b"x", headers={"Nats-Msg-Id": "m1"})
        a2 = await js.publish(s.grad(0, "us-0"), b"x", headers={"Nats-Msg-Id": "m1"})
        assert a1.seq == a2.seq and a2.duplicate

        kv = await js.key_value(s.bucket("members"))
        rev = await kv.create("us-0", b"joining")
        await kv.update("us-0", b"active", last=rev)
        with pytest.raises(KeyWrongLastSequenceError):
            await kv.update("us-0", b"stale", last=rev)
        assert (await (await hub_js.key_value(s.bucket("members"))).get("us-0")).value == b"active"

        await hub_js.publish(s.versioned_head("global", 0), b"head")  # direct get, as VersionedStore reads heads
        msg = await js.get_last_msg(s.stream("global"), s.versioned_head("global", 0), direct=True)
        assert msg.data == b"head"

        sub = await eu.jetstream(timeout=10).pull_subscribe(s.grad_fragment_filter(0), "t_leaf", stream=s.stream("grad"))
        got = await sub.fetch(1, timeout=5)
        assert got[0].data == b"x"
        await got[0].ack_sync()

        seen: list[bytes] = []

        async def cb(m):
            seen.append(m.data)

        await hub.subscribe(s.heartbeat("eu-0"), cb=cb)
        await hub.flush()
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:  # interest reaches the leaf asynchronously
            await eu.publish(s.heartbeat("eu-0"), b"hb")
            await eu.flush()
            await asyncio.sleep(0.1)
        assert seen
    finally:
        for c in (us, eu, hub):
            await c.close()


async def test_leaf_mappings_work_inside_an_account(tmp_path):
    """With accounts and users (as ``diloco auth init`` makes them), the mappings go into the run's
    account on the leaf, and the leaf link binds that account on both sides."""
    import nats

    lp = free_port()
    maps = ", ".join(f'"{k}": "{v}"' for k, v in leaf_mappings().items())
    hub = EmbeddedServer(store_dir=str(tmp_path / "hub"), server_name="hub", extra_config=(
        f'jetstream {{ store_dir: "{tmp_path}/hub/js", domain: {HUB_DOMAIN} }}\n'
        "accounts { DILOCO_t { jetstream: enabled, users: [ { user: aggregator, password: a } ] } }\n"
        f'leafnodes {{ listen: "127.0.0.1:{lp}", authorization {{ users: [ '
        "{ user: leaf-us, password: l, account: DILOCO_t } ] } }\n"))
    leaf = EmbeddedServer(store_dir=str(tmp_path / "leaf"), server_name="leaf-us", extra_config=(
        "jetstream: disabled\n"
        f"accounts {{ DILOCO_t {{ users: [ {{ user: learner-us-0, password: p }} ], mappings {{ {maps} }} }} }}\n"
        f'leafnodes {{ remotes [ {{ url: "nats-leaf://leaf-us:l@127.0.0.1:{lp}", account: DILOCO_t }} ] }}\n'))
    hub.start()
    try:
        leaf.start()
        nc = await nats.connect(leaf.url, user="learner-us-0", password="p")
        hc = await nats.connect(hub.url, user="aggregator", password="a")
        try:
            js = nc.jetstream(timeout=10)
            for _ in range(50):  # the leaf link comes up asynchronously
                try:
                    await js.account_info()
                    break
                except Exception:
                    await asyncio.sleep(0.1)
            await hc.jetstream().add_stream(name="T", subjects=["t.>"], allow_direct=True)
            # a new stream's subject interest reaches the leaf asynchronously too: until it has, a
            # publish there gets "no responders" (1 clean-clone CI run in about 20); Msg-Id dedupes
            assert (await _once_interest_arrived(
                lambda: js.publish("t.1", b"x", headers={"Nats-Msg-Id": "1"}))).seq == 1
            kv = await hc.jetstream().create_key_value(bucket="k")
            lkv = await js.key_value("k")
            await lkv.update("a", b"2", last=await _once_interest_arrived(lambda: lkv.create("a", b"1")))
            assert (await kv.get("a")).value == b"2"
            assert (await js.get_last_msg("T", "t.1", direct=True)).data == b"x"
        finally:
            await nc.close()
            await hc.close()
    finally:
        leaf.close()
        hub.close()


async def _once_interest_arrived(call, timeout: float = 10.0):
    """``await call()``, again while the server answers that nobody listens on the subject yet."""
    from nats.errors import NoRespondersError
    from nats.js.errors import NoStreamResponseError

    t_end = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except (NoRespondersError, NoStreamResponseError):
            if time.monotonic() > t_end:
                raise
            await asyncio.sleep(0.05)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update({"DILOCO_D_MODEL": "32", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "2", "DILOCO_D_FF": "64",
                "DILOCO_SEQ_LEN": "32", "DILOCO_NUM_FRAGMENTS": "4", "DILOCO_RUN": "leaftrain",
                "DILOCO_METRICS_INTERVAL": "0.5", "DILOCO_LOG_LEVEL": "info"})
    env.update(extra)
    return env


async def test_leaf_learners_train_with_the_hub_aggregator(leaf_topology, tmp_path):
    """A learner on each leaf publishes outer gradients, the hub's aggregator merges them, and both
    leaf-side learners receive the new global versions (synthetic compute: no JAX, fast)."""
    from bus.codec import loads_json
    from bus.config import CommonConfig
    from bus.conn import connect
    from diloco.up import Child, ProcSpec, RunState, astop_children

    topo = leaf_topology
    learner_env = dict(DILOCO_COMPUTE="synthetic", DILOCO_STEP_TIME="0.02", DILOCO_SYNC_EVERY="4",
                       DILOCO_MAX_STEPS="150", DILOCO_NUM_LEARNERS="2")
    specs = [
        ProcSpec("aggregator", "aggregator", None, _env(DILOCO_NATS_URL=topo.hub_url, DILOCO_QUORUM="1",
                                                      DILOCO_GRACE="fixed", DILOCO_GRACE_SECONDS="0.2")),
        ProcSpec("monitor", "monitor", None, _env(DILOCO_NATS_URL=topo.hub_url, DILOCO_MONITOR_ID="m0")),
        ProcSpec("learner-us-0", "learner", "us", _env(DILOCO_NATS_URL=topo.url_for("us"), DILOCO_REGION="us",
                                                       DILOCO_LEARNER_ID="us-0", **learner_env), "us-0"),
        ProcSpec("learner-eu-0", "learner", "eu", _env(DILOCO_NATS_URL=topo.url_for("eu"), DILOCO_REGION="eu",
                                                       DILOCO_LEARNER_ID="eu-0", **learner_env), "eu-0"),
    ]
    state = RunState(run="leaftrain")
    nc = await connect(CommonConfig(nats_url=topo.hub_url, run="leaftrain"), name="t-watch")

    async def on_metrics(m):
        state.on_metrics(loads_json(m.data))

    await nc.subscribe("diloco.leaftrain.metrics.>", cb=on_metrics)
    children = [Child(p, str(tmp_path / f"{p.name}.log"), str(tmp_path)) for p in specs]
    try:
        for c in children:
            c.start()

        def trained() -> bool:
            contrib = state.contributions()
            received = all(max((state.learners.get(l, {}).get("versions") or {"0": 0}).values()) > 0
                           for l in ("us-0", "eu-0"))
            return all(contrib.get(l, 0) > 0 for l in ("us-0", "eu-0")) and received

        deadline = time.monotonic() + 60
        while not trained() and time.monotonic() < deadline:
            for c in children:
                if c.spec.role != "learner":
                    assert c.poll() is None, f"{c.spec.name} exited: {Path(c.log_path).read_text()[-2000:]}"
            await asyncio.sleep(0.2)
        assert trained(), (state.contributions(), {k: v.get("versions") for k, v in state.learners.items()},
                           Path(children[0].log_path).read_text()[-3000:])
        # the learners' traffic entered through their leaves
        names = {c["name"]: c["server"] for c in topo.traffic()["connections"]}
        assert names["learner-us-0"] == "leaf-us" and names["learner-eu-0"] == "leaf-eu"
        assert names["aggregator-agg-0"] == "hub"
    finally:
        await astop_children([children[2:] + children[1:2], children[:1]], 15)
        await nc.close()
    assert all(c.poll() is not None for c in children)


# -- the gateway alternative ------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_gateway_supercluster_shares_one_jetstream(tmp_path):
    """deploy/nats/cluster-*.conf: two regional clusters joined by gateways use one JetStream without
    domains or mappings (a stream created in "us" is used from "eu")."""
    gw = {"us": free_port(), "eu": free_port()}
    routes = {"us": free_port(), "eu": free_port()}
    servers = {}
    try:
        for r in ("us", "eu"):
            gateways = ", ".join(f'{{ name: {n}, urls: ["nats://127.0.0.1:{p}"] }}' for n, p in gw.items())
            store = tmp_path / r
            extra = (f'jetstream {{ store_dir: "{store}/js" }}\n'
                     f'cluster {{ name: {r}, listen: "127.0.0.1:{routes[r]}", '
                     f'routes: ["nats-route://127.0.0.1:{routes[r]}"] }}\n'
                     f'gateway {{ name: {r}, listen: "127.0.0.1:{gw[r]}", gateways: [ {gateways} ] }}\n')
            servers[r] = EmbeddedServer(store_dir=str(store), server_name=f"{r}-1", extra_config=extra,
                                        log_file=str(tmp_path / f"{r}.log"))
            servers[r].start(timeout=30)
        code = f"""
import asyncio, time, nats, nats.errors, nats.js.errors
async def main():
    us = await nats.connect("{servers['us'].url}"); eu = await nats.connect("{servers['eu'].url}")
    jus, jeu = us.jetstream(timeout=10), eu.jetstream(timeout=10)
    # JetStream answers once the two clusters elected a meta leader over the gateway; until then a
    # request goes unanswered (the first 10 s probe always timed out), so probe with short timeouts
    pus, peu, t_end = us.jetstream(timeout=1), eu.jetstream(timeout=1), time.monotonic() + 60
    while True:
        try:
            await pus.account_info(); await peu.account_info(); break
        except Exception as e:
            if time.monotonic() > t_end:
                raise AssertionError("JetStream not ready in both clusters after 60 s: " + repr(e))
            await asyncio.sleep(0.2)
    async def from_eu(call, what):
        # a new stream's interest reaches the other cluster over the gateway shortly after
        for _ in range(100):
            try:
                return await call()
            except (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError):
                await asyncio.sleep(0.1)
        raise AssertionError(what + " never became reachable from eu")
    si = await jus.add_stream(name="G", subjects=["g.>"], allow_direct=True)
    assert si.cluster.name == "us", si.cluster
    await from_eu(lambda: jeu.publish("g.1", b"from-eu"), "the stream")
    kv = await jus.create_key_value(bucket="gkv")
    ekv = await jeu.key_value("gkv")
    await from_eu(lambda: ekv.put("k", b"v"), "the bucket")
    assert (await kv.get("k")).value == b"v"
    assert (await jeu.get_last_msg("G", "g.1", direct=True)).data == b"from-eu"
    print("ok")
    await us.close(); await eu.close()
asyncio.run(main())
"""
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)
        assert p.returncode == 0 and "ok" in p.stdout, p.stdout + p.stderr
    finally:
        for s in servers.values():
            s.close()


# -- diloco up --topology leaf ------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_up_leaf_topology_trains(tmp_path):
    """The whole run with a hub and one leaf per region: learners on their leaves, loss falls; with auth
    by default: every role as its own user on every server, without one permission violation."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, "-m", "diloco.cli", "up", "--topology", "leaf", "--quick", "--steps", "400",
                        "--learners", "2", "--out", str(out), "--progress", "none"],
                       capture_output=True, text=True, timeout=280, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert set(s["servers"]) == {"hub", "leaf-us", "leaf-eu"}
    assert s["final_eval_loss"] < 0.9 * s["initial_eval_loss"]
    for lid, l in s["learners"].items():
        assert l["contributions"] > 0 and l["link_bytes"] > 0, (lid, l)
    procs = json.loads((out / "processes.json").read_text())
    learners = {c["name"]: c for c in procs["children"] if c["role"] == "learner"}
    assert set(learners) == {"learner-us-0", "learner-eu-0"}
    # auth on by default on the leaf topology too: credentials generated, said in the first line
    assert s["settings"]["auth"] is True and procs["auth"] == str(out / "auth")
    assert "auth: one user per role on every server" in p.stdout
    assert (out / "auth" / "learner-us-0.env").exists()
    for name in ("leaf-us", "leaf-eu"):  # the learners' least-privilege users sufficed through their leaves
        log = (out / "logs" / f"nats-{name}.log").read_text(errors="replace")
        assert "Violation" not in log, (name, [ln for ln in log.splitlines() if "Violation" in ln][:5])
