"""Attention FLOPs: counted on CPU (torch counts 0 there) and causal attention counted once, not as the square."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchnitro.profile import ProfileConfig, profile
from torchnitro.profile.flops import causal_fraction

_CFG = ProfileConfig(warmup=1, steps=1, measure_peak=False, monitor=False, track_memory=False)


def test_causal_fraction_by_hand():
    assert causal_fraction(4, 4) == 10 / 16  # 1 + 2 + 3 + 4 kept pairs
    assert causal_fraction(5, 3) == 12 / 15  # rows see 1, 2, 3, 3, 3 keys
    assert causal_fraction(2, 6) == 3 / 12
    assert causal_fraction(0, 3) == 0.0


@pytest.mark.parametrize("b,h,t,d", [(2, 4, 64, 32), (1, 3, 17, 24)])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_flops_forward_and_backward(b, h, t, d, causal):
    q = torch.randn(b, h, t, d, requires_grad=True)
    k, v = torch.randn(b, h, t, d), torch.randn(b, h, t, d)
    square = 2 * (2 * b * h * t * t * d)  # Q K^T and P V, each 2*t*t*d per head
    keep = (t * (t + 1) // 2) / (t * t) if causal else 1.0
    fwd = profile(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), config=_CFG)
    assert fwd.flops == int(square * keep) and set(fwd.flops_by_category) == {"attention"}
    both = profile(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward(), config=_CFG)
    assert both.flops == int(square * keep) + int(2.5 * square * keep)  # backward: 5 matmuls to forward's 2
