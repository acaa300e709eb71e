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
    with pytest.raises(ShapeError, match="multiple of Hkv"):  # no key heads: an error, not a division by zero
        flash_attention(torch.randn(1, 2, 8, 16), torch.randn(1, 0, 8, 16), torch.randn(1, 0, 8, 16))
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


def _fa_module():
    import importlib

    return importlib.import_module("torchnitro.kernels.flash_attention")  # the package re-exports the function


def _grads_vs_reference(fa, q, k, v, dy, causal, fwd_cfg, bwd_cfgs, scale=0.25):
    """Max abs errors, relative to the largest reference value, of (O, dQ, dK, dV) from the launchers under forced configs, vs the fp32 reference."""
    o, lse = fa.flash_attention_forward(q, k, v, causal, None, scale, config=fwd_cfg)
    dq, dk, dv = fa.flash_attention_backward(dy, q, k, v, o, lse, causal, None, scale, configs=bwd_cfgs)
    qr, kr, vr = (t.detach().float().clone().requires_grad_() for t in (q, k, v))
    ref = reference.flash_attention(qr, kr, vr, causal, None, scale)
    ref.backward(dy.float())
    return [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in
            ((o, ref.detach()), (dq, qr.grad), (dk, kr.grad), (dv, vr.grad))]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("i", range(6))
@pytest.mark.parametrize("D", [16, 160])  # the D <= 128 lists, and the wide ones (160 also pads BLOCK_D)
def test_flash_attention_every_candidate_config(triton_cpu, causal, i, D):
    # fp32 through the interpreter; T spans two 128-blocks plus a tail, so every candidate runs its
    # unmasked interior loops, the causal diagonal and the ragged edge; GQA (G=2) runs the dK/dV head loop
    fa = _fa_module()
    torch.manual_seed(i)
    B, H, Hkv, T = 1, 2, 1, 272
    cands = fa.candidates(D)
    if i >= max(map(len, cands)):
        pytest.skip(f"the D={D} lists have {max(map(len, cands))} candidates")
    q, k, v, dy = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, H, T, D)
    fwd_cfg, kv_cfg, q_cfg = (c[i % len(c)] for c in cands)
    errs = _grads_vs_reference(fa, q, k, v, dy, causal, fwd_cfg, (kv_cfg, q_cfg))
    assert max(errs) < 1e-4, f"configs {fwd_cfg}, {kv_cfg}, {q_cfg}: errors (O, dQ, dK, dV) {errs}"


def test_flash_attention_candidate_lists_cover_every_kernel():
    fa = _fa_module()
    for cands in (*fa.candidates(128), *fa.candidates(256)):
        assert 1 <= len(cands) <= 6 and len(set(cands)) == len(cands)  # the config test above walks 6 per kernel
        assert all(c.block_m >= 16 and c.block_n >= 16 for c in cands)  # tl.dot needs 16-wide tiles


def test_pick_config_times_candidates_once_and_caches(monkeypatch):
    fa = _fa_module()
    monkeypatch.setattr(fa, "_CHOSEN", {})
    monkeypatch.setattr(fa, "tuning_enabled", lambda device: True)
    cands = (fa.KernelConfig(16, 16, 4, 1), fa.KernelConfig(32, 16, 4, 2), fa.KernelConfig(64, 16, 4, 3))
    cost = {cands[0]: 3.0, cands[1]: 1.0}
    timed = []

    def fake_time(launch):
        launch()
        return cost[timed[-1]]

    def launch(c):
        timed.append(c)
        if c not in cost:
            raise RuntimeError("out of shared memory")  # a candidate that does not compile is skipped

    monkeypatch.setattr(fa, "_time_ms", fake_time)
    x = torch.zeros(1)
    assert fa._pick_config("fwd", ("k",), cands, x, launch) == cands[1]
    assert timed == list(cands)
    assert fa._pick_config("fwd", ("k",), cands, x, launch) == cands[1]  # cached: nothing timed again
    assert len(timed) == 3
    assert fa.chosen_configs() == {"fwd k": "M32/N16/w4/s2"}
    with pytest.raises(fa.BackendUnavailableError, match="no launch config ran"):
        fa._pick_config("dq", ("k",), cands[2:], x, launch)


def test_pick_config_untimed_defaults(monkeypatch):
    fa = _fa_module()
    cands = (fa.KernelConfig(128, 64, 8, 3), fa.KernelConfig(64, 64, 4, 3))
    never = lambda c: pytest.fail("nothing may be timed here")  # noqa: E731
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fa._pick_config("fwd", ("x",), cands, torch.zeros(1), never) == fa._INTERPRET_CONFIG
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert fa._pick_config("fwd", ("x",), cands, torch.zeros(1), never) == cands[0]  # CPU tensor: fixed default
    monkeypatch.setenv("TORCHNITRO_KERNEL_TUNE", "0")
    assert not fa.tuning_enabled(torch.device("cuda"))  # the switch reaches the picker on CUDA too


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [128, 256])
def test_flash_attention_every_candidate_config_gpu(causal, D):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU; none is visible (run on the device machine)")
    fa = _fa_module()
    B, H, Hkv, T = 1, 4, 2, 600
    q, k, v = (torch.randn(B, h, T, D, device="cuda").bfloat16() for h in (H, Hkv, Hkv))
    dy = torch.randn(B, H, T, D, device="cuda").bfloat16()
    for i in range(6):
        cfgs = [c[i % len(c)] for c in fa.candidates(D)]
        try:
            errs = _grads_vs_reference(fa, q, k, v, dy, causal, cfgs[0], tuple(cfgs[1:]), scale=D ** -0.5)
        except Exception as e:  # noqa: BLE001 - a config over this GPU's shared memory is skipped by the picker too
            if "OutOfResources" not in type(e).__name__ and "shared memory" not in str(e):
                raise
            continue
        assert max(errs) < 3e-2, f"configs {cfgs}: errors (O, dQ, dK, dV) {errs}"


def test_flash_attention_negative_scale_matches_reference(triton_cpu):
    # the kernels take the row max before scaling (one FMA per score), valid for scale > 0 only
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    torch.testing.assert_close(flash_attention(q, k, v, False, scale=-0.3),
                               reference.flash_attention(q, k, v, False, None, -0.3), atol=1e-5, rtol=1e-4)
    fa = _fa_module()
    with pytest.raises(InputError, match="scale=-0.3"):
        fa.flash_attention_forward(q, k, v, True, None, -0.3)
