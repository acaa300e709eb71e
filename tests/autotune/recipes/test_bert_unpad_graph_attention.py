"""The fused bf16 attention (oneDNN Graph) of padding-free int8 encoders: matches SDPA, engages only
without padding, falls back to SDPA when it cannot run, and is recorded and reloaded by bert-unpad-int8."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.recipe import BuildContext, get_recipe
from torchnitro.autotune.recipes import _graph_attention as ga_mod
from torchnitro.autotune.recipes._graph_attention import GraphAttention, enable_graph_attention_, graph_attention_reason
from torchnitro.autotune.recipes._unpad import PackedLayer
from torchnitro.autotune.recipes.bert_unpad import unpad_model
from torchnitro.autotune.recipes.int8_mixed import row_cosine
from torchnitro.hardware import hardware_info

WHY = graph_attention_reason()
needs_fusion = pytest.mark.skipif(WHY is not None, reason=f"fused bf16 attention unavailable here: {WHY}")


class ScriptEncoder(nn.Module):
    """A user's own wrapper around an HF BERT, as in a script: token states out."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.fixture(scope="module")
def user_model() -> nn.Module:
    from torchnitro.hf import bert_config, random_hf_model

    torch.manual_seed(0)
    return ScriptEncoder(random_hf_model(bert_config(), sentence_embedding=False).model).eval()


def _full(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 1000, (batch, seq), generator=g), torch.ones(batch, seq, dtype=torch.long)


def _ragged(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, _ = _full(batch, seq, seed)
    lens = torch.randint(1, seq + 1, (batch,), generator=torch.Generator().manual_seed(seed + 1))
    lens[-1] = seq
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    return ids * mask, mask


def _ctx(model: nn.Module, x: tuple, tmp_path) -> BuildContext:
    return BuildContext(copy.deepcopy(model).eval(), x, hardware_info(), torch.device("cpu"), tmp_path, {0: [0]},
                        OptimizeConfig(threads=1))


@needs_fusion
@pytest.mark.parametrize("shape", [(2, 16, 4, 8), (3, 37, 2, 16)])
def test_fused_attention_matches_fp32_sdpa(shape):
    b, t, h, dh = shape
    qkv = torch.randn(b * t, 3 * h * dh)
    ga = GraphAttention(h, dh)
    with torch.inference_mode():
        out = ga(qkv, b, t)
        ref = ga_mod._sdpa(qkv, b, t, h, dh)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert ga.failed is None and list(ga._graphs) == [(b, t)]
    assert row_cosine(ref, out.float()) >= 0.999  # bf16 attention
    assert float((out.float() - ref).abs().max()) < 0.05


def test_a_failing_trace_falls_back_to_sdpa_once_with_one_warning(monkeypatch):
    def broken(self, b, t):
        raise RuntimeError("no fusion here\nsecond line")

    monkeypatch.setattr(GraphAttention, "_trace", broken)
    ga = GraphAttention(2, 8)
    qkv = torch.randn(2 * 5, 48)
    with pytest.warns(UserWarning, match="no fusion here"):
        assert ga(qkv, 2, 5) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ga(qkv, 2, 5) is None  # does not try again, no second warning
    assert ga.failed == "RuntimeError: no fusion here"


def test_packed_layer_falls_back_to_sdpa_exactly(user_model, monkeypatch):
    """A layer whose fused attention cannot run computes what it computes without it (fp32 SDPA)."""
    monkeypatch.setattr(GraphAttention, "__call__", lambda self, qkv, b, t: None)
    m = unpad_model(copy.deepcopy(user_model))
    x = _full(3, 12, 1)
    with torch.inference_mode():
        plain = m(*x)
        assert enable_graph_attention_(m) == 2
        torch.testing.assert_close(m(*x), plain)


@needs_fusion
def test_fused_attention_engages_without_padding_only(user_model):
    m = unpad_model(copy.deepcopy(user_model))
    enable_graph_attention_(m)
    layers = [l for l in m.modules() if isinstance(l, PackedLayer)]
    with torch.inference_mode():
        ragged = _ragged(4, 16, 2)
        out = m(*ragged)
        assert all(not l.graph_attention._graphs for l in layers)  # padding: SDPA with its mask
        ref = user_model(*ragged)
        keep = ragged[1].bool()
        torch.testing.assert_close(out[keep], ref[keep], atol=1e-4, rtol=1e-4)
        full = _full(4, 16, 3)
        assert row_cosine(user_model(*full), m(*full)) >= 0.999
        assert all(list(l.graph_attention._graphs) == [(4, 16)] for l in layers)
    copied = copy.deepcopy(m)  # a cache, not state: a copy starts empty and still runs
    assert all(not l.graph_attention._graphs for l in copied.modules() if isinstance(l, PackedLayer))


@needs_fusion
def test_bert_unpad_int8_records_fused_attention_and_reloads_it(user_model, tmp_path, monkeypatch):
    r = get_recipe("bert-unpad-int8")
    monkeypatch.setattr(type(r), "graph_attention", True)
    x = _full(4, 32, 5)
    built = r.build(_ctx(user_model, x, tmp_path))
    assert built.meta["graph_attention"] is True, built.notes
    assert "fused bf16" in built.notes
    held = _full(4, 32, 9)
    with torch.inference_mode():
        ref, out = user_model(*held), built.fn(*held)
        again = r.load(tmp_path, built.meta, user_model)(*held)
    assert row_cosine(ref, out) >= 0.98  # int8 floor of these tests
    torch.testing.assert_close(again, out)
    assert all(isinstance(l.graph_attention, GraphAttention)
               for l in built.fn.modules() if isinstance(l, PackedLayer))


def test_bert_unpad_int8_without_the_fuser_keeps_sdpa(user_model, tmp_path, monkeypatch):
    import torchnitro.autotune.recipes._graph_attention as g

    r = get_recipe("bert-unpad-int8")
    monkeypatch.setattr(type(r), "graph_attention", True)
    monkeypatch.setattr(g, "graph_attention_reason", lambda: "no fuser (test)")
    built = r.build(_ctx(user_model, _full(4, 32, 5), tmp_path))
    assert built.meta["graph_attention"] is False and "SDPA (no fuser (test))" in built.notes
    assert all(l.graph_attention is None for l in built.fn.modules() if isinstance(l, PackedLayer))


def test_bert_unpad_int8_default_build_keeps_sdpa(user_model, tmp_path):
    """Off by default: not measured faster in the whole variant (results/encoder_full_length.md); the attention
    is SDPA or the native kernel, whichever the build measured faster (test_bert_unpad_native_attention)."""
    built = get_recipe("bert-unpad-int8").build(_ctx(user_model, _full(4, 32, 5), tmp_path))
    assert built.meta["graph_attention"] is False and "oneDNN Graph" not in built.notes
    assert all(l.graph_attention is None for l in built.fn.modules() if isinstance(l, PackedLayer))


@needs_fusion
def test_fused_attention_runs_in_a_fresh_process():
    """The fuser flag is on only while tracing: a fresh process gets the fused graph and leaves the flag off."""
    code = ("import torch\nfrom torchnitro.autotune.recipes._graph_attention import GraphAttention\n"
            "ga = GraphAttention(2, 8)\nwith torch.inference_mode():\n    o = ga(torch.randn(20, 48), 2, 10)\n"
            "print(o is not None, ga.failed, torch._C._jit_llga_enabled())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "None", "False"]
