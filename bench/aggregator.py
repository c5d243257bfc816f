"""Merge + outer-step throughput of the aggregator against numpy copy bandwidth, and its memory.

For M = 4, 16, 64 contributions of one fragment (n float32 values each), times what the service
does per merge once contributions are validated (their norms are known from validation):

* ``core``: token x staleness weights, merge (RDA by default), outer Nesterov step;
* ``merge_step``: the whole pure step (updating the applied-set), plus encoding the global blob
  (``bus.downlink.encode_version``, fp32) as the service does when it publishes.

Throughput is GB of outer-gradient data (M x n x 4 bytes) per second; ``merge_vs_memcpy`` is the
worst (over M) core throughput over the bandwidth of ``np.copyto`` on buffers larger than the L3
cache, measured in the same run. ``rss_over_state`` is the peak RSS of a child process that holds
the contributions and does one merge, over (contributions + params + momentum) bytes.

    python -m bench.aggregator --quick --out aggregator.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import subprocess
import sys
import time

import numpy as np
import orjson

from aggregator.contribution import Contribution
from aggregator.merge import l2_norm, merge
from aggregator.step import FragmentState, MergeSettings, merge_step
from aggregator.weights import contribution_weights
from bench.common import finish, parser, peak_rss_mib, progress
from bus.downlink import encode_version

MS = (4, 16, 64)


def memcpy_gbps(nbytes: int = 256 * 1024 * 1024, reps: int = 3) -> float:
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(reps))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _contribs(m: int, n: int) -> list[Contribution]:
    rng = np.random.default_rng(m)
    base = rng.standard_normal(n).astype(np.float32)
    return [Contribution("b", "h", f"l{i}", "i", 0, 1, 0, 10, 640 + i, base * np.float32(1 + 0.01 * i))
            for i in range(m)]


def measure(m: int, n: int, reps: int, method: str) -> dict:
    cs = _contribs(m, n)
    norms = [l2_norm(c.vector) for c in cs]
    settings = MergeSettings(method=method)
    opt = settings.make_optimizer()
    st = FragmentState.initial(0, 1, np.zeros(n, np.float32), settings)

    def core():
        w = contribution_weights(cs, st.version, settings.staleness)
        g = merge([c.vector for c in cs], w, method, None, norms=np.asarray(norms))
        opt.step(st.params, g, st.opt, inplace=True)

    core_t = min(_timed(core) for _ in range(reps))
    step_t = min(_timed(lambda: step_and_blob(st, cs, settings, norms)) for _ in range(reps))
    gb = m * n * 4 / 1e9
    return {"M": m, "n": n, "core_gbps": round(gb / core_t, 3), "merge_step_gbps": round(gb / step_t, 3),
            "core_ms": round(core_t * 1e3, 2)}


def step_and_blob(st: FragmentState, cs: list, settings: MergeSettings, norms) -> None:
    """What the service does per merge before I/O: the merge step, then the fp32 global blob."""
    new = merge_step(st, cs, settings, norms)
    encode_version(new.params, new.version, None, "fp32", 1)


def child(m: int, n: int) -> None:
    cs = _contribs(m, n)
    settings = MergeSettings()
    st = FragmentState.initial(0, 1, np.zeros(n, np.float32), settings)
    step_and_blob(st, cs, settings, [l2_norm(c.vector) for c in cs])
    print(orjson.dumps({"peak_rss_mib": peak_rss_mib()}).decode())


def rss(m: int, n: int) -> dict:
    out = subprocess.run([sys.executable, "-m", "bench.aggregator", "--child", str(m), str(n)],
                         capture_output=True, text=True, check=True)
    peak = orjson.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    base = subprocess.run([sys.executable, "-m", "bench.aggregator", "--child", "1", "1"],
                          capture_output=True, text=True, check=True)
    interp = orjson.loads(base.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    state_mib = (m * n + 2 * n) * 4 / 2**20
    return {"M": m, "peak_rss_mib": round(peak, 1), "interpreter_mib": round(interp, 1),
            "state_mib": round(state_mib, 1), "rss_over_state": round((peak - interp) / state_mib, 3)}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]))
        return
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--method", default="rda", choices=["rda", "mean"])
    a = p.parse_args()
    n = (1 if a.quick else 4) * 1024 * 1024
    reps = 2 if a.quick else 4
    bw = memcpy_gbps()
    progress(f"memcpy {bw:.2f} GB/s")
    rows = []
    for m in MS:
        r = measure(m, n, reps, a.method)
        r["vs_memcpy"] = round(r["core_gbps"] / bw, 3)
        rows.append(r)
        progress(str(r))
    mem = [rss(m, n) for m in MS]
    for r in mem:
        progress(str(r))
    finish({
        "bench": "aggregator", "quick": a.quick, "method": a.method, "memcpy_gbps": round(bw, 3), "rows": rows,
        "merge_vs_memcpy": min(r["vs_memcpy"] for r in rows), "memory": mem,
        "rss_over_state": max(r["rss_over_state"] for r in mem),
    }, a.out)


if __name__ == "__main__":
    main()
