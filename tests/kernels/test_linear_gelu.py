from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import ShapeError
from torchnitro.kernels import FusedLinearGELU, linear_gelu, reference


@pytest.mark.parametrize("shape,N", [((2, 8, 64), 48), ((3, 7, 33), 20)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_gelu_matches_reference(triton_cpu, shape, N, approximate, bias):
    K = shape[-1]
    x, w = torch.randn(shape), torch.randn(N, K) / K ** 0.5
    inputs = [x, w] + ([torch.randn(N)] if bias else [])
    check_against_reference(lambda a, b, *c: linear_gelu(a, b, *(c or [None]), approximate),
                            lambda a, b, *c: reference.linear_gelu(a, b, *(c or [None]), approximate), inputs,
                            torch.float32)


def test_linear_gelu_fp16_inference(triton_cpu):
    x, w, b = torch.randn(3, 7, 33).half(), (torch.randn(20, 33) / 6).half(), torch.randn(20).half()
    with torch.no_grad():
        torch.testing.assert_close(linear_gelu(x, w, b).float(), reference.linear_gelu(x.float(), w.float(), b.float()),
                                   atol=2e-2, rtol=2e-2)


def test_module_shares_linear_parameters(triton_cpu):
    lin = torch.nn.Linear(33, 20)
    m = FusedLinearGELU.from_linear(lin)
    assert m.weight is lin.weight and m.bias is lin.bias
    x = torch.randn(4, 33)
    torch.testing.assert_close(m(x), torch.nn.functional.gelu(lin(x)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ShapeError, match="expected x"):
        linear_gelu(torch.randn(4, 32), lin.weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_gelu_gpu(dtype):
    x = torch.randn(5, 123, 256, device="cuda", dtype=dtype)
    w = (torch.randn(384, 256, device="cuda") / 16).to(dtype)
    b = torch.randn(384, device="cuda", dtype=dtype)
    check_against_reference(linear_gelu, reference.linear_gelu, [x, w, b], dtype, tol_scale=2.0)


def test_linear_gelu_follows_autocast(triton_cpu):
    lin = torch.nn.Linear(33, 20)
    x = torch.randn(3, 33, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        y = linear_gelu(x, lin.weight, lin.bias)
        ref = torch.nn.functional.gelu(lin(x))
    assert y.dtype == ref.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
