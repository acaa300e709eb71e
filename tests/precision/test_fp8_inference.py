"""FP8 inference Linear on CPU: quantisation math, the emulated path, and the _scaled_mm call plumbing
(with a stand-in for torch._scaled_mm that checks its argument rules). The real kernel: tests/autotune/test_gpu_recipes.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchnitro.errors import BackendUnavailableError, InputError
from torchnitro.precision import fp8_inference as F8
from torchnitro.precision.fp8_inference import (Fp8InferenceLinear, fp8_inference_reason, quantize_weight_rows,
                                                to_fp8_inference_)

E4M3 = torch.float8_e4m3fn


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().reshape(-1, a.shape[-1]), b.detach().double().reshape(-1, b.shape[-1])
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def test_weight_rows_dequantize_within_e4m3_rounding():
    w = torch.randn(48, 64) * torch.logspace(-3, 2, 48).unsqueeze(1)  # rows of very different ranges
    q, s = quantize_weight_rows(w)
    assert q.dtype == E4M3 and q.shape == (48, 64) and s.shape == (48,) and s.dtype == torch.float32
    assert torch.allclose(s, w.abs().amax(1) / 448.0)
    back = q.float() * s.unsqueeze(1)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2**-4 for normal values, and each row's max is exact
    err = (back - w).abs() / (w.abs().amax(1, keepdim=True))
    assert float(err.max()) <= 2 ** -4
    assert torch.allclose(back.abs().amax(1), w.abs().amax(1), rtol=1e-6)


@pytest.mark.parametrize("shape", [(2, 128, 512), (5, 123, 48)])
def test_emulated_matches_dequantized_math_and_linear(shape):
    *lead, k = shape
    lin = nn.Linear(k, 96)
    x = torch.randn(*lead, k)
    m = Fp8InferenceLinear(lin, backend="emulated", out_dtype=torch.float32)
    y = m(x)
    assert y.shape == (*lead, 96) and y.dtype == x.dtype
    xq = x.reshape(-1, k)
    a = xq.abs().amax(1, keepdim=True) / 448.0  # per-token scale
    xd = (xq / a).clamp(-448, 448).to(E4M3).float() * a
    wq, ws = quantize_weight_rows(lin.weight)
    expected = xd @ (wq.float() * ws.unsqueeze(1)).t() + lin.bias
    torch.testing.assert_close(y.reshape(-1, 96), expected.detach(), rtol=1e-5, atol=1e-5)
    assert _cos(y, lin(x)) > 0.995  # e4m3 both operands: ~3% error per product, averaged over K


def test_output_is_bf16_in_a_bf16_model_and_bias_is_kept():
    lin = nn.Linear(32, 16).bfloat16()
    with torch.no_grad():
        lin.bias.fill_(3.0)
    m = Fp8InferenceLinear(lin)
    y = m(torch.zeros(4, 32, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, torch.full((4, 16), 3.0, dtype=torch.bfloat16))


def test_cpu_reason_and_explicit_scaled_mm_raises():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible; the CPU reason does not apply")
    why = fp8_inference_reason()
    assert why is not None and why.startswith("needs CUDA sm_89+ for FP8 _scaled_mm")
    m = Fp8InferenceLinear(nn.Linear(32, 16), backend="scaled_mm")
    with pytest.raises(BackendUnavailableError, match="sm_89"):
        m(torch.randn(2, 32))
    y = Fp8InferenceLinear(nn.Linear(32, 16))(torch.randn(2, 32))  # auto: emulated here
    assert y.shape == (2, 16)


def test_bad_backend_and_shapes_are_named():
    with pytest.raises(InputError, match="backend='fast'"):
        Fp8InferenceLinear(nn.Linear(32, 16), backend="fast")
    with pytest.raises(InputError, match="multiples of 16"):
        Fp8InferenceLinear(nn.Linear(30, 16), backend="scaled_mm")
    with pytest.raises(InputError, match="expected 32"):
        Fp8InferenceLinear(nn.Linear(32, 16))(torch.randn(2, 31))


def _fake_scaled_mm(calls):
    """torch._scaled_mm's row-wise contract, checked, computed in fp32."""

    def fake(a, b, *, scale_a, scale_b, out_dtype, **kw):
        m, k = a.shape
        n = b.shape[1]
        assert a.dtype == b.dtype == E4M3 and a.is_contiguous()
        assert b.stride(0) == 1, "mat2 must be column-major"
        assert m % 16 == 0 and k % 16 == 0 and n % 16 == 0
        assert scale_a.shape == (m, 1) and scale_b.shape == (1, n)
        assert scale_a.dtype == scale_b.dtype == torch.float32 and out_dtype == torch.bfloat16
        calls.append((m, k, n))
        return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)

    return fake


def test_scaled_mm_path_pads_rows_and_agrees_with_emulated(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", _fake_scaled_mm(calls), raising=False)
    monkeypatch.setattr(F8, "fp8_inference_reason", lambda device=None: None)
    lin = nn.Linear(64, 32)
    x = torch.randn(3, 7, 64)  # M = 21: padded to 32 for the call
    hw = Fp8InferenceLinear(lin)
    hw.uses_scaled_mm = lambda device: True  # the CPU stands in for the GPU here
    y = hw(x)
    assert calls == [(32, 64, 32)]
    ref = Fp8InferenceLinear(lin, backend="emulated")(x)
    assert y.shape == (3, 7, 32)
    torch.testing.assert_close(y, ref, rtol=2e-2, atol=2e-2)  # both bf16 outputs of the same fp32 products


def test_failing_scaled_mm_warns_once_and_falls_back(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("CUDA error: no kernel image")

    monkeypatch.setattr(torch, "_scaled_mm", broken, raising=False)
    monkeypatch.setattr(F8, "fp8_inference_reason", lambda device=None: None)
    monkeypatch.setattr(F8, "_warned", set())
    lin = nn.Linear(64, 32)
    m = Fp8InferenceLinear(lin)
    m.uses_scaled_mm = lambda device: not m._hw_failed
    x = torch.randn(16, 64)
    with pytest.warns(UserWarning, match="_scaled_mm failed"):
        y = m(x)
    torch.testing.assert_close(y, Fp8InferenceLinear(lin, backend="emulated")(x))
    assert m._hw_failed


def test_to_fp8_inference_swaps_fitting_linears_and_names_the_rest():
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10), nn.Linear(10, 32))
    rep = to_fp8_inference_(model, skip=())
    assert rep.converted == ["0"]
    assert set(rep.skipped) == {"2", "3"} and "multiples of 16" in rep.skipped["2"]
    assert isinstance(model[0], Fp8InferenceLinear) and type(model[2]) is nn.Linear
    rep2 = to_fp8_inference_(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64)), skip=("1",))
    assert rep2.converted == ["0"] and rep2.skipped == {"1": "name is in skip"}
    with pytest.raises(InputError, match="received Linear"):
        to_fp8_inference_(nn.Linear(16, 16))
