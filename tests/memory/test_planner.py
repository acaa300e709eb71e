from __future__ import annotations

import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.memory import Budget, plan
from torchnitro.nn.models import TransformerConfig, TransformerLM

from ._steps import tracked_peak

# The README quotes the planner within 1.1% of the tracker's peak (worst of 40 cases in
# results/memory_cpu.md); the tests hold it to that bound (worst here: 0.74%, autocast + blocks).
PEAK_TOL = 0.011

GRID = [
    (dict(vocab_size=1000, dim=64, n_layers=2, n_heads=4, max_seq_len=128), 2, 32),
    (dict(vocab_size=512, dim=96, n_layers=3, n_heads=3, max_seq_len=128), 3, 96),  # odd shapes
    (dict(vocab_size=700, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=128), 2, 64),  # GQA
    (dict(vocab_size=3000, dim=96, n_layers=2, n_heads=4, max_seq_len=64), 1, 16),  # param-bound
]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("cfg,batch,seq", GRID)
def test_planner_matches_tracker(cfg, batch, seq, dtype):
    c = TransformerConfig(**cfg)
    r = tracked_peak(c, batch, seq, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
    p = plan(c, batch=batch, seq=seq, dtype=dtype, device="cpu")
    assert abs(p.peak_bytes / r.peak.bytes - 1) < PEAK_TOL, p.table()
    for phase in ("forward", "backward", "optimizer"):
        assert abs(p.phases[phase] / r.per_phase[phase].bytes - 1) < PEAK_TOL, phase


@pytest.mark.parametrize("policy", ["blocks", "every_2", "selective"])
def test_planner_matches_tracker_with_checkpointing(policy):
    c = TransformerConfig(vocab_size=512, dim=64, n_layers=4, n_heads=4, max_seq_len=128)
    r = tracked_peak(c, 2, 128, torch.float32, policy)
    p = plan(c, batch=2, seq=128, checkpointing=policy, device="cpu")
    assert abs(p.peak_bytes / r.peak.bytes - 1) < PEAK_TOL, p.table()


def test_parameter_count_and_table():
    c = TransformerConfig(vocab_size=1000, dim=64, n_layers=2)
    n = sum(p.numel() for p in TransformerLM(c).parameters())
    p = plan(c, batch=1, seq=8, dtype="bf16")
    assert p.term("parameters") == 2 * n
    assert p.term("optimizer_state") >= 2 * p.term("parameters")
    text = p.table()
    assert "activations/layer" in text and "peak" in text
    assert p.to_dict()["peak_bytes"] == p.peak_bytes


def test_activations_scale_with_batch_and_policy():
    c = dict(vocab_size=128, dim=64, n_layers=4, max_seq_len=256)
    a1 = plan(c, batch=1, seq=256).activation_bytes
    a2 = plan(c, batch=2, seq=256).activation_bytes
    assert a2 == pytest.approx(2 * a1, rel=1e-6)
    none = plan(c, batch=4, seq=256).term("activations/layers")
    blocks = plan(c, batch=4, seq=256, checkpointing="blocks").term("activations/layers")
    sel = plan(c, batch=4, seq=256, checkpointing="selective").term("activations/layers")
    half = plan(c, batch=4, seq=256, checkpointing=Budget(0.5)).activation_bytes
    assert blocks < sel < none
    assert half <= 0.5 * plan(c, batch=4, seq=256).activation_bytes * 1.001
    math_attn = plan(c, batch=4, seq=256, attention="math").activation_bytes
    assert math_attn > plan(c, batch=4, seq=256).activation_bytes


def test_bad_input():
    c = TransformerConfig(vocab_size=100, dim=32, n_layers=1, max_seq_len=16)
    with pytest.raises(InputError, match="checkpointing"):
        plan(c, batch=1, seq=8, checkpointing="sometimes")
    with pytest.raises(InputError, match="max_seq_len"):
        plan(c, batch=1, seq=64)
    with pytest.raises(InputError, match="dtype"):
        plan(c, batch=1, seq=8, dtype="fp8")
    with pytest.raises(InputError, match="optimizer"):
        plan(c, batch=1, seq=8, optimizer="lion")
    with pytest.raises(InputError, match="batch"):
        plan(c, batch=0, seq=8)
    with pytest.raises(InputError, match="TransformerConfig"):
        plan("gpt2", batch=1, seq=8)
    with pytest.raises(InputError, match="Budget"):
        Budget(1.5)


@pytest.mark.parametrize("kv", [None, 2])
def test_planner_math_attention_matches_tracker(kv):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torchnitro.memory import track

    from ._steps import lm_step

    c = TransformerConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=kv, max_seq_len=128)
    model, opt, step = lm_step(c, 2, 96, torch.bfloat16)
    with sdpa_kernel(SDPBackend.MATH):  # materialised softmax: memory grows with T^2
        step()
        with track(model, opt) as t:
            step()
    p = plan(c, batch=2, seq=96, dtype="bf16", attention="math", device="cpu")
    assert abs(p.peak_bytes / t.report().peak.bytes - 1) < PEAK_TOL, p.table()


@pytest.mark.parametrize("cfg,batch,seq,policy", [(*GRID[0], "none"), (*GRID[2], "none"), (*GRID[3], "none"),
                                                 (*GRID[1], "blocks"), (*GRID[0], "selective")])
def test_planner_autocast_matches_tracker(cfg, batch, seq, policy):
    import torch.nn.functional as F

    from torchnitro.memory import checkpoint_, track

    c = TransformerConfig(**cfg)
    model = checkpoint_(TransformerLM(c), policy)
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randint(0, c.vocab_size, (batch, seq))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 master weights, bf16 matmuls
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with track(model, opt) as t:
        step()
    r = t.report()
    p = plan(c, batch=batch, seq=seq, amp="bf16", checkpointing=policy, device="cpu")
    assert abs(p.peak_bytes / r.peak.bytes - 1) < PEAK_TOL, p.table()
    fwd_acts = r.per_phase["forward"].by_category["activations"]
    assert abs(p.activation_bytes / fwd_acts - 1) < PEAK_TOL


def test_autocast_bad_combinations():
    c = TransformerConfig(vocab_size=100, dim=32, n_layers=1, max_seq_len=16)
    with pytest.raises(InputError, match="fp32 parameters"):
        plan(c, batch=1, seq=8, dtype="bf16", amp="bf16")
    with pytest.raises(InputError, match="amp"):
        plan(c, batch=1, seq=8, amp="fp32")


def test_sdpa_backend_on_cpu_follows_pytorch():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from torchnitro.memory.planner import sdpa_backend

    kw = dict(n_heads=4, kv_heads=2, head_dim=32, seq=64)
    assert sdpa_backend("cpu", 4, **kw) == "flash"
    with sdpa_kernel(SDPBackend.MATH):
        assert sdpa_backend("cpu", 2, **kw) == "math"
        assert plan(dict(vocab_size=128, dim=64, n_layers=1, max_seq_len=64), batch=1, seq=64,
                    device="cpu").inputs["attention"] == "math"


def test_sdpa_backend_rules_for_cuda_without_a_gpu(monkeypatch):
    from torchnitro.memory.planner import sdpa_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mha, gqa = dict(n_heads=4, kv_heads=4, head_dim=64, seq=128), dict(n_heads=4, kv_heads=2, head_dim=64, seq=128)
    assert sdpa_backend("cuda", 2, **mha) == "cudnn"  # Hopper default for 16-bit
    assert sdpa_backend("cuda", 4, **mha) == "efficient"  # no fp32 flash/cuDNN kernels
    assert sdpa_backend("cuda", 4, **gqa) == "math"  # memory-efficient kernel has no GQA
    prev = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert sdpa_backend("cuda", 2, **gqa) == "flash"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(prev)


@pytest.mark.parametrize("T", [64, 50])
def test_attention_and_norm_terms_by_device(monkeypatch, T):
    """The attention term is the formula of the backend that runs; CUDA norms are the fused kernel."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    c = TransformerConfig(vocab_size=128, dim=96, n_layers=2, n_heads=3, max_seq_len=64)
    B, H, Dh, D = 2, 3, 32, 96
    q = B * T * D
    for dt, e in (("fp32", 4), ("bf16", 2)):
        cpu = plan(c, batch=B, seq=T, dtype=dt, device="cpu")
        cuda = plan(c, batch=B, seq=T, dtype=dt, device="cuda")
        assert cpu.inputs["attention"] == "flash"
        assert cpu.term("activations/attention") == e * (3 * q + 2 * q) + 4 * B * H * T  # wo input is a copy
        if e == 4:
            assert cuda.inputs["attention"] == "efficient"  # output (B,T,H,Dh) memory: wo input is a view
            lse = 4 * B * H * (32 * -(-T // 32))  # log-sum-exp padded to 32 rows
            assert cuda.term("activations/attention") == e * (2 * q + 2 * q) + lse
        else:
            assert cuda.inputs["attention"] == "cudnn"
            assert cuda.term("activations/attention") == cpu.term("activations/attention")
        norms = cpu.term("activations/layer") - cpu.term("activations/attention") - (
            cuda.term("activations/layer") - cuda.term("activations/attention"))
        assert norms == 2 * (8 + e - 2 * e) * q  # decomposed CPU norm vs fused CUDA norm, two per layer
        math_cuda = plan(c, batch=B, seq=T, dtype=dt, device="cuda", attention="math")
        assert math_cuda.term("activations/attention") == e * (4 * q + B * H * T * T)
    with pytest.raises(InputError, match="device"):
        plan(c, batch=1, seq=8, device="tpu")
    with pytest.raises(InputError, match="attention"):
        plan(c, batch=1, seq=8, attention="sparse")


# Peaks measured by the tracker on an H200 (torch 2.11, cuDNN attention for bf16, memory-efficient for
# fp32 MHA, math for fp32 GQA; foreach AdamW): the CUDA terms must reproduce them on any machine.
H200_PEAKS_MIB = [
    (dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, max_seq_len=512), 4, 256, "fp32", "none", 77.93),
    (dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, max_seq_len=512), 4, 256, "bf16", "none", 52.02),
    (dict(vocab_size=2048, dim=128, n_layers=4, n_heads=4, max_seq_len=512), 4, 256, "bf16", "every_2", 41.97),
    (dict(vocab_size=1024, dim=192, n_layers=3, n_heads=6, n_kv_heads=2, max_seq_len=512), 3, 200, "fp32", "none",
     56.61),
    (dict(vocab_size=2048, dim=256, n_layers=4, n_heads=4, max_seq_len=512), 4, 256, "fp32", "blocks", 80.31),
]


@pytest.mark.parametrize("cfg,batch,seq,dtype,policy,measured", H200_PEAKS_MIB)
def test_cuda_terms_match_h200_measurements(monkeypatch, cfg, batch, seq, dtype, policy, measured):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = plan(cfg, batch=batch, seq=seq, dtype=dtype, checkpointing=policy, foreach=True, device="cuda")
    assert abs(p.peak_bytes / 2**20 / measured - 1) < PEAK_TOL, p.table()  # worst: 0.38% (blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["none", "blocks", "selective", "every_2"])
def test_planner_matches_tracker_on_cuda(dtype, policy):
    import torch.nn.functional as F

    from torchnitro.memory import checkpoint_, track

    c = TransformerConfig(vocab_size=1024, dim=192, n_layers=3, n_heads=6, n_kv_heads=2, max_seq_len=256)
    torch.manual_seed(0)
    model = checkpoint_(TransformerLM(c).to("cuda", {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]), policy)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    x = torch.randint(0, c.vocab_size, (3, 200), device="cuda")

    def step():
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with track(model, opt) as t:
        step()
    p = plan(c, batch=3, seq=200, dtype=dtype, checkpointing=policy, foreach=True, device="cuda")
    # fp32 without checkpointing is this config's H200_PEAKS_MIB row (56.61 MiB, the tracker on an H200):
    # PEAK_TOL. The other seven cases keep 10% until a GPU run records their errors (the 27 Nov H200 run,
    # results/gpu_tests_nvidia_h200.md, passed them at 10% without printing the error).
    tol = PEAK_TOL if (dtype, policy) == ("fp32", "none") else 0.10
    assert abs(p.peak_bytes / t.report().peak.bytes - 1) < tol, p.table()
