from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import InputError, ShapeError
from torchnitro.kernels import flash_attention, reference

CASES = [  # (B, H, Hkv, T, D, causal, window)
    (1, 2, 2, 33, 16, False, None),
    (1, 2, 2, 40, 64, True, None),
    (2, 4, 2, 24, 64, True, 7),  # GQA + sliding window
    (1, 4, 1, 20, 32, False, 9),  # MQA, bidirectional window
]


@pytest.mark.parametrize("B,H,Hkv,T,D,causal,window", CASES)
def test_flash_attention_fp32_matches_sdpa(triton_cpu, B, H, Hkv, T, D, causal, window):
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    check_against_reference(lambda a, b, c: flash_attention(a, b, c, causal, window),
                            lambda a, b, c: reference.flash_attention(a, b, c, causal, window), [q, k, v],
                            torch.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_cross_lengths_and_scale(triton_cpu, causal):
    q, k, v = torch.randn(1, 2, 20, 32), torch.randn(1, 2, 33, 32), torch.randn(1, 2, 33, 32)
    check_against_reference(lambda a, b, c: flash_attention(a, b, c, causal, scale=0.3),
                            lambda a, b, c: reference.flash_attention(a, b, c, causal, scale=0.3), [q, k, v],
                            torch.float32)


def test_flash_attention_strided_inputs(triton_cpu):
    x = torch.randn(2, 24, 3, 4, 32)  # (B, T, qkv, H, D) as a fused QKV projection lays it out
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))  # (B, H, T, D) views, not contiguous
    check_against_reference(lambda a, b, c: flash_attention(a, b, c, True),
                            lambda a, b, c: reference.flash_attention(a, b, c, True), [q, k, v], torch.float32)


def _err(fn, q, k, v, ref_out, ref_grads, dy):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(dy.to(out.dtype))
    errs = [(out.float() - ref_out).abs().max()]
    errs += [(t.grad.float() - g).abs().max() for t, g in zip((q, k, v), ref_grads)]
    return torch.stack(errs)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_fp16_error_within_2x_of_reference(triton_cpu, causal):
    B, H, Hkv, T, D = 1, 2, 1, 32, 64
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    dy = torch.randn(B, H, T, D)
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    out32 = reference.flash_attention(qf, kf, vf, causal)
    out32.backward(dy)
    grads32 = [t.grad for t in (qf, kf, vf)]
    low = [t.half() for t in (q, k, v)]
    ours = _err(lambda a, b, c: flash_attention(a, b, c, causal), *low, out32.detach(), grads32, dy)
    theirs = _err(lambda a, b, c: reference.flash_attention(a, b, c, causal), *low, out32.detach(), grads32, dy)
    assert torch.all(ours <= 2 * theirs + 1e-3), f"fused fp16 errors {ours.tolist()} vs reference {theirs.tolist()}"


def test_flash_attention_bad_input(triton_cpu):
    with pytest.raises(ShapeError, match="4-d"):
        flash_attention(torch.randn(2, 8, 16), torch.randn(2, 8, 16), torch.randn(2, 8, 16))
    with pytest.raises(ShapeError, match="multiple of Hkv"):
        flash_attention(torch.randn(1, 3, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16))
    with pytest.raises(InputError, match="window=0"):
        q = torch.randn(1, 1, 8, 16)
        flash_attention(q, q, q, window=0)


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 256)])
def test_flash_attention_gpu(D, dtype, causal, window):
    B, H, Hkv, T = 2, 8, 2, 1000
    q = torch.randn(B, H, T, D, device="cuda")
    k, v = torch.randn(B, Hkv, T, D, device="cuda"), torch.randn(B, Hkv, T, D, device="cuda")
    dy = torch.randn(B, H, T, D, device="cuda")
    qf, kf, vf = (t.clone().requires_grad_() for t in (q, k, v))
    out32 = reference.flash_attention(qf, kf, vf, causal, window)
    out32.backward(dy)
    grads32 = [t.grad for t in (qf, kf, vf)]
    low = [t.to(dtype) for t in (q, k, v)]
    ours = _err(lambda a, b, c: flash_attention(a, b, c, causal, window), *low, out32.detach(), grads32, dy)
    theirs = _err(lambda a, b, c: reference.flash_attention(a, b, c, causal, window), *low, out32.detach(), grads32, dy)
    assert torch.all(ours <= 2 * theirs + 1e-3), f"fused errors {ours.tolist()} vs reference {theirs.tolist()}"


def test_flash_attention_module(triton_cpu):
    from torchnitro.kernels import FlashAttention

    q, k, v = torch.randn(1, 2, 12, 16), torch.randn(1, 1, 12, 16), torch.randn(1, 1, 12, 16)
    torch.testing.assert_close(FlashAttention(causal=True, window=4)(q, k, v),
                               reference.flash_attention(q, k, v, True, 4), atol=1e-5, rtol=1e-5)
