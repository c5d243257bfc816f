"""The ``diloco`` command: one entry point, one subcommand per job (the operations layer: it may
import the roles and the bus; they never import it).

Subcommands are looked up lazily (``COMMANDS`` maps a name to ``module:function``) so that
``diloco nats`` does not import JAX. Each function takes the remaining argv and returns an exit
code. Configuration comes from ``DILOCO_*`` environment variables (see ``diloco config``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import signal
import sys
import time

from bus.config import ROLE_CONFIGS, CommonConfig, from_env, markdown_table, sources
from bus.entry import run_command

COMMANDS: dict[str, tuple[str, str]] = {
    "nats": ("diloco.cli:cmd_nats", "run an embedded JetStream nats-server in the foreground"),
    "run": ("diloco.cli:cmd_run", "create a run (streams, version 0, manifest), inspect or delete it"),
    "config": ("diloco.cli:cmd_config", "print a role's effective configuration and its sources"),
    "learner": ("learner.service:main", "run one learner (island)"),
    "aggregator": ("diloco.cli:cmd_aggregator", "run the aggregator (creating a built-in run if there is none)"),
    "monitor": ("monitor.service:main", "run the membership monitor"),
    "eval": ("learner.evaluator:main", "follow global versions and publish held-out loss"),
    "metrics": ("monitor.cli:cmd_metrics", "live table of a run's metrics"),
    "status": ("monitor.status:cmd_status", "one snapshot of a run: membership, versions, streams"),
    "export": ("learner.export:main", "write a run's newest global parameters to an .npz (while it runs)"),
    "up": ("diloco.up:main", "start a whole local run: server, aggregator, monitor, evaluator, learners"),
    "auth": ("diloco.auth:main", "generate NATS accounts, per-role users with least privilege, and TLS material"),
}

ROLE_MODULES = ("learner.config", "aggregator.config", "monitor.config")


def load_role_configs() -> dict[str, type]:
    """Import every role's config module so that ``ROLE_CONFIGS`` lists all variables."""
    for mod in ROLE_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
    return ROLE_CONFIGS


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: diloco COMMAND [args]\n\ncommands:")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<11} {help_}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"diloco: unknown command {name!r} (see diloco --help)", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    mod_name, fn_name = target.split(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except ModuleNotFoundError as e:
        print(f"diloco {name}: not available in this build ({e})", file=sys.stderr)
        return 2
    return run_command(name, fn, rest)


def cmd_nats(argv: list[str]) -> int:
    from bus.server import EmbeddedServer

    p = argparse.ArgumentParser(prog="diloco nats", description=COMMANDS["nats"][1])
    p.add_argument("--port", type=int, default=4222, help="client port (0: a free one)")
    p.add_argument("--http-port", type=int, default=8222, help="monitoring port on 127.0.0.1 (0: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (keep loopback unless auth is on)")
    p.add_argument("--store-dir", default="./nats-data", help="JetStream file store")
    p.add_argument("--max-payload", type=int, default=8 * 1024 * 1024)
    p.add_argument("--config-extra", default="", help="file whose text is appended to the config (auth, TLS)")
    a = p.parse_args(argv)
    extra = open(a.config_extra).read() if a.config_extra else ""
    srv = EmbeddedServer(store_dir=a.store_dir, host=a.host, port=a.port, http_port=a.http_port,
                         max_payload=a.max_payload, extra_config=extra)
    srv.start()
    print(f"nats-server ready: {srv.url} (monitoring {srv.monitor_url}, store {a.store_dir}); Ctrl-C stops it",
          flush=True)
    stop = {"flag": False}

    def on_signal(*_: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        while not stop["flag"] and srv.proc is not None and srv.proc.poll() is None:
            time.sleep(0.2)
    finally:
        srv.stop()
    return 0


def cmd_run(argv: list[str]) -> int:
    import orjson

    from bus.conn import connect
    from bus.streams import delete_run, inspect_run

    p = argparse.ArgumentParser(prog="diloco run", description=COMMANDS["run"][1])
    p.add_argument("action", choices=["create", "inspect", "delete"])
    p.add_argument("--init", metavar="FILE", default=None,
                   help="create: make version 0 from this .npz of named float leaves (`diloco export`'s format, "
                        "or np.savez(f, **{path: array})): a run of your own model. Without it: a run of the "
                        "built-in model (DILOCO_D_MODEL...), version 0 from DILOCO_SEED")
    p.add_argument("--streams-only", action="store_true",
                   help="create: only the streams and buckets, sized for the model (the admin of a run under "
                        "strict auth; the aggregator's credentials then write version 0)")
    a = p.parse_args(argv)
    if (a.init is not None or a.streams_only) and a.action != "create":
        p.error("--init and --streams-only go with create")
    cfg = from_env(CommonConfig)
    from bus.log import setup

    setup(cfg.log_level, run=cfg.run, role="cli")  # logs to stderr: stdout is the JSON result
    from aggregator.config import AggregatorConfig

    provision = from_env(AggregatorConfig).provision  # false: the streams are admin's (strict auth)
    try:  # LimitsTooSmall, a bad --init file: one line, before connecting
        limits, tree = _run_limits(cfg, a.init)
    except ValueError as e:
        print(f"diloco run: {e}", file=sys.stderr)
        return 2

    async def go() -> object:
        nc = await connect(cfg, name=f"cli-run-{a.action}")
        try:
            js = nc.jetstream(timeout=10)
            if a.action == "create":
                from bus.runs import create_tree_run, read_manifest

                out: dict = {}
                if a.streams_only:
                    from bus.streams import ensure_run

                    await ensure_run(js, cfg.run, limits, update=True)
                elif tree is not None:
                    spec, plan, arrays, model = tree
                    out["created"] = await create_tree_run(js, cfg, spec, plan, arrays, model.max_imbalance,
                                                           max_inner_lr=model.max_inner_lr, provision=provision)
                    out["params"], out["fragments"] = spec.num_params, plan.num_fragments
                else:
                    from learner.builtin import create_builtin_run
                    from learner.config import ModelConfig

                    out["created"] = await create_builtin_run(js, cfg, from_env(ModelConfig), provision=provision)
                    m = await read_manifest(js, cfg.run)
                    out["fragments"] = m.num_fragments if m is not None else None
                return {**out, **await inspect_run(js, cfg.run)}
            if a.action == "inspect":
                return await inspect_run(js, cfg.run)
            return {"deleted": await delete_run(js, cfg.run)}
        finally:
            await nc.close()

    code, result = _one_line("diloco run", go)
    if code:
        return code
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0


def _one_line(who: str, go) -> tuple[int, object]:
    """Run ``go()`` (a coroutine function): (0, its result), or an exit code after one line on
    stderr for what a run's creation can meet: a limit too small (2), a server without the
    storage (1), a run that is not this one or not provisioned (3)."""
    from bus.runs import RunMismatch
    from bus.streams import LimitsTooSmall, StorageUnavailable

    try:
        return 0, asyncio.run(go())
    except (LimitsTooSmall, StorageUnavailable, RunMismatch) as e:
        print(f"{who}: {e}", file=sys.stderr)
        return {LimitsTooSmall: 2, StorageUnavailable: 1, RunMismatch: 3}[type(e)], None


def cmd_aggregator(argv: list[str]) -> int:
    """`diloco aggregator`: with DILOCO_MODEL=builtin (default) first create the run of the built-in
    model if it has none (as `diloco run create` would, with the aggregator's own credentials:
    under auth the aggregator writes version 0); then the aggregator, which knows no model and
    merges what the run's manifest describes (``python -m aggregator`` is the aggregator alone)."""
    from aggregator.config import AggregatorConfig
    from aggregator.service import main as aggregator_main
    from learner.config import ModelConfig

    common, model, cfg = from_env(CommonConfig), from_env(ModelConfig), from_env(AggregatorConfig)
    if model.model == "builtin":
        code = create_builtin_if_missing(common, model, provision=cfg.provision, who="diloco aggregator")
        if code:
            return code
    return aggregator_main(argv)


def create_builtin_if_missing(common: CommonConfig, model, *, provision: bool = True, who: str = "diloco") -> int:
    """Create the built-in run of ``model`` unless it exists; 0, or an exit code after one line."""
    from bus.conn import connect
    from bus.log import setup
    from bus.streams import Limits, LimitsTooSmall
    from learner.builtin import builtin_manifest, create_builtin_run

    setup(common.log_level, run=common.run, role="cli")
    try:  # before connecting: a limit too small for the model is a configuration error
        Limits.for_run(common, builtin_manifest(common.run, model)[1].sizes, common.run)
    except LimitsTooSmall as e:
        print(f"{who}: {e}", file=sys.stderr)
        return 2

    async def go() -> None:
        nc = await connect(common, name="create-run")
        try:
            await create_builtin_run(nc.jetstream(timeout=10), common, model, provision=provision)
        finally:
            await nc.close()

    try:
        return _one_line(who, go)[0]
    except Exception as e:
        print(f"{who}: cannot create run {common.run!r} at {common.nats_url}: {e!r}", file=sys.stderr)
        return 1


def _run_limits(cfg: CommonConfig, init: str | None):
    """(stream limits, (tree, plan, arrays, ModelConfig) of ``init`` or None): sized from the
    ``--init`` file's tree, else from the built-in model of the environment."""
    from bus.streams import Limits
    from learner.config import ModelConfig

    model = from_env(ModelConfig)
    if init is None:
        from learner.spec import make_plan

        plan = make_plan(model.spec(), model.num_fragments, model.max_imbalance)
        return Limits.for_run(cfg, plan.sizes, cfg.run), None
    from bus.runs import plan_for
    from bus.tree import Leaf, TreeSpec
    from learner.export import read_params_file

    arrays, dtypes = read_params_file(init)
    spec = TreeSpec(tuple(Leaf(k, tuple(a.shape), dtypes[k]) for k, a in arrays.items()))
    plan = plan_for(spec, model.num_fragments, model.max_imbalance)
    return Limits.for_run(cfg, plan.sizes, cfg.run), (spec, plan, arrays, model)


def cmd_config(argv: list[str]) -> int:
    roles = load_role_configs()
    p = argparse.ArgumentParser(prog="diloco config", description=COMMANDS["config"][1])
    p.add_argument("role", nargs="?", choices=sorted(roles), default="common")
    p.add_argument("--markdown", action="store_true", help="print the table of every variable (for the README)")
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown_table())
        return 0
    rows = sources(CommonConfig) + ([] if a.role == "common" else sources(roles[a.role]))
    seen = set()
    for name, value, src in rows:
        if name in seen:
            continue
        seen.add(name)
        print(f"{name}={value}  # {src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
