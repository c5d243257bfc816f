"""Robust merges on a clean run: is clip or trim free in quality? And what does one hostile vector cost?

Runs of the chaos test's tiny JAX model (3 learners x ``--steps`` inner steps, real processes on a
fresh embedded server, the aggregator's defaults plus the merge under test), no faults, and the
final held-out loss of the global model once every learner finished:

* ``none``: the default merge (RDA) with the always-on bounded influence (norm caps);
* ``clip``: robust=clip on top (every vector in a merge clipped to the merge's median norm);
* ``trim``: robust=trim (coordinate-wise trimmed mean; needs DILOCO_MERGE=mean);
* ``hostile``: the default merge with the hostile volleys of tests/test_hostile_gradient.py.

Each variant runs ``--repeats`` times, interleaved (none, clip, trim, hostile, none, ...), so
that the machine's load drifts over all of them alike. The spread of the ``none`` runs is the noise.

    python -m bench.robust --quick --out robust.json
    python -m bench.robust --repeats 3 --out robust.json
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import asyncio
import statistics
import tempfile

from bench.common import finish, parser, progress

VARIANTS = {"none": {}, "clip": {"DILOCO_ROBUST": "clip"},
            "trim": {"DILOCO_ROBUST": "trim", "DILOCO_MERGE": "mean"}, "hostile": {}}


async def main_async(repeats: int, steps: int) -> dict:
    from tests.test_hostile_gradient import _run  # the same runs as the system test

    losses: dict[str, list[float]] = {k: [] for k in VARIANTS}
    for r in range(repeats):
        for name, env in VARIANTS.items():
            with tempfile.TemporaryDirectory(prefix="diloco-robust-") as tmp:
                res = await _run(tmp, attack=name == "hostile", agg_env=env, steps=steps)
            losses[name].append(round(res["final"], 4))
            progress(f"repeat {r + 1} {name}: final held-out loss {res['final']:.3f}")
    mean = {k: round(statistics.fmean(v), 4) for k, v in losses.items()}
    base = mean["none"]
    return {"steps": steps, "repeats": repeats, "final_loss": losses, "mean": mean,
            "relative_to_none": {k: round(v / base - 1, 4) for k, v in mean.items()},
            "noise_none": round((max(losses["none"]) - min(losses["none"])) / base, 4) if repeats > 1 else None}


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=1500)
    a = p.parse_args()
    repeats = 1 if a.quick else a.repeats
    steps = 600 if a.quick else a.steps
    finish(asyncio.run(main_async(repeats, steps)), a.out)


if __name__ == "__main__":
    main()
