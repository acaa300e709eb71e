"""Re-runs come from the on-disk cache; changed weights or inputs miss it."""

from __future__ import annotations

import shutil

import pytest
import torch
from fake_recipes import fast_config

import torchnitro
from torchnitro.autotune.cache import CandidateCache, make_key, model_hash
from torchnitro.autotune.inputs import model_and_inputs

RECIPES = ["torchscript", "onnxruntime"]


@pytest.fixture(scope="module")
def first_search(tmp_path_factory):
    """One search on an empty cache, shared by the tests that re-run it: (model, inputs, info, its result, the
    cache it filled). Each test copies that cache (``_cache_copy``), so what one test adds is not seen by another."""
    torch.manual_seed(0)
    model, inputs, info = model_and_inputs("mlp", batch=4)
    tmp = tmp_path_factory.mktemp("first-search")
    first = torchnitro.optimize(model, inputs, fast_config(tmp, recipes=RECIPES), info=info)
    return model, inputs, info, first, tmp / "cache"


def _cache_copy(first_search, tmp_path):
    """The first search's cache copied into this test's folder, where ``fast_config(tmp_path)`` looks for it."""
    shutil.copytree(first_search[-1], tmp_path / "cache")


def test_rerun_uses_search_cache_and_candidate_cache(first_search, fast_cfg, tmp_path):
    model, inputs, info, first, _ = first_search
    _cache_copy(first_search, tmp_path)
    cfg = fast_cfg(recipes=RECIPES)
    assert not first.report.cached
    again = torchnitro.optimize(model, inputs, cfg, info=info)
    assert again.report.cached and again.recipe == first.recipe
    assert again.report.search_s < first.report.search_s
    x = torch.randn(3, 512)
    torch.testing.assert_close(again(x), first(x))
    # a different config misses the whole-search entry but reuses the evaluated candidates
    other = torchnitro.optimize(model, inputs, fast_cfg(recipes=RECIPES, finalists=1), info=info)
    assert not other.report.cached
    assert other.report.get("onnxruntime").cached and other.report.get("torchscript").cached


def test_a_recipe_version_bump_misses_its_cached_results(first_search, fast_cfg, tmp_path, monkeypatch):
    from torchnitro.autotune.recipe import get_recipe

    model, inputs, info, _, _ = first_search
    _cache_copy(first_search, tmp_path)
    cfg = fast_cfg(recipes=RECIPES)
    assert torchnitro.optimize(model, inputs, cfg, info=info).report.cached  # the copied cache holds the search
    monkeypatch.setattr(type(get_recipe("torchscript")), "version", "999")  # its builder changed
    again = torchnitro.optimize(model, inputs, cfg, info=info)
    assert not again.report.cached  # the whole-search entry names every recipe's version
    assert not again.report.get("torchscript").cached and again.report.get("onnxruntime").cached


def test_changed_weights_change_the_key():
    model, _, _ = model_and_inputs("mlp")
    h1 = model_hash(model)
    with torch.no_grad():
        model.layers[0].weight[0, 0] += 1e-3
    assert model_hash(model) != h1
    assert make_key(a=1, b=[1, 2]) == make_key(b=[1, 2], a=1) != make_key(a=2, b=[1, 2])


def test_cache_ignores_corrupt_entries(tmp_path):
    c = CandidateCache(tmp_path)
    assert c.get_search("nope") is None
    (tmp_path / "searches").mkdir()
    (tmp_path / "searches" / "bad.json").write_text("{")
    assert c.get_search("bad") is None
    src = tmp_path / "src"
    src.mkdir()
    (src / "f.bin").write_bytes(b"x")
    d = c.put_candidate("k", {"record": {}}, src, ["f.bin"])
    assert d is not None and c.get_candidate("k") is not None
    (d / "f.bin").unlink()
    assert c.get_candidate("k") is None  # a missing file is a miss, not a crash


def test_cached_non_standalone_winner_saves_fp32_weights(fast_cfg, tmp_path):
    """A cached re-run whose winner converts the model in place (bf16) still saves the eager fp32 weights."""
    from torchnitro.autotune.recipe import get_recipe
    from torchnitro.hardware import hardware_info

    if get_recipe("bf16").unavailable_reason(hardware_info()):
        pytest.skip("bf16 is not available on this CPU")
    model, inputs, info = model_and_inputs("mlp", batch=4)
    cfg = fast_cfg(recipes=["bf16"], min_speedup=0.0)
    first = torchnitro.optimize(model, inputs, cfg, info=info)
    again = torchnitro.optimize(model, inputs, cfg, info=info)
    assert again.report.cached and again.recipe == first.recipe == "bf16"
    assert all(p.dtype == torch.float32 for p in again.source.model.parameters())
    loaded = torchnitro.load(again.save(tmp_path / "a"))
    x = torch.randn(2, 512)
    torch.testing.assert_close(loaded(x), first(x), rtol=0, atol=0)
