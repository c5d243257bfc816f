"""The WAN harness (bench.netns, bench.relay, bench.wan_cluster): pure plans, then real namespaces.

Tests that make namespaces skip with the harness's own one-line reason where this machine does not
allow them (not root, no iproute2, a kernel that refuses). Every host used is inside namespaces
the harness made.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from bench.netns import Link, Plan, WanNet, in_netns, list_namespaces, stale_tags, tbf_args, unavailable
from bench.relay import MSS, RTO_MIN, Relay, lost_segments, schedule
from bench.wan import dp_comm_seconds, steps_per_s

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# -- pure ------------------------------------------------------------------------------------------


def test_link_rejects_bad_values_with_the_field_named():
    for kw, field in (({"rate_mbit": 0}, "rate_mbit"), ({"delay_ms": -1}, "delay_ms"), ({"loss": 1.0}, "loss")):
        with pytest.raises(ValueError, match=field):
            Link(**kw)
    assert Link(rate_mbit=None).rate_mbit is None


def test_plan_names_fit_linux_interface_names_and_are_distinct():
    pl = Plan(tag="dw4194304z", regions=tuple(f"r{i}" for i in range(12)))
    names = [n for i in range(12) for n in pl.veth(i)]
    assert all(len(n) <= 15 for n in names)
    assert len(set(names)) == len(names)
    assert len(set(pl.namespaces())) == 13
    assert pl.addrs(3) == ("10.77.3.1", "10.77.3.2")


def test_tbf_bucket_passes_full_frames_and_queue_holds_half_a_second():
    a = tbf_args(0.5)  # a thin link: the 10 ms bucket would be 625 bytes, less than one frame
    burst, limit = int(a[a.index("burst") + 1]), int(a[a.index("limit") + 1])
    assert burst >= 3 * 1514 and limit >= 65536
    b = tbf_args(100)
    assert int(b[b.index("burst") + 1]) == int(100e6 / 8 * 0.01)
    assert int(b[b.index("limit") + 1]) == int(100e6 / 8 * 0.5)


def test_stale_tags_are_those_of_dead_owners_only():
    names = ["dw100a-hub", "dw100a-r0", "dw200b-hub", "other-ns", "dwprobe5"]
    assert stale_tags(names, alive=lambda pid: pid == 200) == {"dw100a"}


def test_relay_schedule_keeps_order_and_charges_one_rto_per_lossy_chunk():
    assert schedule(10.0, 0.0, 0.05, 0) == pytest.approx(10.05)
    assert schedule(10.0, 0.0, 0.05, 3) == pytest.approx(10.05 + RTO_MIN)  # one retransmission round
    assert schedule(10.0, 0.0, 0.5, 1) == pytest.approx(11.5)  # RTO is at least 2 x one-way delay
    assert schedule(10.0, 10.3, 0.05, 0) == 10.3  # never overtakes the chunk before it
    rng = random.Random(1)
    assert lost_segments(10 * MSS, 0.0, rng) == 0
    n = sum(lost_segments(MSS, 0.1, rng) for _ in range(20000))
    assert 1700 < n < 2300


def test_dp_ring_allreduce_time():
    # 1M fp32 values over 4 regions at 8 Mbit/s (1 MB/s), 50 ms one way: 1.5 x 4 MB = 6 s + 6 x 50 ms
    assert dp_comm_seconds(1_000_000, 4, 8.0, 50.0) == pytest.approx(6.0 + 0.3)
    assert dp_comm_seconds(1_000_000, 1, 8.0, 50.0) == 0.0


def test_steps_per_s_uses_the_samples_inside_the_window():
    s = [(0.0, 0), (1.0, 10), (2.0, 20), (3.0, 40)]
    assert steps_per_s(s, 0.5, 2.5) == pytest.approx(10.0)
    assert steps_per_s(s, 0.0, 3.0) == pytest.approx(40 / 3)
    assert steps_per_s(s, 2.5, 2.9) is None


# -- real namespaces -----------------------------------------------------------------------------------

WHY = unavailable()
needs_netns = pytest.mark.skipif(WHY is not None, reason=f"WAN harness: {WHY}")


def _ours(net: WanNet) -> set[str]:
    return {n for n in list_namespaces() if n.startswith(net.plan.tag + "-")}


def _sink(host: str, port: int, ready: threading.Event, got: list) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1)
        ready.set()
        c, _ = s.accept()
        n = 0
        while data := c.recv(1 << 16):
            n += len(data)
        got.append(n)
        c.close()


def _send(host: str, port: int, nbytes: int) -> float:
    t = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(os.urandom(nbytes))
        s.shutdown(socket.SHUT_WR)
        s.recv(1)  # the sink closes once it has read everything
    return time.monotonic() - t


def _transfer(net: WanNet, nbytes: int, port: int) -> float:
    """Seconds to move ``nbytes`` from region 0 to a sink in the hub namespace over the link."""
    ready, got = threading.Event(), []
    hub_addr = net.plan.addrs(0)[0]
    in_netns(net.plan.hub_ns, _sink, hub_addr, port, ready, got, daemon=True)
    assert ready.wait(5)
    took = net.call(net.regions[0], _send, hub_addr, port, nbytes)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    assert got == [nbytes]
    return took


@needs_netns
def test_namespaces_links_and_rate_limit_then_everything_is_removed():
    with WanNet(["a"], [Link(rate_mbit=8.0)]) as net:
        assert _ours(net) == set(net.plan.namespaces())
        limited = _transfer(net, 1_000_000, 9001)  # 8 Mbit at 8 Mbit/s: at least ~1 s
        stats = net.qdisc_stats(0)
        net.set_rate(0, None)
        free = _transfer(net, 1_000_000, 9002)
    assert limited >= 0.95, limited
    assert limited > 5 * free, (limited, free)
    assert stats["up"]["bytes"] >= 1_000_000
    assert _ours(net) == set()


def _echo(host: str, port: int, ready: threading.Event) -> None:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(1)
        ready.set()
        c, _ = s.accept()
        while data := c.recv(4096):
            c.sendall(data)
        c.close()


def _pingpong(host: str, port: int, n: int) -> list[float]:
    out = []
    with socket.create_connection((host, port), timeout=10) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(n):
            t = time.monotonic()
            s.sendall(b"x")
            assert s.recv(1) == b"x"
            out.append(time.monotonic() - t)
    return out


@needs_netns
def test_relay_adds_the_one_way_delay_in_both_directions():
    with WanNet(["a"], [Link(delay_ms=60)]) as net:
        ready = threading.Event()
        in_netns(net.plan.hub_ns, _echo, "127.0.0.1", 9100, ready, daemon=True)
        assert ready.wait(5)
        hub_addr = net.plan.addrs(0)[0]
        relay = Relay((hub_addr, 9200), ("127.0.0.1", 9100), delay=0.06)
        relay.serve_in_thread(start=lambda body: in_netns(net.plan.hub_ns, body, daemon=True))
        try:
            rtts = net.call("a", _pingpong, hub_addr, 9200, 5)
        finally:
            relay.close()
    assert min(rtts) >= 0.12, rtts  # 2 x 60 ms, never less
    assert relay.bytes == {"up": 5, "down": 5}


@needs_netns
def test_a_killed_owner_leaves_no_namespace_behind():
    code = ("import sys, time; sys.path.insert(0, %r)\n"
            "from bench.netns import WanNet, Link\n"
            "net = WanNet(['a', 'b'], [Link(), Link()]).start()\n"
            "print(net.plan.tag, flush=True); time.sleep(60)\n") % ROOT
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    tag = p.stdout.readline().strip()
    assert tag.startswith("dw")
    assert any(n.startswith(tag + "-") for n in list_namespaces())
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.monotonic() + 15
    while any(n.startswith(tag + "-") for n in list_namespaces()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(n.startswith(tag + "-") for n in list_namespaces())


@needs_netns
def test_leaf_in_a_region_with_auth_reaches_the_hubs_jetstream_and_a_partition_cuts_it_until_healed():
    import nats

    from bench.wan_cluster import LOCAL_URL, WanCluster, run_in_hub

    creds: dict = {}

    async def region_client(phase: str) -> str:
        try:
            nc = await nats.connect(LOCAL_URL, connect_timeout=5, allow_reconnect=False, max_reconnect_attempts=0,
                                    user=creds.get("DILOCO_NATS_USER"), password=creds.get("DILOCO_NATS_PASSWORD"))
        except Exception as e:
            return type(e).__name__
        try:  # the read-only metrics user asks the hub's JetStream for its account info, through the leaf
            r = await nc.request("$JS.API.INFO", b"", timeout=1.5)
            return "answered" if b"account_info_response" in r.data else r.data.decode()[:80]
        except Exception as e:
            return type(e).__name__
        finally:
            await nc.close()

    async def scenario(net: WanNet) -> list[str]:
        async with WanCluster(net, "wantest") as c:
            assert c.leaves_connected() == 1
            anonymous = net.call("a", lambda: asyncio.run(region_client("create")))
            creds.update(c.creds["metrics"])
            out = [net.call("a", lambda: asyncio.run(region_client("create"))), anonymous]
            net.partition(0)
            out.append(net.call("a", lambda: asyncio.run(region_client("cut"))))
            net.heal(0)
            deadline = time.monotonic() + 20
            while True:
                r = net.call("a", lambda: asyncio.run(region_client("healed")))
                if r == "answered" or time.monotonic() > deadline:
                    out.append(r)
                    return out

    with WanNet(["a"], [Link(rate_mbit=20.0, delay_ms=20)]) as net:
        results = run_in_hub(net, scenario, net)
    assert results[0] == "answered", results
    assert results[1] != "answered", results  # the leaf refuses anonymous clients
    assert results[2] == "TimeoutError", results  # the hub is out of reach while cut
    assert results[3] == "answered", results


@needs_netns
def test_wan_benchmark_with_auth_region_is_evicted_readmitted_and_contributes_after_a_cut(tmp_path):
    out = tmp_path / "wan.json"
    p = subprocess.run([sys.executable, "-m", "bench.wan", "--quick", "--scenarios", "loopback,partition",
                        "--window", "6", "--cut", "6", "--out", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=110)
    assert p.returncode == 0, p.stderr[-3000:]
    import orjson

    r = orjson.loads(p.stdout.strip().splitlines()[-1])
    part = r["partition"]
    assert part["evicted_after_s"] is not None and part["evicted_after_s"] < 6, part
    assert part["readmitted_after_heal_s"] is not None, part
    assert part["contributed_after_heal"] is True, part
    assert r["auth"] is True
    assert r["scenarios"]["loopback"]["rejected"] == {}, r["scenarios"]["loopback"]
    # what the cut learner published while cut may arrive after its eviction and before its
    # readmission: the aggregator refuses that as `inactive_learner` (it follows the monitor), nothing else
    assert set(r["scenarios"]["partition"]["rejected"]) <= {"inactive_learner"}, r["scenarios"]["partition"]
    for name in ("loopback", "partition"):
        sc = r["scenarios"][name]
        assert sc["permission_violations"] == 0, sc  # every role within its user's rights, hub and leaves
