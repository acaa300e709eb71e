"""TensorRT (GPU, needs torch_tensorrt)."""

from __future__ import annotations

import pytest
import torch

from torchnitro.nn.zoo import get_builtin


@pytest.mark.gpu
def test_tensorrt_if_installed(build):
    pytest.importorskip("torch_tensorrt")
    b = get_builtin("mlp")
    model = b.build().cuda()
    x = tuple(t.cuda() for t in b.inputs(8, 0, 0))
    _, built, _ = build("tensorrt", model, x, device="cuda")
    y, ref = built.fn(*x), model(*x)
    assert torch.nn.functional.cosine_similarity(y.float().flatten(), ref.flatten(), dim=0) > 0.999
