"""A full JetStream store told apart from other failures, and said once (bus.store_health), and the
restart decision of a server whose streams could not write (bus.server.heal_due): pure parts."""

from __future__ import annotations

import asyncio

import nats.errors
from nats.js.errors import APIError, NoStreamResponseError, ServerError, ServiceUnavailableError

from nats.js.api import StreamConfig

from bus.server import HEAL_MIN_FREE, heal_due, store_write_error
from bus.store_health import FULL, SILENT, StoreHealth, StoreWatch, classify, store_fault
from bus.streams import Limits, needs_update, stream_configs
from bus.subjects import Subjects
from bus.transport import TransportError

ENOSPC = "write /s/jetstream/$G/streams/S/msgs/1.blk: no space left on device"


def test_the_servers_answers_at_a_full_store_are_full():
    # what nats-py raises, as measured: max_file_store used up, a stream created on a full disk
    assert classify(ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources")) \
        == (FULL, "insufficient resources")
    assert classify(ServerError(code=500, err_code=10077, description=ENOSPC))[0] == FULL
    assert classify(APIError(code=400, err_code=10002, description="resource limits exceeded for account"))[0] == FULL


def test_silence_is_only_a_suspicion_and_other_failures_are_not_the_stores():
    assert classify(nats.errors.TimeoutError()) == (SILENT, "no acknowledgement in time")
    assert classify(asyncio.TimeoutError())[0] == SILENT
    for e in (nats.errors.ConnectionClosedError(), nats.errors.NoRespondersError(), NoStreamResponseError(),
              ServiceUnavailableError(code=503, err_code=10008, description="jetstream not enabled"),
              ValueError("x")):
        assert classify(e) is None, e
    assert store_fault(FULL, server_answers=False)
    assert store_fault(SILENT, server_answers=True)
    assert not store_fault(SILENT, server_answers=False)  # down or restarting: not the store
    assert not store_fault(None, server_answers=True)


def test_a_wrapped_error_is_classified_by_its_cause():
    try:
        try:
            raise ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources")
        except Exception as e:
            raise TransportError(f"publish failed after retries: {e!r}") from e
    except TransportError as t:
        assert classify(t) == (FULL, "insufficient resources")


def test_a_reservation_refused_is_not_a_full_store():
    # bus.streams raises StorageUnavailable "from None" over the server's 10047: a sizing error
    try:
        try:
            raise ServiceUnavailableError(code=503, err_code=10047, description="insufficient storage")
        except Exception:
            raise RuntimeError("cannot reserve 64 MiB: see diloco run list") from None
    except RuntimeError as e:
        assert classify(e) is None


def test_the_state_changes_once_per_episode_and_probes_are_spaced():
    h = StoreHealth(probe_every=5.0)
    assert h.may_write(0.0) and not h.faulted
    assert h.stored(0.0) is None
    assert h.fault(FULL, 10.0) is True
    assert h.fault(FULL, 11.0) is False and h.faulted  # the same episode
    assert not h.may_write(12.0)  # refused at 11: the next try at 16
    assert h.may_write(16.0) and not h.may_write(17.0)
    m = h.metrics(20.0)
    assert m == {"store_fault": FULL, "store_faults": 1, "store_refused": 2, "store_fault_s": 10.0}
    assert h.stored(30.0) == 20.0 and h.stored(31.0) is None
    assert h.may_write(31.0)
    assert h.fault(SILENT, 40.0) is True and h.episodes == 2
    h.stored(41.0)
    assert h.metrics(50.0)["store_fault_s"] == 21.0


def test_a_rare_writer_probes_after_a_quiet_spell_and_every_few_seconds_while_faulted():
    h = StoreHealth(probe_every=5.0)
    h.stored(100.0)
    assert not h.probe_due(105.0, idle=10.0)  # a write was stored 5 s ago
    assert h.probe_due(110.0, idle=10.0) and not h.probe_due(115.0, idle=10.0)  # then every 10 s
    assert h.probe_due(120.0, idle=10.0)
    h.fault(SILENT, 121.0)
    assert not h.probe_due(125.0, idle=10.0) and h.probe_due(126.0, idle=10.0)  # faulted: every 5 s
    h.stored(127.0)
    assert not h.probe_due(130.0, idle=10.0)


def test_a_probe_that_timed_out_is_followed_one_spacing_after_it_was_sent():
    """A silent store fails a probe only at its timeout (5 s): spaced from its failure, the probes of a
    faulted role came 10 s apart, and a role resumed up to 10 s after the server's restart."""
    h = StoreHealth(probe_every=5.0)
    h.fault(SILENT, 105.0, tried_at=100.0)  # sent at 100, timed out at 105
    assert h.may_write(105.0)  # the next one now, 5 s after the last was sent
    h.fault(SILENT, 106.0, tried_at=106.0)  # refused at once
    assert not h.may_write(110.0) and h.may_write(111.0)
    h.fault(SILENT, 120.0)  # a write of the role's own: spaced from its failure, as before
    assert not h.may_write(124.0) and h.may_write(125.0)


def test_a_faulted_role_probes_as_soon_as_its_connection_comes_back():
    """A full store usually ends with the server restarted on freed space: a role probed on its old
    schedule, up to 5 s after it reconnected (the full-disk test resumed 11.5 s after the space was
    freed in 6 of 10 runs). Reconnected while faulted: the next probe is due now; while healthy the
    idle probes keep their spacing."""
    h = StoreHealth(probe_every=5.0)
    h.fault(FULL, 100.0)
    assert not h.may_write(101.0)
    h.reconnected(101.5)
    assert h.may_write(101.5) and not h.may_write(102.0)  # one probe, then the spacing again
    ok = StoreHealth(probe_every=5.0, last_stored=100.0)
    assert ok.probe_due(110.0, idle=10.0) and not ok.probe_due(111.0, idle=10.0)
    ok.reconnected(111.0)
    assert not ok.probe_due(111.0, idle=10.0) and ok.may_write(111.0)


class Log:
    def __init__(self):
        self.lines: list[tuple[str, str, dict]] = []

    def __getattr__(self, level):
        return lambda event, **kw: self.lines.append((level, event, kw))


async def test_the_watch_says_it_once_and_asks_the_server_before_blaming_silence():
    answers = {"ok": False}

    async def probe():
        if not answers["ok"]:
            raise nats.errors.TimeoutError
        return "info"

    log = Log()
    w = StoreWatch(log, "pausing", probe=probe, probe_timeout=0.5)
    assert not await w.failed(nats.errors.TimeoutError())  # the server does not answer either
    assert not w.faulted and log.lines == []
    answers["ok"] = True
    assert await w.failed(nats.errors.TimeoutError())  # it answers: its store is silent
    assert await w.failed(nats.errors.TimeoutError())
    assert not await w.failed(nats.errors.ConnectionClosedError())  # not the store's: the caller logs it
    assert [(lv, ev) for lv, ev, _ in log.lines] == [("warning", "store_full")]
    assert log.lines[0][2]["effect"] == "pausing" and "diloco nats" in log.lines[0][2]["hint"]
    w.stored()
    w.stored()
    assert [(lv, ev) for lv, ev, _ in log.lines] == [("warning", "store_full"), ("info", "store_writable")]
    assert log.lines[1][2]["refused"] == 2
    assert w.metrics()["store_faults"] == 1 and w.metrics()["store_fault"] is None


async def test_a_write_of_its_own_stored_means_the_timeout_was_not_the_stores():
    log = Log()
    writes = {"stored": True}

    async def answers():
        return "info"

    async def write():
        if not writes["stored"]:
            raise nats.errors.TimeoutError
        return "ack"

    w = StoreWatch(log, "pausing", probe=answers, write_probe=write, probe_timeout=0.5)
    assert not await w.failed(nats.errors.TimeoutError())  # a lost ack: the store writes
    writes["stored"] = False
    assert await w.failed(nats.errors.TimeoutError()) and w.faulted


def test_an_update_that_changes_nothing_is_not_sent():
    s = Subjects("r")
    for want in stream_configs(s, Limits()):
        have = StreamConfig.from_response({**want.as_dict(), "duplicate_window": 120_000_000_000})
        assert not needs_update(have, want), want.name
        bigger = StreamConfig.from_response({**have.as_dict(), "max_bytes": (want.max_bytes or 0) * 2})
        assert needs_update(bigger, want)
        fewer = StreamConfig.from_response({**have.as_dict(), "subjects": []})
        assert needs_update(fewer, want)


def test_a_stream_write_error_in_healthz_is_found():
    assert store_write_error({"status": "ok"}) is None
    err = f"JetStream stream '$G > DILOCO_r_GRAD' write error: {ENOSPC}"
    assert store_write_error({"status": "unavailable", "error": err}) == err
    assert store_write_error({"status": "unavailable", "errors": [{"type": 3, "error": err}]}) == err
    assert store_write_error({"status": "unavailable", "error": "JetStream has not processed the meta"}) is None


def test_the_server_is_restarted_only_when_space_is_back_and_not_too_often():
    err = f"JetStream stream '$G > S' write error: {ENOSPC}"
    assert heal_due(err, HEAL_MIN_FREE, now=100.0, last=None)
    assert not heal_due(err, HEAL_MIN_FREE - 1, now=100.0, last=None)  # the disk is still full
    assert not heal_due(None, 10 * HEAL_MIN_FREE, now=100.0, last=None)
    assert not heal_due("JetStream stream '$G > S' write error: input/output error", 10 * HEAL_MIN_FREE, 100.0, None)
    assert not heal_due(err, HEAL_MIN_FREE, now=100.0, last=80.0)  # restarted 20 s ago
    assert heal_due(err, HEAL_MIN_FREE, now=100.0, last=60.0)


def test_a_refusal_that_nats_py_hands_to_the_error_callback_is_not_logged_twice():
    from bus.conn import ConnectionLog

    log = Log()
    conn = ConnectionLog(log, clock=lambda: 0.0)
    conn.error(ServiceUnavailableError(code=503, err_code=10023, description="insufficient resources"))
    conn.error(ValueError("slow consumer"))
    assert [(lv, ev) for lv, ev, _ in log.lines] == [("debug", "nats_error"), ("warning", "nats_error")]


async def test_a_reconnect_reaches_the_store_watch(nats_server):
    """``bus.conn.connect(..., after_reconnect=StoreWatch.reconnected)``, as every role connects: the
    server restarted, a faulted watch may probe at once. (That the connection still logs
    ``nats_reconnected`` beside it: ``test_learner_service.py::test_learner_survives_nats_restart``,
    from the learner's own stderr; captured here, structlog's loggers cached by other tests of the
    same worker hid the lines.)"""
    import time

    from bus.config import CommonConfig
    from bus.conn import connect

    watch = StoreWatch(Log(), "waits", probe_every=600.0)  # (its old schedule is far off whatever the load)
    watch.health.fault(FULL, time.monotonic())
    assert not watch.may_write()
    came_back = asyncio.Event()

    async def after() -> None:
        await watch.reconnected()
        came_back.set()

    nc = await connect(CommonConfig(nats_url=nats_server.url, run="r"), name="t", after_reconnect=after)
    try:
        nats_server.kill()
        await asyncio.sleep(0.5)
        nats_server.start()
        # (a loaded suite: the restart and the client's next attempt took over 10 s once)
        await asyncio.wait_for(came_back.wait(), 60)
    finally:
        await nc.close()
    assert watch.may_write() and not watch.may_write()  # one probe now, then the spacing
