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
