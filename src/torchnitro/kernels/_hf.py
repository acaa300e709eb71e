"""Hugging Face pieces of ``patch_``: attention routing, fused RoPE in Llama attention, fused causal-LM loss.

Everything works on model *instances* (an attention function registered under its own name and
selected per model, a per-instance ``forward``, a per-instance ``loss_function``), so other models
in the process are untouched. transformers is imported only when a model comes from it.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

from torchnitro.kernels.attention_policy import route_attention, sdpa
from torchnitro.kernels.cross_entropy import cross_entropy
from torchnitro.kernels.flash_attention import flash_attention
from torchnitro.kernels.rope import rope

__all__ = ["HF_ATTENTION_NAME", "hf_attention", "route_hf_attention", "patch_hf_rope", "patch_hf_causal_lm_loss"]

HF_ATTENTION_NAME = "torchnitro"
# attention classes whose forward is replicated exactly -> where their sliding window comes from
_ROPE_CLASSES = {"LlamaAttention": None, "MistralAttention": "config", "Qwen2Attention": "module"}


def hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None, **kwargs: Any):
    """HF attention-interface function: SDPA as HF runs it, or our flash kernel where the attention
    policy (``kernels.attention_policy``) routes a call needing no explicit mask to it.

    query (B, H, Tq, D), key/value (B, Hkv, Tk, D); returns ((B, Tq, H, D), None).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    tq, tk = query.shape[2], key.shape[2]
    simple = (attention_mask is None and not kwargs.get("output_attentions") and kwargs.get("softcap") is None
              and (dropout == 0.0 or not module.training) and kwargs.get("position_bias") is None
              and (tq == tk or tq == 1) and key.shape == value.shape)
    if not simple:  # padding masks, cache offsets, dropout: the exact SDPA path
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    if window is not None and tq != tk:  # decode step with a window: positions need the cache offset
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = bool(causal) and tq > 1
    route = route_attention(query, key, value, causal, window, scaling, site=f"hf:{type(module).__name__}")
    if route.backend != "flash" and (window is None or window >= tk):  # nothing for a mask to do: HF's SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if route.backend != "flash":  # SDPA forced with a window that masks: SDPA with the window as a mask
        out = sdpa(query, key, value, causal=causal, window=window, scale=scaling)
    else:
        out = flash_attention(query, key, value, causal=causal, window=window, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def route_hf_attention(model: nn.Module) -> str | None:
    """Select the ``torchnitro`` attention implementation on an HF model; returns what changed."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "_attn_implementation") or not hasattr(model, "set_attn_implementation"):
        return None
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(HF_ATTENTION_NAME, hf_attention)
    AttentionMaskInterface.register(HF_ATTENTION_NAME, sdpa_mask)  # padding masks still reach us (-> SDPA)
    before = cfg._attn_implementation
    model.set_attn_implementation(HF_ATTENTION_NAME)
    return (f"HF attn_implementation {before!r} -> {HF_ATTENTION_NAME!r} (SDPA, or flash attention where the "
            "attention policy routes it; SDPA whenever a mask is needed)")


def _llama_attention_forward(self: nn.Module, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor],
                             attention_mask: Tensor | None = None, cache: Any = None, **kwargs: Any):
    """Llama/Mistral/Qwen2 attention forward with RoPE on the fused kernel (same math, same outputs)."""
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    cos, sin = position_embeddings  # (B, T, D): HF duplicates the D/2 angles, rotate_half pairing
    half = cos.shape[-1] // 2
    if cos.shape[-1] != self.head_dim:  # partial rotary: the original handles it
        return self._torchnitro_original_forward(hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, H, T, D)
    k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)  # (B, Hkv, T, D)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    c, s = cos[..., :half], sin[..., :half]
    q, k = rope(q, c, s), rope(k, c, s)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    if attn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as attn
    source = _ROPE_CLASSES[type(self).__name__]
    if source == "config":
        kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
    elif source == "module":
        kwargs["sliding_window"] = self.sliding_window
    out, weights = attn(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                        scaling=self.scaling, **kwargs)
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def patch_hf_rope(module: nn.Module) -> bool:
    """Give an HF Llama/Mistral/Qwen2 attention module a forward with fused RoPE; True when it did."""
    if type(module).__name__ not in _ROPE_CLASSES or hasattr(module, "_torchnitro_original_forward"):
        return False
    if not all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx")):
        return False
    module._torchnitro_original_forward = module.forward
    module.forward = types.MethodType(_llama_attention_forward, module)
    return True


def _causal_lm_loss(logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: Tensor | int | None = None,
                    ignore_index: int = -100, shift_labels: Tensor | None = None, **kwargs: Any) -> Tensor:
    """HF ``ForCausalLMLoss`` on the fused cross-entropy (fp32 math inside, no fp32 copy of the logits)."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    z = logits.reshape(-1, vocab_size)
    t = shift_labels.reshape(-1).to(z.device)
    if num_items_in_batch is None:
        return cross_entropy(z, t, ignore_index=ignore_index, reduction="mean")
    n = num_items_in_batch.to(z.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
    return cross_entropy(z, t, ignore_index=ignore_index, reduction="sum") / n


def patch_hf_causal_lm_loss(model: nn.Module) -> bool:
    """Point an HF causal LM's ``loss_function`` at the fused cross-entropy; True when it did."""
    cls = type(model)
    if not isinstance(getattr(cls, "loss_function", None), property) or getattr(model, "_loss_function", None):
        return False
    if not (cls.__name__.endswith("ForCausalLM") or cls.__name__.endswith("LMHeadModel")):
        return False
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM"):
        return False
    model.loss_function = _causal_lm_loss
    return True
