"""Stream limits that follow the model (issue 13, item 6).

A stream at its byte limit drops its oldest messages: in GLOBAL those can be the committed version
of a fragment that has not changed for a while. The control test shows that with a real server;
the others show the run's limits are sized so it cannot happen, and that a limit too small for the
run is refused at start with one line naming the variable and the bytes needed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from bus import codec
from bus.config import CommonConfig
from bus.streams import DEFAULT_MAX_BYTES, Limits, LimitsTooSmall, ensure_run, footprint
from bus.subjects import GLOBAL, Subjects
from bus.transport import ChunkPublisher, VersionedStore, VersionLost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = [300_000, 300_000, 300_000]  # three fragments of 1.2 MB each


def test_footprint_counts_every_kept_version():
    f2, f4 = footprint(SIZES, 2), footprint(SIZES, 4)
    params = 4 * sum(SIZES)
    assert f2["global"] >= 2 * 2 * params  # two slots, fp32 and keyframes
    assert f4["global"] >= 2 * f2["global"] - 1024 * 1024  # history 4: two versions per slot
    assert f2["state"] >= 2 * 3 * params
    assert footprint([10 * n for n in SIZES], 2)["grad"] > 9 * f2["grad"]


def test_auto_limits_hold_the_run_and_an_explicit_small_one_is_refused():
    auto = Limits.for_run(CommonConfig(), SIZES)
    need = footprint(SIZES, 2)
    for kind in ("global", "state", "grad"):
        assert auto.bytes_of(kind) >= need[kind]
    # GRAD: 16 copies of the model (the merge log's replay window; bus.streams), not a 2 GiB floor
    assert auto.bytes_of("grad") >= max(DEFAULT_MAX_BYTES, 16 * 4 * sum(SIZES))
    with pytest.raises(LimitsTooSmall) as e:
        Limits.for_run(CommonConfig(stream_max_bytes=4_000_000), SIZES, "big")
    msg = str(e.value)
    assert "\n" not in msg and "DILOCO_STREAM_MAX_BYTES=4000000" in msg and "'big'" in msg
    assert str(max(need.values())) in msg
    ok = Limits.for_run(CommonConfig(stream_max_bytes=max(need.values())), SIZES)
    assert ok.bytes_of("global") == ok.bytes_of("grad") == max(need.values())


async def _write_versions(js, limits: Limits) -> tuple[bool, int, str | None]:
    """Fragments 0 and 2 keep version 0; fragment 1 gets 12 versions. (fragment 0 v0 still
    readable?, newest readable version of fragment 1)."""
    await ensure_run(js, "t", limits, update=True)
    store = VersionedStore(js, "t", GLOBAL, ChunkPublisher(js, 256 * 1024, 8))
    store.check_every = 0.0  # check after every put (the default is once a second)
    vec = np.arange(SIZES[0], dtype=np.float32)
    await store.put(0, 0, codec.encode_array(vec), {})
    await store.put(2, 0, codec.encode_array(vec), {})
    lost = None
    for v in range(12):
        try:
            await store.put(1, v, codec.encode_array(vec + v), {})
        except VersionLost as e:  # the writer says so: the version is still committed, fragment 0's is gone
            lost = lost or str(e)
    store.lost = lost
    newest = await store.head(1)
    await store.fetch(newest)
    try:
        blob = await store.fetch(await store.head(0))
        return bool(np.array_equal(codec.decode_array(blob), vec)), newest.version, lost
    except Exception:
        return False, newest.version, lost


async def test_control_a_stream_below_the_footprint_loses_a_committed_version(js):
    """The failure the sizing prevents, on a real server: 4 MB holds 3 versions of 1.2 MB, while
    the per-subject limits keep 4 (two of fragment 1, one each of 0 and 2): the writes of fragment 1
    evict fragment 0's committed version 0 while every put succeeds on the server. The writer
    notices (``VersionLost``, naming the fragments and the variable), so nothing reports it as kept."""
    kept, newest, lost = await _write_versions(js, Limits(max_bytes=4_000_000))
    assert newest == 11 and not kept
    assert lost is not None and "fragments [0" in lost and "DILOCO_STREAM_MAX_BYTES" in lost


async def test_a_run_sized_from_its_parameters_keeps_every_committed_version(js):
    kept, newest, lost = await _write_versions(js, Limits.for_run(CommonConfig(max_chunk_bytes=256 * 1024), SIZES, "t"))
    assert newest == 11 and kept and lost is None
    info = await js.stream_info(Subjects("t").stream(GLOBAL))
    assert info.config.max_bytes >= footprint(SIZES, 2)["global"]


def _env(**extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    e.update({"DILOCO_NATS_URL": "nats://127.0.0.1:1", "DILOCO_RUN": "big", **extra})
    return e


@pytest.mark.parametrize("argv", [["-m", "diloco.cli", "run", "create"], ["-m", "diloco.cli", "aggregator"],
                                  ["-m", "diloco.cli", "up", "--quick", "--out", "{tmp}"]])
def test_every_provisioner_refuses_a_limit_too_small_in_one_line(argv, tmp_path):
    """The issue's case (the default model, DILOCO_STREAM_MAX_BYTES=4000000): `diloco run create`,
    `diloco aggregator` and `diloco up` stop before connecting, with one line naming the variable."""
    argv = [a.replace("{tmp}", str(tmp_path / "up")) for a in argv]
    r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=_env(DILOCO_STREAM_MAX_BYTES="4000000"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert "DILOCO_STREAM_MAX_BYTES=4000000 cannot hold run 'big'" in lines[0] and "needs" in lines[0]


def test_the_aggregator_of_an_existing_run_refuses_a_limit_too_small(nats_server):
    """The aggregator alone (``python -m aggregator``) knows the model from the manifest only: it
    refuses once it has read it, in one line, and leaves the run's streams as they were."""
    env = {**_env(DILOCO_NATS_URL=nats_server.url), "DILOCO_D_MODEL": "64"}
    made = subprocess.run([sys.executable, "-m", "diloco.cli", "run", "create"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    r = subprocess.run([sys.executable, "-m", "aggregator"], cwd=ROOT, env={**env, "DILOCO_STREAM_MAX_BYTES": "4000000"},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("diloco aggregator:")]
    assert len(lines) == 1 and "DILOCO_STREAM_MAX_BYTES=4000000 cannot hold run 'big'" in lines[0], r.stderr


def test_run_create_streams_only_sizes_the_streams_and_writes_no_version(nats_server):
    """Strict auth: admin creates the streams (sized for the model) and nothing else; the
    aggregator's credentials write version 0 later."""
    import asyncio

    from bus.conn import connect
    from bus.runs import read_manifest
    from learner.builtin import builtin_manifest
    from learner.config import ModelConfig

    env = {**_env(DILOCO_NATS_URL=nats_server.url), "DILOCO_RUN": "adm"}
    r = subprocess.run([sys.executable, "-m", "diloco.cli", "run", "create", "--streams-only"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

    async def look():
        nc = await connect(CommonConfig(nats_url=nats_server.url, run="adm"), name="t")
        try:
            js = nc.jetstream(timeout=10)
            info = await js.stream_info(Subjects("adm").stream(GLOBAL))
            return info.config.max_bytes, await read_manifest(js, "adm")
        finally:
            await nc.close()

    max_bytes, manifest = asyncio.run(look())
    sizes = builtin_manifest("adm", ModelConfig())[1].sizes
    assert manifest is None
    assert max_bytes == Limits.for_run(CommonConfig(), sizes).bytes_of("global") >= footprint(sizes, 2)["global"]


async def test_a_manifest_above_the_servers_max_payload_is_refused_before_anything_is_written(tmp_path):
    """A tree of very many leaves: its description cannot be stored as one message; one line says
    so and what to do, and the run is left uncreated (no claim, no version 0). (A server of 256 KiB
    messages: at the default 8 MiB the tree took 280,000 leaves and 17 CPU seconds.)"""
    from bus.conn import connect
    from bus.runs import RunMismatch, create_tree_run, plan_for, read_manifest
    from bus.server import EmbeddedServer
    from bus.tree import Leaf, TreeSpec

    srv = EmbeddedServer(store_dir=str(tmp_path / "store"), max_payload=256 * 1024).start()
    common = CommonConfig(nats_url=srv.url, run="wide")
    nc = await connect(common, name="test")
    try:
        js = nc.jetstream(timeout=10)
        limit = nc.max_payload
        assert limit == 256 * 1024
        n = limit // 30 + 1  # each leaf costs more than 30 bytes of JSON (["layer_0000001/w",[1],"float32"],)
        spec = TreeSpec(tuple(Leaf(f"layer_{i:07d}/w", (1,), "float32") for i in range(n)))
        plan = plan_for(spec, 2, 1.1)
        init = {leaf.path: np.zeros(1, np.float32) for leaf in spec.leaves}
        with pytest.raises(RunMismatch, match=rf"manifest is \d+ bytes \(a tree of {n} leaves\), above the server's "
                                              rf"max_payload of {limit}"):
            await create_tree_run(js, common, spec, plan, init, 1.1)
        assert await read_manifest(js, "wide") is None
        assert not [s async for s in _stream_names(js) if "wide" in s]
    finally:
        await nc.close()
        srv.close()


async def _stream_names(js):
    for info in await js.streams_info():
        yield info.config.name
