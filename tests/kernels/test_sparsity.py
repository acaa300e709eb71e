from __future__ import annotations

import pytest
import torch

from torchnitro.errors import BackendUnavailableError, ShapeError
from torchnitro.kernels import mask_2to4, prune_2to4, sparsify_, to_semi_structured, verify_2to4


def test_prune_keeps_two_largest_of_four():
    w = torch.tensor([[1.0, -4.0, 3.0, 0.5, 0.1, 0.2, -0.3, 0.4]])
    p = prune_2to4(w)
    torch.testing.assert_close(p, torch.tensor([[0.0, -4.0, 3.0, 0.0, 0.0, 0.0, -0.3, 0.4]]))
    assert verify_2to4(p) and not verify_2to4(w)
    assert mask_2to4(torch.randn(64, 128)).float().mean().item() == 0.5


def test_prune_rejects_bad_shape():
    with pytest.raises(ShapeError, match="divisible by 4"):
        mask_2to4(torch.randn(8, 6))


def test_sparsify_prunes_eligible_layers_only():
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    report = sparsify_(model, convert=False)
    assert report.pruned_only == ["0"] and "2" in report.skipped
    assert verify_2to4(model[0].weight) and not verify_2to4(model[2].weight)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_convert_refuses_without_gpu():
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        to_semi_structured(torch.nn.Linear(128, 64))


@pytest.mark.gpu
def test_semi_structured_linear_matches_dense():
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("needs compute capability >= 8.0")
    lin = torch.nn.Linear(256, 128).half().cuda()
    with torch.no_grad():
        lin.weight.copy_(prune_2to4(lin.weight))
    x = torch.randn(64, 256, device="cuda", dtype=torch.half)
    dense = lin(x)
    to_semi_structured(lin)
    torch.testing.assert_close(lin(x), dense, atol=1e-2, rtol=1e-2)
