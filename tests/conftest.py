"""Shared fixtures: a real JetStream nats-server per test (free ports, temp store dir)."""

from __future__ import annotations

import os

import pytest

from bus.server import EmbeddedServer


@pytest.fixture
def nats_server(tmp_path):
    """A fresh JetStream server with file storage in ``tmp_path/store``; stopped after the test."""
    srv = EmbeddedServer(store_dir=str(tmp_path / "store"), log_file=str(tmp_path / "nats.log"))
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture
async def nc(nats_server):
    """A client with fast reconnects, connected to ``nats_server``."""
    from bus.config import CommonConfig
    from bus.conn import connect

    client = await connect(CommonConfig(nats_url=nats_server.url, run="t"), name="test")
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def js(nc):
    return nc.jetstream(timeout=10)


def pytest_configure(config):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# CI runs property tests with a fixed seed so a landing never depends on a lucky draw; run
# locally (no CI variable) hypothesis keeps exploring new examples.
try:
    from hypothesis import settings as _hsettings

    _hsettings.register_profile("ci", derandomize=True, deadline=None)
    if os.environ.get("CI"):
        _hsettings.load_profile("ci")
except ImportError:  # pragma: no cover
    pass

