"""Connecting to NATS with a run's settings: credentials, TLS, and reconnect behaviour.

At start, :func:`connect` tries for ``DILOCO_CONNECT_TIMEOUT`` seconds (10 by default: the
servers of ``DILOCO_NATS_URL`` in turn, an attempt every 0.5 s, so a slow server or network has
time to answer), then raises :class:`ConnectFailed`, whose message is one line naming the URL
(credentials redacted), what went wrong and what to check. A refused login or a failed TLS
handshake ends the wait at once: retrying cannot fix them. For a command a person runs (``diloco
status``, ``metrics``, ``trust``, ``run``, ``export``: ``refused_grace=REFUSED_GRACE``) a refused
connection (nothing listens on the port: every attempt refused at once) ends it after 1.5 s, enough
for a server that is just starting up; a role (learner, aggregator, monitor, evaluator) waits the
whole window, refused or not: a server restarting, or started after its roles, is part of a run's
life (a monitor restarted while the chaos test's server was down exited after 1.5 s and the run's
membership stopped). Nothing is logged while it tries.

Once connected, nats-py's defaults would notice a dead peer only after minutes (ping every 120 s)
and give up after 60 reconnect attempts; a training process must instead reconnect forever and
notice quickly. We ping every ``ping_interval`` seconds (default 5), reconnect without limit every
0.5 s, and buffer up to 64 MiB of publishes while disconnected (a full buffer raises, which the
transport turns into a retry). nats-py reports every failed reconnect attempt to the error
callback (two a second); :class:`ConnectionLog` turns them into one line per change of state:
``nats_disconnected``, ``nats_still_down`` after 10 s, 60 s and then every 5 minutes, and
``nats_reconnected`` (with the outage's length and attempts); other errors are logged once a
minute at most per distinct message (``nats_error``, with how many were suppressed). A start that
needed several attempts logs ``nats_connected`` once; a deliberate close, ``nats_closed`` at debug.
"""

from __future__ import annotations

import asyncio
import errno
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client

from bus.config import CommonConfig
from bus.log import get_logger
from bus.store_health import classify

#: Seconds of an outage after which ``nats_still_down`` is logged; then every last one.
STILL_DOWN_AFTER = (10.0, 60.0, 300.0)
#: A distinct error (same type and text) while connected is logged at most once per this many seconds.
ERROR_REPEAT_S = 60.0
#: Seconds a start keeps trying while every attempt is refused at once (nothing listens there).
REFUSED_GRACE = 1.5
#: errnos of an attempt refused at once (``Multiple exceptions`` of one host's addresses may mix them)
_REFUSED_ERRNOS = {errno.ECONNREFUSED, errno.EADDRNOTAVAIL, errno.ENETUNREACH}


class ConnectFailed(ConnectionError):
    """The server could not be reached (or refused us) at start. ``str()`` is one line naming the URL
    (credentials redacted), the cause and what to check; ``url`` and ``cause`` hold them."""

    #: how every message starts (``diloco``'s callers recognise the one line by it)
    PREFIX = "cannot connect to "

    def __init__(self, message: str, url: str, cause: BaseException | None = None):
        super().__init__(message)
        self.url, self.cause = url, cause


def redact_url(url: str) -> str:
    """``nats://user:secret@host`` -> ``nats://***@host`` (URLs end up in error messages)."""
    return re.sub(r"//[^@/,]*@", "//***@", url)


def _text(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if text.startswith("nats: "):
        text = text[6:]
    return text.strip("'\"")


def _fatal(e: BaseException) -> bool:
    """Errors a retry cannot fix: a refused login, a failed TLS handshake."""
    text = str(e).lower()
    return isinstance(e, ssl.SSLError) or "authorization violation" in text or "authentication" in text \
        or type(e).__name__ in ("AuthorizationError",)


def refused_at_once(e: BaseException) -> bool:
    """An attempt that the host refused at once: nothing listens on the port (``ECONNREFUSED``; a
    host name whose addresses all failed so, or with no route for one family, as asyncio's
    ``Multiple exceptions``). Not a timeout, a DNS failure or a slow server."""
    if isinstance(e, ConnectionRefusedError):
        return True
    if not isinstance(e, OSError) or isinstance(e, (socket.gaierror, TimeoutError)):
        return False
    if e.errno is not None:
        return e.errno == errno.ECONNREFUSED
    codes = [int(c) for c in re.findall(r"\[Errno (\d+)\]", str(e))]
    return bool(codes) and errno.ECONNREFUSED in codes and all(c in _REFUSED_ERRNOS for c in codes)


def _lost(e: BaseException) -> bool:
    """Errors that mean the connection is gone (a reconnect follows), not a problem worth its own line."""
    return isinstance(e, (OSError, EOFError)) or type(e).__name__ in ("UnexpectedEOF", "StaleConnectionError")


def explain(e: BaseException | None) -> str:
    """``what happened: what to check`` for the last error of a failed start."""
    auth = "check DILOCO_NATS_USER/DILOCO_NATS_PASSWORD, DILOCO_NATS_CREDS or DILOCO_NATS_NKEY_SEED (the env file " \
           "`diloco auth init` wrote for this role)"
    tls = "check DILOCO_TLS_CA (and DILOCO_TLS_CERT/DILOCO_TLS_KEY for mutual TLS) and that the URL's scheme " \
          "(tls:// or nats://) is what the server expects"
    anything = ("is a nats-server running there? are the host and port of DILOCO_NATS_URL right? do the "
                "credentials (DILOCO_NATS_USER, DILOCO_NATS_CREDS) and TLS settings (DILOCO_TLS_*) match the server's?")
    if e is None:
        return "no answer: is the host reachable from here (firewall, VPN), and is the port of DILOCO_NATS_URL right?"
    if _fatal(e) and not isinstance(e, ssl.SSLError):
        return f"the server refused the login ({_text(e)}): {auth}"
    if isinstance(e, ssl.SSLError):
        return f"TLS failed ({_text(e)}): {tls}"
    if isinstance(e, ConnectionRefusedError):
        return ("connection refused: is a nats-server running there (`diloco nats`, `docker compose up nats`), "
                "and are the host and port of DILOCO_NATS_URL right?")
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
        return f"cannot read {e.filename or 'a credentials file'} ({e.strerror}): check DILOCO_NATS_CREDS and " \
               "DILOCO_NATS_NKEY_SEED"
    if isinstance(e, socket.gaierror):
        return f"the host name does not resolve ({_text(e)}): check the host of DILOCO_NATS_URL"
    if isinstance(e, (TimeoutError, asyncio.TimeoutError)):
        return "no answer in time: is the host reachable from here (firewall, VPN), and is the port of " \
               "DILOCO_NATS_URL a NATS client port?"
    if "tls" in str(e).lower():
        return f"{_text(e)}: {tls}"
    return f"{_text(e)}: {anything}"


def still_down_threshold(k: int) -> float:
    """Seconds of an outage at which its ``k``-th ``nats_still_down`` line is due (10, 60, 300, 600, 900...)."""
    n = len(STILL_DOWN_AFTER)
    return STILL_DOWN_AFTER[k] if k < n else STILL_DOWN_AFTER[-1] * (k - n + 2)


class ConnectionLog:
    """One log line per change of a connection's state, however many reconnect attempts fail."""

    def __init__(self, log: Any, clock: Callable[[], float] = time.monotonic):
        self.log, self.clock = log, clock
        self.down_since: float | None = None
        self.attempts = 0
        self.last_error: BaseException | None = None
        self._next_report = 0
        self._errors: dict[str, tuple[float, int]] = {}  # error text -> (last logged, suppressed since)

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def disconnected(self) -> None:
        if self.down_since is not None:
            return
        self.down_since, self.attempts, self.last_error, self._next_report = self.clock(), 0, None, 0
        self.log.warning("nats_disconnected", hint="reconnecting (one line per change of state, not per attempt)")

    def failed_attempt(self, e: BaseException) -> None:
        if self.down_since is None:
            self.disconnected()
        assert self.down_since is not None
        self.attempts += 1
        self.last_error = e
        down_s = self.clock() - self.down_since
        if down_s >= still_down_threshold(self._next_report):
            self._next_report += 1
            self.log.warning("nats_still_down", down_s=round(down_s, 1), attempts=self.attempts, error=repr(e))

    def reconnected(self) -> None:
        down_s = None if self.down_since is None else round(self.clock() - self.down_since, 1)
        self.log.info("nats_reconnected", down_s=down_s, attempts=self.attempts)
        self.down_since, self.attempts = None, 0

    def error(self, e: BaseException) -> None:
        """An error while connected (a permissions violation, a slow consumer...). A full store's
        refusal of a write ("insufficient resources") lands here too (nats-py 2.16's async publish
        reply handler raises it instead of failing the publish): the role's ``store_full`` line
        says that one (bus.store_health), so it is logged at debug."""
        if classify(e) is not None and getattr(e, "err_code", None) is not None:
            self.log.debug("nats_error", error=str(e))
            return
        key = f"{type(e).__name__}: {e}"
        now = self.clock()
        last = self._errors.get(key)
        if last is not None and now - last[0] < ERROR_REPEAT_S:
            self._errors[key] = (last[0], last[1] + 1)
            return
        if len(self._errors) > 256:
            self._errors.clear()
        self._errors[key] = (now, 0)
        self.log.warning("nats_error", error=repr(e), **({"suppressed": last[1]} if last and last[1] else {}))


async def connect(cfg: CommonConfig, name: str, ping_interval: float = 5.0, *, timeout: float | None = None,
                  refused_grace: float | None = None, after_reconnect: Callable[[], Awaitable[None]] | None = None,
                  **extra: Any) -> Client:
    """A connected client named ``name`` (shown in the server's /connz) for ``cfg``.

    ``timeout``: seconds to try at start (default DILOCO_CONNECT_TIMEOUT), then ConnectFailed.
    ``refused_grace``: seconds after which a start whose every attempt was refused at once
    (:func:`refused_at_once`) gives up without waiting out ``timeout`` (commands a person runs:
    ``REFUSED_GRACE``); None (roles): the whole window.
    ``extra``: nats-py options; an ``error_cb``, ``disconnected_cb`` or ``reconnected_cb`` given
    there replaces our logging once connected (errors while connecting are never passed to it:
    they make the ConnectFailed). ``after_reconnect``: awaited after every reconnect as well, beside
    the logging (a role's store watch probes a full store at once: ``StoreWatch.reconnected``)."""
    window = cfg.connect_timeout if timeout is None else max(0.1, float(timeout))
    log = get_logger(component="conn", conn=name)
    states = ConnectionLog(log)
    user_error, user_disc, user_rec = (extra.pop(k, None) for k in ("error_cb", "disconnected_cb", "reconnected_cb"))
    nc = Client()
    errors: list[BaseException] = []  # the last few errors while connecting
    refusal: list[BaseException] = []  # a refused login or TLS failure: no point trying again
    failed = [0]
    only_refused = [True]  # every error so far refused at once
    fatal = asyncio.Event()
    connecting = True

    async def on_error(e: Exception) -> None:
        if connecting:
            del errors[:-4]
            errors.append(e)
            failed[0] += 1
            only_refused[0] = only_refused[0] and refused_at_once(e)
            if _fatal(e) and not fatal.is_set():
                refusal.append(e)  # what later errors (the server closing on us) must not hide
                fatal.set()
            return
        if user_error is not None:
            await user_error(e)
        elif states.down or nc.is_reconnecting:
            states.failed_attempt(e)
        elif _lost(e):  # reported before the disconnect callback: the outage starts here
            states.disconnected()
        else:
            states.error(e)

    async def on_disconnect() -> None:
        if connecting:  # a failed start closing its client: the ConnectFailed says it all
            return
        if user_disc is not None:
            await user_disc()
        elif nc.is_closed or nc.is_draining:
            log.debug("nats_closed")
        else:
            states.disconnected()

    async def on_reconnect() -> None:
        if nc._flusher_task is None or nc._flusher_task.done():
            # nats-py's reconnect after a slow login (see handshake_left_connecting) flushes inline
            # from then on; give it back its flusher
            nc._flusher_task = asyncio.get_running_loop().create_task(nc._flusher())
        if user_rec is not None:
            await user_rec()
        else:
            states.reconnected()
        if after_reconnect is not None:
            try:  # (raised into nats-py's reconnect, it would count the reconnect as failed)
                await after_reconnect()
            except Exception as e:  # noqa: BLE001
                log.warning("after_reconnect_failed", error=repr(e))

    opts: dict[str, Any] = dict(
        servers=cfg.nats_url.split(","),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=ping_interval,
        max_outstanding_pings=3,
        pending_size=64 * 1024 * 1024,
        connect_timeout=min(5.0, window),
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
    if cfg.nats_user:
        opts["user"], opts["password"] = cfg.nats_user, cfg.nats_password
    if cfg.nats_creds:
        opts["user_credentials"] = cfg.nats_creds
    if cfg.nats_nkey_seed:
        opts["nkeys_seed"] = cfg.nats_nkey_seed
    url = redact_url(cfg.nats_url)
    try:
        ctx = tls_context(cfg)
    except (OSError, ssl.SSLError) as e:
        raise ConnectFailed(f"cannot connect to {url}: cannot load the TLS files ({_text(e)}): check DILOCO_TLS_CA, "
                            "DILOCO_TLS_CERT and DILOCO_TLS_KEY", url, e) from None
    if ctx is not None:
        opts["tls"] = ctx
    opts.update(extra)
    t0 = time.monotonic()
    attempt = asyncio.ensure_future(nc.connect(**opts))
    refused = asyncio.ensure_future(fatal.wait())
    grace = window if refused_grace is None else min(window, max(0.1, float(refused_grace)))
    gave_up = False  # every attempt refused at once for ``grace`` seconds
    try:
        await asyncio.wait({attempt, refused}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        if not attempt.done() and not fatal.is_set():
            if failed[0] >= 2 and only_refused[0] and grace < window:
                gave_up = True
            else:
                await asyncio.wait({attempt, refused}, timeout=max(0.0, window - (time.monotonic() - t0)),
                                   return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the caller gave up (a stop while waiting for the server)
        await _abandon(nc, attempt)
        raise
    finally:
        refused.cancel()
    cause: BaseException | None = refusal[0] if refusal else errors[-1] if errors else None
    if not attempt.done() or attempt.cancelled() or attempt.exception() is not None:
        timed_out = not attempt.done() and not fatal.is_set() and not gave_up
        raised = attempt.exception() if attempt.done() and not attempt.cancelled() else None
        if raised is not None and not (type(raised).__name__ == "NoServersError" and cause is not None):
            cause = raised
        attempts = failed[0]
        await _abandon(nc, attempt)
        within = f" within {window:g}s (DILOCO_CONNECT_TIMEOUT)" if timed_out else ""
        if gave_up:
            within = f" ({attempts} attempts in {time.monotonic() - t0:.1f}s, each refused at once)"
        raise ConnectFailed(f"cannot connect to {url}{within}: {explain(cause)}", url, cause)
    connecting = False
    if handshake_left_connecting(nc):
        # seen in CI and here under load: every learner whose login took over 2 s trained nothing
        await finish_handshake(nc, max(1.0, window - (time.monotonic() - t0)), url)
        log.info("nats_handshake_completed", hint="the server's first PING came before its PONG (a slow login); "
                 "nats-py left the connection unusable, completed here")
    if failed[0]:
        log.info("nats_connected", after_s=round(time.monotonic() - t0, 1), failed_attempts=failed[0])
    return nc


def handshake_left_connecting(nc: Client) -> bool:
    """nats-py 2.16 takes the first line after its CONNECT + PING as the handshake's answer: PONG ->
    connected, -ERR -> failed, anything else -> it returns from ``connect()`` with the client still
    CONNECTING. A server slow to check a login (bcrypt on a loaded 2-core machine: over 2 s) sends
    its own first PING (2 s after CONNECT) before that PONG; the client then publishes and subscribes
    into a buffer that is never written (its flusher exits at once, and ``flush()`` returns without
    a round trip), while its interval PINGs, written directly, keep the server content: every
    request times out on a connection that looks alive. True in that state."""
    return bool(getattr(nc, "is_connecting", False)) and not nc.is_closed and getattr(nc, "_transport", None) is not None


async def finish_handshake(nc: Client, timeout: float, url: str) -> None:
    """Complete what nats-py left of a handshake whose answer came after the server's PING
    (:func:`handshake_left_connecting`): the server took the CONNECT (it would have closed on us
    otherwise, and the read loop already answers its pings), so mark the client connected, restart
    its flusher and prove it with a round trip; ConnectFailed if none comes."""
    nc._status = Client.CONNECTED
    if nc._flusher_task is None or nc._flusher_task.done():
        nc._flusher_task = asyncio.get_running_loop().create_task(nc._flusher())
    try:
        await nc.flush(timeout=max(1, round(timeout)))
    except Exception as e:  # noqa: BLE001 - the server closed it after all (a refused login)
        try:
            await nc.close()
        except Exception:  # noqa: BLE001
            pass
        raise ConnectFailed(f"cannot connect to {url}: the handshake did not complete ({_text(e)}): "
                            f"{explain(e)}", url, e) from None


async def probe(nc: Client, stream: str, timeout: float = 3.0, direct_subject: str | None = None) -> dict[str, Any]:
    """What of the server still answers ``nc``, to log beside a request that timed out:
    ``ping_ms`` (round trip of a PING, or None) and ``jetstream``: "answered" (its info of
    ``stream``, "not found" included, in ``jetstream_ms``), "unavailable" (no JetStream to answer)
    or "silent" (no answer in ``timeout``); "not asked" after an unanswered ping. A ping unanswered
    is the connection (or the whole server) stalled; a ping answered and JetStream silent is
    JetStream's API stalled. ``stream``: one the user may ask about (a role's user cannot ask for
    the account's info). ``direct_subject``: also a direct get of that subject's last message in
    ``stream`` (``direct_get``: "answered", "not found" counted as answered, "no responder", or
    "silent", in ``direct_ms``): direct gets are answered by the stream itself, stream info by the
    server's JetStream API workers, so an API silent beside a direct get answered is the API's queue
    (as many workers as the server has cores), both silent with a ping answered this connection's
    replies. A client nats-py does not hold connected (``client``: "connecting", the slow-login
    handshake of :func:`handshake_left_connecting`, or "not connected") is asked nothing: its
    ``flush()`` would return at once and look like a 0 ms ping."""
    from nats.errors import NoRespondersError
    from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError

    out: dict[str, Any] = {"ping_ms": None, "jetstream": "not asked", "jetstream_ms": None}
    if not nc.is_connected:  # nats-py's flush() then returns at once, without a round trip
        out["client"] = "connecting" if handshake_left_connecting(nc) else "not connected"
        return out
    t0 = time.monotonic()
    try:
        await nc.flush(timeout=max(1, round(timeout)))
        out["ping_ms"] = round(1e3 * (time.monotonic() - t0), 1)
    except Exception:  # noqa: BLE001 - the answer is the None
        return out
    js = nc.jetstream(timeout=timeout)

    async def ask(call) -> tuple[str, float | None]:
        t0 = time.monotonic()
        try:
            await call()
        except ServiceUnavailableError:
            return "unavailable", None
        except NoRespondersError:
            return "no responder", None
        except (APIError, NotFoundError):
            pass  # an answer all the same
        except Exception:  # noqa: BLE001 - unanswered
            return "silent", None
        return "answered", round(1e3 * (time.monotonic() - t0), 1)

    if direct_subject is not None:
        out["direct_get"], out["direct_ms"] = await ask(lambda: js.get_last_msg(stream, direct_subject, direct=True))
    out["jetstream"], out["jetstream_ms"] = await ask(lambda: js.stream_info(stream))
    return out


async def _abandon(nc: Client, attempt: asyncio.Future) -> None:
    attempt.cancel()
    await asyncio.gather(attempt, return_exceptions=True)
    try:
        await nc.close()
    except Exception:
        pass


def tls_context(cfg: CommonConfig) -> ssl.SSLContext | None:
    if not (cfg.tls_ca or cfg.tls_cert):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.tls_ca or None)
    if cfg.tls_cert:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
    return ctx
