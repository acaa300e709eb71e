from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import ShapeError
from torchnitro.kernels import geglu, reference, swiglu

SHAPES = [(2, 8, 64), (3, 7, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_swiglu_matches_reference(triton_cpu, shape, dtype):
    g, u = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    check_against_reference(swiglu, reference.swiglu, [g, u], dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_matches_reference(triton_cpu, shape, approximate):
    g, u = torch.randn(shape), torch.randn(shape)
    check_against_reference(lambda a, b: geglu(a, b, approximate), lambda a, b: reference.geglu(a, b, approximate),
                            [g, u], torch.float32)


def test_shape_mismatch_names_both_shapes(triton_cpu):
    with pytest.raises(ShapeError, match=r"gate=\(2, 3\).*up=\(2, 4\)"):
        swiglu(torch.randn(2, 3), torch.randn(2, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_glu_gpu(dtype):
    g, u = (torch.randn(5, 123, 123, device="cuda", dtype=dtype) for _ in range(2))
    check_against_reference(swiglu, reference.swiglu, [g, u], dtype)
    check_against_reference(geglu, reference.geglu, [g, u], dtype)


def test_activation_modules(triton_cpu):
    from torchnitro.kernels import GeGLUActivation, SwiGLUActivation

    g, u = torch.randn(4, 9), torch.randn(4, 9)
    torch.testing.assert_close(SwiGLUActivation()(g, u), torch.nn.functional.silu(g) * u, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(GeGLUActivation("tanh")(g, u), torch.nn.functional.gelu(g, approximate="tanh") * u,
                               atol=1e-6, rtol=1e-5)
