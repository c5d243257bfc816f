"""DILOCO_MODEL_PRESET: one variable gives every role the same model (issue 42). A role config
loaded with only the preset has the preset's values, an explicit DILOCO_* wins, a bad name fails
with one line naming the variable and the valid names, and ``diloco up`` uses the same table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bus.config import CommonConfig, ConfigError, from_env, sources
from bus.presets import MODEL_PRESETS
from learner.config import EvalConfig, LearnerConfig, ModelConfig

ROOT = Path(__file__).resolve().parent.parent
SMALL = {"d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "seq_len": 64, "num_fragments": 4}


def shape(m: ModelConfig) -> dict:
    return {k: getattr(m, k) for k in SMALL}


def test_only_the_preset_gives_the_small_model_to_every_role():
    env = {"DILOCO_MODEL_PRESET": "small"}
    assert shape(from_env(ModelConfig, env)) == SMALL
    assert shape(from_env(ModelConfig, {})) != SMALL  # the defaults are another model
    assert from_env(LearnerConfig, env).batch_size == 16
    assert from_env(CommonConfig, env).model_preset == "small"
    tiny = {"DILOCO_MODEL_PRESET": "tiny"}
    assert from_env(ModelConfig, tiny).d_model == 32 and from_env(LearnerConfig, tiny).batch_size == 8
    assert from_env(EvalConfig, tiny).eval_batch_size == 16
    # a learner and an aggregator given only the preset build the model of the explicit variables:
    # the same spec and fragment count, hence the same hashes in the manifest
    assert from_env(ModelConfig, env) == from_env(ModelConfig, MODEL_PRESETS["small"])
    assert from_env(ModelConfig, {"DILOCO_MODEL_PRESET": "default"}) == from_env(ModelConfig, {})


def test_an_explicit_variable_wins_over_the_preset(tmp_path):
    m = from_env(ModelConfig, {"DILOCO_MODEL_PRESET": "small", "DILOCO_D_MODEL": "96", "DILOCO_N_HEADS": "8"})
    assert (m.d_model, m.n_heads, m.n_layers, m.seq_len) == (96, 8, 2, 64)
    f = tmp_path / "role.env"  # the env file's values win over the preset's too, and may name the preset
    f.write_text("DILOCO_MODEL_PRESET=small\nDILOCO_SEQ_LEN=128\n")
    m = from_env(ModelConfig, {"DILOCO_ENV_FILE": str(f)})
    assert (m.d_model, m.seq_len) == (64, 128)
    src = {n: s for n, _, s in sources(ModelConfig, {"DILOCO_ENV_FILE": str(f), "DILOCO_N_LAYERS": "3"})}
    assert src["DILOCO_D_MODEL"] == "preset small" and src["DILOCO_SEQ_LEN"] == "file"
    assert src["DILOCO_N_LAYERS"] == "env" and src["DILOCO_SEED"] == "default"


@pytest.mark.parametrize("cls", [CommonConfig, ModelConfig, LearnerConfig])
def test_a_bad_preset_name_is_one_line_naming_the_variable_and_the_valid_names(cls):
    with pytest.raises(ConfigError) as e:
        from_env(cls, {"DILOCO_MODEL_PRESET": "huge"})
    assert str(e.value) == "DILOCO_MODEL_PRESET='huge': expected one of tiny, small, default"


def test_diloco_config_shows_the_preset_as_the_source():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    run = [sys.executable, "-m", "diloco.cli", "config"]
    p = subprocess.run(run + ["learner"], env={**env, "DILOCO_MODEL_PRESET": "small", "DILOCO_D_FF": "128"},
                       capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "DILOCO_MODEL_PRESET=small  # env" in lines and "DILOCO_D_MODEL=64  # preset small" in lines
    assert "DILOCO_D_FF=128  # env" in lines and "DILOCO_BATCH_SIZE=16  # preset small" in lines
    p = subprocess.run(run + ["aggregator"], env={**env, "DILOCO_MODEL_PRESET": "big"}, capture_output=True,
                       text=True, timeout=60, cwd=str(ROOT))
    assert p.returncode == 2
    assert p.stderr.strip() == "diloco config: DILOCO_MODEL_PRESET='big': expected one of tiny, small, default"


def test_diloco_up_uses_the_same_presets_and_the_variable(monkeypatch):
    from diloco.up import plan

    assert plan.PRESETS is MODEL_PRESETS
    monkeypatch.setenv("DILOCO_MODEL_PRESET", "small")
    assert plan.parse_args([]).model_preset == "small"  # the roles' variable names the launcher's preset
    assert plan.parse_args(["--model-preset", "tiny"]).model_preset == "tiny"  # the flag wins
    env = plan.base_env({"DILOCO_MODEL_PRESET": "small"}, "default", None, False, cpu_count=64)
    assert env["DILOCO_MODEL_PRESET"] == "default"  # every child sees the launcher's preset
    assert env["DILOCO_MAX_INNER_LR"] == "0.008" and from_env(ModelConfig, env).d_model == 128  # Muon's rate
    env = plan.base_env({}, "small", None, False, cpu_count=64)
    assert env["DILOCO_MAX_INNER_LR"] == "0.016" and shape(from_env(ModelConfig, env)) == SMALL
    env = plan.base_env({"DILOCO_INNER_OPTIMIZER": "adamw"}, "small", None, False, cpu_count=64)
    assert env["DILOCO_MAX_INNER_LR"] == "0.008"  # AdamW's rate is half Muon's
    monkeypatch.setenv("DILOCO_MODEL_PRESET", "huge")
    with pytest.raises(SystemExit):
        plan.parse_args([])


async def test_a_run_created_with_only_the_preset_is_the_run_of_the_explicit_variables(nats_server, nc):
    """Real processes: `diloco run create` (what the aggregator does with DILOCO_MODEL=builtin) given
    only DILOCO_MODEL_PRESET=small writes the manifest a learner given the seven variables expects."""
    import asyncio

    from bus.runs import read_manifest
    from learner.builtin import builtin_manifest

    env = {k: v for k, v in os.environ.items() if not k.startswith("DILOCO_")}
    env.update(DILOCO_NATS_URL=nats_server.url, DILOCO_RUN="p42", DILOCO_MODEL_PRESET="small")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "diloco.cli", "run", "create", env=env,
                                                cwd=str(ROOT), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()
    m = await read_manifest(nc.jetstream(timeout=10), "p42")
    assert m is not None
    learner_side, plan = builtin_manifest("p42", from_env(ModelConfig, {**MODEL_PRESETS["small"], "DILOCO_RUN": "p42"}))
    assert (m.model_hash, m.plan_hash, m.num_fragments) == (learner_side.model_hash, plan.plan_hash(), 4)
    default_side, _ = builtin_manifest("p42", from_env(ModelConfig, {}))
    assert m.model_hash != default_side.model_hash  # the check can fail: the defaults are another model
