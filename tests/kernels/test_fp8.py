from __future__ import annotations

import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.kernels import fp8_dequantize, fp8_quantize, reference

# (mantissa bits, smallest normal exponent, largest finite value) from the OCP FP8 spec
# (e4m3fn: no infinities, max 0b1111_110 = 448; e5m2: IEEE-like, max 57344)
FP8_FORMAT = {torch.float8_e4m3fn: (3, -6, 448.0), torch.float8_e5m2: (2, -14, 57344.0)}


def _fp8_grid(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round ``v`` to the nearest FP8 value, ties to even, saturating: computed in float64 from the format's
    bit layout, not with torch's fp8 cast (which the interpreted kernels also use)."""
    mbits, emin, fmax = FP8_FORMAT[dtype]
    a = v.double().abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** (emin - mbits - 2)))).clamp(min=emin)  # subnormals: emin's step
    step = torch.pow(2.0, e - mbits)
    return torch.sign(v.double()) * torch.clamp(torch.round(a / step) * step, max=fmax)  # round(): ties to even


def test_fp8_grid_matches_the_spec_table():
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    t = torch.tensor
    # smallest subnormal, smallest normal, largest value; ties to even around 1 (step 1/8 for e4m3, 1/4 e5m2)
    assert _fp8_grid(t([2.0 ** -9, 2.0 ** -6, 448.0, 1e4]), e4).tolist() == [2.0 ** -9, 2.0 ** -6, 448.0, 448.0]
    assert _fp8_grid(t([1.0625, 1.1875, -3.3, 2.0 ** -10]), e4).tolist() == [1.0, 1.25, -3.25, 0.0]
    assert _fp8_grid(t([2.0 ** -16, 57344.0, 1.125, 1.375, 2.0 ** -17 * 3]), e5).tolist() == \
        [2.0 ** -16, 57344.0, 1.0, 1.5, 2.0 ** -15]


@pytest.mark.parametrize("shape", [(2, 8, 64), (3, 7, 33)])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_row", [False, True])
def test_fp8_roundtrip_matches_reference(triton_cpu, shape, dtype, per_row):
    x = torch.randn(shape) * 5
    q, s = fp8_quantize(x, dtype, per_row)
    q_ref, s_ref = reference.fp8_quantize(x, dtype, per_row)
    assert q.dtype == dtype and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0)
    # against the bit-layout rounding, not torch's cast: the scale is amax / max (per tensor or row)
    amax = x.abs().amax(dim=-1, keepdim=True) if per_row else x.abs().amax()
    torch.testing.assert_close(s, amax / FP8_FORMAT[dtype][2], rtol=1e-6, atol=0)
    torch.testing.assert_close(q.double(), _fp8_grid(x / s, dtype), rtol=0, atol=0)
    y = fp8_dequantize(q, s, torch.float32)
    torch.testing.assert_close(y, reference.fp8_dequantize(q_ref, s_ref), rtol=1e-6, atol=1e-6)
    rel = 2 ** -3 if dtype == torch.float8_e4m3fn else 2 ** -2  # half an ulp of the mantissa, relative to amax
    assert torch.all((y - x).abs() <= rel * amax)


def test_fp8_bad_input(triton_cpu):
    with pytest.raises(InputError, match="float8_e4m3fn or torch.float8_e5m2"):
        fp8_quantize(torch.randn(4), torch.float16)
    with pytest.raises(InputError, match="expected an FP8 tensor"):
        fp8_dequantize(torch.randn(4), torch.tensor(1.0))


@pytest.mark.gpu
def test_fp8_gpu():
    x = torch.randn(5, 123, 123, device="cuda", dtype=torch.bfloat16)
    for per_row in (False, True):
        q, s = fp8_quantize(x, per_row=per_row)
        q_ref, s_ref = reference.fp8_quantize(x, per_row=per_row)
        torch.testing.assert_close(s, s_ref)
        assert (q.float() != q_ref.float()).float().mean() < 1e-3  # rounding ties may differ


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("margin", [0, 2])
def test_recipe_cast_matches_the_precision_recipe(triton_cpu, dtype, margin):
    from torchnitro.kernels.fp8 import fp8_recipe_cast
    from torchnitro.precision.fp8 import amax_to_scale, cast_to_fp8

    prev = torch.tensor(3.0)
    for x in (torch.randn(3, 1000) * 7, torch.zeros(5, 17), torch.tensor([1.0, float("inf"), -2.0])):
        q, s, inv, amax = fp8_recipe_cast(x, prev, dtype, margin)
        s_ref = amax_to_scale(x.abs().amax(), dtype, margin, prev)
        torch.testing.assert_close(amax, x.abs().amax(), rtol=0, atol=0)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
        torch.testing.assert_close(inv, 1 / s_ref, rtol=1e-6, atol=0)
        assert q.dtype == dtype and q.shape == x.shape
        torch.testing.assert_close(q.float(), cast_to_fp8(x, s_ref, dtype).float(), rtol=0, atol=0)
    assert s.item() == 3.0  # inf amax keeps the previous scale
