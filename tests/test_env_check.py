"""Unknown ``DILOCO_*`` variables (typos) are warned about once per process with the closest known
name, and refused under DILOCO_STRICT_ENV; ``diloco config ROLE`` shows every variable the role
reads (DILOCO_MODEL for the aggregator) and checks them; the one-line refusal of an island's tree
by a run of the built-in model says how to fix it."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bus import config as bc
from bus.config import ConfigError, check_environment, known_variables, unknown_variables

ROOT = Path(__file__).resolve().parent.parent
DILOCO = str(Path(sys.executable).parent / "diloco")


def clean_env(**kw: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(kw)
    return env


def test_typos_get_the_closest_known_name():
    env = {"DILOCO_QUROUM": "2", "DILOCO_SYNC_EVRY": "48", "DILOCO_NATS_ULR": "x", "DILOCO_TOTALLY_NEW": "1",
           "DILOCO_RUN": "r", "DILOCO_MODEL": "run", "OTHER": "1"}
    assert unknown_variables(env) == [("DILOCO_NATS_ULR", "DILOCO_NATS_URL"), ("DILOCO_QUROUM", "DILOCO_QUORUM"),
                                      ("DILOCO_SYNC_EVRY", "DILOCO_SYNC_EVERY"), ("DILOCO_TOTALLY_NEW", None)]


def test_the_env_file_is_checked_too(tmp_path):
    f = tmp_path / "learner.env"
    f.write_text("DILOCO_RUN=r\nDILOCO_LEARNERID=x\n")
    assert unknown_variables({"DILOCO_ENV_FILE": str(f)}) == [("DILOCO_LEARNERID", "DILOCO_LEARNER_ID")]


def test_every_variable_read_from_the_environment_directly_is_known():
    """Names the code reads from os.environ outside the config dataclasses are known (a new one
    must join bus.config.OTHER_VARIABLES, or every process would warn about it)."""
    pattern = re.compile(r"""(?:environ(?:\.get)?\s*[\[(]|getenv\()\s*["'](DILOCO_[A-Z0-9_]+)["']""")
    found = set()
    for pkg in ("bus", "learner", "aggregator", "monitor", "diloco"):
        for path in (ROOT / pkg).rglob("*.py"):
            found.update(pattern.findall(path.read_text()))
    assert {"DILOCO_NATS_SERVER_BIN", "DILOCO_UP_OUT"} <= found
    assert found <= known_variables(), found - known_variables()


def test_each_name_is_warned_about_once_and_strict_refuses_them_all(monkeypatch):
    monkeypatch.setattr(bc, "_reported", set())
    env = {"DILOCO_QUROUM": "2"}
    first = check_environment(env)
    assert first == ["DILOCO_QUROUM is not a variable of any role (did you mean DILOCO_QUORUM?): ignored "
                     "(DILOCO_STRICT_ENV=true makes it an error)"]
    assert check_environment(env) == []  # a second set-up in the same process says nothing new
    assert len(check_environment({**env, "DILOCO_SYNC_EVRY": "4"})) == 1
    with pytest.raises(ConfigError) as ei:
        check_environment({**env, "DILOCO_SYNC_EVRY": "4", "DILOCO_STRICT_ENV": "true"})
    msg = str(ei.value)
    assert "\n" not in msg and "DILOCO_QUROUM" in msg and "DILOCO_SYNC_EVERY?" in msg and "DILOCO_STRICT_ENV" in msg
    assert check_environment({"DILOCO_STRICT_ENV": "true", "DILOCO_RUN": "r"}) == []


async def test_a_process_warns_once_per_unknown_variable_and_strict_exits_2(nats_server):
    env = clean_env(DILOCO_NATS_URL=nats_server.url, DILOCO_RUN="envc", DILOCO_QUROUM="2")

    async def diloco(env: dict, *args: str) -> tuple[int, str, str]:
        p = await asyncio.create_subprocess_exec(DILOCO, *args, env=env, cwd=str(ROOT), stdout=subprocess.PIPE,
                                                 stderr=subprocess.PIPE)
        out, err = await asyncio.wait_for(p.communicate(), 60)
        return p.returncode, out.decode(), err.decode()

    rc, out, err = await diloco(env, "status", "--json", "--wait", "0")
    assert rc == 0 and orjson.loads(out)["run"] == "envc", err
    warnings = [orjson.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [w["event"] for w in warnings] == ["unknown_variable"], err
    assert "did you mean DILOCO_QUORUM?" in warnings[0]["problem"]
    rc, out, err = await diloco({**env, "DILOCO_STRICT_ENV": "true"}, "status")
    assert rc == 2 and out == "" and err.strip().startswith("diloco status: DILOCO_QUROUM is not a variable"), err
    assert len(err.strip().splitlines()) == 1


def test_diloco_config_shows_every_variable_the_role_reads_and_the_unknown_ones():
    def config(role: str, **kw: str) -> subprocess.CompletedProcess:
        return subprocess.run([DILOCO, "config", role], env=clean_env(**kw), capture_output=True, text=True,
                              timeout=60, cwd=str(ROOT))

    p = config("aggregator", DILOCO_QUROUM="2")
    assert p.returncode == 0, p.stderr
    rows = dict(line.split("  # ", 1)[0].split("=", 1) for line in p.stdout.splitlines())
    assert rows["DILOCO_MODEL"] == "builtin" and "DILOCO_QUORUM" in rows and "DILOCO_CONNECT_TIMEOUT" in rows
    assert "DILOCO_D_MODEL" in rows  # `diloco aggregator` reads the model's variables (builtin)
    model_line = next(line for line in p.stdout.splitlines() if line.startswith("DILOCO_MODEL="))
    assert "set DILOCO_MODEL=run" in model_line
    assert p.stderr.strip() == ("diloco config: DILOCO_QUROUM is not a variable of any role (did you mean "
                                "DILOCO_QUORUM?): ignored by every role")
    p = config("aggregator", DILOCO_MODEL="run")
    assert "DILOCO_MODEL=run  # env" in p.stdout and "set DILOCO_MODEL=run" not in p.stdout
    p = config("aggregator", DILOCO_MODEL="mine")  # checked: one line, exit 2
    assert p.returncode == 2 and p.stderr.strip() == "diloco config: DILOCO_MODEL='mine': expected one of builtin, run"
    p = config("learner", DILOCO_SYNC_EVRY="48", DILOCO_STRICT_ENV="true")
    assert p.returncode == 2 and "DILOCO_SYNC_EVERY?" in p.stderr and "DILOCO_STRICT_ENV is true" in p.stderr
    p = config("monitor")
    assert p.returncode == 0 and "DILOCO_EVICT_AFTER=" in p.stdout and "DILOCO_D_MODEL" not in p.stdout


def test_a_tree_refused_by_a_run_of_the_built_in_model_says_how_to_fix_it():
    import numpy as np

    from bus.tree import describe
    from learner.builtin import builtin_manifest
    from learner.config import ModelConfig
    from learner.island import TreeModel

    m, _ = builtin_manifest("mine", ModelConfig(d_model=16, n_layers=1, n_heads=2, d_ff=32, seq_len=16))
    model = TreeModel(describe({"l1/b": np.zeros(3, np.float32)}), 2, 1.1, 1, lambda _: None)
    why = model.check(m)
    assert why is not None and "\n" not in why
    assert why.startswith("run 'mine' holds the built-in model, not this island's tree (leaf l1/b")
    assert "an aggregator started without DILOCO_MODEL=run creates one" in why
    assert "`DILOCO_RUN=mine diloco run delete`" in why and "start the aggregator with DILOCO_MODEL=run" in why
