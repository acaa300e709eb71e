"""OptimizeConfig validation and its YAML form."""

from __future__ import annotations

import pytest

from torchnitro.autotune.config import OptimizeConfig, default_cache_dir
from torchnitro.config import load_section, save_yaml
from torchnitro.errors import ConfigError


def test_defaults_and_tolerance_override():
    cfg = OptimizeConfig(tolerances={"int8": {"cosine": 0.995}})
    assert cfg.tolerance("exact") == {"rel": 1e-4}
    assert cfg.tolerance("reduced") == {"cosine": 0.999, "top1": 1.0}
    assert cfg.tolerance("int8") == {"cosine": 0.995, "top1": 1.0}


@pytest.mark.parametrize("kw,match", [
    ({"objective": "speed"}, "objective"), ({"percentile": "p95"}, "percentile"), ({"budget_s": 0}, "budget_s"),
    ({"held_out": 0}, "held_out"), ({"device": "tpu"}, "device"), ({"tolerances": {"fp8": {}}}, "unknown class"),
    ({"tolerances": {"int8": {"cos": 0.9}}}, "unknown key"), ({"metric_fn": lambda a, b: 1.0}, "metric_threshold"),
])
def test_bad_values_raise_config_error(kw, match):
    with pytest.raises(ConfigError, match=match):
        OptimizeConfig(**kw)


def test_yaml_round_trip_and_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    save_yaml(path, optimize=OptimizeConfig(budget_s=60, recipes=["onnxruntime"], exclude=["bf16"]))
    cfg = load_section(path, "optimize", OptimizeConfig)
    assert cfg.budget_s == 60 and cfg.recipes == ["onnxruntime"] and cfg.exclude == ["bf16"]
    path.write_text("version: 1\noptimize:\n  budget: 60\n")
    with pytest.raises(ConfigError, match="budget"):
        load_section(path, "optimize", OptimizeConfig)


def test_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    assert OptimizeConfig().resolved_cache_dir() == tmp_path
    monkeypatch.delenv("TORCHNITRO_CACHE_DIR")
    assert default_cache_dir().name == "torchnitro"
