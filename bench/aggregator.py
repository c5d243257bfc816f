"""The aggregator's merge path in ns per value, beside numpy's memcpy in the same run, and its memory.

What ``aggregator.service`` does with int8 contributions to a fragment of n float32 values (the
learners' default uplink), timed here function by function in one process (no broker):

* **per contribution**: its norm (``l2_norm``, used by validation and the caps) and its share of
  the merge (the slope of ``merge_step``, in place, the default ``rounds`` optimizer and mean merge,
  over the contributions a merge holds). Both decode the int8 blob block by block as they read it
  (``aggregator.int8vec``); a whole decode (``decode_whole``) is reported beside, off the path;
* **per version**: ``merge_step`` less the contributions' share, the int8 downlink delta against
  the keyframe (``bus.downlink.encode_version``), the crc32 of what is sent, the norm of the
  parameters (the ``merged`` log line), the merge record, and a checkpoint (state record and its
  crc32) divided by ``DILOCO_CHECKPOINT_EVERY``.

``trust_cost``: ``merge_step`` of 4 contributions with the trust check off and weighing, at the small
model's fragment (15k values), at 1M (issue 37) and at 25M (issue 39's target: at most +5%). ``blas_threads``: a float64 norm of 15k values with
numpy's BLAS threads and with one, while four processes run JAX steps (why every role runs one
BLAS thread, ``bus/blas.py``).

``memcpy_ns_per_value``: ``np.copyto`` of float32 buffers larger than the caches, same run.
Targets on the 2-core development machine (issue 25): <= 2 ns per value per contribution, <= 6 ns
per value per version. ``bytes_per_owned_value``: the peak RSS of a child process that holds a
fragment's state and keyframe, buffers M int8 contributions as they came and merges them, publishing-side
blob included, less the interpreter's, over n.

    python -m bench.aggregator --quick --out aggregator.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import dataclasses
import os
import sys
import time

import numpy as np
import orjson

from aggregator.config import AggregatorConfig
from aggregator.contribution import Contribution
from aggregator.int8vec import Int8Vector, from_parts
from aggregator.merge import l2_norm
from aggregator.mlog import LoggedContribution, MergeRecord, settings_to_dict
from aggregator.step import FragmentState, MergeSettings, fuses, merge_step
from bench.common import finish, parser, peak_rss_mib, progress
from bus import codec
from bus.chunks import checksum
from bus.downlink import Keyframe, encode_version
from bus.procs import popen, run

MS = (1, 2, 4, 8)


def memcpy_ns(nbytes: int = 256 * 1024 * 1024, reps: int = 3) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(reps))
    return best / (nbytes // 4) * 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _best(fn, reps: int) -> float:
    return min(_timed(fn) for _ in range(reps))


def _settings() -> MergeSettings:
    """The aggregator's defaults, with the int8 downlink of ``diloco up`` and a declared max lr."""
    s = MergeSettings.from_config(AggregatorConfig())
    return dataclasses.replace(s, downlink_quantiser="int8", max_inner_lr=0.008)


def _blobs(m: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(m)
    base = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
    return [bytes(codec.encode_array(base * np.float32(1 + 0.01 * i), "int8")) for i in range(m)]


def _contribs(blobs: list[bytes]) -> list[Contribution]:
    """As intake holds them: int8 kept as it came (``aggregator.int8vec``), decoded block by block
    where it is read."""
    return [Contribution("b", "h", f"l{i}", "i", 0, 1, 0, 12, 12 * 64, lazy_vector(b), 12) for i, b in enumerate(blobs)]


def lazy_vector(blob: bytes) -> Int8Vector:
    h, shape, parts = codec.decode_parts(blob)
    v = from_parts(parts, int(np.prod(shape)), h["b"])
    assert v is not None, "the bench's fragment is whole blocks"
    return v


def hot_path(n: int, reps: int, checkpoint_every: int) -> dict:
    s = _settings()
    rng = np.random.default_rng(0)
    params0 = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
    blobs = _blobs(max(MS), n)
    cs = _contribs(blobs)
    norms = [l2_norm(c.vector) for c in cs]
    ns = lambda t: t / n * 1e9  # noqa: E731
    out: dict = {"n": n}
    out["decode_whole"] = ns(_best(lambda: codec.decode_array(blobs[0]), reps))  # not on the path since issue 41
    out["norm"] = ns(_best(lambda: l2_norm(cs[0].vector), reps))  # decodes block by block
    st = FragmentState.initial(0, 0, params0, s)
    acc = None if fuses(s) else np.empty(n, np.float32)  # the service's merge buffer (none with the defaults)
    merge_t = {}
    rnd = [0]

    def fresh(m: int) -> list[Contribution]:  # new rounds: a merge applies each key once
        rnd[0] += 1
        return [dataclasses.replace(c, round=rnd[0]) for c in cs[:m]]

    for m in MS:
        def one(m=m):
            nonlocal st
            st = merge_step(st, fresh(m), s, norms[:m], m / 8, 8, inplace=True, out=acc)
        one()  # warm: page faults of the optimizer arrays
        merge_t[m] = ns(_best(one, reps))
    slope = float(np.polyfit(list(MS), [merge_t[m] for m in MS], 1)[0])
    out["merge_step_by_m"] = {str(m): round(v, 3) for m, v in merge_t.items()}
    out["merge_per_contribution"] = slope
    out["merge_per_version"] = merge_t[1] - slope
    key = Keyframe(0, params0.copy())
    got: dict = {}

    def enc():
        got["blob"] = encode_version(st.params, st.version, key, "int8", 64)[0]
    out["downlink_int8"] = ns(_best(enc, reps))
    out["crc32_sent"] = ns(_best(lambda: checksum(got["blob"]), reps))
    out["param_norm"] = ns(_best(lambda: l2_norm(st.params), reps))
    rec = MergeRecord(0, st.version, tuple(LoggedContribution(f"l{i}", "i", 0, 1, 0, (1, 2), 1.0, len(blobs[i]))
                                           for i in range(4)), 0.5, 8, settings_to_dict(s))
    out["merge_record"] = ns(_best(lambda: rec.to_bytes(), reps))

    def ckpt():  # what the aggregator does before the publish: the header and the crc of the live arrays
        got["state"] = st.checkpoint()
        checksum(got["state"])
    out["checkpoint"] = ns(_best(ckpt, max(1, reps // 2)))
    out["checkpoint_bytes_per_value"] = round(got["state"].nbytes / n, 2)
    per_c = out["norm"] + slope  # each decodes the contribution's blocks it reads
    per_v = (out["merge_per_version"] + out["downlink_int8"] + out["crc32_sent"] + out["param_norm"]
             + out["merge_record"] + out["checkpoint"] / checkpoint_every)
    res = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items()}
    res["ns_per_value_per_contribution"] = round(per_c, 3)
    res["ns_per_value_per_version"] = round(per_v, 3)
    return res


def trust_cost(n: int, reps: int, m: int = 4) -> dict:
    """merge_step of m contributions (two rounds of m/2 learners, as a backlogged merge holds) with the
    trust check off and weighing: ms per merge and what trust adds (issue 37: it was most of a small
    fragment's merge)."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
    vs = [base * np.float32(1 + 0.1 * i) + rng.standard_normal(n, dtype=np.float32) * np.float32(0.003)
          for i in range(m)]
    out = {}
    for mode in ("off", "weigh"):
        s = _settings()
        s = dataclasses.replace(s, trust=dataclasses.replace(s.trust, mode=mode))
        st = FragmentState.initial(0, 0, rng.standard_normal(n, dtype=np.float32) * np.float32(0.02), s)
        acc = np.empty(n, np.float32)
        norms = [l2_norm(v) for v in vs]
        rnd = [0]

        def one():
            nonlocal st
            rnd[0] += 1
            cs = [Contribution("b", "h", f"l{i % (m // 2)}", "i", 0, 2 * rnd[0] + i // (m // 2), st.version, 12,
                               12 * 512, vs[i], 12) for i in range(m)]
            st = merge_step(st, cs, s, norms, m / 2, m // 2, inplace=True, out=acc)
        one()
        out[mode] = _best(one, reps) * 1e3
    # the trust check alone (aggregator.trust.assess: the sample, its cosines, the verdicts) in CPU time,
    # which a loaded machine disturbs less than the wall time of two whole merges
    from aggregator.trust import TrustState, assess

    tst = TrustState()
    names = [f"l{i}" for i in range(m)]
    for v in range(6):
        tst = assess(tst, names, vs, s.trust, v + 1).state
    cpu = []
    for r in range(max(3, reps)):
        t0 = time.process_time()
        assess(tst, names, vs, s.trust, 10 + r)
        cpu.append(time.process_time() - t0)
    return {"n": n, "off_ms": round(out["off"], 3), "weigh_ms": round(out["weigh"], 3),
            "trust_adds": round(out["weigh"] / out["off"] - 1, 3), "assess_cpu_ms": round(min(cpu) * 1e3, 3),
            "assess_over_off": round(min(cpu) * 1e3 / out["off"], 4)}


BURNERS = 4  # two learners' worth of XLA threads per core of this 2-core machine
#: what a learner does to the cores: JAX steps (XLA's own thread pool), for at most 40 s
BURNER = ("import time\nimport jax, jax.numpy as jnp\nf = jax.jit(lambda a: jnp.tanh(a @ a))\n"
          "x = jnp.ones((384, 384)) * 0.01\nt = time.time() + 40\nwhile time.time() < t: x = f(x).block_until_ready()")


def blas_under_load(n: int = 15_000, reps: int = 200) -> dict:
    """ms per norm of n float64 values (``np.linalg.norm``, as the trust check took them) with numpy's
    BLAS threads as loaded and with one, while BURNERS processes run JAX steps (learners beside an
    aggregator; with two such processes, or a busy loop per core, the ratio is under 2)."""
    from threadpoolctl import threadpool_info, threadpool_limits

    threads = max([i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"], default=1)
    v = np.random.default_rng(2).standard_normal(n)  # float64: the trust check's norms before issue 37
    burners = [popen([sys.executable, "-c", BURNER], env={**os.environ, "JAX_PLATFORMS": "cpu"})
               for _ in range(BURNERS)]
    try:
        time.sleep(8.0)  # their imports and compilation
        with threadpool_limits(limits=threads, user_api="blas"):
            many = _timed(lambda: [np.linalg.norm(v) for _ in range(reps)]) / reps * 1e3
        with threadpool_limits(limits=1, user_api="blas"):
            one = _timed(lambda: [np.linalg.norm(v) for _ in range(reps)]) / reps * 1e3
    finally:
        for b in burners:
            b.kill()
            b.wait()
    return {"n": n, "threads": threads, "norm_ms_threads": round(many, 4), "norm_ms_one_thread": round(one, 4),
            "ratio": round(many / max(one, 1e-9), 1)}


def child(m: int, n: int) -> None:
    """Hold a fragment (state, keyframe), M buffered int8 contributions as they came, merge in place
    and encode the downlink, as the service does; print the peak RSS."""
    s = _settings()
    blobs = _blobs(m, n) if n > 1 else []
    st = FragmentState.initial(0, 0, np.zeros(n, np.float32), s)
    key = Keyframe(0, st.params.copy())
    if blobs:
        cs = _contribs(blobs)
        del blobs
        acc = None if fuses(s) else np.empty(n, np.float32)
        for r in range(2):  # K = all (and the on-time quorum at equal speeds): every merge is a whole round
            st = merge_step(st, [dataclasses.replace(c, round=r + 1) for c in cs], s,
                            [l2_norm(c.vector) for c in cs], 1.0, m, inplace=True, out=acc)
            encode_version(st.params, st.version, key, "int8", 64)
    print(orjson.dumps({"peak_rss_mib": peak_rss_mib()}).decode())


def rss(m: int, n: int) -> dict:
    def peak_of(mm, nn):
        out = run([sys.executable, "-m", "bench.aggregator", "--child", str(mm), str(nn)],
                  capture_output=True, text=True, check=True)
        return orjson.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    peak, interp = peak_of(m, n), peak_of(1, 1)
    return {"M": m, "peak_rss_mib": round(peak, 1), "interpreter_mib": round(interp, 1),
            "bytes_per_owned_value": round((peak - interp) * 2**20 / n, 2)}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]))
        return
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--values", type=float, default=None, help="fragment size in millions of values (12.5; quick 4)")
    a = p.parse_args()
    n = int((a.values or (4 if a.quick else 12.5)) * 1e6)
    reps = 3 if a.quick else 5
    every = AggregatorConfig().checkpoint_every
    mc = memcpy_ns()
    progress(f"memcpy {mc:.3f} ns per float32 value")
    hp = hot_path(n, reps, every)
    progress(str(hp))
    # 25M values: the size issue 39's target is set at (trust adds at most 5% per merge)
    tc = [trust_cost(k, reps * 4 if k < 100_000 else reps) for k in (15_000, 1_000_000) + (() if a.quick else (25_000_000,))]
    for r in tc:
        progress(f"trust: {r}")
    bl = blas_under_load()
    progress(f"BLAS on a busy machine: {bl}")
    mem = [rss(m, n) for m in (1, 4)]
    for r in mem:
        progress(str(r))
    finish({
        "bench": "aggregator", "quick": a.quick, "values": n, "memcpy_ns_per_value": round(mc, 3),
        "checkpoint_every": every, "hot_path": hp,
        "ns_per_value_per_contribution": hp["ns_per_value_per_contribution"],
        "ns_per_value_per_version": hp["ns_per_value_per_version"],
        "contribution_over_memcpy": round(hp["ns_per_value_per_contribution"] / mc, 2),
        "version_over_memcpy": round(hp["ns_per_value_per_version"] / mc, 2),
        "memory": mem, "bytes_per_owned_value_m4": mem[-1]["bytes_per_owned_value"],
        "trust_cost": tc, "blas_threads": bl,
    }, a.out)


if __name__ == "__main__":
    main()
