from __future__ import annotations

from dataclasses import dataclass

import pytest

from torchnitro.config import from_dict, load_section, save_yaml
from torchnitro.errors import ConfigError, InputError


@dataclass
class Demo:
    budget_s: float = 10.0
    recipes: tuple[str, ...] = ()
    name: str | None = None


def test_unknown_keys_are_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['budjet_s'\].*known keys are"):
        from_dict(Demo, {"budjet_s": 3})


def test_types_are_checked_and_coerced():
    d = from_dict(Demo, {"budget_s": 3, "recipes": ["a", "b"]})
    assert d.budget_s == 3.0 and d.recipes == ("a", "b")
    with pytest.raises(ConfigError, match="budget_s"):
        from_dict(Demo, {"budget_s": "soon"})


def test_yaml_roundtrip_and_version(tmp_path):
    p = tmp_path / "c.yaml"
    save_yaml(p, optimize=Demo(budget_s=5, recipes=("x",)))
    assert load_section(p, "optimize", Demo) == Demo(budget_s=5.0, recipes=("x",))
    p.write_text("version: 99\noptimize: {}\n")
    with pytest.raises(ConfigError, match="version 99"):
        load_section(p, "optimize", Demo)
    with pytest.raises(InputError, match="does not exist"):
        load_section(tmp_path / "missing.yaml", "optimize", Demo)
    p.write_text("version: 1\noptimise: {}\n")
    with pytest.raises(ConfigError, match="optimise"):
        load_section(p, "optimize", Demo)
