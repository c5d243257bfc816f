"""What a run reserves on the server (issue 26, part 6).

nats-server reserves every stream's ``max_bytes`` against its ``max_file_store`` when the stream is
created. Runs reserved 4.3 GiB each whatever their model (GRAD and EVENTS 2 GiB), 8 GiB with a
monitor started first, so the 5th run on a default ``diloco nats`` failed. Here: 20 small runs (and
a 21st whose monitor came first) on a server configured as ``diloco nats`` configures it, each
reserving what its model needs; ``diloco run list`` shows them; a server out of storage says, in
one line, what the runs reserve and that ``diloco run delete`` frees it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import orjson
import pytest

from bus.config import CommonConfig
from bus.conn import connect
from bus.runs import create_tree_run, plan_for, read_manifest
from bus.server import DEFAULT_MAX_FILE_STORE, DEFAULT_MAX_PAYLOAD, EmbeddedServer, _get_json
from bus.streams import (DEFAULT_MAX_BYTES, EVENTS_MAX_BYTES, GRAD_REPLAY_MAX_BYTES, KV_MAX_BYTES, MIB,
                         MIN_STREAM_BYTES, Limits, StorageUnavailable, ensure_run, footprint, inspect_run,
                         list_runs, reserved_total, run_of_stream, sized_bytes)
from bus.subjects import GLOBAL, STATE, Subjects
from bus.transport import ChunkPublisher
from bus.tree import Leaf, TreeSpec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARAMS = 10_000
SPEC = TreeSpec((Leaf("w", (100, 90), "float32"), Leaf("b", (1000,), "float32")))
PLAN = plan_for(SPEC, 4, 1.1)
INIT = {"w": np.zeros((100, 90), np.float32), "b": np.zeros(1000, np.float32)}


def _reserved_of_limits(lim: Limits, max_payload: int = DEFAULT_MAX_PAYLOAD) -> int:
    r = lim.reserved()
    r["kv_run"] = max(r["kv_run"], 2 * max_payload)
    return sum(r.values())


def _split(n: int, k: int = 4) -> list[int]:
    return [n // k] * (k - 1) + [n - (n // k) * (k - 1)]


def test_the_sizes_follow_the_model_with_small_floors():
    """The table of docs/bus.md: a small run reserves the floors; no run reserves more than the
    4.3 GiB-and-up every run reserved before; GRAD holds 16 copies of the model up to 2 GiB, and at
    least the 4 outer gradients of every fragment the explicit limit is checked against."""
    cfg = CommonConfig()
    totals = {}
    for n in (10_000, 1_000_000, 25_000_000, 100_000_000):
        lim = Limits.for_run(cfg, _split(n))
        totals[n] = _reserved_of_limits(lim)
        need = footprint(_split(n), 2)
        assert lim.bytes_of("grad") >= need["grad"] and lim.bytes_of(GLOBAL) >= need["global"]
        assert lim.bytes_of(STATE) >= need["state"] and lim.bytes_of("events") == EVENTS_MAX_BYTES
        before = 2 * 2 * 1024**3 + 3 * 64 * MIB + max(lim.bytes_of(GLOBAL), 64 * MIB) + lim.bytes_of(STATE)
        assert totals[n] < before
    assert totals[10_000] == 3 * MIN_STREAM_BYTES + EVENTS_MAX_BYTES + sum(KV_MAX_BYTES.values()) < 350 * MIB
    assert totals[1_000_000] < 400 * MIB
    assert Limits.for_run(cfg, _split(1_000_000)).bytes_of("grad") >= 16 * 4_000_000
    assert Limits.for_run(cfg, _split(25_000_000)).bytes_of("grad") <= GRAD_REPLAY_MAX_BYTES
    assert Limits.for_run(cfg, _split(100_000_000)).bytes_of("grad") == GRAD_REPLAY_MAX_BYTES
    huge = _split(1_000_000_000)
    assert sized_bytes(huge, 2)["grad"] >= footprint(huge, 2)["grad"] > GRAD_REPLAY_MAX_BYTES
    # a process that knows no model (the monitor): the floor, never 2 GiB
    unsized = Limits.from_config(cfg)
    assert not unsized.from_run and DEFAULT_MAX_BYTES == MIN_STREAM_BYTES
    assert max(unsized.reserved().values()) == MIN_STREAM_BYTES


async def _publish_a_little(js, run: str) -> None:
    """An outer gradient of every fragment and an event, as a short run would leave behind."""
    pub = ChunkPublisher(js, 1 << 20, 8)
    s = Subjects(run)
    for p, n in enumerate(PLAN.sizes):
        await pub.publish(s.grad(p, "l0"), f"{run}.l0.{p}", np.ones(n, np.float32).tobytes(), {"fragment": p})
    await js.publish(s.event("membership"), b'{"learner": "l0", "state": "active"}')


async def test_twenty_small_runs_fit_a_default_diloco_nats_server(tmp_path):
    """The issue's case, 20 runs back to back on the server ``diloco nats`` starts (same config:
    ``cmd_nats`` builds an EmbeddedServer with these defaults), plus a 21st whose monitor provisioned
    it before its creator: every run complete, each reserving what its model needs (339 MiB), all
    of them listed by ``list_runs`` with the bytes the server itself says are reserved."""
    with EmbeddedServer(store_dir=str(tmp_path / "store"), log_file=str(tmp_path / "nats.log")) as srv:
        jsz = _get_json(f"{srv.monitor_url}/jsz")
        assert jsz["config"]["max_storage"] == DEFAULT_MAX_FILE_STORE == 20 * 1024**3
        nc = await connect(CommonConfig(nats_url=srv.url, run="r00"), name="test")
        try:
            js = nc.jetstream(timeout=10)
            t0 = time.monotonic()
            per_run = _reserved_of_limits(Limits.for_run(CommonConfig(), PLAN.sizes), nc.max_payload)
            runs = [f"r{i:02d}" for i in range(21)]
            for i, run in enumerate(runs):
                common = CommonConfig(nats_url=srv.url, run=run)
                if i == 20:  # the monitor of this run started first: it provisions without a model
                    await ensure_run(js, run, Limits.from_config(common))
                    assert reserved_total(await inspect_run(js, run)) <= per_run
                assert await create_tree_run(js, common, SPEC, PLAN, INIT, 1.1)
                await _publish_a_little(js, run)
                assert (await read_manifest(js, run)) is not None
            elapsed = time.monotonic() - t0
            listing = await list_runs(js)
            assert sorted(listing["runs"]) == runs
            for run, r in listing["runs"].items():
                assert r["complete"] and r["reserved_bytes"] == per_run, (run, r)
                assert r["bytes"] > 4 * PARAMS  # version 0 and one outer gradient at least
            assert listing["other_reserved_bytes"] == 0
            assert listing["reserved_bytes"] == 21 * per_run < 21 * 350 * MIB
            # the server agrees, and has room for many more
            reserved = _get_json(f"{srv.monitor_url}/jsz")["reserved_storage"]
            assert reserved == listing["reserved_bytes"]
            assert DEFAULT_MAX_FILE_STORE // per_run >= 60 and (DEFAULT_MAX_FILE_STORE - reserved) // per_run >= 39
            # the monitor's streams were grown to the run's size by its creator, not left at 2 GiB
            g = await js.stream_info(Subjects("r20").stream("grad"))
            assert g.config.max_bytes == Limits.for_run(CommonConfig(), PLAN.sizes).bytes_of("grad")
            assert elapsed < 15, elapsed
        finally:
            await nc.close()


async def test_an_update_without_the_model_never_resizes_and_the_runs_limits_do(js):
    """A monitor (limits from the config, no model) re-provisioning never changes a stream's byte
    limit; the run's creator or aggregator (``Limits.for_run``) sets it, up or down."""
    sized = Limits.for_run(CommonConfig(), [4_000_000] * 4, "t")
    await ensure_run(js, "t", sized, update=True)
    grad = Subjects("t").stream("grad")
    before = (await js.stream_info(grad)).config.max_bytes
    assert before == sized.bytes_of("grad") > MIN_STREAM_BYTES
    await ensure_run(js, "t", Limits.from_config(CommonConfig()), update=True)
    await ensure_run(js, "t", Limits())
    assert (await js.stream_info(grad)).config.max_bytes == before
    small = Limits.for_run(CommonConfig(), PLAN.sizes, "t")
    await ensure_run(js, "t", small, update=True)
    assert (await js.stream_info(grad)).config.max_bytes == MIN_STREAM_BYTES
    ev = await js.stream_info(Subjects("t").stream("events"))
    assert ev.config.max_bytes == EVENTS_MAX_BYTES and ev.config.max_msgs_per_subject == 10_000


def test_runs_are_found_by_their_stream_and_bucket_names():
    for run in ("exp1", "my_run", "a_GRAD", "x-1"):
        s = Subjects(run)
        names = [s.stream(k) for k in ("grad", GLOBAL, STATE, "events")] + [f"KV_{s.bucket(k)}" for k in KV_MAX_BYTES]
        assert {run_of_stream(n) for n in names} == {run}
    assert run_of_stream("RAW") is None and run_of_stream("DILOCO__GRAD") is None and run_of_stream("KV_other") is None


def _env(url: str, run: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    e.update({"DILOCO_NATS_URL": url, "DILOCO_RUN": run, "DILOCO_D_MODEL": "32", "DILOCO_N_LAYERS": "1",
              "JAX_PLATFORMS": "cpu"})
    return e


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", "run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_out_of_storage_names_run_list_and_delete_and_delete_frees_it(tmp_path):
    """A server with room for two small runs: the third `diloco run create` fails with one line
    naming `diloco run list` and `diloco run delete` and what the runs reserve; `diloco run list`
    shows both runs with their reservations; after `diloco run delete` of one, the third fits."""
    with EmbeddedServer(store_dir=str(tmp_path / "store"), max_file_store=720 * MIB) as srv:
        first = _cli(_env(srv.url, "one"), "create")
        assert first.returncode == 0, first.stderr
        made = orjson.loads(first.stdout)
        assert made["created"] is True
        assert made["reserved_bytes"] == sum(v["reserved_bytes"] for k, v in made.items()
                                             if isinstance(v, dict)) < 350 * MIB
        logged = [orjson.loads(ln) for ln in first.stderr.splitlines() if '"run_created"' in ln]
        assert logged and logged[0]["reserved_bytes"] == made["reserved_bytes"], first.stderr

        async def second() -> str:
            nc = await connect(CommonConfig(nats_url=srv.url, run="two"), name="test")
            try:
                js = nc.jetstream(timeout=10)
                assert await create_tree_run(js, CommonConfig(nats_url=srv.url, run="two"), SPEC, PLAN, INIT, 1.1)
                with pytest.raises(StorageUnavailable) as e:
                    await create_tree_run(js, CommonConfig(nats_url=srv.url, run="three"), SPEC, PLAN, INIT, 1.1)
                return str(e.value)
            finally:
                await nc.close()

        msg = asyncio.run(second())
        assert "\n" not in msg and "`diloco run list`" in msg and "diloco run delete" in msg
        assert "run 'three'" in msg and "this account's streams reserve" in msg and "one " in msg, msg

        third = _cli(_env(srv.url, "three"), "create")
        assert third.returncode == 1
        lines = [ln for ln in third.stderr.splitlines() if ln.startswith("diloco run:")]
        assert len(lines) == 1 and "diloco run delete" in lines[0] and "diloco run list" in lines[0], third.stderr

        listed = _cli(_env(srv.url, "any"), "list")
        assert listed.returncode == 0, listed.stderr
        runs = orjson.loads(listed.stdout)
        assert {"one", "two"} <= set(runs["runs"]) and runs["runs"]["one"]["complete"]
        assert runs["runs"]["one"]["reserved_bytes"] == made["reserved_bytes"]
        assert runs["reserved_bytes"] == sum(r["reserved_bytes"] for r in runs["runs"].values())
        assert runs["account"]["storage_bytes"] >= runs["bytes"] > 0

        gone = _cli(_env(srv.url, "one"), "delete")
        assert gone.returncode == 0 and "DILOCO_one_GRAD" in orjson.loads(gone.stdout)["deleted"], gone.stderr
        again = _cli(_env(srv.url, "three"), "create")
        assert again.returncode == 0, again.stderr
