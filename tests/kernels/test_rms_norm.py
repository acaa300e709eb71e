from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import ShapeError
from torchnitro.kernels import RMSNorm, reference, rms_norm

SHAPES = [(2, 8, 64), (3, 7, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_reference(triton_cpu, shape, dtype):
    x, w = torch.randn(shape).to(dtype), (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    check_against_reference(lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w],
                            dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_fused_residual(triton_cpu, shape):
    x, r, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    check_against_reference(lambda a, b, c: rms_norm(a, c, 1e-6, residual=b),
                            lambda a, b, c: reference.rms_norm(a, c, 1e-6, residual=b), [x, r, w], torch.float32)


def test_rms_norm_without_weight(triton_cpu):
    x = torch.randn(3, 7, 33)
    check_against_reference(lambda a: rms_norm(a, None), lambda a: reference.rms_norm(a, None), [x], torch.float32)


def test_module_matches_torch_rmsnorm(triton_cpu):
    ref = torch.nn.RMSNorm(33, eps=1e-6)
    torch.nn.init.normal_(ref.weight)
    m = RMSNorm(33, eps=1e-6)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(4, 33)
    torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)


def test_bad_weight_shape(triton_cpu):
    with pytest.raises(ShapeError, match=r"\(32,\).*expected \(33,\)"):
        rms_norm(torch.randn(2, 33), torch.randn(32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_gpu(dtype):
    x, r = (torch.randn(5, 123, 123, device="cuda", dtype=dtype) for _ in range(2))
    w = torch.randn(123, device="cuda", dtype=dtype)
    check_against_reference(lambda a, b, c: rms_norm(a, c, residual=b),
                            lambda a, b, c: reference.rms_norm(a, c, residual=b), [x, r, w], dtype)
