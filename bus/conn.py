"""Connecting to NATS with a run's settings: credentials, TLS, and reconnect behaviour.

nats-py's defaults notice a dead peer only after minutes (ping every 120 s) and give up after 60
reconnect attempts; a training process must instead reconnect forever and notice quickly. We ping
every ``ping_interval`` seconds (default 5), reconnect without limit every 0.5 s, and buffer up to
64 MiB of publishes while disconnected (a full buffer raises, which the transport turns into a
retry).
"""

from __future__ import annotations

import ssl
from typing import Any

import nats
from nats.aio.client import Client

from bus.config import CommonConfig
from bus.log import get_logger


def tls_context(cfg: CommonConfig) -> ssl.SSLContext | None:
    if not (cfg.tls_ca or cfg.tls_cert):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.tls_ca or None)
    if cfg.tls_cert:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
    return ctx


async def connect(cfg: CommonConfig, name: str, ping_interval: float = 5.0, **extra: Any) -> Client:
    """A connected client named ``name`` (shown in the server's /connz) for ``cfg``."""
    log = get_logger(component="conn", conn=name)

    async def on_error(e: Exception) -> None:
        log.warning("nats_error", error=repr(e))

    client: dict[str, Client] = {}

    async def on_disconnect() -> None:
        nc = client.get("nc")
        if nc is not None and (nc.is_closed or nc.is_draining):
            log.info("nats_closed")
        else:
            log.warning("nats_disconnected")

    async def on_reconnect() -> None:
        log.info("nats_reconnected")

    opts: dict[str, Any] = dict(
        servers=cfg.nats_url.split(","),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        ping_interval=ping_interval,
        max_outstanding_pings=3,
        pending_size=64 * 1024 * 1024,
        connect_timeout=5,
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
    ctx = tls_context(cfg)
    if ctx is not None:
        opts["tls"] = ctx
    opts.update(extra)
    nc = await nats.connect(**opts)
    client["nc"] = nc
    return nc
