"""The run's declared geometry: in the manifest, checked by learners at start, set by diloco up."""

from __future__ import annotations

import pytest

from diloco.up import base_env
from bus.protocol import Manifest
from learner.startup import StartupError, check_geometry


def _manifest(**kw) -> Manifest:
    return Manifest("r", "h", {}, 0, 4, "p", 1.0, **kw)


def test_manifest_carries_the_geometry_and_reads_old_manifests():
    m = _manifest(max_inner_lr=0.003, max_tokens_per_step=4096)
    assert Manifest.from_dict(m.to_dict()) == m
    old = {k: v for k, v in m.to_dict().items() if k not in ("max_inner_lr", "max_tokens_per_step")}
    assert Manifest.from_dict(old).max_inner_lr is None
    with pytest.raises(ValueError, match="max_inner_lr"):
        Manifest.from_dict({**m.to_dict(), "max_inner_lr": -1})


def test_a_learner_above_the_declared_geometry_refuses_to_start_with_one_line():
    m = _manifest(max_inner_lr=0.003, max_tokens_per_step=4096)
    check_geometry(m, 0.003, 4096)
    check_geometry(_manifest(), 1.0, 10**9)  # nothing declared: nothing checked
    with pytest.raises(StartupError) as e:
        check_geometry(m, 0.01, 4096)
    assert e.value.code == 3 and "DILOCO_INNER_LR=0.01" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(StartupError, match="tokens per inner step"):
        check_geometry(m, 0.001, 8192)


def test_diloco_up_declares_the_learners_learning_rate():
    # the learners' default by width and learners (Muon, 4 learners: tiny, d_model 32 -> 0.016; the
    # default model 0.008; 2 learners: half that; 8: 0.024 / 0.012, the most), or theirs
    assert base_env({}, "tiny", None, True)["DILOCO_MAX_INNER_LR"] == "0.016"
    assert base_env({}, "default", None, False)["DILOCO_MAX_INNER_LR"] == "0.008"
    assert base_env({}, "tiny", None, True, n_learners=2)["DILOCO_MAX_INNER_LR"] == "0.008"
    assert base_env({}, "default", None, False, n_learners=8)["DILOCO_MAX_INNER_LR"] == "0.012"
    assert base_env({}, "default", None, False, n_learners=100)["DILOCO_MAX_INNER_LR"] == "0.012"
    assert base_env({"DILOCO_INNER_LR": "0.003"}, "tiny", None, True)["DILOCO_MAX_INNER_LR"] == "0.003"
    assert base_env({"DILOCO_MAX_INNER_LR": "0.1"}, "tiny", None, True)["DILOCO_MAX_INNER_LR"] == "0.1"
    assert "DILOCO_MAX_INNER_LR" not in base_env({"DILOCO_INNER_LR": "fast"}, "tiny", None, True)
