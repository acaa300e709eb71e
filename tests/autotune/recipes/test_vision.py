from __future__ import annotations

import pytest
import torch

from torchnitro.nn.zoo import get_builtin

_BN = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def _trained_bns(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every BatchNorm the statistics and affine terms of a trained net: with the defaults (mean 0,
    var 1, weight 1, bias 0) BN is nearly the identity, and a wrong fold or a dropped BN would pass."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, _BN):
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(c, generator=g) * 2 + 0.25)
                m.weight.copy_(torch.rand(c, generator=g) * 1.5 + 0.25)
                m.bias.copy_(torch.randn(c, generator=g) * 0.5)
    return model.eval()


def _without_bns(model: torch.nn.Module) -> torch.nn.Module:
    import copy

    m = copy.deepcopy(model)
    for name, mod in list(m.named_modules()):
        if isinstance(mod, _BN):
            m.set_submodule(name, torch.nn.Identity())
    return m


@pytest.mark.parametrize("name", ["conv-bn-fold", "channels-last", "conv-bn-fold+channels-last"])
@pytest.mark.parametrize("batch,hw", [(2, 32), (3, 17)])
def test_vision_recipes_exact(build, name, batch, hw):
    b = get_builtin("cnn")
    model = _trained_bns(b.build())
    x = (torch.randn(batch, 3, hw, hw),)
    with torch.no_grad():
        want = model(*x)
        # the BatchNorms matter here: dropping them moves the output far beyond the tolerance below
        assert (_without_bns(model)(*x) - want).abs().max() > 0.1
    r, built, _ = build(name, model, (torch.randn(2, 3, 32, 32),))
    with torch.no_grad():
        torch.testing.assert_close(built.fn(*x), want, rtol=1e-4, atol=1e-4)
    if "fold" in name:
        assert built.notes == "15/15 BatchNorms folded"
    again = r.load(None, built.meta, _trained_bns(b.build()))
    with torch.no_grad():
        torch.testing.assert_close(again(*x), want, rtol=1e-4, atol=1e-4)


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
