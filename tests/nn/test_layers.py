from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchnitro import nn as tnn
from torchnitro.errors import ConfigError


@pytest.fixture(params=["reference", "triton"])
def backend(request, monkeypatch):
    if request.param == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", request.param)
    return request.param


def test_swiglu_mlp_matches_plain_math(backend):
    m = tnn.SwiGLU(32, 64)
    x = torch.randn(2, 5, 32, requires_grad=True)
    ref = m.w2(F.silu(m.w1(x)) * m.w3(x))
    out = m(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.sum().backward()
    assert m.w1.weight.grad is not None and x.grad is not None


def test_geglu_and_gelu_mlps(backend):
    x = torch.randn(3, 32)
    g = tnn.GeGLU(32, 48)
    torch.testing.assert_close(g(x), g.w2(F.gelu(g.w1(x)) * g.w3(x)), atol=1e-5, rtol=1e-5)
    m = tnn.GELUMLP(32, 48)
    torch.testing.assert_close(m(x), m.fc2(F.gelu(F.linear(x, m.fc1.weight, m.fc1.bias))), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mlp,norm", [("swiglu", "rmsnorm"), ("gelu", "layernorm"), ("geglu", "rmsnorm")])
def test_transformer_block_matches_unfused_math(backend, mlp, norm):
    blk = tnn.TransformerBlock(dim=32, heads=4, kv_heads=2, mlp=mlp, norm=norm, rope=True, max_seq_len=16)
    x = torch.randn(2, 9, 32, requires_grad=True)
    with torch.no_grad():
        a = blk.attn(blk.attn_norm(x))
        h = x + a
        ref = h + blk.mlp(blk.mlp_norm(h))
    out = blk(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    out.square().mean().backward()
    assert all(p.grad is not None for p in blk.parameters())


def test_block_trains_with_fused_adamw():
    blk = tnn.TransformerBlock(dim=32, heads=4)
    opt = torch.optim.AdamW(blk.parameters(), lr=1e-2, fused=True)  # fused AdamW runs on CPU and CUDA
    x = torch.randn(4, 8, 32)
    target = torch.randn(4, 8, 32)
    first = None
    for _ in range(5):
        loss = F.mse_loss(blk(x), target)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < first


def test_block_rejects_unknown_options():
    with pytest.raises(ConfigError, match="mlp='relu'"):
        tnn.TransformerBlock(dim=32, heads=4, mlp="relu")
    with pytest.raises(ConfigError, match="norm='batchnorm'"):
        tnn.TransformerBlock(dim=32, heads=4, norm="batchnorm")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_transformer_block_triton_matches_reference_on_gpu(dtype, monkeypatch):
    blk = tnn.TransformerBlock(dim=256, heads=4, kv_heads=2, max_seq_len=512).cuda().to(dtype)
    x = torch.randn(2, 300, 256, device="cuda", dtype=dtype, requires_grad=True)
    monkeypatch.setenv("TORCHNITRO_KERNELS", "reference")
    ref = blk(x)
    (gx_ref,) = torch.autograd.grad(ref.float().square().mean(), x)
    monkeypatch.setenv("TORCHNITRO_KERNELS", "triton")
    out = blk(x)
    (gx,) = torch.autograd.grad(out.float().square().mean(), x)
    torch.testing.assert_close(out.float(), ref.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(gx.float(), gx_ref.float(), atol=5e-2, rtol=5e-2)
