from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.kernels import LayerNorm, layer_norm, reference

SHAPES = [(2, 8, 64), (3, 7, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_matches_reference(triton_cpu, shape, dtype):
    C = shape[-1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtype)
    w, b = (1 + 0.1 * torch.randn(C)).to(dtype), (0.1 * torch.randn(C)).to(dtype)
    check_against_reference(lambda a, ww, bb: layer_norm(a, ww, bb), lambda a, ww, bb: reference.layer_norm(a, ww, bb),
                            [x, w, b], dtype)


def test_layer_norm_without_affine(triton_cpu):
    x = torch.randn(3, 7, 33)
    check_against_reference(lambda a: layer_norm(a), lambda a: reference.layer_norm(a, None, None), [x], torch.float32)


def test_module_loads_torch_layernorm_state(triton_cpu):
    ref = torch.nn.LayerNorm(33)
    torch.nn.init.normal_(ref.weight)
    torch.nn.init.normal_(ref.bias)
    m = LayerNorm(33)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(5, 33)
    torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_gpu(dtype):
    x = torch.randn(5, 123, 123, device="cuda", dtype=dtype)
    w, b = (torch.randn(123, device="cuda", dtype=dtype) for _ in range(2))
    check_against_reference(layer_norm, reference.layer_norm, [x, w, b], dtype)
