from __future__ import annotations

import pytest
from fake_recipes import fast_config

from torchnitro.autotune.recipe import register_recipe, unregister_recipe


@pytest.fixture
def fast_cfg(tmp_path):
    return lambda **kw: fast_config(tmp_path, **kw)


@pytest.fixture
def fake_recipes():
    """Register every recipe in fake_recipes for one test."""
    import fake_recipes as fr

    classes = [fr.Raises, fr.Hangs, fr.HangsIsolated, fr.ExitsIsolated, fr.SegfaultIsolated, fr.BadCheck, fr.Hog, fr.Wrong,
               fr.ReusesBuffer, fr.Faster, fr.Slower, fr.NoisyStart, fr.DecoyA, fr.DecoyB]
    for c in classes:
        register_recipe(c)
    yield fr
    for c in classes:
        unregister_recipe(c.name)
