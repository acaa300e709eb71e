from __future__ import annotations

import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.memory import Budget, plan
from torchnitro.nn.models import TransformerConfig, TransformerLM

from ._steps import tracked_peak

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
    p = plan(c, batch=batch, seq=seq, dtype=dtype)
    assert abs(p.peak_bytes / r.peak.bytes - 1) < 0.10, p.table()
    for phase in ("forward", "backward", "optimizer"):
        assert abs(p.phases[phase] / r.per_phase[phase].bytes - 1) < 0.10, phase


@pytest.mark.parametrize("policy", ["blocks", "every_2", "selective"])
def test_planner_matches_tracker_with_checkpointing(policy):
    c = TransformerConfig(vocab_size=512, dim=64, n_layers=4, n_heads=4, max_seq_len=128)
    r = tracked_peak(c, 2, 128, torch.float32, policy)
    p = plan(c, batch=2, seq=128, checkpointing=policy)
    assert abs(p.peak_bytes / r.peak.bytes - 1) < 0.10, p.table()


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
    p = plan(c, batch=2, seq=96, dtype="bf16", attention="math")
    assert abs(p.peak_bytes / t.report().peak.bytes - 1) < 0.10, p.table()


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
    p = plan(c, batch=batch, seq=seq, amp="bf16", checkpointing=policy)
    assert abs(p.peak_bytes / r.peak.bytes - 1) < 0.10, p.table()
    fwd_acts = r.per_phase["forward"].by_category["activations"]
    assert abs(p.activation_bytes / fwd_acts - 1) < 0.10


def test_autocast_bad_combinations():
    c = TransformerConfig(vocab_size=100, dim=32, n_layers=1, max_seq_len=16)
    with pytest.raises(InputError, match="fp32 parameters"):
        plan(c, batch=1, seq=8, dtype="bf16", amp="bf16")
    with pytest.raises(InputError, match="amp"):
        plan(c, batch=1, seq=8, amp="fp32")
