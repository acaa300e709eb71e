from __future__ import annotations

import dataclasses

import pytest
import torch

from torchnitro.autotune.recipe import BuildContext, get_recipe
from torchnitro.hardware import hardware_info
from torchnitro.nn.models import MLP, TransformerLM


def test_registered_and_gpu_only_with_reason():
    r = get_recipe("fused-kernels")
    hw = hardware_info()
    if not hw.has_gpu:
        reason = r.unavailable_reason(hw)
        assert reason and "CUDA GPU" in reason
    assert r.inapplicable_reason(MLP(16, 16, 16, 2), ()) is not None


def test_build_patches_the_private_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_KERNELS", "reference")  # build logic only; kernels are checked in tests/kernels
    model = TransformerLM(vocab_size=64, dim=32, n_layers=1, n_heads=2).eval()
    tokens = torch.randint(0, 64, (1, 8))
    expected = model(tokens)
    ctx = BuildContext(model=model, example_inputs=(tokens,), hardware=hardware_info(), device=torch.device("cpu"),
                       workdir=tmp_path)
    built = get_recipe("fused-kernels").build(ctx)
    assert built.meta["replaced"]["_SwiGLU -> FusedSwiGLU"] == 1
    torch.testing.assert_close(built.fn(tokens), expected, atol=1e-5, rtol=1e-5)
    assert dataclasses.is_dataclass(built)


@pytest.mark.gpu
def test_build_on_gpu_matches_eager(tmp_path):
    model = TransformerLM(vocab_size=256, dim=128, n_layers=2, n_heads=2).eval().cuda()
    tokens = torch.randint(0, 256, (2, 64), device="cuda")
    expected = model(tokens)
    ctx = BuildContext(model=model, example_inputs=(tokens,), hardware=hardware_info(), device=torch.device("cuda"),
                       workdir=tmp_path)
    built = get_recipe("fused-kernels").build(ctx)
    torch.testing.assert_close(built.fn(tokens), expected, atol=1e-3, rtol=1e-3)
