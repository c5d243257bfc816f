"""The ``diloco`` command: one entry point, one subcommand per job (the operations layer: it may
import the roles and the bus; they never import it).

Subcommands are looked up lazily (``COMMANDS`` maps a name to ``module:function``) so that
``diloco nats`` does not import JAX. Each function takes the remaining argv and returns an exit
code. Configuration comes from ``DILOCO_*`` environment variables (see ``diloco config``).
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import importlib
import signal
import sys
import time

from bus.config import CommonConfig, ConfigError, describe_unknown, from_env, markdown_table, sources, unknown_variables
from bus.entry import EXIT_UNAVAILABLE, EXIT_USAGE, run_command

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
    "trust": ("monitor.trust_cli:cmd_trust", "each learner's trust and its evidence; clear a learner's record"),
    "export": ("learner.export:main", "write a run's newest global parameters to an .npz (while it runs)"),
    "up": ("diloco.up:main", "start a whole local run: server, aggregator, monitor, evaluator, learners"),
    "auth": ("diloco.auth:main", "generate NATS accounts, per-role users with least privilege, and TLS material"),
    "simulate": ("diloco.simulate:main", "before deploying: a configuration's quality vs data-parallel and goodput under failures"),
}

#: The configs each role's command reads besides CommonConfig (what ``diloco config ROLE`` shows):
#: ``diloco aggregator`` reads the model's (DILOCO_MODEL=builtin creates a run of it).
ROLE_READS: dict[str, tuple[str, ...]] = {"learner": ("model", "learner"), "eval": ("model", "learner", "eval"),
                                          "aggregator": ("model", "aggregator")}


def load_role_configs() -> dict[str, type]:
    """Every role's config class by role (:mod:`diloco.config_registry`, imported on first use:
    ``diloco nats`` needs none of them)."""
    from diloco.config_registry import load_role_configs as registry

    return registry()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: diloco COMMAND [args]\n\ncommands:")
        for name, (_, help_) in COMMANDS.items():
            print(f"  {name:<11} {help_}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"diloco: {unknown_command(name)}", file=sys.stderr)
        return EXIT_USAGE
    target, _ = COMMANDS[name]
    mod_name, fn_name = target.split(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except ModuleNotFoundError as e:
        print(f"diloco {name}: not available in this build ({e})", file=sys.stderr)
        return EXIT_USAGE
    from bus.conn import ConnectFailed

    try:
        return run_command(name, fn, rest)
    except ConnectFailed as e:  # the server is not reachable at start: one line naming it, what to check
        print(f"diloco {name}: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE


def unknown_command(name: str) -> str:
    """One line for ``diloco NAME`` with no such command, naming the closest one (``lerner``: learner)."""
    close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown command {name!r}: {hint}(diloco --help lists them)"


def cmd_nats(argv: list[str]) -> int:
    from bus.server import HEAL_MIN_FREE, EmbeddedServer, ServerError, port_taken

    p = argparse.ArgumentParser(prog="diloco nats", description=COMMANDS["nats"][1])
    p.add_argument("--port", type=int, default=4222, help="client port (default: %(default)s; 0: a free one)")
    p.add_argument("--http-port", type=int, default=0,
                   help="monitoring port on 127.0.0.1 (default: 0, a free one, printed in the ready line, so "
                        "that two servers on one machine do not collide; nats-server's usual is 8222)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (keep loopback unless auth is on)")
    p.add_argument("--store-dir", default="./nats-data", help="JetStream file store")
    p.add_argument("--max-payload", type=int, default=8 * 1024 * 1024)
    p.add_argument("--config-extra", default="", help="file whose text is appended to the config (auth, TLS)")
    p.add_argument("--log-file", default=None, help="nats-server's own log (default: discarded)")
    p.add_argument("--heal-min-free-mib", type=int, default=HEAL_MIN_FREE // 2**20,
                   help="after a full disk, restart the server (its streams cannot write until then) once "
                        "this many MiB are free in --store-dir")
    a = p.parse_args(argv)
    try:
        extra = open(a.config_extra).read() if a.config_extra else ""
    except OSError as e:
        print(f"diloco nats: --config-extra: {e}", file=sys.stderr)
        return 2  # a bad argument
    for flag, host, port in (("--port", a.host, a.port), ("--http-port", "127.0.0.1", a.http_port)):
        if port and port_taken(host, port):
            print(f"diloco nats: {flag} {port}: {host}:{port} is in use (another nats-server?): "
                  f"pass another {flag}, or {flag} 0 for a free one", file=sys.stderr)
            return 2  # a bad argument: nothing was started
    srv = EmbeddedServer(store_dir=a.store_dir, host=a.host, port=a.port, http_port=a.http_port,
                         max_payload=a.max_payload, extra_config=extra, log_file=a.log_file,
                         heal_min_free=a.heal_min_free_mib * 2**20)
    stop = {"flag": False}

    def on_signal(*_: object) -> None:
        stop["flag"] = True

    # before the server starts: a signal at any instant ends in close(), which removes the temp config dir
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        try:
            srv.start()
        except ServerError as e:
            print(f"diloco nats: {e}", file=sys.stderr)
            return 1
        print(f"nats-server ready: {srv.url} (monitoring {srv.monitor_url}, store {a.store_dir}); Ctrl-C stops it",
              flush=True)
        checked = time.monotonic()
        while not stop["flag"] and srv.proc is not None and srv.proc.poll() is None:
            time.sleep(0.2)
            if time.monotonic() - checked >= 2.0:  # a full disk: restart once space is back
                checked = time.monotonic()
                if line := srv.heal_store():
                    print(line, flush=True)
    finally:
        srv.close()  # stops it and removes its temp config dir (the store in --store-dir stays)
    return 0


def cmd_run(argv: list[str]) -> int:
    import orjson

    from bus.conn import REFUSED_GRACE, connect
    from bus.streams import delete_run, inspect_run, reserved_total

    p = argparse.ArgumentParser(prog="diloco run", description=COMMANDS["run"][1],
                                epilog="list: every run on the server (by its stream names) with the bytes it stores "
                                       "and reserves; the server reserves each stream's max_bytes when it is "
                                       "created, and delete (DILOCO_RUN=<run>) frees them")
    p.add_argument("action", choices=["create", "inspect", "delete", "list"])
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

    log = setup(cfg.log_level, run=cfg.run, role="cli")  # logs to stderr: stdout is the JSON result
    from aggregator.config import AggregatorConfig

    provision = from_env(AggregatorConfig).provision  # false: the streams are admin's (strict auth)
    limits, tree = None, None
    if a.action == "create":  # only a creation sizes streams
        try:  # LimitsTooSmall, a bad --init file: one line, before connecting
            limits, tree = _run_limits(cfg, a.init)
        except ValueError as e:
            print(f"diloco run: {e}", file=sys.stderr)
            return 2

    async def go() -> object:
        nc = await connect(cfg, name=f"cli-run-{a.action}", refused_grace=REFUSED_GRACE)
        try:
            js = nc.jetstream(timeout=10)
            if a.action == "create":
                from bus.runs import create_tree_run, read_manifest

                out: dict = {}
                if a.streams_only:
                    from bus.streams import ensure_run

                    assert limits is not None  # sized before connecting
                    await ensure_run(js, cfg.run, limits, update=True)
                elif tree is not None:
                    spec, plan, arrays, model = tree
                    out["created"] = await create_tree_run(js, cfg, spec, plan, arrays, model.max_imbalance,
                                                           max_inner_lr=model.max_inner_lr, provision=provision,
                                                           log=log)
                    out["params"], out["fragments"] = spec.num_params, plan.num_fragments
                else:
                    from learner.builtin import create_builtin_run
                    from learner.config import ModelConfig

                    out["created"] = await create_builtin_run(js, cfg, from_env(ModelConfig), provision=provision,
                                                              log=log)
                    m = await read_manifest(js, cfg.run)
                    out["fragments"] = m.num_fragments if m is not None else None
                streams = await inspect_run(js, cfg.run)
                return {**out, **streams, "reserved_bytes": reserved_total(streams)}
            if a.action == "inspect":
                streams = await inspect_run(js, cfg.run)
                return {**streams, "reserved_bytes": reserved_total(streams)}
            if a.action == "list":
                return await _run_list(js)
            return {"deleted": await delete_run(js, cfg.run)}
        finally:
            await nc.close()

    code, result = _one_line("diloco run", go)
    if code:
        return code
    print(orjson.dumps(result, option=orjson.OPT_INDENT_2).decode())
    return 0


async def _run_list(js) -> dict:
    """`diloco run list`: every run on the server (``bus.streams.list_runs``) and the account's
    JetStream storage (used, and its limit where the account has one; -1: the server's)."""
    from bus.streams import list_runs

    out = await list_runs(js)
    try:
        info = await js.account_info()
        out["account"] = {"storage_bytes": info.storage, "streams": info.streams,
                          "max_storage_bytes": getattr(info.limits, "max_storage", -1)}
    except Exception as e:  # noqa: BLE001 - a user without the right: the runs alone
        out["account"] = {"error": repr(e)}
    return out


def _one_line(who: str, go) -> tuple[int, object]:
    """Run ``go()`` (a coroutine function): (0, its result), or an exit code after one line on
    stderr for what a run's creation can meet: a limit too small (2), a server without the
    storage (1), a run that is not this one or not provisioned (3), a server out of reach (4)."""
    from bus.conn import ConnectFailed
    from bus.runs import RunMismatch
    from bus.streams import LimitsTooSmall, StorageUnavailable

    try:
        return 0, asyncio.run(go())
    except (LimitsTooSmall, StorageUnavailable, RunMismatch) as e:
        print(f"{who}: {e}", file=sys.stderr)
        return {LimitsTooSmall: 2, StorageUnavailable: 1, RunMismatch: 3}[type(e)], None
    except ConnectFailed as e:  # the server is not reachable: the URL and what to check
        print(f"{who}: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE, None


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
    from diloco.hub import monitor_companions

    try:
        companions = monitor_companions(cfg)  # the embedded monitor (DILOCO_EMBEDDED_MONITOR)
    except ConfigError as e:
        print(f"diloco aggregator: {e}", file=sys.stderr)
        return 2
    return aggregator_main(argv, companions=companions)


#: Seconds `diloco aggregator` (and `diloco run create`) retry creating a run while JetStream does
#: not answer, before one line and exit 1.
RUN_CREATE_WAIT_S = 60.0


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

    async def create(nc) -> bool:
        """Again while the server's JetStream does not answer in time (a just-started server on a loaded
        machine timed a stream's creation out and `diloco aggregator` exited: test_compose, once
        in an idle suite), for at most RUN_CREATE_WAIT_S; every step is safe to repeat. Each retry
        says what still answers (:func:`bus.conn.probe`: the server's ping, JetStream's info of the
        run's GLOBAL stream): seen once in CI, 60 s of JetStream silence, cause unknown."""
        import asyncio
        import time

        from nats.errors import TimeoutError as NatsTimeout
        from nats.js.errors import ServiceUnavailableError

        from bus.conn import probe
        from bus.log import get_logger
        from bus.subjects import GLOBAL, Subjects

        t_end, delay = time.monotonic() + RUN_CREATE_WAIT_S, 0.5
        while True:
            try:
                return await create_builtin_run(nc.jetstream(timeout=10), common, model, provision=provision)
            except (NatsTimeout, ServiceUnavailableError, asyncio.TimeoutError) as e:  # not "no responders":
                if time.monotonic() + delay > t_end:  # a server without JetStream fails at once
                    raise
                seen = await probe(nc, Subjects(common.run).stream(GLOBAL))
                get_logger(component="cli").warning("run_create_retry", error=repr(e), retry_in_s=delay, **seen)
                await asyncio.sleep(delay)
                delay = min(5.0, 2 * delay)

    async def go() -> None:
        nc = await connect(common, name="create-run")
        try:
            if await create(nc):
                from bus.log import get_logger

                get_logger(component="cli").info(
                    "builtin_run_created", hint="DILOCO_MODEL=builtin (the default): islands of your own model "
                    "cannot join this run; for them delete it (`diloco run delete`) and start the aggregator with "
                    "DILOCO_MODEL=run")
        finally:
            await nc.close()

    try:
        return _one_line(who, go)[0]
    except Exception as e:
        from bus.conn import redact_url

        print(f"{who}: cannot create run {common.run!r} at {redact_url(common.nats_url)}: {e!r}", file=sys.stderr)
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
    """``diloco config ROLE``: every variable the role's command reads, with its effective value and
    source; then the unknown ``DILOCO_*`` variables (typos), a warning each, exit 2 under
    DILOCO_STRICT_ENV. A bad value: one line, exit 2."""
    roles = load_role_configs()
    p = argparse.ArgumentParser(prog="diloco config", description=COMMANDS["config"][1])
    p.add_argument("role", nargs="?", choices=sorted(roles), default="common")
    p.add_argument("--markdown", action="store_true", help="print the table of every variable (docs/configuration.md)")
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown_table())
        return 0
    rows = sources(CommonConfig)
    for role in ROLE_READS.get(a.role, () if a.role == "common" else (a.role,)):
        rows += sources(roles[role])
    seen = set()
    for name, value, src in rows:
        if name in seen:
            continue
        seen.add(name)
        note = ""
        if name == "DILOCO_MODEL" and value == "builtin" and a.role == "aggregator":
            note = ("; `diloco aggregator` creates a run of the built-in model if DILOCO_RUN has none: "
                    "for your own model (islands, `diloco run create --init`) set DILOCO_MODEL=run")
        print(f"{name}={value}  # {src}{note}")
    unknown = unknown_variables()
    for name, closest in unknown:
        print(f"diloco config: {describe_unknown(name, closest)}: ignored by every role", file=sys.stderr)
    if unknown and from_env(CommonConfig).strict_env:
        print("diloco config: DILOCO_STRICT_ENV is true: every role refuses to start with these", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
