"""Collaboration never hurts a user's model: 2 islands x N steps against 1 island alone x N steps.

For each example of the repository (``examples/regression.py``: an MLP regressing a function of its
own data; ``examples/digits.py``: an MLP classifying scikit-learn's digits, each island its own shard
of the training images), with the project's defaults (learner: H, P, int8 outer gradients with error
feedback, rebase, fetch per round; aggregator: K = every active learner, mean merge, outer Nesterov
lr 0.7 / momentum 0.5 once per round) and each example's own inner optimizer (AdamW 3e-3):

- ``alone``: one island alone, N steps on its own data (the run then holds only its work);
- ``two``: two islands, N steps each, each on its own data;
- ``plain_n`` / ``plain_2n``: one process without any island, N steps on island 0's data / 2N steps
  on both islands' data (the same examples ``two`` saw, one after the other).

The runs are the in-process reference (``simulation.reference``: the services' own pure functions on a
virtual clock, deterministic per seed; ``bench.fidelity`` holds the system to it), so a difference is
the algorithm's, not the machine's load. ``two_vs_alone`` = two / alone - 1 (<= 0: collaborating did
not hurt; ``tests/test_collab.py`` checks it), ``two_vs_plain_2n`` = two / plain_2n - 1 (what the
outer loop costs against training on all the data in one place).

    python -m bench.collab --quick          (N = 200, under a minute)
    python -m bench.collab --out collab.json   (N = 600 for the regression, 500 for the digits)
"""

from __future__ import annotations

if __package__ in (None, ""):  # `python bench/NAME.py` as well as `python -m bench.NAME`
    import sys as _sys
    from pathlib import Path as _Path
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import importlib.util
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.common import finish, parser, progress
from simulation.reference import RefConfig, TreeSetup, run_reference

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LR = 3e-3


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def regression_setup(cfg: RefConfig, pooled: bool = False) -> TreeSetup:
    """examples/regression.py: island m draws from its own generated data (seed 100 + m); ``pooled``:
    one learner drawing from both islands' data in turn."""
    import optax

    reg = _example("regression")
    opt = optax.adamw(LR, weight_decay=0.0)
    hx, hy = reg.make_data(12345, 1024)

    def batches(m: int):
        if not pooled:
            return reg.batches(100 + m, 64)
        a, b = reg.batches(100, 64), reg.batches(101, 64)
        return (next(a) if i % 2 == 0 else next(b) for i in range(10**12))

    return TreeSetup(cfg, reg.init_params(), reg.make_train_step(opt), lambda p: opt.init(reg.trainable(p)), batches,
                     lambda p: reg.loss_fn(reg.trainable(p), hx, hy), tokens_per_step=64, max_inner_lr=LR)


def digits_setup(cfg: RefConfig, pooled: bool = False) -> TreeSetup:
    """examples/digits.py: island m trains on shard m of 2 of the training images; ``pooled``: one
    learner on all of them."""
    import optax

    dg = _example("digits")
    opt = optax.adamw(LR, weight_decay=0.0)
    train, (hx, hy) = dg.load()

    def batches(m: int):
        if pooled:
            return dg.batches(train, seed=100, batch=32)
        return dg.batches(dg.shard(train, m, 2), seed=100 + m, batch=32)

    return TreeSetup(cfg, dg.init_params(), dg.make_train_step(opt), opt.init, batches,
                     lambda p: dg.loss_fn(p, hx, hy), tokens_per_step=32, max_inner_lr=LR)


#: example -> (setup, default N, the outer settings its script gives its Island: regression.py passes
#: sync_every=20 and num_fragments=4, digits.py nothing)
SETUPS = {"regression": (regression_setup, 600, {"H": 20, "P": 4}), "digits": (digits_setup, 500, {})}


def compare(name: str, steps: int, **overrides) -> dict:
    """The four runs of one example (module docstring); ``overrides``: RefConfig fields (none: the
    defaults)."""
    make, _, own = SETUPS[name]
    base = RefConfig(mode="decoupled", M=1, steps=steps, eval_points=4, **{**own, **overrides})
    out: dict = {"example": name, "steps": steps, "settings": {**own, **overrides}}
    t0 = time.monotonic()
    out["alone"] = run_reference(base, make(base))["eval_loss"]
    two = replace(base, M=2)
    r = run_reference(two, make(two))
    out["two"], out["two_rejected"] = r["eval_loss"], r["rejected"]
    n = replace(base, mode="dp")
    out["plain_n"] = run_reference(n, make(n))["eval_loss"]
    n2 = replace(base, mode="dp", steps=2 * steps)
    out["plain_2n"] = run_reference(n2, make(n2, pooled=True))["eval_loss"]
    out["two_vs_alone"] = out["two"] / out["alone"] - 1
    out["two_vs_plain_n"] = out["two"] / out["plain_n"] - 1
    out["two_vs_plain_2n"] = out["two"] / out["plain_2n"] - 1
    out["wall_s"] = round(time.monotonic() - t0, 1)
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="N (default: 600 regression, 500 digits; --quick 200)")
    p.add_argument("--examples", default="regression,digits")
    a = p.parse_args()
    rows = []
    for name in a.examples.split(","):
        steps = a.steps or (200 if a.quick else SETUPS[name][1])
        r = compare(name, steps)
        progress(f"{name} N={steps}: alone {r['alone']:.5f}, two {r['two']:.5f} ({r['two_vs_alone']:+.1%}), plain N "
                 f"{r['plain_n']:.5f}, plain 2N {r['plain_2n']:.5f} ({r['two_vs_plain_2n']:+.1%} for two) "
                 f"[{r['wall_s']} s]")
        rows.append(r)
    finish({"bench": "collab", "quick": a.quick, "examples": rows,
            "worst_two_vs_alone": max(r["two_vs_alone"] for r in rows)}, a.out)


if __name__ == "__main__":
    main()
