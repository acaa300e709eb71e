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


def _plain_block(sd: dict, x: torch.Tensor, heads: int, kv_heads: int, mlp: str, norm: str,
                 eps: float = 1e-6) -> torch.Tensor:
    """The pre-norm block written from the math on copied weights: no torchnitro module or kernel runs."""
    def nrm(prefix, t):
        if norm == "layernorm":
            mu = t.mean(-1, keepdim=True)
            var = (t - mu).square().mean(-1, keepdim=True)
            return (t - mu) / torch.sqrt(var + eps) * sd[prefix + ".weight"] + sd[prefix + ".bias"]
        return t / torch.sqrt(t.square().mean(-1, keepdim=True) + eps) * sd[prefix + ".weight"]

    def attn(t):  # t (B, T, D)
        B, T, D = t.shape
        dh = D // heads
        q = (t @ sd["attn.wq.weight"].T).view(B, T, heads, dh).transpose(1, 2)  # (B, H, T, Dh)
        k = (t @ sd["attn.wk.weight"].T).view(B, T, kv_heads, dh).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = (t @ sd["attn.wv.weight"].T).view(B, T, kv_heads, dh).transpose(1, 2)
        ang = torch.arange(T).double()[:, None] / 10000.0 ** (torch.arange(0, dh, 2).double() / dh)  # (T, Dh/2)
        cos, sin = ang.cos().float(), ang.sin().float()

        def rot(z):  # rotate the pairs (z_i, z_{i + Dh/2}) by the position's angle
            z1, z2 = z[..., : dh // 2], z[..., dh // 2:]
            return torch.cat([z1 * cos - z2 * sin, z2 * cos + z1 * sin], -1)

        q, k = rot(q), rot(k)
        k, v = (z.repeat_interleave(heads // kv_heads, dim=1) for z in (k, v))  # query head h reads kv head h // g
        s = q @ k.transpose(-1, -2) / dh ** 0.5  # (B, H, T, T)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = torch.softmax(s, -1) @ v  # (B, H, T, Dh)
        return y.transpose(1, 2).reshape(B, T, D) @ sd["attn.wo.weight"].T

    def ffn(t):
        if mlp == "gelu":
            hid = F.gelu(t @ sd["mlp.fc1.weight"].T + sd["mlp.fc1.bias"])
            return hid @ sd["mlp.fc2.weight"].T + sd["mlp.fc2.bias"]
        gate = t @ sd["mlp.w1.weight"].T
        act = gate * torch.sigmoid(gate) if mlp == "swiglu" else 0.5 * gate * (1 + torch.erf(gate / 2 ** 0.5))
        return (act * (t @ sd["mlp.w3.weight"].T)) @ sd["mlp.w2.weight"].T

    h = x + attn(nrm("attn_norm", x))
    return h + ffn(nrm("mlp_norm", h))


@pytest.mark.parametrize("mlp,norm", [("swiglu", "rmsnorm"), ("gelu", "layernorm"), ("geglu", "rmsnorm")])
def test_transformer_block_matches_unfused_math(backend, mlp, norm):
    torch.manual_seed(0)
    blk = tnn.TransformerBlock(dim=32, heads=4, kv_heads=2, mlp=mlp, norm=norm, rope=True, max_seq_len=16)
    with torch.no_grad():  # norms with non-trivial affine terms, so a dropped or misplaced one shows
        for name, p in blk.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if name.endswith("weight") else 0.0))
    x = torch.randn(2, 9, 32, requires_grad=True)
    sd = {k: v.detach().clone() for k, v in blk.state_dict().items()}
    ref = _plain_block(sd, x.detach(), heads=4, kv_heads=2, mlp=mlp, norm=norm)
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
