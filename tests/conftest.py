"""Shared fixtures: a real JetStream nats-server per test (free ports, temp store dir)."""

from __future__ import annotations

import os
import tempfile

import pytest

# One JAX compilation cache for the whole suite and every process it starts (they inherit the
# environment): the same few small models are compiled in about a hundred learner, evaluator and
# reference processes, and a cached compile costs a fraction of one (a JAX learner's test, 8.4 ->
# 5.2 CPU seconds). The key holds the program and the compiler's flags, so a stale entry is never
# taken; the cache outlives the run (later runs start warm), bounded at 1 GiB. Only with filelock
# (the dev extra): a bound needs it, and without its lock a process could read an entry another is
# still writing (a warning on stderr, which tests of clean output would catch).
try:
    import filelock  # noqa: F401
except ImportError:  # pragma: no cover - then every process compiles for itself, as before
    pass
else:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          os.path.join(tempfile.gettempdir(), f"diloco-tests-jax-cache-{os.getuid()}"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 30))

# One bytecode cache for the suite and every process it starts, under the temp folder. Where
# PYTHONDONTWRITEBYTECODE is set (as on this project's development machines) no process of a run would write one,
# and each of the ~300 Python processes the suite starts (roles, CLIs, benchmarks), and each xdist
# worker's test modules, would be compiled from source again: about a fifth of the suite's CPU
# (beside two CPU hogs: 10:50-11:28 without, 8:48 with; docs/BENCHMARKS.md, issue 42). The cache
# lives in the temp folder (PYTHONPYCACHEPREFIX), like the JAX compilation cache above, not in the
# source tree the variable keeps free of __pycache__ folders.
if os.environ.get("PYTHONDONTWRITEBYTECODE"):
    import sys

    _prefix = os.environ.setdefault("PYTHONPYCACHEPREFIX",
                                    os.path.join(tempfile.gettempdir(), f"diloco-tests-pycache-{os.getuid()}"))
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    sys.pycache_prefix, sys.dont_write_bytecode = _prefix, False

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

