"""SemiSparseLinear on CPU: the dense pruned reference path, the reasons, the explicit-backend errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchnitro.errors import BackendUnavailableError, InputError
from torchnitro.kernels.sparsity import SemiSparseLinear, mask_2to4, prune_2to4, semi_structured_reason, verify_2to4


@pytest.mark.parametrize("shape", [(2, 128, 512), (5, 123, 64)])
def test_dense_path_is_linear_with_the_pruned_weight(shape):
    *lead, k = shape
    lin = nn.Linear(k, 128)
    m = SemiSparseLinear(lin)
    x = torch.randn(*lead, k)
    w = lin.weight.detach()
    pruned = prune_2to4(w)
    assert verify_2to4(pruned) and not verify_2to4(w)
    assert int((pruned != 0).sum()) == w.numel() // 2  # exactly 2 of every 4 kept (no ties in random weights)
    torch.testing.assert_close(m(x), F.linear(x, pruned, lin.bias.detach()))
    assert torch.equal(lin.weight.detach(), w)  # the source layer is not changed


def test_mask_keeps_the_two_largest_of_each_four():
    w = torch.tensor([[0.1, -5.0, 2.0, 0.3, 1.0, 1.5, -2.0, 0.0]])
    assert mask_2to4(w).tolist() == [[False, True, True, False, False, True, True, False]]


def test_cpu_reason_and_explicit_sparse_backend():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible; the CPU reason does not apply")
    why = semi_structured_reason()
    assert why is not None and why.startswith("needs CUDA sm_80+ with cuSPARSELt/CUTLASS semi-structured sparse")
    with pytest.raises(BackendUnavailableError, match="sm_80"):
        SemiSparseLinear(nn.Linear(64, 64), backend="sparse")
    assert SemiSparseLinear(nn.Linear(64, 64)).sparse is False
    with pytest.raises(InputError, match="backend='cusparse'"):
        SemiSparseLinear(nn.Linear(64, 64), backend="cusparse")
