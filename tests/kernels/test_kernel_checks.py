"""The shared kernel check itself can fail: an output in the wrong dtype or shape is caught."""

from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.kernels import reference


def test_output_in_another_dtype_fails():
    x = torch.randn(3, 8).half()
    check_against_reference(reference.gelu, reference.gelu, [x], torch.float16)  # the honest op passes
    with pytest.raises(AssertionError, match="dtype torch.float32, expected torch.float16"):
        check_against_reference(lambda a: reference.gelu(a).float(), reference.gelu, [x], torch.float16)


def test_output_of_another_shape_fails():
    x = torch.randn(3, 8)
    with pytest.raises(AssertionError, match=r"shape \(3, 8, 1\), expected \(3, 8\)"):
        check_against_reference(lambda a: reference.gelu(a).unsqueeze(-1), reference.gelu, [x], torch.float32)
