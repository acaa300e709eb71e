from __future__ import annotations

import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.kernels import patch_
from torchnitro.nn.models import TransformerConfig, TransformerEncoder, TransformerLM

transformers = pytest.importorskip("transformers")


def _parity(model, ids, **kw):
    model.eval()
    with torch.no_grad():
        before = model(ids, **kw)
        before = before if isinstance(before, torch.Tensor) else before[0]
        summary = patch_(model)
        after = model(ids, **kw)
        after = after if isinstance(after, torch.Tensor) else after[0]
    return summary, before, after


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_patch_reference_lm_keeps_outputs(backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", backend)
    model = TransformerLM(TransformerConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1))
    keys = set(model.state_dict())
    summary, before, after = _parity(model, torch.randint(0, 64, (1, 12)))
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert summary.replaced["RMSNorm -> RMSNorm"] == 3
    assert summary.replaced["_SwiGLU -> FusedSwiGLU"] == 1
    assert summary.replaced["_CausalSelfAttention -> FusedRefAttention"] == 1
    assert set(model.state_dict()) == keys


def test_patch_encoder_layernorm(monkeypatch):
    monkeypatch.setenv("TORCHNITRO_KERNELS", "reference")
    model = TransformerEncoder(vocab_size=64, dim=32, n_layers=1, n_heads=2, ffn_dim=64)
    summary, before, after = _parity(model, torch.randint(0, 64, (2, 7)))
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
    assert summary.replaced["LayerNorm -> LayerNorm"] == 3


def _hf(name):
    if name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2)
        return transformers.LlamaForCausalLM(cfg)
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2)
        return transformers.BertModel(cfg)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


EXPECTED = {
    "llama": {"LlamaRMSNorm -> RMSNorm": 3, "LlamaMLP -> FusedGatedMLP": 1, "LlamaAttention(RoPE) -> fused RoPE": 1,
              "LlamaForCausalLM.loss_function -> fused cross_entropy": 1},
    "bert": {"LayerNorm -> LayerNorm": 3, "BertIntermediate(Linear+GELU) -> FusedLinearGELU": 1},
    "gpt2": {"LayerNorm -> LayerNorm": 3, "GPT2MLP(Conv1D+GELU) -> FusedLinearGELU": 1},
}


@pytest.mark.parametrize("name", ["llama", "bert", "gpt2"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_patch_hf_models_keeps_outputs(name, backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", backend)
    model = _hf(name)
    ids = torch.randint(0, 64, (2, 9))
    summary, before, after = _parity(model, ids)
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    for label, count in EXPECTED[name].items():
        assert summary.replaced[label] == count, str(summary)
    assert summary.attention and "torchnitro" in summary.attention
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # padding routes through SDPA and must still match
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(ids, attention_mask=mask)[0]
        model.set_attn_implementation("torchnitro")
        got = model(ids, attention_mask=mask)[0]
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["Mistral", "Qwen2"])
def test_patch_mistral_qwen2_rope_and_window(arch, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", "triton")
    cfg_cls, model_cls = getattr(transformers, f"{arch}Config"), getattr(transformers, f"{arch}ForCausalLM")
    extra = {"use_sliding_window": True, "max_window_layers": 0} if arch == "Qwen2" else {}
    cfg = cfg_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, sliding_window=4, **extra)
    summary, before, after = _parity(model_cls(cfg), torch.randint(0, 64, (1, 10)))
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    assert summary.replaced[f"{arch}Attention(RoPE) -> fused RoPE"] == 1, str(summary)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_patched_llama_loss_and_generation_match(backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", backend)
    model = _hf("llama").eval()
    ids = torch.randint(0, 64, (1, 8))
    labels = ids.clone()
    labels[0, :2] = -100
    with torch.no_grad():
        ref = model(ids, labels=labels).loss
        ref_gen = model.generate(ids[:, :4], attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=3,
                                 do_sample=False, pad_token_id=0)
        patch_(model)
        got = model(ids, labels=labels).loss
        gen = model.generate(ids[:, :4], attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=3,
                             do_sample=False, pad_token_id=0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(gen, ref_gen)  # KV-cache decoding goes through the patched RoPE and attention


def test_patch_plain_gelu_and_rejects_non_module(monkeypatch):
    monkeypatch.setenv("TORCHNITRO_KERNELS", "reference")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU("tanh"), torch.nn.LayerNorm(8))
    summary, before, after = _parity(model, torch.randn(3, 8))
    torch.testing.assert_close(after, before)
    assert summary.total == 2 and "GELU -> GELU" in summary.replaced
    with pytest.raises(InputError, match="expected a torch.nn.Module"):
        patch_(lambda x: x)


def test_count_patchable_does_not_modify(monkeypatch):
    from torchnitro.kernels.patch import count_patchable

    model = _hf("gpt2")
    before = [type(m).__name__ for m in model.modules()]
    assert count_patchable(model) == 4  # 3 LayerNorms + 1 Conv1D+GELU MLP
    assert [type(m).__name__ for m in model.modules()] == before
    assert count_patchable(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())) == 0


def test_patched_reference_lm_gradients_match(monkeypatch):
    import copy

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", "triton")
    model = TransformerLM(TransformerConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1))
    patched = copy.deepcopy(model)
    patch_(patched)
    tokens = torch.randint(0, 64, (2, 10))
    for m in (model, patched):
        logits = m(tokens)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), tokens[:, 1:].reshape(-1)).backward()
    for (name, p), q in zip(model.named_parameters(), patched.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


# (arch, sliding window, TORCHNITRO_ATTENTION, routes recorded, kernel launches)
HF_ROUTES = [
    ("Llama", None, None, ["sdpa"], 0),  # plain causal GQA: SDPA, as the unpatched model ran it
    ("Llama", None, "flash", ["flash"], 1),
    ("Mistral", 16, None, ["sdpa"], 0),  # a window wider than the sequence masks nothing: plain attention
    ("Mistral", 4, None, [], 0),  # a window that masks comes with HF's mask: HF's SDPA path, not routed
]


@pytest.mark.parametrize("arch,window,forced,routes,launches", HF_ROUTES)
def test_patched_hf_attention_routes_by_policy(arch, window, forced, routes, launches, monkeypatch):
    from torchnitro.kernels import attention_policy
    from torchnitro.kernels.flash_attention import FlashAttentionFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TORCHNITRO_KERNELS", "triton")
    monkeypatch.setenv("TORCHNITRO_ATTENTION", forced or "auto")
    attention_policy.reset_attention_routes()
    calls, real = [], FlashAttentionFunction.apply
    monkeypatch.setattr(FlashAttentionFunction, "apply", lambda *a: calls.append(a) or real(*a))
    cfg_cls, model_cls = getattr(transformers, f"{arch}Config"), getattr(transformers, f"{arch}ForCausalLM")
    cfg = cfg_cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, **({"sliding_window": window} if window else {}))
    summary, before, after = _parity(model_cls(cfg), torch.randint(0, 64, (1, 10)))
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)
    got = [r["backend"] for r in attention_policy.attention_routes() if r["site"] == f"hf:{arch}Attention"]
    attention_policy.reset_attention_routes()
    assert got == routes and len(calls) == launches


@pytest.mark.parametrize("forced", ["auto", "sdpa", "flash"])
def test_hf_attention_window_without_mask_keeps_the_window(forced, monkeypatch):
    from torchnitro.kernels import reference
    from torchnitro.kernels._hf import hf_attention

    monkeypatch.setenv("TORCHNITRO_KERNELS", "reference")
    monkeypatch.setenv("TORCHNITRO_ATTENTION", forced)
    module = torch.nn.Module().eval()
    module.is_causal = True
    q, k, v = torch.randn(1, 4, 9, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    out, _ = hf_attention(module, q, k, v, None, sliding_window=3)
    torch.testing.assert_close(out, reference.flash_attention(q, k, v, True, 3).transpose(1, 2))


@pytest.mark.gpu
def test_patch_llama_bf16_gpu():
    model = _hf("llama").cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 64, (2, 128), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.float()
        patch_(model)
        got = model(ids).logits.float()
    assert (got - ref).abs().max() < 5e-2 * ref.abs().max()
