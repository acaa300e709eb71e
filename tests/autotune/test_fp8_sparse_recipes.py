"""fp8-inference and sparse-2:4 on CPU: registration, accuracy classes, skip reasons, the optimizer not
crashing where they cannot run, and the recipes' build logic on their CPU reference paths."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from fake_recipes import fast_config

from torchnitro.autotune.config import DEFAULT_TOLERANCES, OptimizeConfig
from torchnitro.autotune.recipe import BuildContext, NumericClass, all_recipes, get_recipe
from torchnitro.autotune.verify import clone_outputs, compare_outputs
from torchnitro.autotune.workload import select_recipes
from torchnitro.errors import BackendUnavailableError
from torchnitro.hardware import hardware_info
from torchnitro.nn.models import TransformerLM

FP8, SPARSE = "fp8-inference", "sparse-2:4"


def _hw(name: str | None, cap: tuple[int, int] | None):
    return dataclasses.replace(hardware_info(), gpu_name=name, gpu_capability=cap)


def test_registered_with_their_accuracy_classes():
    assert get_recipe(FP8).numeric_class is NumericClass.INT8 and get_recipe(FP8).default
    sp = get_recipe(SPARSE)
    assert sp.numeric_class is NumericClass.PRUNED and sp.default is False
    assert DEFAULT_TOLERANCES["pruned"]["cosine"] < DEFAULT_TOLERANCES["int8"]["cosine"]
    assert OptimizeConfig(tolerances={"pruned": {"cosine": 0.5}}).tolerance("pruned") == {"cosine": 0.5, "top1": 0.9}


def test_pruned_class_is_opt_in_only():
    assert all(not r.default for r in all_recipes() if r.numeric_class is NumericClass.PRUNED)
    assert SPARSE not in [r.name for r in select_recipes(OptimizeConfig())]
    assert FP8 in [r.name for r in select_recipes(OptimizeConfig())]
    assert SPARSE in [r.name for r in select_recipes(OptimizeConfig(recipes=[SPARSE]))]


@pytest.mark.parametrize("name,cap,fp8_ok,sparse_ok", [
    (None, None, False, False), ("Tesla T4", (7, 5), False, False), ("A100", (8, 0), False, None),
    ("H100", (9, 0), True, None)])
def test_skip_reasons_by_capability(name, cap, fp8_ok, sparse_ok):
    hw = _hw(name, cap)
    why = get_recipe(FP8).unavailable_reason(hw)
    assert (why is None) == fp8_ok
    if not fp8_ok:
        assert why.startswith("needs CUDA sm_89+ for FP8 _scaled_mm")
        assert ("no CUDA GPU is visible" in why) if name is None else (f"sm_{cap[0]}{cap[1]}" in why)
    swhy = get_recipe(SPARSE).unavailable_reason(hw)
    if sparse_ok is False:
        assert swhy.startswith("needs CUDA sm_80+ with cuSPARSELt/CUTLASS semi-structured sparse")
    elif not torch.cuda.is_available():  # sm_80+ named, but this process has no CUDA to run it
        assert swhy is not None and "sm_80+" in swhy


def test_doctor_lists_both_with_reasons(capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    monkeypatch.setenv("COLUMNS", "400")  # one table row per line: the reasons are not wrapped
    from torchnitro.cli import doctor

    doctor()
    out = " ".join(capsys.readouterr().out.split())
    assert FP8 in out and "needs CUDA sm_89+ for FP8" in out
    assert SPARSE in out and "opt-in" in out and "needs CUDA sm_80+ with" in out


def _slow_recipes() -> list[str]:
    """Every default recipe but eager and fp8-inference: this test is about the skip, not the search."""
    return [r.name for r in all_recipes() if r.default and r.name not in ("eager", FP8)]


def test_optimize_on_cpu_skips_them_without_crashing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    import torchnitro

    model = TransformerLM(dim=64, n_layers=1, n_heads=2, vocab_size=128).eval()
    ids = torch.randint(0, 128, (2, 16))
    om = torchnitro.optimize(model, (ids,), fast_config(tmp_path, cache=False, exclude=_slow_recipes()))
    rows = {c.recipe: c for c in om.report.candidates}
    assert rows[FP8].status == "skipped" and "sm_89" in rows[FP8].reason
    assert SPARSE not in rows  # opt-in: not part of a default search
    with pytest.raises(BackendUnavailableError, match="sm_80"):
        torchnitro.optimize(model, (ids,), fast_config(tmp_path, recipes=[SPARSE], cache=False))


def _ctx(model, inputs, tmp_path: Path) -> BuildContext:
    return BuildContext(model, inputs, hardware_info(), torch.device("cpu"), tmp_path)


def test_fp8_build_on_cpu_passes_the_int8_gate(tmp_path):
    """The recipe's conversion on the emulated path: same quantised numerics as the GPU's."""
    import copy

    torch.manual_seed(0)
    model = TransformerLM(dim=64, n_layers=2, n_heads=2, vocab_size=256).eval()
    ids = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        ref = clone_outputs(model(ids))
        built = get_recipe(FP8).build(_ctx(copy.deepcopy(model), (ids,), tmp_path))
        out = clone_outputs(built.fn(ids))
    assert len(built.meta["converted"]) == 2 * 7 + 1  # q, k, v, o, w1, w2, w3 per block, and the head
    err = compare_outputs(ref, out)[0]
    assert err.cosine >= DEFAULT_TOLERANCES["int8"]["cosine"], err
    assert err.cosine < 0.99999  # it did quantise


def test_sparse_build_on_cpu_is_the_pruned_model(tmp_path):
    import copy

    from torchnitro.kernels.sparsity import prune_2to4

    torch.manual_seed(0)
    model = TransformerLM(dim=64, n_layers=2, n_heads=2, vocab_size=256).eval()
    ids = torch.randint(0, 256, (2, 24))
    built = get_recipe(SPARSE).build(_ctx(copy.deepcopy(model), (ids,), tmp_path))
    assert built.meta["sparse"] == 0 and "lm_head" in built.meta["skipped"]
    pruned = copy.deepcopy(model).bfloat16()
    with torch.no_grad():
        for n in built.meta["converted"]:
            lin = pruned.get_submodule(n)
            lin.weight.copy_(prune_2to4(lin.weight))
        got, want = built.fn(ids), pruned(ids).float()
    torch.testing.assert_close(got, want)
    gate = compare_outputs(clone_outputs(model(ids)), clone_outputs(got))[0]
    assert gate.cosine < DEFAULT_TOLERANCES["pruned"]["cosine"]  # a dense model pruned untrained: refused


def test_sparse_inapplicable_without_fitting_linears():
    small = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    assert "multiples of 64" in get_recipe(SPARSE).inapplicable_reason(small, ())
    assert "multiples of 16" in get_recipe(FP8).inapplicable_reason(torch.nn.Sequential(torch.nn.Linear(10, 6)), ())
    assert get_recipe(FP8).inapplicable_reason(small, ()) is None
