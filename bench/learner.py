"""One learner island on the default model: inner-step speed, peak RSS against the memory formula.

Starts an embedded server, an aggregator and one real learner process (``python -m learner``,
default model unless DILOCO_* overrides are set), lets it train ``--steps`` inner steps, and reads
its metrics (``tokens_per_s``, ``rss_mib``, ``step_seconds_total``, bytes sent/received).
The learner's memory formula (docs/learner.md): 4 x (5N + 2F) bytes of model state for N
parameters and F the largest fragment (params, two AdamW moments, base copy, error-feedback
residual, in-flight fragment buffers); the rest of the RSS is the Python/JAX/XLA runtime.

    python -m bench.learner --quick --out learner.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import os
import subprocess
import sys
import tempfile
import time

import orjson

from learner.spec import make_plan
from bench.common import finish, parser, progress
from bus.config import CommonConfig, from_env
from bus.conn import connect
from bus.procs import popen
from bus.server import EmbeddedServer
from bus.subjects import Subjects
from learner.config import ModelConfig
from learner.spec import count_params


async def run(steps: int) -> dict:
    model = from_env(ModelConfig)
    spec = model.spec()
    plan = make_plan(spec, model.num_fragments, model.max_imbalance)
    n, f = count_params(spec), max(plan.sizes)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(store_dir=tmp) as srv:
        env = {**os.environ, "DILOCO_NATS_URL": srv.url, "DILOCO_RUN": "bench", "DILOCO_METRICS_INTERVAL": "0.5",
               "DILOCO_REQUIRE_MEMBERSHIP": "false", "DILOCO_LOG_LEVEL": "warning"}
        latest: dict = {}
        nc = await connect(CommonConfig(nats_url=srv.url, run="bench"), "bench")

        async def on_metrics(m):
            d = orjson.loads(m.data)
            if d.get("role") == "learner":
                latest.update(d)

        await nc.subscribe(Subjects("bench").metrics_all, cb=on_metrics)
        agg = popen([sys.executable, "-m", "diloco.cli", "aggregator"], env=env, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        lrn = popen([sys.executable, "-m", "learner"], stderr=subprocess.DEVNULL, env={
            **env, "DILOCO_LEARNER_ID": "bench-0", "DILOCO_MAX_STEPS": str(steps),
            "DILOCO_TOTAL_STEPS": str(max(steps, 100)), "DILOCO_WARMUP_STEPS": "10"})
        while lrn.poll() is None:
            await asyncio.sleep(0.5)
            if latest:
                progress(f"step {latest.get('step')} loss {latest.get('loss')} rss {latest.get('rss_mib')} MiB")
        wall = time.monotonic() - t0
        await asyncio.sleep(0.5)
        agg.terminate()
        agg.wait(20)
        await nc.close()
    formula = 4 * (5 * n + 2 * f)
    return {"params": n, "largest_fragment": f, "steps": latest.get("step"), "exit_code": lrn.returncode,
            "tokens_per_s": latest.get("tokens_per_s"), "step_seconds_total": latest.get("step_seconds_total"),
            "bytes_sent": latest.get("bytes_sent"), "bytes_received": latest.get("bytes_received"),
            "loss": latest.get("loss"), "peak_rss_mib": latest.get("rss_mib"),
            "formula_state_mib": round(formula / 2**20, 2), "wall_s": round(wall, 1),
            "spec": spec.to_dict()}


def main() -> None:
    a = parser(__doc__.splitlines()[0]).parse_args()
    r = asyncio.run(run(20 if a.quick else 200))
    finish({"bench": "learner", "quick": a.quick, **r}, a.out)


if __name__ == "__main__":
    main()
