"""fp8-inference and sparse-2:4 on a CUDA GPU: the modules against bf16 references, and the recipes
through ``torchnitro.optimize`` with the gate verifying and refusing as it should."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from fake_recipes import fast_config
from torch import nn

pytestmark = pytest.mark.gpu

FP8, SPARSE = "fp8-inference", "sparse-2:4"


def _need_fp8() -> None:
    from torchnitro.precision.fp8_inference import fp8_inference_reason

    why = fp8_inference_reason()
    if why:
        pytest.skip(why)


def _need_sparse() -> None:
    from torchnitro.kernels.sparsity import semi_structured_reason

    why = semi_structured_reason()
    if why:
        pytest.skip(why)


def _norm_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm())


def _min_cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(F.cosine_similarity(a.double().reshape(-1, a.shape[-1]), b.double().reshape(-1, b.shape[-1]), -1).min())


@pytest.mark.parametrize("m,k,n", [(256, 1024, 2048), (615, 512, 768)])
def test_fp8_module_matches_bf16_linear(m, k, n):
    """Tolerance: worst row cosine >= 0.995 against the bf16 Linear (e4m3 keeps 3 mantissa bits), and
    within 1% (norm-relative) of the emulated path (same operands; only summation order and bf16 output)."""
    _need_fp8()
    from torchnitro.precision.fp8_inference import Fp8InferenceLinear

    torch.manual_seed(0)
    lin = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    fp8 = Fp8InferenceLinear(lin, backend="scaled_mm")
    with torch.inference_mode():
        y, ref = fp8(x), lin(x)
        emu = Fp8InferenceLinear(lin, backend="emulated")(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert fp8.uses_scaled_mm(x.device) and not fp8._hw_failed
    assert _min_cos(ref, y) >= 0.995
    assert _norm_rel(emu, y) <= 1e-2


def test_fp8_module_3d_input_and_bias():
    _need_fp8()
    from torchnitro.precision.fp8_inference import Fp8InferenceLinear

    lin = nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(3, 37, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        y = Fp8InferenceLinear(lin, backend="scaled_mm")(x)
        assert y.shape == (3, 37, 512)
        assert _min_cos(lin(x), y) >= 0.995


@pytest.mark.parametrize("m,k,n", [(256, 1024, 2048), (123, 512, 768)])
def test_sparse_module_matches_dense_matmul_with_the_pruned_weight(m, k, n):
    """Tolerance: within 1% (norm-relative) of F.linear with the dense pruned bf16 weight (bf16
    output rounding; the sparse kernels skip the zeros, the products are the same)."""
    _need_sparse()
    from torchnitro.kernels.sparsity import SemiSparseLinear, prune_2to4

    torch.manual_seed(0)
    lin = nn.Linear(k, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    sp = SemiSparseLinear(lin, backend="sparse")
    with torch.inference_mode():
        y = sp(x)
        ref = F.linear(x, prune_2to4(lin.weight.detach()), lin.bias)
    assert sp.sparse and y.shape == (m, n)
    assert _norm_rel(ref, y) <= 1e-2


def _lm():
    from torchnitro.nn.models import TransformerLM

    torch.manual_seed(0)
    return TransformerLM(dim=256, n_layers=2, n_heads=4, vocab_size=1024).eval()


def _ids():
    return (torch.randint(0, 1024, (4, 128), generator=torch.Generator().manual_seed(1)),)


def _rows(om):
    return {c.recipe: c for c in om.report.candidates}


def _cfg(tmp_path, **kw):
    return fast_config(tmp_path, device="cuda", cache=False, min_speedup=0.0, **kw)  # min_speedup 0: force the recipe


def test_optimize_runs_fp8_inference_and_the_gate_verifies(tmp_path):
    _need_fp8()
    import torchnitro

    om = torchnitro.optimize(_lm(), _ids(), _cfg(tmp_path, recipes=[FP8]))
    row = _rows(om)[FP8]
    assert row.status in ("chosen", "verified"), row.reason
    assert om.recipe == FP8
    assert "Linear FP8" in row.notes, row.notes
    with torch.inference_mode():
        ref = _lm().cuda()(_ids()[0].cuda())
    assert _min_cos(ref, om(_ids()[0].cuda()).float()) >= 0.99


def test_gate_refuses_fp8_under_a_tighter_int8_tolerance(tmp_path):
    _need_fp8()
    import torchnitro

    om = torchnitro.optimize(_lm(), _ids(), _cfg(tmp_path, recipes=[FP8], tolerances={"int8": {"cosine": 0.99999}}))
    row = _rows(om)[FP8]
    assert row.status == "rejected" and "cosine" in row.reason
    assert om.recipe == "eager"


def test_gate_refuses_sparse_on_a_dense_model(tmp_path):
    _need_sparse()
    import torchnitro

    om = torchnitro.optimize(_lm(), _ids(), _cfg(tmp_path, recipes=[SPARSE]))
    row = _rows(om)[SPARSE]
    assert row.status == "rejected" and "cosine" in row.reason, (row.status, row.reason)
    assert om.recipe == "eager"


def test_gate_verifies_sparse_on_a_model_trained_2to4(tmp_path):
    """A model whose Linear weights are already 2:4 (as after sparse fine-tuning): pruning changes nothing."""
    _need_sparse()
    import torchnitro
    from torchnitro.autotune.recipes.sparse24 import _eligible
    from torchnitro.kernels.sparsity import prune_2to4

    model = _lm()
    with torch.no_grad():
        for n, m in model.named_modules():
            if type(m) is nn.Linear and _eligible(n, m) is None:
                m.weight.copy_(prune_2to4(m.weight))
    om = torchnitro.optimize(model, _ids(), _cfg(tmp_path, recipes=[SPARSE]))
    row = _rows(om)[SPARSE]
    assert row.status in ("chosen", "verified"), (row.status, row.reason)
    found = re.search(r"\((\d+) on sparse kernels", row.notes)
    assert found and int(found.group(1)) > 0, row.notes  # the semi-structured path ran, not the dense fallback
