from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchnitro.errors import InputError
from torchnitro.memory import Budget, checkpoint_
from torchnitro.memory.checkpointing import checkpointed_blocks
from torchnitro.nn.models import TransformerConfig, TransformerLM

from ._steps import tracked_peak

CFG = TransformerConfig(vocab_size=256, dim=64, n_layers=4, n_heads=4, max_seq_len=128)


def _grads(model: nn.Module, x: torch.Tensor):
    out = model(x)
    F.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", ["blocks", "every_2", "selective", Budget(0.5)])
@pytest.mark.parametrize("shape", [(2, 64), (3, 37)])
def test_outputs_and_grads_identical(policy, shape):
    torch.manual_seed(0)
    ref = TransformerLM(CFG)
    ck = TransformerLM(CFG)
    ck.load_state_dict(ref.state_dict())
    checkpoint_(ck, policy)
    x = torch.randint(0, CFG.vocab_size, shape)
    o_ref, g_ref = _grads(ref, x)
    o_ck, g_ck = _grads(ck, x)
    torch.testing.assert_close(o_ck, o_ref, rtol=0, atol=0)
    for n in g_ref:
        torch.testing.assert_close(g_ck[n], g_ref[n], rtol=1e-6, atol=1e-7, msg=n)


def test_policies_choose_blocks_and_undo():
    m = TransformerLM(CFG)
    keys = set(m.state_dict())
    assert checkpointed_blocks(checkpoint_(m, "blocks")) == [0, 1, 2, 3]
    assert checkpointed_blocks(checkpoint_(m, "every_2")) == [1, 3]
    assert checkpointed_blocks(checkpoint_(m, "every_4")) == [3]
    assert checkpointed_blocks(checkpoint_(m, "none")) == []
    assert set(m.state_dict()) == keys  # parameter names untouched


def test_inference_skips_checkpoint():
    m = checkpoint_(TransformerLM(CFG), "blocks")
    x = torch.randint(0, CFG.vocab_size, (1, 8))
    with torch.no_grad():
        y = m(x)
    assert y.shape == (1, 8, CFG.vocab_size)


def test_memory_ordering_measured():
    """Tracked activations: blocks < selective < none; every_2 in between; selective past the midpoint."""
    cfg = TransformerConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=128)
    peaks = {p: tracked_peak(cfg, 2, 128, torch.float32, p).per_phase["forward"].by_category["activations"]
             for p in ("none", "blocks", "every_2", "selective")}
    assert peaks["blocks"] < peaks["selective"] < peaks["none"]
    assert peaks["blocks"] < peaks["every_2"] < peaks["none"]
    assert peaks["blocks"] < 0.4 * peaks["none"]
    assert peaks["selective"] <= (peaks["none"] + peaks["blocks"]) / 2  # the target, measured exactly


def test_generic_module_list_model():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    a, b = Stack(), Stack()
    b.load_state_dict(a.state_dict())
    checkpoint_(b, "selective")
    x = torch.randn(4, 16)
    a(x).sum().backward()
    b(x).sum().backward()
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0)


def test_bad_input():
    m = TransformerLM(CFG)
    with pytest.raises(InputError, match="policy"):
        checkpoint_(m, "sometimes")
    with pytest.raises(InputError, match="every_"):
        checkpoint_(m, "every_0")
    with pytest.raises(InputError, match="ModuleList"):
        checkpoint_(nn.Linear(2, 2), "blocks")
    with pytest.raises(InputError, match="nn.Module"):
        checkpoint_("model", "blocks")  # type: ignore[arg-type]


def test_budget_uses_planner_rule_and_meets_fraction():
    from torchnitro.memory.planner import checkpoint_indices, plan

    cfg = TransformerConfig(vocab_size=128, dim=64, n_layers=6, n_heads=4, max_seq_len=128)
    p = plan(cfg, batch=2, seq=128, checkpointing=Budget(0.5), device="cpu")
    m = checkpoint_(TransformerLM(cfg), Budget(0.5))
    expect = checkpoint_indices("budget", 6, 1, p.inputs["checkpointed_layers"])
    assert checkpointed_blocks(m) == expect and 0 < len(expect) < 6
    assert p.activation_bytes <= 0.5 * plan(cfg, batch=2, seq=128, device="cpu").activation_bytes
    measured = {pol: tracked_peak(cfg, 2, 128, torch.float32, pol).per_phase["forward"].by_category["activations"]
                for pol in ("none", Budget(0.5))}
    assert measured[Budget(0.5)] <= 0.5 * measured["none"] * 1.02


def test_selective_custom_save_ops_trade_memory():
    cfg = TransformerConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=128)
    only_attn = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
    acts = {}
    for name, kw in (("default", {}), ("attn only", {"save_ops": only_attn})):
        torch.manual_seed(0)
        m = checkpoint_(TransformerLM(cfg), "selective", **kw)
        x = torch.randint(0, 128, (2, 64))
        from torchnitro.memory import track

        with track(m) as t:
            out = m(x)
        acts[name] = t.report().per_phase["forward"].by_category["activations"]
        out.sum().backward()
    assert acts["attn only"] < acts["default"]
    with pytest.raises(InputError, match="selective"):
        checkpoint_(TransformerLM(cfg), "blocks", save_ops=only_attn)


def test_selective_recomputes_the_residual_projections():
    from torchnitro.memory.checkpointing import recompute_scope_modules

    m = TransformerLM(CFG)
    assert recompute_scope_modules(m.blocks[0]) == ["attn.wo", "mlp.w2"]

    class HFBlock(nn.Module):  # Llama / BERT style names
        def __init__(self):
            super().__init__()
            self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(4, 4), "o_proj": nn.Linear(4, 4)})
            self.intermediate = nn.ModuleDict({"dense": nn.Linear(4, 4)})
            self.output = nn.ModuleDict({"dense": nn.Linear(4, 4)})

    assert recompute_scope_modules(HFBlock()) == ["self_attn.o_proj", "output.dense"]
    cfg = TransformerConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, max_seq_len=128)
    x = torch.randint(0, 128, (2, 64))
    acts = {}
    for name, kw in (("default", {}), ("save every matmul", {"recompute": ()})):
        torch.manual_seed(0)
        model = checkpoint_(TransformerLM(cfg), "selective", **kw)
        from torchnitro.memory import track

        with track(model) as t:
            out = model(x)
        acts[name] = t.final_bytes - t.baseline_bytes  # live at the end of forward: exact
        out.sum().backward()
    B, T, D, L = 2, 64, 64, 2
    assert acts["save every matmul"] - acts["default"] == 2 * 4 * B * T * D * L  # wo and w2 outputs, fp32


def test_selective_policy_decisions_and_hooks_removed():
    from torch.utils.checkpoint import CheckpointPolicy

    from torchnitro.memory.checkpointing import _Scope, selective_policy

    mm = torch.ops.aten.mm.default
    assert selective_policy(None, mm) == CheckpointPolicy.MUST_SAVE
    assert selective_policy(None, mm, scope=_Scope(depth=1)) == CheckpointPolicy.PREFER_RECOMPUTE
    assert selective_policy(None, torch.ops.aten.mul.Tensor) == CheckpointPolicy.PREFER_RECOMPUTE
    m = checkpoint_(TransformerLM(CFG), "selective")
    wo = m.blocks[0].attn.wo
    assert len(wo._forward_pre_hooks) == 1 and len(wo._forward_hooks) == 1
    checkpoint_(m, "blocks")
    assert not wo._forward_pre_hooks and not wo._forward_hooks
    with pytest.raises(InputError, match="selective"):
        checkpoint_(m, "blocks", recompute=("wo",))
    with pytest.raises(InputError, match="tuple"):
        checkpoint_(m, "selective", recompute="wo")
