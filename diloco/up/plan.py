"""``diloco up``: its arguments, the model presets and launcher defaults, and every child process's
environment (:class:`ProcSpec`), checked before anything starts (:func:`validate_envs`). Pure but
for reading the env files of the credentials (:func:`with_credentials`).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any

from bus.config import CommonConfig, ConfigError, from_env, preset_values
from bus.presets import MODEL_PRESETS
from learner.config import LearnerConfig, ModelConfig, auto_inner_lr

# -- presets and defaults (pure) --------------------------------------------------------------------

#: Model presets (``--model-preset``): the bus's, which every role reads as DILOCO_MODEL_PRESET.
PRESETS = MODEL_PRESETS

#: Bandwidth presets (``--preset``): DILOCO_* values for every process. ``lean``: sparse 2-bit outer
#: gradients up (the 64 largest of each 4096 values, error feedback decayed by 0.95), each global version chained
#: against the previous one down (the 256 largest of each 4096 changes, 4 bits), outer SGD at lr 1
#: (error feedback stands in for the outer momentum, and the merged update stays sparse).
#: Measured in docs/BENCHMARKS.md ("Compression frontier", "The lean preset").
BANDWIDTH_PRESETS: dict[str, dict[str, str]] = {
    "default": {},
    "lean": {"DILOCO_QUANTISER": "topk2", "DILOCO_TOPK_CHUNK": "4096", "DILOCO_TOPK_K": "64",
             "DILOCO_FEEDBACK_DECAY": "0.95",
             "DILOCO_DOWNLINK_CHAIN": "true", "DILOCO_DOWNLINK_QUANTISER": "topk4", "DILOCO_DOWNLINK_TOPK_K": "256",
             "DILOCO_OUTER_LR": "1.0", "DILOCO_OUTER_MOMENTUM": "0"},
}

#: Inner steps per learner when neither --steps nor DILOCO_MAX_STEPS/DILOCO_TOTAL_STEPS is given.
DEFAULT_STEPS = {"tiny": 1000, "small": 500, "default": 200}
QUICK_STEPS = 1000

#: Launcher defaults for every process (the caller's environment overrides them).
RUN_DEFAULTS: dict[str, str] = {
    "DILOCO_RUN": "up",
    "DILOCO_METRICS_INTERVAL": "1.0",
    "DILOCO_EVAL_INTERVAL": "4.0",
    # several JAX processes share few cores here: a learner's heartbeats can be late by a step
    "DILOCO_SUSPECT_AFTER": "6.0",
    "DILOCO_EVICT_AFTER": "20.0",
    "DILOCO_MANIFEST_TIMEOUT": "120.0",
    # int8 deltas against fp32 keyframes: a quarter of the downlink, no measured loss (docs/BENCHMARKS.md)
    "DILOCO_DOWNLINK_QUANTISER": "int8",
}

#: DILOCO_REGION of the aggregator, monitor and evaluator (they connect to the hub server).
CENTRAL_REGION = "hub"


@dataclass(frozen=True)
class ProcSpec:
    """One child process: its name (log file stem), role, region (None: central) and environment."""

    name: str
    role: str
    region: str | None
    env: dict[str, str]
    learner_id: str | None = None

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "diloco.cli", self.role]


def learner_ids(n: int, regions: list[str]) -> list[tuple[str, str]]:
    """(learner id, region) for n learners spread round-robin: us-0, eu-0, us-1, eu-1, ..."""
    return [(f"{regions[k % len(regions)]}-{k // len(regions)}", regions[k % len(regions)]) for k in range(n)]


def parse_regions(text: str) -> list[str]:
    from bus.subjects import check_token

    regions = [r.strip() for r in text.split(",") if r.strip()]
    if not regions:
        raise ValueError("--regions: expected a comma-separated list like us,eu")
    for r in regions:
        check_token("region", r)
    if len(set(regions)) != len(regions):
        raise ValueError(f"--regions {text!r}: regions must be distinct")
    return regions


#: XLA flags for JAX children when more JAX processes than cores share the machine: one thread each
#: (measured here: 0.34 s per default-model step single-threaded vs 0.40 s with XLA's thread pool, and
#: far less contention with 4 learners and an evaluator on 2 cores).
SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def resolve_steps(environ: dict[str, str], preset: str, steps: int | None, quick: bool) -> int:
    """--steps, else DILOCO_MAX_STEPS, else DILOCO_TOTAL_STEPS, else the preset's default."""
    if steps is not None:
        return steps
    for name in ("DILOCO_MAX_STEPS", "DILOCO_TOTAL_STEPS"):
        given = (environ.get(name) or "").strip()
        if given.isdigit() and int(given) > 0:
            return int(given)
    return QUICK_STEPS if quick else DEFAULT_STEPS[preset]


def base_env(environ: dict[str, str], preset: str, steps: int | None, quick: bool, n_learners: int = 4,
             cpu_count: int | None = None, bandwidth: str = "default") -> dict[str, str]:
    """Settings shared by every process: presets (model, bandwidth) and launcher defaults, then the
    caller's DILOCO_* env, then the explicit step count. Non-DILOCO variables (PATH, JAX_*,
    XLA_FLAGS...) pass through."""
    env = dict(environ)
    defaults = dict(RUN_DEFAULTS)
    defaults.update(PRESETS[preset])
    defaults.update(BANDWIDTH_PRESETS[bandwidth])
    if quick:
        defaults["DILOCO_EVAL_INTERVAL"] = "2.0"
    for k, v in defaults.items():
        env.setdefault(k, v)
    env["DILOCO_MODEL_PRESET"] = preset  # what the flag said, not a DILOCO_MODEL_PRESET of the caller's
    n = resolve_steps(environ, preset, steps, quick)
    env["DILOCO_MAX_STEPS"] = str(n)
    total = (environ.get("DILOCO_TOTAL_STEPS") or "").strip()
    if steps is not None or not (total.isdigit() and int(total) >= n):
        env["DILOCO_TOTAL_STEPS"] = str(n)  # the cosine schedule ends with the run
    # the run declares its peak inner learning rate (it bounds one outer gradient's norm): the
    # learners' own (DILOCO_INNER_LR, or the built-in model's default by its width, inner optimizer
    # and learners), unless the caller declares one
    try:
        lr = float(env.get("DILOCO_INNER_LR") or 0)
        if lr <= 0:
            d_model = int(env.get("DILOCO_D_MODEL") or ModelConfig.__dataclass_fields__["d_model"].default)
            optimizer = (env.get("DILOCO_INNER_OPTIMIZER") or LearnerConfig.__dataclass_fields__["inner_optimizer"].default)
            lr = auto_inner_lr(d_model, optimizer, n_learners)
        env.setdefault("DILOCO_MAX_INNER_LR", repr(lr))
    except ValueError:
        pass  # a bad DILOCO_INNER_LR, DILOCO_D_MODEL or DILOCO_INNER_OPTIMIZER is reported under its own name
    cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    if "XLA_FLAGS" not in environ and n_learners + 1 > cpus:
        env["XLA_FLAGS"] = SINGLE_THREAD_XLA
    return env


def plan_processes(env: dict[str, str], n_learners: int, regions: list[str]) -> list[ProcSpec]:
    """Every child of a run with its environment (NATS URLs are filled in by :func:`with_urls`)."""
    procs = [
        ProcSpec("aggregator", "aggregator", None,
                 {"DILOCO_EMBEDDED_MONITOR": "false",  # the run has a monitor process of its own
                  **env, "DILOCO_REGION": CENTRAL_REGION, "DILOCO_AGGREGATOR_ID": env.get("DILOCO_AGGREGATOR_ID", "agg-0")}),
        ProcSpec("monitor", "monitor", None,
                 {**env, "DILOCO_REGION": CENTRAL_REGION, "DILOCO_MONITOR_ID": env.get("DILOCO_MONITOR_ID") or "monitor-0"}),
        ProcSpec("evaluator", "eval", None,
                 {**env, "DILOCO_REGION": CENTRAL_REGION, "DILOCO_EVAL_ID": env.get("DILOCO_EVAL_ID", "eval-0")}),
    ]
    for k, (lid, region) in enumerate(learner_ids(n_learners, regions)):
        procs.append(ProcSpec(f"learner-{lid}", "learner", region, {
            **env, "DILOCO_REGION": region, "DILOCO_LEARNER_ID": lid, "DILOCO_NUM_LEARNERS": str(n_learners),
            "DILOCO_SHARD_INDEX": str(k), "DILOCO_NUM_SHARDS": str(n_learners)}, learner_id=lid))
    return procs


def with_urls(procs: list[ProcSpec], url_for) -> list[ProcSpec]:
    return [ProcSpec(p.name, p.role, p.region, {**p.env, "DILOCO_NATS_URL": url_for(p.region)}, p.learner_id)
            for p in procs]


#: The diloco.auth user each role process connects as (learners: ``learner-<id>``).
ROLE_USERS = {"aggregator": "aggregator", "monitor": "monitor", "eval": "evaluator"}


def user_of(spec: ProcSpec) -> str:
    """The NATS user of ``spec`` in the credentials ``diloco.auth.init`` generates."""
    if spec.role == "learner":
        return f"learner-{spec.learner_id}"
    return ROLE_USERS[spec.role]


def with_credentials(procs: list[ProcSpec], env_files: dict[str, Any]) -> list[ProcSpec]:
    """Each process with its user's env file (``DILOCO_NATS_USER``/``PASSWORD``, ...) merged into its env."""
    from bus.config import parse_env_file

    out = []
    for p in procs:
        with open(env_files[user_of(p)]) as f:
            creds = parse_env_file(f.read())
        out.append(ProcSpec(p.name, p.role, p.region, {**p.env, **creds}, p.learner_id))
    return out


def auth_enabled(a: argparse.Namespace) -> bool:
    """Credentials for this launch: on by default (either topology), off with --no-auth."""
    return not a.no_auth


def validate_envs(procs: list[ProcSpec]) -> None:
    """Parse every process's configuration now, so a bad variable stops the launcher, not a child."""
    from diloco.cli import load_role_configs

    roles = load_role_configs()
    need = {"aggregator": ("model", "aggregator"), "monitor": ("monitor",), "eval": ("model", "learner", "eval"),
            "learner": ("model", "learner")}
    for p in procs:
        common = from_env(CommonConfig, p.env)
        for r in need[p.role]:
            if r in roles:
                from_env(roles[r], p.env)
        if p.role == "aggregator" and "model" in roles:  # the streams must hold the model's versions
            from bus.streams import Limits, LimitsTooSmall
            from learner.spec import make_plan

            model = from_env(roles["model"], p.env)
            try:
                Limits.for_run(common, make_plan(model.spec(), model.num_fragments, model.max_imbalance).sizes,
                               common.run)
            except LimitsTooSmall as e:
                raise ConfigError(str(e)) from None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="diloco up",
        description="Start a whole local run: NATS server(s), aggregator, monitor, evaluator and N learners as "
                    "separate processes; show progress; stop everything at the end or on Ctrl-C; write "
                    "OUT/summary.json and OUT/eval_loss.png. DILOCO_* variables in the environment are honoured "
                    "(see `diloco config ROLE`).")
    p.add_argument("--learners", type=int, default=4, help="number of learners (default 4)")
    p.add_argument("--regions", default="us,eu", help="comma-separated region names the learners are spread over")
    p.add_argument("--steps", type=int, default=None,
                   help="inner steps per learner (default: DILOCO_MAX_STEPS, else 200 for the default model, "
                        f"{QUICK_STEPS} with --quick)")
    p.add_argument("--out", default="./diloco-out", help="output folder: logs, store, summary.json, eval_loss.png")
    p.add_argument("--topology", choices=("single", "leaf"), default="single",
                   help="single: one server; leaf: a hub (JetStream; aggregator, monitor, evaluator) plus one "
                        "leaf-node server per region (its learners), each with the run's account and users, the "
                        "leaf links bound to that account (unless --no-auth)")
    p.add_argument("--no-auth", action="store_true",
                   help="anonymous access to the server(s), as before auth existed. Default (either topology): "
                        "generate one least-privilege user per role and per learner into OUT/auth (diloco auth, "
                        "new passwords every launch), start the server(s) with those accounts only and give each "
                        "process its user's credentials; the launcher reads as the metrics user")
    p.add_argument("--model-preset", choices=sorted(PRESETS), default=None,
                   help="tiny | small | default (default: DILOCO_MODEL_PRESET, else default, or tiny with --quick); "
                        "DILOCO_* overrides win")
    p.add_argument("--preset", choices=sorted(BANDWIDTH_PRESETS), default="default",
                   help="bandwidth preset: default, or lean (sparse 2-bit outer gradients up, chained sparse "
                        "4-bit versions down, outer SGD: docs/BENCHMARKS.md); DILOCO_* overrides win")
    p.add_argument("--quick", action="store_true", help="tiny model and few steps: a demo in about 25 s (2 CPU cores)")
    p.add_argument("--run", default=None, help="run id (default: DILOCO_RUN, else 'up')")
    p.add_argument("--progress", choices=("auto", "table", "line", "none"), default="auto",
                   help="live view: a redrawn table (auto on a terminal), one line per interval, or nothing")
    p.add_argument("--progress-interval", type=float, default=None, help="seconds between progress updates")
    p.add_argument("--initial-eval-timeout", type=float, default=180.0,
                   help="seconds to wait for the evaluator's first loss before starting learners")
    p.add_argument("--final-timeout", type=float, default=60.0,
                   help="seconds to wait, after the learners finished, for the last merges and evaluation")
    p.add_argument("--stop-timeout", type=float, default=20.0, help="seconds a process gets after SIGTERM")
    a = p.parse_args(argv)
    if a.learners < 1:
        p.error("--learners must be >= 1")
    if a.steps is not None and a.steps < 1:
        p.error("--steps must be >= 1")
    try:
        a.regions = parse_regions(a.regions)
    except ValueError as e:
        p.error(str(e))
    if a.model_preset is None and "DILOCO_MODEL_PRESET" in os.environ:  # the roles' variable: one name for both
        try:
            a.model_preset = preset_values(os.environ)[0]
        except ConfigError as e:
            p.error(str(e))
    a.model_preset = a.model_preset or ("tiny" if a.quick else "default")
    return a
