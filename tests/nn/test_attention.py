from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchnitro import nn as tnn
from torchnitro.errors import ConfigError, ShapeError
from torchnitro.kernels.attention_policy import attention_routes, reset_attention_routes
from torchnitro.nn.models import apply_rope


@pytest.mark.parametrize("backend,attn_backend", [("reference", "auto"), ("triton", "auto"), ("triton", "flash"),
                                                  ("triton", "sdpa")])
@pytest.mark.parametrize("kv_heads,window", [(4, None), (2, None), (1, 5)])
def test_attention_matches_sdpa(backend, attn_backend, kv_heads, window, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", backend)
    monkeypatch.delenv("TORCHNITRO_ATTENTION", raising=False)
    reset_attention_routes()
    attn = tnn.Attention(32, heads=4, kv_heads=kv_heads, window=window, max_seq_len=16, backend=attn_backend)
    x = torch.randn(2, 11, 32, requires_grad=True)
    B, T, _ = x.shape
    q = attn.wq(x).view(B, T, 4, 8).transpose(1, 2)
    k = attn.wk(x).view(B, T, kv_heads, 8).transpose(1, 2)
    v = attn.wv(x).view(B, T, kv_heads, 8).transpose(1, 2)
    cos, sin = attn.rotary.cos[:T], attn.rotary.sin[:T]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    i = torch.arange(T)
    mask = (i[None, :] <= i[:, None]) & ((i[:, None] - i[None, :]) < (window or T))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 4)
    ref = attn.wo(y.transpose(1, 2).reshape(B, T, -1))
    out = attn(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert attn.wq.weight.grad is not None
    route = next(r for r in attention_routes() if r["site"] == "nn.Attention")
    expected = attn_backend if attn_backend != "auto" else ("flash" if window else "sdpa")
    assert route["backend"] == expected, route


def test_attention_errors():
    with pytest.raises(ConfigError, match="heads divisible by kv_heads"):
        tnn.Attention(32, heads=4, kv_heads=3)
    with pytest.raises(ConfigError, match=r"backend='cudnn'; expected one of \['auto', 'sdpa', 'flash'\]"):
        tnn.Attention(32, heads=4, backend="cudnn")
    with pytest.raises(ShapeError, match=r"expected \(batch, seq, 32\)"):
        tnn.Attention(32, heads=4)(torch.randn(2, 5, 16))
