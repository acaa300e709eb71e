"""QA from a user's side (task E6): models and calls the recipes were not written around."""

from __future__ import annotations

import pytest
import torch
from torch import nn


class _Scaled(nn.Module):
    """A user's model with a defaulted non-tensor argument the example does not pass."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.act = lambda t: t * 2  # a lambda attribute, as scripts have

    def forward(self, x, mask=None, scale=1.0):
        y = self.act(self.lin(x)) * scale
        return y if mask is None else y * mask[..., None]


@pytest.mark.parametrize("n_inputs", [1, 2])
def test_onnx_export_keeps_defaulted_arguments_constant(tmp_path, n_inputs):
    """A defaulted forward argument that is not given (``scale=1.0``) must not become an ONNX graph input
    that no call feeds (it did: ORT failed with "Required inputs (['onnx::Cast_2']) are missing")."""
    pytest.importorskip("onnxruntime")
    from torchnitro.autotune.recipes.onnx import OrtRunner, export_onnx

    torch.manual_seed(0)
    model = _Scaled().eval()
    args = (torch.randn(3, 8), torch.ones(3))[:n_inputs]
    meta = export_onnx(model, args, tmp_path / "m.onnx", {i: [0] for i in range(n_inputs)})
    runner = OrtRunner(tmp_path / "m.onnx", meta, threads=1)
    held = (torch.randn(5, 8), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]))[:n_inputs]
    with torch.no_grad():
        torch.testing.assert_close(runner(*held), model(*held), rtol=1e-4, atol=1e-5)
