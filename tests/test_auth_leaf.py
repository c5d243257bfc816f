"""Auth on the leaf topology (diloco/auth_leaf.py): the configs it renders, ``diloco auth init --leaf``, and a
hub that refuses leaf servers without their region's credentials.

What each role may do through a leaf is checked by tests/test_auth.py, whose broker is parametrized
over ``single`` and ``leaf``; anonymous clients on the hub and on every leaf by its
``test_anonymous_and_wrong_credentials_are_refused[leaf]``; ``diloco up --topology leaf`` with auth by
tests/test_topology.py::test_up_leaf_topology_trains.
"""

from __future__ import annotations

import re
import stat
import time
import urllib.request
from pathlib import Path

import orjson
import pytest

from diloco import auth
from diloco.auth import init, may_publish, parse_env_file, parse_learners, role_permissions
from diloco.auth_leaf import (
    LeafAuth,
    leaf_auth_from_init,
    leaf_permissions,
    make_leaf_auth,
    mapped_subject,
)
from bus.server import EmbeddedServer, ServerError, free_port, render_config, validate_config_file
from diloco.topology import hub_extra_config, leaf_extra_config, leaf_mappings, make_topology, with_userinfo
from tests.test_auth import PUBLISH_MATRIX, RUN

MAPS = leaf_mappings()


# -- pure ------------------------------------------------------------------------------------------


def test_mapped_subject_rewrites_prefixes_only():
    assert mapped_subject("$JS.API.STREAM.INFO.X", MAPS) == "$JS.hub.API.STREAM.INFO.X"
    assert mapped_subject("$KV.b.k", MAPS) == "$JS.hub.API.$KV.b.k"
    assert mapped_subject("$KV.b.>", MAPS) == "$JS.hub.API.$KV.b.>"
    assert mapped_subject("$OBJ.o.*", MAPS) == "$JS.hub.API.$OBJ.o.*"
    # the first token after the prefix decides; inner $KV tokens stay
    assert mapped_subject("$JS.API.DIRECT.GET.KV_b.$KV.b.k", MAPS) == "$JS.hub.API.DIRECT.GET.KV_b.$KV.b.k"
    for same in ("$JS.API", "$KVX.a", "$JS.FC.S.>", "$JS.ACK.S.>", "_INBOX.>", "diloco.r.grad.*.us-0"):
        assert mapped_subject(same, MAPS) == same
    with pytest.raises(ValueError, match="prefix"):
        mapped_subject("a.b", {"a.*": "c.*"})


@pytest.mark.parametrize("role", auth.ROLES)
def test_leaf_permissions_allow_the_same_operations_in_mapped_form(role):
    """What a leaf checks (the mapped subject) is allowed exactly when the unmapped one is on the hub."""
    p = role_permissions(role, RUN, "us-0" if role == "learner" else None)
    lp = leaf_permissions(p)
    assert lp.subscribe == p.subscribe
    assert not [x for x in lp.publish if x.startswith(("$JS.API.", "$KV.", "$OBJ."))]  # all moved
    assert len(lp.publish) == len(p.publish)
    for subject, _ in PUBLISH_MATRIX:
        assert may_publish(lp, mapped_subject(subject, MAPS)) == may_publish(p, subject), (role, subject)


def test_leaf_auth_renders_valid_hub_and_leaf_configs(tmp_path):
    r = init(tmp_path / "a", RUN, parse_learners("us-0,eu-0"), hash_mode="plain")
    la = leaf_auth_from_init(r, RUN, ["us", "eu"])
    assert la.account == f"DILOCO_{RUN}" and la.regions == ["us", "eu"]
    assert la.credentials("us")[0] == "leaf-us" and la.credentials("us")[1] != la.credentials("eu")[1]
    with pytest.raises(KeyError, match="ap"):
        la.credentials("ap")
    assert not any(pw in repr(la) for pw in la.link_passwords.values())
    # the users' passwords are those of their env files (diloco up hands those to the processes)
    learner_pw = parse_env_file(r.env_files["learner-us-0"].read_text())["DILOCO_NATS_PASSWORD"]
    assert learner_pw in la.hub_accounts and learner_pw in la.leaf_accounts
    assert "jetstream: enabled" in la.hub_accounts and "jetstream" not in la.leaf_accounts
    assert "$JS.hub.API.STREAM.INFO" in la.leaf_accounts and "$JS.API.STREAM.INFO" not in la.leaf_accounts
    lp = free_port()
    hub = hub_extra_config(str(tmp_path / "js"), lp, accounts=la.hub_accounts,
                           leafnode_authorization=la.leafnode_authorization)
    assert re.search(r'user: "leaf-us", password: "[^"]+", account: DILOCO_sec', hub)
    leaf = leaf_extra_config([f"nats-leaf://127.0.0.1:{lp}"], accounts=la.leaf_accounts, account=la.account,
                             credentials=la.credentials("us"))
    assert f"nats-leaf://leaf-us:{la.link_passwords['us']}@127.0.0.1:{lp}" in leaf
    assert "account: DILOCO_sec" in leaf and not re.search(r"^mappings", leaf, re.M)  # inside the account only
    for name, extra in (("hub.conf", hub), ("leaf.conf", leaf)):
        path = tmp_path / name
        path.write_text(render_config(host="127.0.0.1", port=free_port(), http_port=free_port(),
                                      store_dir=str(tmp_path / "js"), max_payload=8 << 20, extra=extra))
        ok, out = validate_config_file(str(path))
        assert ok, out


def test_config_helpers_refuse_half_an_auth_and_stay_anonymous_without():
    plain_hub = hub_extra_config("/js", 7422)
    assert "accounts" not in plain_hub and "authorization" not in plain_hub
    plain_leaf = leaf_extra_config(["nats-leaf://h:7422"])
    assert re.search(r"^mappings", plain_leaf, re.M) and "account" not in plain_leaf
    with pytest.raises(ServerError, match="go together"):
        hub_extra_config("/js", 7422, accounts="accounts { A: { } }")
    with pytest.raises(ServerError, match="go together"):
        leaf_extra_config(["nats-leaf://h:7422"], account="A")
    with pytest.raises(ServerError, match="mappings"):
        leaf_extra_config(["nats-leaf://h:7422"], accounts="accounts { A: { users: [] } }", account="A")
    assert with_userinfo("nats-leaf://h:7422", "leaf-us", "p@ss/w:rd") == "nats-leaf://leaf-us:p%40ss%2Fw%3Ard@h:7422"
    with pytest.raises(ServerError, match="credentials"):
        with_userinfo("nats-leaf://u:p@h:7422", "a", "b")
    with pytest.raises(ValueError, match="region"):
        make_leaf_auth(RUN, [], {}, [])
    with pytest.raises(ServerError, match="single server"):
        make_topology("single", ["us"], "/tmp/x", leaf_auth=LeafAuth(RUN, "", "", "", {"us": "p"}))
    with pytest.raises(ServerError, match="extra_config"):
        make_topology("leaf", ["us"], "/tmp/x", extra_config="accounts { }").start()
    with pytest.raises(ServerError, match="eu"):
        make_topology("leaf", ["us", "eu"], "/tmp/x", leaf_auth=LeafAuth(RUN, "", "", "", {"us": "p"})).start()


def test_auth_init_leaf_writes_the_leaf_account(tmp_path, capsys):
    out = tmp_path / "a"
    assert auth.main(["init", "--run", RUN, "--learners", "us-0,eu-0", "--out", str(out), "--hash", "plain",
                      "--leaf"]) == 0
    assert "nats-auth-leaf.conf" in capsys.readouterr().out
    leaf = out / "nats-auth-leaf.conf"
    assert stat.S_IMODE(leaf.stat().st_mode) == 0o600
    text, hub_text = leaf.read_text(), (out / "nats-auth.conf").read_text()
    users = re.findall(r'user: "([^"]+)"\s+password: "([^"]+)"', hub_text)
    assert len(users) == 7 and re.findall(r'user: "([^"]+)"\s+password: "([^"]+)"', text) == users
    assert all(f'"{k}": "{v}"' in text for k, v in MAPS.items())
    path = tmp_path / "leaf.conf"
    path.write_text(render_config(host="127.0.0.1", port=4222, http_port=8222, store_dir=str(tmp_path / "js"),
                                  max_payload=8 << 20, extra="jetstream: disabled\n" + text))
    ok, msg = validate_config_file(str(path))
    assert ok, msg
    # a later init without --leaf takes the old leaf account (and its passwords) away
    init(out, RUN, parse_learners("us-0"), hash_mode="plain", force=True)
    assert not leaf.exists()


# -- against real servers --------------------------------------------------------------------------


def _leafz(srv: EmbeddedServer) -> int:
    with urllib.request.urlopen(f"{srv.monitor_url}/leafz", timeout=5) as r:
        return int(orjson.loads(r.read()).get("leafnodes", 0))


def test_hub_refuses_leaf_servers_without_their_credentials(tmp_path):
    """Only a leaf server with its region's leaf user gets a link to the hub: none with no credentials,
    with a wrong password, or with a valid password under another region's (unknown) user name."""
    r = init(tmp_path / "a", RUN, parse_learners("us-0"), hash_mode="plain")
    la = leaf_auth_from_init(r, RUN, ["us"])
    topo = make_topology("leaf", ["us"], str(tmp_path / "store"), str(tmp_path), leaf_auth=la)
    topo.start()
    rogues = []
    try:
        hub_leaf_port = int(re.search(r'listen: "127\.0\.0\.1:(\d+)"',
                                      Path(topo.hub.config_path()).read_text()).group(1))
        url = f"nats-leaf://127.0.0.1:{hub_leaf_port}"
        assert _leafz(topo.hub) == 1
        for i, creds in enumerate([None, ("leaf-us", "wrong"), ("leaf-eu", la.link_passwords["us"])]):
            rogue = EmbeddedServer(store_dir=str(tmp_path / f"rogue{i}"), server_name=f"rogue-{i}",
                                   log_file=str(tmp_path / f"rogue{i}.log"),
                                   extra_config=leaf_extra_config([url], accounts=la.leaf_accounts,
                                                                  account=la.account, credentials=creds))
            rogues.append(rogue)
            rogue.start()
        t_end = time.monotonic() + 10
        logs = [""] * len(rogues)
        while time.monotonic() < t_end:
            logs = [Path(x.log_file).read_text(errors="replace") for x in rogues]
            if all("authorization violation" in log.lower() for log in logs):
                break
            time.sleep(0.1)
        assert all("authorization violation" in log.lower() for log in logs), [log[-600:] for log in logs]
        assert _leafz(topo.hub) == 1  # still only the real leaf
    finally:
        for x in rogues:
            x.close()
        topo.stop()
