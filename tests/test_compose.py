"""compose.yaml and the Dockerfile, without a Docker engine.

First the one-shot ``auth`` service's command (``diloco auth init --keep``, which writes the run's
credentials into the ``diloco-auth`` volume on the first start) runs with its ``--out`` in a temp
dir. The structure is checked from the parsed YAML; then every service is run the way compose
would run it: the ``nats`` service's command (the real nats-server binary with the generated
``/auth/nats-server.conf``, the ``/auth`` volume mapped to a copy of the generated folder, ``/data``
and the ports to temp/free loopback ones) and every other service's ``command`` with its
``environment`` as local processes (``DILOCO_ENV_FILE`` mapped to the generated folder: each process
reads its own credentials from it), the ``nats`` hostname in ``DILOCO_NATS_URL`` mapped to that
server. Only where the compose values would be too slow for a test (the default model, 1000 steps,
10 s evaluations) are they overridden: ``TEST_OVERRIDES``.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from bus.server import find_binary, free_port, validate_config_file

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"

#: Shrinks the run for a 2-core test machine (applied to every diloco service alike, so the model
#: variables still agree): tiny model, 1000 steps, fast metrics and evaluations. The learners must
#: outlive the start of the metrics tool, which the test spawns once a learner reports a step and
#: which takes 2-3 s to subscribe: 400 steps (about 2.5 s of training) lost that race in one CI run
#: ("0 learners" in the snapshot).
TEST_OVERRIDES = {
    "DILOCO_D_MODEL": "32", "DILOCO_N_LAYERS": "2", "DILOCO_N_HEADS": "2", "DILOCO_D_FF": "64",
    "DILOCO_SEQ_LEN": "32", "DILOCO_NUM_FRAGMENTS": "4", "DILOCO_BATCH_SIZE": "8", "DILOCO_SYNC_EVERY": "12",
    "DILOCO_INNER_LR": "0.003", "DILOCO_MAX_INNER_LR": "0.003", "DILOCO_MAX_STEPS": "1000", "DILOCO_TOTAL_STEPS": "1000", "DILOCO_WARMUP_STEPS": "20",
    "DILOCO_EVAL_INTERVAL": "1.0", "DILOCO_METRICS_INTERVAL": "0.5", "DILOCO_MANIFEST_TIMEOUT": "60",
    # five JAX processes share 2 cores here (in compose each container would get its own cores)
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
}
MODEL_VARS = ("DILOCO_D_MODEL", "DILOCO_N_LAYERS", "DILOCO_N_HEADS", "DILOCO_D_FF", "DILOCO_SEQ_LEN",
              "DILOCO_NUM_FRAGMENTS", "DILOCO_SEED", "DILOCO_TIED_EMBEDDINGS", "DILOCO_MAX_IMBALANCE",
              "DILOCO_MAX_INNER_LR", "DILOCO_MAX_BATCH_SIZE")


AUTH_MOUNT = "/auth"
AUTH_VOLUME = "diloco-auth"
SETUP_SERVICES = ("nats", "auth")  # the server and the one-shot credentials; the rest run diloco roles


def auth_argv(compose: dict, out: Path) -> list[str]:
    """The auth service's command as a local process, its ``--out`` (the volume) at ``out``."""
    cmd = list(compose["services"]["auth"]["command"])
    i = cmd.index("--out")
    assert cmd[i + 1] == AUTH_MOUNT, cmd
    cmd[i + 1] = str(out)
    return local_argv(cmd)


def run_auth_service(compose: dict, out: Path) -> subprocess.CompletedProcess:
    p = subprocess.run(auth_argv(compose, out), capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")})
    assert p.returncode == 0, p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def auth_dir(compose, tmp_path_factory) -> Path:
    """The ``diloco-auth`` volume as the auth service's first start writes it (in a temp dir)."""
    out = tmp_path_factory.mktemp("volume") / "auth"
    run_auth_service(compose, out)
    return out


def user_of(svc: dict) -> str:
    """The diloco.auth user a service must run as."""
    role = role_of(svc)
    if role == "learner":
        return f"learner-{svc['environment']['DILOCO_LEARNER_ID']}"
    return {"eval": "evaluator"}.get(role, role)


def env_file_of(svc: dict, auth: Path) -> Path:
    """The service's DILOCO_ENV_FILE (``/auth/<user>.env`` in the volume) in the generated folder ``auth``."""
    path = svc["environment"]["DILOCO_ENV_FILE"]
    assert path.startswith(AUTH_MOUNT + "/"), path
    return auth / path[len(AUTH_MOUNT) + 1:]


def nats_mounts(nats: dict) -> dict[str, str]:
    """Container path -> source of the nats service's volumes."""
    return {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}


def diloco_services(compose: dict, include_profiles: bool = False) -> dict[str, dict]:
    return {n: s for n, s in compose["services"].items()
            if n not in SETUP_SERVICES and (include_profiles or not s.get("profiles"))}


def role_of(svc: dict) -> str:
    return svc["command"][1]


# -- structure ------------------------------------------------------------------------------------


def test_auth_service_is_documented_and_writes_into_the_volume(compose):
    auth = compose["services"]["auth"]
    cmd = auth["command"]
    assert cmd[:4] == ["diloco", "auth", "init", "--keep"]
    assert " ".join(cmd) in (ROOT / "docs" / "deploy.md").read_text()
    assert cmd[cmd.index("--path-prefix") + 1] == AUTH_MOUNT  # the paths the other containers see
    assert f"{AUTH_VOLUME}:{AUTH_MOUNT}" in auth["volumes"] and AUTH_VOLUME in compose["volumes"]
    assert auth.get("restart") == "no" and auth["build"]["context"] == "."
    # the run the credentials are for is the run of every service
    runs = {s["environment"]["DILOCO_RUN"] for s in diloco_services(compose, include_profiles=True).values()}
    assert runs == {cmd[cmd.index("--run") + 1]}
    learners = sorted(s["environment"]["DILOCO_LEARNER_ID"] for s in diloco_services(compose).values()
                      if role_of(s) == "learner")
    assert learners == ["eu-0", "eu-1", "us-0", "us-1"] and cmd[cmd.index("--learners") + 1] == "4"


def test_auth_service_keeps_the_credentials_of_its_first_start(compose, tmp_path):
    out = tmp_path / "auth"
    first = run_auth_service(compose, out)
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert "metrics.env" in files and "auth.json" in files, first.stdout
    second = run_auth_service(compose, out)  # a later `docker compose up`
    assert "kept" in second.stdout
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == files
    (out / "auth.json").unlink()  # what an interrupted first start leaves: written anew
    run_auth_service(compose, out)
    assert (out / "auth.json").exists() and (out / "metrics.env").read_bytes() != files["metrics.env"]


def test_nats_service(compose, auth_dir):
    nats = compose["services"]["nats"]
    assert nats["image"].split(":")[0] == "nats"  # the official image
    cmd = nats["command"]
    conf_in_container = cmd[cmd.index("-c") + 1]
    assert conf_in_container == f"{AUTH_MOUNT}/nats-server.conf"  # the generated config, accounts included
    mounts = nats_mounts(nats)
    assert mounts["/data"] in compose["volumes"]  # a named volume holds the JetStream store
    assert mounts[AUTH_MOUNT] == AUTH_VOLUME and f"{AUTH_VOLUME}:{AUTH_MOUNT}:ro" in nats["volumes"]
    assert nats["depends_on"]["auth"]["condition"] == "service_completed_successfully"
    assert (auth_dir / Path(conf_in_container).relative_to(AUTH_MOUNT)).is_file()
    assert "healthcheck" in nats
    for svc in compose["services"].values():  # published ports on the host's loopback only
        assert all(p.startswith("127.0.0.1:") for p in svc.get("ports", []))


def test_nats_config_is_valid_and_allows_8mib_messages(auth_dir):
    conf = auth_dir / "nats-server.conf"
    ok, out = validate_config_file(str(conf))  # nats-server -t, the accounts fragment included
    assert ok, out
    text = conf.read_text()
    assert re.search(r"^max_payload:\s*8388608\b", text, re.M)
    assert re.search(r'^\s*store_dir:\s*"/data"', text, re.M)  # the named volume
    assert re.search(r'^http:\s*"127\.0\.0\.1:8222"', text, re.M)  # monitoring (no auth): container loopback
    assert re.search(r'^include\s+"nats-auth\.conf"', text, re.M)
    fragment = (auth_dir / "nats-auth.conf").read_text()
    assert "accounts {" in fragment and "DILOCO_compose" in fragment and "no_auth_user" not in fragment


def test_env_files_match_the_services(compose, auth_dir):
    from bus.config import parse_env_file

    for name, svc in diloco_services(compose, include_profiles=True).items():
        creds = parse_env_file(env_file_of(svc, auth_dir).read_text())
        assert creds["DILOCO_NATS_USER"] == user_of(svc) and creds["DILOCO_NATS_PASSWORD"], name
        assert creds["DILOCO_RUN"] == svc["environment"]["DILOCO_RUN"], name
        assert creds["DILOCO_NATS_URL"] == svc["environment"]["DILOCO_NATS_URL"], name
        for k in ("DILOCO_LEARNER_ID", "DILOCO_REGION"):
            if k in creds:
                assert creds[k] == svc["environment"][k], (name, k)


def test_diloco_services(compose, auth_dir):
    from diloco.cli import COMMANDS, load_role_configs
    from bus.config import CommonConfig, from_env

    roles = load_role_configs()
    services = diloco_services(compose, include_profiles=True)
    assert {role_of(s) for s in services.values()} >= {"aggregator", "monitor", "eval", "learner"}
    for name, svc in services.items():
        assert svc["image"] and svc["build"]["context"] == "."
        assert (ROOT / svc["build"].get("dockerfile", "Dockerfile")).is_file()
        assert svc["command"][0] == "diloco" and svc["command"][1] in COMMANDS, name
        env = svc["environment"]
        assert isinstance(env, dict) and all(isinstance(v, str) for v in env.values()), name  # quoted values
        assert "env_file" not in svc, name  # the compose CLI would need the file on the host
        assert env["DILOCO_ENV_FILE"] == f"{AUTH_MOUNT}/{user_of(svc)}.env", name  # its own least-privilege user
        assert f"{AUTH_VOLUME}:{AUTH_MOUNT}:ro" in svc["volumes"], name
        assert not {"DILOCO_NATS_USER", "DILOCO_NATS_PASSWORD"} & set(env), name  # secrets only in env files
        assert env["DILOCO_NATS_URL"].startswith("nats://nats:"), name
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name
        local = {**env, "DILOCO_ENV_FILE": str(env_file_of(svc, auth_dir))}
        cfg = from_env(CommonConfig, local)  # every value parses for its role, the env file's included
        assert cfg.nats_user == user_of(svc) and cfg.nats_password, name
        for c in {"learner": ("model", "learner"), "eval": ("model", "learner", "eval"),
                  "aggregator": ("model", "aggregator"), "monitor": ("monitor",)}.get(role_of(svc), ()):
            from_env(roles[c], local)
    models = {tuple(s["environment"].get(k) for k in MODEL_VARS) for s in services.values()
              if role_of(s) in ("learner", "eval", "aggregator")}
    assert len(models) == 1  # every process of the run agrees on the model


def test_compose_runs_the_roles_defaults_and_its_learners_fit_the_declared_geometry(compose):
    """Issue 24: compose sets none of the algorithm's settings (the roles' defaults are the tuned
    ones), and the learners' inner learning rate in force (their own default, by the model's width,
    inner optimizer and DILOCO_NUM_LEARNERS) is within the run's declared DILOCO_MAX_INNER_LR, or they
    would refuse to start (compose's old declared 0.001 with the learners' own default then, 0.004,
    was such a run)."""
    from bus.config import from_env
    from learner.config import LearnerConfig, ModelConfig

    algorithm = {"DILOCO_QUORUM", "DILOCO_OUTER_MOMENTUM", "DILOCO_OUTER_LR", "DILOCO_MERGE", "DILOCO_SYNC_EVERY",
                 "DILOCO_INNER_LR", "DILOCO_WARMUP_STEPS", "DILOCO_NORM_OUTLIER_FACTOR"}
    for name, svc in diloco_services(compose, include_profiles=True).items():
        env = {k: v for k, v in svc["environment"].items() if k != "DILOCO_ENV_FILE"}  # (credentials only)
        assert not algorithm & set(env), (name, algorithm & set(env))
        if role_of(svc) == "learner":
            model, cfg = from_env(ModelConfig, env), from_env(LearnerConfig, env)
            assert 0 < cfg.lr_for(model.d_model) <= model.max_inner_lr, name


def test_learners_in_two_regions_with_disjoint_shards(compose):
    learners = [s["environment"] for s in diloco_services(compose).values() if role_of(s) == "learner"]
    assert len({e["DILOCO_REGION"] for e in learners}) >= 2
    ids = [e["DILOCO_LEARNER_ID"] for e in learners]
    assert len(set(ids)) == len(ids)
    assert sorted(int(e["DILOCO_SHARD_INDEX"]) for e in learners) == list(range(len(learners)))
    assert {int(e["DILOCO_NUM_LEARNERS"]) for e in learners} == {len(learners)}
    for e in learners:
        assert e["DILOCO_LEARNER_ID"].startswith(e["DILOCO_REGION"] + "-")


def test_dockerfile_and_dockerignore():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r"pip install \.", text)
    for pkg in ("bus", "learner", "aggregator", "monitor", "diloco"):  # pyproject's packages
        assert re.search(rf"^COPY {pkg} ", text, re.M), pkg
    assert re.search(r"^COPY pyproject\.toml README\.md", text, re.M)
    # a new named volume at /auth takes the image folder's owner: the auth service (user diloco) writes it
    assert re.search(r"mkdir -m 0700 /auth && chown diloco:diloco /auth", text)
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.lstrip().startswith("#")}
    assert ".git" in ignored and not ignored & {"bus", "learner", "aggregator", "monitor", "pyproject.toml",
                                                "README.md"}


# -- run it -----------------------------------------------------------------------------------------


def start_order(compose: dict) -> list[str]:
    """Services in depends_on order (compose's start order)."""
    services = diloco_services(compose)
    done: list[str] = []
    while len(done) < len(services):
        for name, svc in services.items():
            if name not in done and all(d == "nats" or d in done for d in svc.get("depends_on", {})):
                done.append(name)
                break
        else:
            raise AssertionError("depends_on cycle")
    return done


def local_argv(command: list[str]) -> list[str]:
    exe = Path(sys.executable).with_name("diloco")
    return ([str(exe)] if exe.exists() else [sys.executable, "-m", "diloco.cli"]) + command[1:]


def local_env(svc: dict, nats_url: str, auth: Path) -> dict[str, str]:
    """As compose: `environment:` (the process reads its DILOCO_ENV_FILE itself, mapped to ``auth``),
    then the test's overrides."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    out = {**base, **{k: str(v) for k, v in svc["environment"].items()}, **TEST_OVERRIDES}
    out["DILOCO_ENV_FILE"] = str(env_file_of(svc, auth))
    out["DILOCO_NATS_URL"] = re.sub(r"nats://nats:\d+", nats_url, out["DILOCO_NATS_URL"])
    return out


@pytest.mark.timeout(300)
def test_compose_services_train_as_local_processes(compose, auth_dir, tmp_path):
    import nats as nats_py

    from bus.config import parse_env_file
    from bus.codec import loads_json
    from bus.config import CommonConfig
    from bus.conn import connect
    from bus.procs import popen
    from diloco.up import RunState

    nats = compose["services"]["nats"]
    port, http = free_port(), free_port()
    auth = tmp_path / "auth"  # what the container sees at /auth: the generated folder (as init wrote it)
    shutil.copytree(auth_dir, auth)
    data = tmp_path / "data"
    conf = auth / "nats-server.conf"  # ports and the /data volume mapped for the test; `include` unchanged
    text = conf.read_text()
    for pattern, value in [(r'^host: .*$', 'host: "127.0.0.1"'), (r"^port: .*$", f"port: {port}"),
                           (r"^http: .*$", f'http: "127.0.0.1:{http}"'),
                           (r'^(\s*)store_dir: "/data"$', f'\\1store_dir: "{data}"')]:
        text, n = re.subn(pattern, value, text, count=1, flags=re.M)
        assert n == 1, pattern
    conf.write_text(text)
    argv = [find_binary()] + [str(auth) + a[len(AUTH_MOUNT):] if a.startswith(AUTH_MOUNT + "/") else a
                              for a in nats["command"]]
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, argv: list[str], env: dict[str, str] | None) -> None:
        with open(logs / f"{name}.log", "wb") as log:
            procs[name] = popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def log_tail(name: str) -> str:
        return (logs / f"{name}.log").read_text(errors="replace")[-3000:]

    def log_tail_all(name: str) -> str:
        return (logs / f"{name}.log").read_text(errors="replace")

    async def go() -> RunState:
        url = f"nats://127.0.0.1:{port}"
        run = diloco_services(compose)["aggregator"]["environment"]["DILOCO_RUN"]
        state = RunState(run=run)
        with pytest.raises(Exception) as ei:  # no anonymous access
            anon = await nats_py.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=3)
            await anon.close()
        assert "authorization" in repr(ei.value).lower() or isinstance(ei.value, nats_py.errors.NoServersError)
        me = parse_env_file((auth / "metrics.env").read_text())  # the test watches as the read-only user
        nc = await connect(CommonConfig(nats_url=url, run=run, nats_user=me["DILOCO_NATS_USER"],
                                        nats_password=me["DILOCO_NATS_PASSWORD"]), name="t-compose")

        async def on_metrics(m):
            state.on_metrics(loads_json(m.data))

        await nc.subscribe(f"diloco.{run}.metrics.>", cb=on_metrics)
        services = diloco_services(compose)
        learners = [n for n in start_order(compose) if role_of(services[n]) == "learner"]
        for name in start_order(compose):
            if name not in learners:
                spawn(name, local_argv(services[name]["command"]), local_env(services[name], url, auth))
        # test convenience: the held-out loss of version 0 before any learner trains
        deadline = time.monotonic() + 150
        while not state.evals:
            for n, p in procs.items():
                assert p.poll() is None, f"{n} exited: {log_tail(n)}"
            assert time.monotonic() < deadline, "no evaluation"
            await asyncio.sleep(0.2)
        for name in learners:
            spawn(name, local_argv(services[name]["command"]), local_env(services[name], url, auth))
        tool = diloco_services(compose, include_profiles=True)["metrics"]
        metrics_started = False
        deadline = time.monotonic() + 200
        while any(procs[n].poll() is None for n in learners):
            assert time.monotonic() < deadline, "learners did not finish"
            for n, p in procs.items():
                if n in learners or n == "metrics":
                    continue
                assert p.poll() is None, f"{n} exited: {log_tail(n)}"
            if not metrics_started and any(m.get("step", 0) > 0 for m in state.learners.values()):
                spawn("metrics", local_argv(tool["command"]), local_env(tool, url, auth))
                metrics_started = True
            await asyncio.sleep(0.2)
        for n in learners:
            assert procs[n].returncode == 0, f"{n}: {log_tail(n)}"
        deadline = time.monotonic() + 30  # the last merges, then one evaluation of them
        while time.monotonic() < deadline:
            want = {k: int(v) for k, v in state.versions().items()}
            if state.evals and {k: int(v) for k, v in (state.evals[-1].get("versions") or {}).items()} == want \
                    and not (state.aggregator or {}).get("buffered"):
                break
            await asyncio.sleep(0.2)
        await nc.close()
        return state

    try:
        spawn("nats", argv, None)
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/healthz?js-enabled-only=true", timeout=1):
                    break
            except Exception:
                assert procs["nats"].poll() is None, log_tail("nats")
                assert time.monotonic() < deadline, "nats not healthy"
                time.sleep(0.1)
        try:
            state = asyncio.run(go())
        except AssertionError as e:  # what the server saw, beside what the role said
            raise AssertionError(f"{e}\n--- nats log ---\n{log_tail('nats')}") from None
        assert procs["metrics"].wait(30) == 0, log_tail("metrics")
    finally:
        for name, p in reversed(list(procs.items())):
            if p.poll() is None:
                p.terminate()
        for name, p in procs.items():
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert (data / "jetstream").is_dir()  # the /data volume held the store
    # every role did its job as its own user; the only permitted denial: the monitor, started right after
    # the aggregator, may try to create the run before the aggregator has (it then waits for it)
    denied = [ln for ln in log_tail_all("nats").splitlines() if "Violation" in ln
              and not ('"DILOCO_compose/user:monitor"' in ln and "$JS.API.STREAM.CREATE." in ln)]
    assert denied == [], denied
    learners = sorted(e["environment"]["DILOCO_LEARNER_ID"] for e in diloco_services(compose).values()
                      if role_of(e) == "learner")
    contributions = state.contributions()
    assert all(contributions.get(lid, 0) > 0 for lid in learners), contributions
    assert all(v > 0 for v in state.versions().values()), state.versions()
    first, last = state.evals[0], state.evals[-1]
    assert first["version"] == 0
    assert last["eval_loss"] < 0.9 * first["eval_loss"], [e["eval_loss"] for e in state.evals]
    table = log_tail("metrics")
    # a snapshot of whatever was sent in its 5 s window: at least a learner row and the central roles
    assert any(lid in table for lid in learners) and "merges" in table and "eval_loss" in table, table
    shutil.rmtree(data, ignore_errors=True)
