"""Regions on emulated WAN links: network namespaces, veth pairs, ``tc tbf`` rate limits and a relay.

Layout (``WanNet``; every name starts with the harness's tag ``dw<pid><letter>``)::

    namespace <tag>-hub                              namespace <tag>-r<i> (region i)
    hub nats-server 127.0.0.1:4222 (+JetStream)      leaf nats-server 127.0.0.1:4222 (no JetStream)
    leafnode listener 127.0.0.1:7422                 the region's learners
    aggregator, monitor, evaluator
    relay thread 10.77.<i>.1:7500 -> 127.0.0.1:7422  <-- veth <tag>h<i> / <tag>r<i> --  leaf dials 10.77.<i>.1:7500

* **rate**: ``tc qdisc ... tbf`` on both ends of the region's veth pair (egress of the hub end is
  the region's downlink, egress of the region end its uplink). This kernel has ``tbf`` and ``htb``
  and no ``netem``.
* **delay and loss**: the relay (:mod:`bench.relay`), a thread of this process that has entered the
  hub namespace, holds every chunk of the leaf connection for the one-way delay in each direction
  (``--delay``), and charges a retransmission timeout to a chunk that "lost" one of its segments.
* **partition**: the hub end of the veth pair is set down (:meth:`WanNet.partition`) and up again
  (:meth:`WanNet.heal`); open TCP connections survive a short cut and resume, as on a real link.

Cleanup: :meth:`WanNet.close` kills every process left in the namespaces and deletes them (the veth
pairs go with them). A *reaper* process, started with the namespaces, waits for the end of a pipe
that only this process holds: when this process dies in any way (SIGKILL included) the pipe
closes and the reaper deletes what is left. A new harness also sweeps namespaces whose owner pid
is dead. :func:`unavailable` says in one line why namespaces cannot be used here (not root, no
``ip``/``tc``, or the kernel refused), so tests skip with that reason.

Processes join a namespace with ``ip netns exec`` (:meth:`WanNet.cmd`); threads of this process
with ``setns(2)`` (:func:`in_netns`: the network namespace is per thread, so a thread can connect,
listen or run an asyncio loop inside one while the rest of the process stays where it is).
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"
_TAG_RE = re.compile(r"^dw(\d+)[a-z]")
_counter = 0
_counter_lock = threading.Lock()


# -- the plan: pure --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One region's link to the hub: rate (Mbit/s, None: unlimited), one-way delay (ms), loss (0..1)."""

    rate_mbit: float | None = None
    delay_ms: float = 0.0
    loss: float = 0.0

    def __post_init__(self) -> None:
        if self.rate_mbit is not None and not self.rate_mbit > 0:
            raise ValueError(f"Link rate_mbit={self.rate_mbit}: expected > 0 or None (unlimited)")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"Link delay_ms={self.delay_ms}: expected 0..10000")
        if not 0 <= self.loss < 1:
            raise ValueError(f"Link loss={self.loss}: expected 0 <= loss < 1")


@dataclass(frozen=True)
class Plan:
    """Names and addresses of one harness (``tag`` ``dw<pid><letter>``)."""

    tag: str
    regions: tuple[str, ...]

    @property
    def hub_ns(self) -> str:
        return f"{self.tag}-hub"

    def region_ns(self, i: int) -> str:
        return f"{self.tag}-r{i}"

    def veth(self, i: int) -> tuple[str, str]:
        """(hub end, region end) of region i's pair; at most 15 characters each."""
        return f"{self.tag}h{i}", f"{self.tag}r{i}"

    @staticmethod
    def addrs(i: int) -> tuple[str, str]:
        """(hub end, region end) addresses of region i's /24."""
        return f"10.77.{i}.1", f"10.77.{i}.2"

    def namespaces(self) -> list[str]:
        return [self.hub_ns] + [self.region_ns(i) for i in range(len(self.regions))]


def tbf_args(rate_mbit: float) -> list[str]:
    """``tc qdisc replace ... root`` arguments of a token bucket at ``rate_mbit``.

    Burst: 10 ms of the rate, at least 3 full-size packets (a smaller bucket cannot pass a
    1514-byte frame at all); queue: 500 ms of the rate, at least 64 KiB (a deep, bloated buffer,
    as on a real access link, so bursts wait rather than drop)."""
    byte_rate = rate_mbit * 1e6 / 8
    burst = max(int(byte_rate * 0.01), 3 * 1514)
    limit = max(int(byte_rate * 0.5), 65536)
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "limit", str(limit)]


def stale_tags(names: list[str], alive: Callable[[int], bool]) -> set[str]:
    """Tags of harness namespaces in ``names`` whose owner pid is no longer ``alive``."""
    out = set()
    for n in names:
        m = _TAG_RE.match(n)
        if m and not alive(int(m.group(1))):
            out.add(n.split("-", 1)[0])
    return out


# -- the shell -------------------------------------------------------------------------------------


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used on this machine; the message says why, in one line."""


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    p = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in p.stdout.splitlines() if line.strip()]


_probe_lock = threading.Lock()
_probe: list[str | None] = []


def unavailable() -> str | None:
    """None if this process can make namespaces, veth pairs and tbf qdiscs; else the reason
    (probed once per process)."""
    with _probe_lock:
        if not _probe:
            _probe.append(_probe_once())
        return _probe[0]


def _probe_once() -> str | None:
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add): run as root or skip the WAN harness"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian package iproute2)"
    probe = f"dwprobe{os.getpid()}"
    try:
        p = _run("ip", "netns", "add", probe, check=False)
        if p.returncode != 0:
            return f"ip netns add refused: {(p.stderr or p.stdout).strip()}"
        q = _run("ip", "-n", probe, "link", "add", "dwpa", "type", "veth", "peer", "name", "dwpb", check=False)
        if q.returncode != 0:
            return f"veth pairs refused: {(q.stderr or q.stdout).strip()}"
        t = _run("ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "dwpa", "root", *tbf_args(10), check=False)
        if t.returncode != 0:
            return f"tc tbf refused: {(t.stderr or t.stdout).strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def delete_namespaces(names: list[str]) -> None:
    """Kill every process in each namespace, then delete it (its veth ends go with it)."""
    for ns in names:
        p = _run("ip", "netns", "pids", ns, check=False)
        for pid in p.stdout.split():
            try:
                os.kill(int(pid), 9)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", ns, check=False)


def sweep_stale() -> list[str]:
    """Delete harness namespaces whose owner process is dead; returns their names."""
    names = list_namespaces()
    tags = stale_tags(names, _pid_alive)
    gone = [n for n in names if n.split("-", 1)[0] in tags]
    delete_namespaces(gone)
    return gone


def _libc_setns(ns: str) -> None:
    fd = os.open(os.path.join(NETNS_DIR, ns), os.O_RDONLY)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def in_netns(ns: str, fn: Callable[..., Any], *args: Any, daemon: bool = False) -> Any:
    """Run ``fn(*args)`` in a new thread inside namespace ``ns``; return its result (or raise).

    ``daemon=True``: start it and return the thread at once (for servers that run until closed)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            _libc_setns(ns)
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=body, name=f"netns-{ns}", daemon=True)
    t.start()
    if daemon:
        return t
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")


@dataclass
class WanNet:
    """Namespaces for a hub and ``regions``, each region linked to the hub by ``links[i]``."""

    regions: list[str]
    links: list[Link]
    plan: Plan = field(init=False)
    _reaper: subprocess.Popen | None = field(default=None, init=False)
    _reaper_w: int | None = field(default=None, init=False)
    _up: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        global _counter
        if len(self.links) != len(self.regions):
            raise ValueError(f"{len(self.regions)} regions but {len(self.links)} links")
        with _counter_lock:
            letter = "abcdefghijklmnopqrstuvwxyz"[_counter % 26]
            _counter += 1
        self.plan = Plan(tag=f"dw{os.getpid()}{letter}", regions=tuple(self.regions))

    # -- life --------------------------------------------------------------------------------------

    def start(self) -> "WanNet":
        why = unavailable()
        if why:
            raise NetnsUnavailable(why)
        sweep_stale()
        self._start_reaper()
        try:
            pl = self.plan
            for ns in pl.namespaces():
                _run("ip", "netns", "add", ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
            for i, link in enumerate(self.links):
                h, r = pl.veth(i)
                ha, ra = pl.addrs(i)
                _run("ip", "-n", pl.hub_ns, "link", "add", h, "type", "veth", "peer", "name", r,
                     "netns", pl.region_ns(i))
                _run("ip", "-n", pl.hub_ns, "addr", "add", f"{ha}/24", "dev", h)
                _run("ip", "-n", pl.region_ns(i), "addr", "add", f"{ra}/24", "dev", r)
                _run("ip", "-n", pl.hub_ns, "link", "set", h, "up")
                _run("ip", "-n", pl.region_ns(i), "link", "set", r, "up")
                self.set_rate(i, link.rate_mbit)
            self._up = True
        except BaseException:
            self.close()
            raise
        return self

    def _start_reaper(self) -> None:
        r, w = os.pipe()
        names = ",".join(self.plan.namespaces())
        self._reaper = subprocess.Popen([sys.executable, "-m", "bench.netns", "--reap-on-eof", names], stdin=r,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        start_new_session=True, close_fds=True,
                                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        os.close(r)
        os.set_inheritable(w, False)
        self._reaper_w = w

    def close(self) -> None:
        delete_namespaces(self.plan.namespaces())
        self._up = False
        if self._reaper_w is not None:
            os.close(self._reaper_w)  # the reaper finds nothing left to do and exits
            self._reaper_w = None
        if self._reaper is not None:
            try:
                self._reaper.wait(10)
            except subprocess.TimeoutExpired:
                self._reaper.kill()
            self._reaper = None

    def __enter__(self) -> "WanNet":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the links ---------------------------------------------------------------------------------

    def set_rate(self, i: int, rate_mbit: float | None) -> None:
        """Limit region i's link to ``rate_mbit`` both ways (None: no limit)."""
        pl = self.plan
        h, r = pl.veth(i)
        for ns, dev in ((pl.hub_ns, h), (pl.region_ns(i), r)):
            if rate_mbit is None:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *tbf_args(rate_mbit))

    def partition(self, i: int) -> None:
        """Cut region i off the hub (its veth pair goes down; connections stall, nothing is reset)."""
        _run("ip", "-n", self.plan.hub_ns, "link", "set", self.plan.veth(i)[0], "down")

    def heal(self, i: int) -> None:
        _run("ip", "-n", self.plan.hub_ns, "link", "set", self.plan.veth(i)[0], "up")

    def qdisc_stats(self, i: int) -> dict:
        """Bytes sent and dropped by region i's uplink and downlink qdiscs (``tc -s``)."""
        pl = self.plan
        h, r = pl.veth(i)
        out = {}
        for key, ns, dev in (("down", pl.hub_ns, h), ("up", pl.region_ns(i), r)):
            txt = _run("ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev, check=False).stdout
            m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+)", txt)
            out[key] = {"bytes": int(m.group(1)), "packets": int(m.group(2)), "dropped": int(m.group(3))} if m else {}
        return out

    # -- processes and threads -----------------------------------------------------------------------

    def ns_of(self, region: str | None) -> str:
        """The namespace of a region's processes (None: the hub's)."""
        return self.plan.hub_ns if region is None else self.plan.region_ns(self.regions.index(region))

    def cmd(self, region: str | None, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace of ``region`` (None: the hub)."""
        return ["ip", "netns", "exec", self.ns_of(region), *argv]

    def call(self, region: str | None, fn: Callable[..., Any], *args: Any) -> Any:
        return in_netns(self.ns_of(region), fn, *args)


def _reap_on_eof(names: list[str]) -> None:
    """The reaper: block until stdin closes (the owner exited, however), then delete ``names``."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        while sys.stdin.buffer.read(65536):
            pass
    except OSError:
        pass
    existing = set(list_namespaces())
    delete_namespaces([n for n in names if n in existing])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--reap-on-eof":
        _reap_on_eof(sys.argv[2].split(","))
    elif len(sys.argv) == 2 and sys.argv[1] == "--sweep":
        print("\n".join(sweep_stale()) or "nothing to sweep")
    else:
        print("usage: python -m bench.netns --sweep   (delete the namespaces of dead WAN harnesses)",
              file=sys.stdout if sys.argv[1:] in (["--help"], ["-h"]) else sys.stderr)
        sys.exit(0 if sys.argv[1:] in (["--help"], ["-h"]) else 2)
