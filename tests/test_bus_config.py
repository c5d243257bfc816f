import dataclasses
import pathlib
import subprocess
import sys

import pytest

from diloco.cli import load_role_configs
from bus.config import CommonConfig, ConfigError, all_variables, from_env, markdown_table, sources


def test_defaults_and_env_values():
    cfg = from_env(CommonConfig, {})
    assert cfg.run == "default" and cfg.max_chunk_bytes == 1024 * 1024
    assert cfg.connect_timeout == 10.0 and cfg.strict_env is False and cfg.log_level == "info"
    cfg = from_env(CommonConfig, {"DILOCO_RUN": "exp-1", "DILOCO_INFLIGHT_CHUNKS": "4",
                                  "DILOCO_NATS_URL": "nats://a:1, tls://b:2"})
    assert cfg.run == "exp-1" and cfg.inflight_chunks == 4 and cfg.nats_url == "nats://a:1,tls://b:2"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.run = "x"


@pytest.mark.parametrize(
    "var, value, expected",
    [
        ("DILOCO_RUN", "a.b", "letters, digits"),
        ("DILOCO_RUN", "", "non-empty"),
        ("DILOCO_INFLIGHT_CHUNKS", "zero", "an integer >= 1"),
        ("DILOCO_INFLIGHT_CHUNKS", "0", "an integer >= 1"),
        ("DILOCO_METRICS_INTERVAL", "nan", "a float"),
        ("DILOCO_LOG_LEVEL", "loud", "one of debug"),
        ("DILOCO_NATS_URL", "localhost:4222", "URLs like nats://"),
        ("DILOCO_NATS_URL", "http://x:1", "schemes"),
        ("DILOCO_GLOBAL_HISTORY", "1", ">= 2"),
        ("DILOCO_CONNECT_TIMEOUT", "0", "a float >= 0.1"),
        ("DILOCO_STRICT_ENV", "maybe", "one of 1/0, true/false"),
    ],
)
def test_bad_value_is_one_line_naming_variable_value_and_expectation(var, value, expected):
    with pytest.raises(ConfigError) as e:
        from_env(CommonConfig, {var: value})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{var}={value!r}:") and expected in msg


def test_secrets_are_not_echoed():
    rows = dict((n, v) for n, v, _ in sources(CommonConfig, {"DILOCO_NATS_PASSWORD": "hunter2"}))
    assert rows["DILOCO_NATS_PASSWORD"] == "***"


def test_every_role_variable_is_in_the_configuration_table():
    load_role_configs()
    page = (pathlib.Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    table = markdown_table()
    assert table in page, "docs/configuration.md's table is stale: regenerate it with `python docs/update_readme.py`"
    names = [r[0] for r in all_variables()]
    assert len(names) == len(set(names)) and all(n.startswith("DILOCO_") for n in names)


def test_cli_config_reports_sources_and_bad_values():
    exe = [sys.executable, "-m", "diloco.cli"]
    ok = subprocess.run(exe + ["config"], env={"DILOCO_RUN": "r1", "PATH": ""}, capture_output=True, text=True)
    assert ok.returncode == 0 and "DILOCO_RUN=r1  # env" in ok.stdout and "DILOCO_REGION=local  # default" in ok.stdout
    bad = subprocess.run(exe + ["config"], env={"DILOCO_MAX_CHUNK_BYTES": "1", "PATH": ""}, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "diloco config: DILOCO_MAX_CHUNK_BYTES='1': expected an integer >= 4096 <= 67108864"


def test_env_file_fills_what_the_environment_does_not_set(tmp_path):
    from bus.config import CommonConfig, ConfigError, from_env, sources

    f = tmp_path / "learner-us-0.env"
    f.write_text("# written by diloco auth init\nDILOCO_NATS_USER=learner-us-0\nDILOCO_NATS_PASSWORD='p w'\n"
                 "DILOCO_RUN=exp1\nPATH=/nowhere\n")
    cfg = from_env(CommonConfig, {"DILOCO_ENV_FILE": str(f), "DILOCO_RUN": "mine"})
    assert (cfg.nats_user, cfg.nats_password, cfg.run) == ("learner-us-0", "p w", "mine")  # the environment wins
    src = {name: origin for name, _, origin in sources(CommonConfig, {"DILOCO_ENV_FILE": str(f)})}
    assert src["DILOCO_NATS_USER"] == "file" and src["DILOCO_ENV_FILE"] == "env" and src["DILOCO_REGION"] == "default"
    with pytest.raises(ConfigError, match=r"^DILOCO_ENV_FILE='/nonexistent/x.env': cannot read it"):
        from_env(CommonConfig, {"DILOCO_ENV_FILE": "/nonexistent/x.env"})
    f.write_text("DILOCO_INNER_LR=fast\n")  # a bad value in the file names its variable like any other
    from learner.config import LearnerConfig
    with pytest.raises(ConfigError, match=r"^DILOCO_INNER_LR='fast'"):
        from_env(LearnerConfig, {"DILOCO_ENV_FILE": str(f)})


def test_the_generated_variable_list_is_the_registry_of_every_role():
    from bus.config import config_variables
    from bus.variables import VARIABLES
    from diloco.config_registry import VARIABLES_FILE, variables_module

    names = config_variables(load_role_configs())
    assert {"DILOCO_QUORUM", "DILOCO_SYNC_EVERY", "DILOCO_EVICT_AFTER", "DILOCO_MODEL_PRESET"} <= names
    assert VARIABLES == names, ("bus/variables.py is stale: regenerate it with "
                                "`python -m diloco.config_registry --write`")
    assert VARIABLES_FILE.read_text() == variables_module(names)


def test_a_process_of_the_bus_alone_knows_every_role_variable_without_importing_the_roles():
    code = ("import sys; from bus.config import known_variables, unknown_variables; "
            "assert {'DILOCO_QUORUM', 'DILOCO_SYNC_EVERY', 'DILOCO_EVICT_AFTER'} <= known_variables(); "
            "assert unknown_variables({'DILOCO_QUORUM': '2', 'DILOCO_QUROUM': '2'}) == "
            "[('DILOCO_QUROUM', 'DILOCO_QUORUM')]; "
            "roles = sorted(m for m in sys.modules if m.split('.')[0] in ('learner', 'aggregator', 'monitor', 'diloco')); "
            "assert not roles, roles")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=str(pathlib.Path(__file__).parent.parent))
    assert p.returncode == 0, p.stderr


def test_bus_config_names_no_role_module():
    text = (pathlib.Path(__file__).parent.parent / "bus" / "config.py").read_text()
    assert "importlib" not in text and not any(f'"{r}.config"' in text for r in ("learner", "aggregator", "monitor"))
