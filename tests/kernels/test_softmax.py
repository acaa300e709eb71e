from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.kernels import reference, softmax

SHAPES = [(2, 8, 64), (3, 7, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_matches_reference(triton_cpu, shape, dtype):
    x = (3 * torch.randn(shape)).to(dtype)
    check_against_reference(softmax, reference.softmax, [x], dtype)


def test_softmax_other_dim(triton_cpu):
    x = torch.randn(3, 7, 33)
    check_against_reference(lambda a: softmax(a, 1), lambda a: reference.softmax(a, 1), [x], torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_gpu(dtype):
    check_against_reference(softmax, reference.softmax, [torch.randn(5, 123, 123, device="cuda", dtype=dtype)], dtype)


def test_softmax_module(triton_cpu):
    from torchnitro.kernels import Softmax

    x = torch.randn(3, 5, 7)
    torch.testing.assert_close(Softmax(dim=1)(x), torch.softmax(x, 1), atol=1e-6, rtol=1e-5)
