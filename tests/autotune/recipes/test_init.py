"""A recipe module that fails to import costs only its own recipes."""

from __future__ import annotations

import sys

import pytest

import torchnitro.autotune.recipes as recipes
from torchnitro.autotune.recipe import list_recipes


def test_broken_recipe_module_is_reported_not_fatal(tmp_path, monkeypatch):
    pkg = tmp_path / "extra_recipes"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a_broken.py").write_text("raise ImportError('needs libfoo')\n")
    (pkg / "b_fine.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(recipes, "BROKEN", {})
    with pytest.warns(UserWarning, match="a_broken failed to import"):
        recipes._load_all([str(pkg)], "extra_recipes")
    assert "needs libfoo" in recipes.BROKEN["a_broken"]
    assert sys.modules["extra_recipes.b_fine"].LOADED  # modules after the broken one still load
    assert {"eager", "onnxruntime", "torchscript"} <= set(list_recipes())
