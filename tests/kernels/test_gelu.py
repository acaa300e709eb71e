from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import InputError
from torchnitro.kernels import gelu, reference, GELU

SHAPES = [(2, 8, 64), (3, 7, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_matches_reference(triton_cpu, shape, dtype, approximate):
    x = torch.randn(shape).to(dtype)
    check_against_reference(lambda a: gelu(a, approximate), lambda a: reference.gelu(a, approximate), [x], dtype)


def test_gelu_module_and_bad_input(triton_cpu):
    x = torch.randn(4, 5)
    torch.testing.assert_close(GELU("tanh")(x), torch.nn.functional.gelu(x, approximate="tanh"), atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match="approximate"):
        gelu(x, "fast")
    with pytest.raises(InputError, match="int64"):
        gelu(torch.ones(3, dtype=torch.int64))


def test_reference_path_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("TORCHNITRO_KERNELS", raising=False)
    x = torch.randn(3, 9)
    torch.testing.assert_close(gelu(x), torch.nn.functional.gelu(x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gelu_gpu(dtype):
    x = torch.randn(5, 123, 123, device="cuda", dtype=dtype)
    check_against_reference(gelu, reference.gelu, [x], dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_launchers_write_into_out_even_in_place(triton_cpu, approximate):
    from torchnitro.kernels.gelu import gelu_backward, gelu_forward

    x, dy = torch.randn(3, 7, 33), torch.randn(3, 7, 33)
    xr = x.clone().requires_grad_()
    want_y = reference.gelu(xr, approximate)
    want_y.backward(dy)
    z = x.clone()
    y = gelu_forward(z, approximate, out=z)  # in place
    assert y is z
    torch.testing.assert_close(y, want_y.detach(), atol=1e-5, rtol=1e-5)
    z = x.clone()
    dx = gelu_backward(dy, z, approximate, out=z)  # dz over z, as linear_gelu's backward does
    assert dx is z
    torch.testing.assert_close(dx, xr.grad, atol=1e-5, rtol=1e-5)
    with pytest.raises(InputError, match="expected a contiguous tensor of 693 elements"):
        gelu_forward(x, approximate, out=torch.empty(5))
    with pytest.raises(InputError, match="contiguous: False"):
        gelu_backward(dy, x, approximate, out=torch.empty(33, 7, 3).transpose(0, 2))
