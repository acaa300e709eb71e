from __future__ import annotations

import pytest
import torch

from torchnitro.nn.zoo import get_builtin


@pytest.mark.parametrize("name", ["conv-bn-fold", "channels-last", "conv-bn-fold+channels-last"])
@pytest.mark.parametrize("batch,hw", [(2, 32), (3, 17)])
def test_vision_recipes_exact(build, name, batch, hw):
    b = get_builtin("cnn")
    model = b.build()
    x = (torch.randn(batch, 3, hw, hw),)
    r, built, _ = build(name, model, (torch.randn(2, 3, 32, 32),))
    torch.testing.assert_close(built.fn(*x), model(*x), rtol=1e-4, atol=1e-4)
    if "fold" in name:
        assert built.notes == "15/15 BatchNorms folded"
    again = r.load(None, built.meta, b.build())
    torch.testing.assert_close(again(*x), built.fn(*x), rtol=1e-5, atol=1e-5)


def test_fold_leaves_non_consecutive_bn_alone(build):
    class Skip(torch.nn.Module):  # BN consumes conv output + residual: not foldable
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 3, 3, padding=1)
            self.bn = torch.nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(self.conv(x) + x)

    m = Skip().eval()
    m.bn.running_mean.uniform_()
    x = (torch.randn(2, 3, 8, 8),)
    _, built, _ = build("conv-bn-fold", m, x)
    assert built.notes == "0/1 BatchNorms folded"
    torch.testing.assert_close(built.fn(*x), m(*x))


def test_inapplicable_without_convs():
    from torchnitro.autotune.recipe import get_recipe

    mlp = get_builtin("mlp").build()
    assert "Conv2d" in get_recipe("channels-last").inapplicable_reason(mlp, ())
    assert "BatchNorm" in get_recipe("conv-bn-fold").inapplicable_reason(mlp, ())
