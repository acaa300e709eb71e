from __future__ import annotations

import pytest

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.recipe import register_recipe, unregister_recipe


def fast_config(tmp_path, **kw) -> OptimizeConfig:
    """Cheap timing so a search over tiny models takes seconds on 2 cores."""
    base = dict(timing_min_iters=2, timing_min_time_s=0.01, final_min_iters=3, final_min_time_s=0.02,
                progress=False, cache_dir=str(tmp_path / "cache"), candidate_timeout_s=60.0, held_out=2, threads=1)
    base.update(kw)
    return OptimizeConfig(**base)


@pytest.fixture
def fast_cfg(tmp_path):
    return lambda **kw: fast_config(tmp_path, **kw)


@pytest.fixture
def fake_recipes():
    """Register every recipe in fake_recipes for one test."""
    import fake_recipes as fr

    classes = [fr.Raises, fr.Hangs, fr.HangsIsolated, fr.ExitsIsolated, fr.SegfaultIsolated, fr.Wrong,
               fr.ReusesBuffer, fr.Faster, fr.Slower]
    for c in classes:
        register_recipe(c)
    yield fr
    for c in classes:
        unregister_recipe(c.name)
