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


@pytest.fixture
def noisy_search(fake_recipes, fast_cfg, monkeypatch):
    """Runs the search the screen exists for: the truly fastest candidate's search-time sample was hit by load
    (``fake_recipes.NoisyStart``), two decoys look faster; the load is gone once the final phase times anything.
    Returns the ``OptimizedModel``."""
    import torchnitro
    import torchnitro.autotune.final as final_mod

    fr = fake_recipes
    real_compare = final_mod.compare

    def compare_after_load_is_gone(*a, **kw):  # the load that hit the search-time samples has passed
        fr.NOISY["slow"] = False
        return real_compare(*a, **kw)

    def run():
        fr.NOISY["slow"] = True
        monkeypatch.setattr(final_mod, "compare", compare_after_load_is_gone)
        cfg = fast_cfg(recipes=["test-decoy-a", "test-decoy-b", "test-noisy-start"], finalists=2, cache=False)
        return torchnitro.optimize(fr.SlowModel(0.06), fr.tiny_inputs(), cfg)  # decoys 40 ms: 1.5x eager

    yield run
    fr.NOISY["slow"] = True  # the module's initial state, for the next test
