"""Long chaos mode: ``python -m tests.chaos.run --trials 30 --out chaos.json`` prints the table
of trials and invariants (for docs/RELIABILITY.md) and the results as one JSON line last."""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

import orjson

from tests.chaos.harness import ChaosRun, table


async def main_async(trials: int, learners: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="diloco-chaos-") as tmp:
        run = ChaosRun(tmp, learners=learners, seed=seed)
        t0 = time.monotonic()
        try:
            await run.setup()
            await run.warm_up()
            print(f"[{time.monotonic() - t0:.0f}s] warmed up", file=sys.stderr, flush=True)
            for i in range(trials):
                t = await run.trial()
                print(f"[{time.monotonic() - t0:.0f}s] trial {i + 1}: {t}", file=sys.stderr, flush=True)
            await run.drain_and_check()
        finally:
            await run.close()
        print(table(run.report), file=sys.stderr)
        return {"trials": [t.__dict__ for t in run.report.trials], "invariants": run.report.invariants,
                "details": run.report.details, "seconds": round(time.monotonic() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--learners", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    res = asyncio.run(main_async(a.trials, a.learners, a.seed))
    data = orjson.dumps(res)
    if a.out:
        open(a.out, "wb").write(data)
    print(data.decode())
    sys.exit(0 if all(res["invariants"].values()) else 1)


if __name__ == "__main__":
    main()
