"""``patch_(model)``: swap the submodules of a model for fused ones, in place, sharing parameters.

What it recognises (by type, or by class name and attributes for Hugging Face models, so
transformers is not imported unless the model comes from it):

- ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` / HF ``*RMSNorm`` (Llama, Mistral, Qwen2) -> fused norms
- ``torch.nn.GELU`` and HF ``GELUActivation`` / ``NewGELUActivation`` -> fused GELU
- HF gated MLPs (``gate_proj``/``up_proj``/``down_proj`` with SiLU) and ``nn.models`` ``_SwiGLU`` -> fused SwiGLU
- HF BERT ``*Intermediate`` (Linear then GELU) and GPT-2 ``*MLP`` (Conv1D then GELU) -> fused Linear+GELU GEMM
- ``nn.models`` attention (RoPE + SDPA) -> fused RoPE + routed attention
- HF attention (Llama, BERT, GPT-2, ...): the model's ``attn_implementation`` is set to ``"torchnitro"``,
  a registered attention function that routes calls needing no explicit mask and SDPA otherwise
  (padding masks, decoding with a cache offset, attention dropout in training)
- HF Llama/Mistral/Qwen2 attention: RoPE on the fused kernel (per-instance ``forward``)
- HF causal LMs: ``loss_function`` on the fused cross-entropy (per instance)

"Routed" attention goes through :mod:`torchnitro.kernels.attention_policy`: torch SDPA (as the model had)
unless the call needs a feature only our flash kernel has (sliding window) or a one-time measurement on
this GPU shows ours faster; ``attention_policy.attention_report()`` lists each call site's route and why.

Parameters are shared, not copied: ``model.state_dict()`` keys and values are unchanged.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from torchnitro.kernels._hf import patch_hf_causal_lm_loss, patch_hf_rope, route_hf_attention
from torchnitro.kernels.attention_policy import attention as routed_attention
from torchnitro.kernels.gelu import GELU
from torchnitro.kernels.layer_norm import LayerNorm
from torchnitro.kernels.linear_gelu import FusedLinearGELU, linear_gelu
from torchnitro.kernels.rms_norm import RMSNorm
from torchnitro.kernels.rope import rope
from torchnitro.kernels.swiglu import swiglu

__all__ = ["patch_", "PatchSummary", "count_patchable"]


@dataclass
class PatchSummary:
    """What ``patch_`` replaced: ``replaced`` counts ``'Old -> New'`` swaps; ``modules`` names them."""

    replaced: Counter = field(default_factory=Counter)  # "LlamaRMSNorm -> RMSNorm" -> count
    modules: list[str] = field(default_factory=list)  # qualified names of swapped submodules
    attention: str | None = None  # how attention calls were handed to the attention policy, if they were
    notes: list[str] = field(default_factory=list)  # what was recognised but left alone, and why

    @property
    def total(self) -> int:
        return sum(self.replaced.values())

    def __str__(self) -> str:
        lines = [f"{n} x {k}" for k, n in sorted(self.replaced.items())]
        if self.attention:
            lines.append(f"attention: {self.attention}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines) or "nothing to patch"


def _norm_from(m: nn.Module, kind: str) -> nn.Module:
    w = getattr(m, "weight", None)
    dim = int(w.shape[0]) if w is not None else int(m.normalized_shape[0])
    if kind == "layer":
        new = LayerNorm(dim, eps=m.eps, elementwise_affine=False)
        new.weight, new.bias = m.weight, m.bias
        return new
    eps = getattr(m, "variance_epsilon", None) or getattr(m, "eps", None)
    if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
        eps = torch.finfo(w.dtype if w is not None else torch.float32).eps
    new = RMSNorm(dim, eps=float(eps), elementwise_affine=False)
    new.weight = w
    return new


def _gelu_kind(m: nn.Module) -> str | None:
    if isinstance(m, nn.GELU):
        return m.approximate
    name = type(m).__name__
    if name == "GELUActivation" and not getattr(m, "use_gelu_python", False):
        return "none"
    if name in ("NewGELUActivation", "GELUTanh", "PytorchGELUTanh", "GELUPytorchTanh"):
        return "tanh"
    return None


class _FusedGatedMLP(nn.Module):
    """HF gated MLP (gate_proj, up_proj, down_proj, SiLU) with the gate fused."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class _FusedSwiGLU(nn.Module):
    """``nn.models`` SwiGLU MLP (w1 gate, w3 up, w2 down) with the gate fused; same names, same state-dict keys.

    Defined here rather than reusing ``torchnitro.nn.SwiGLU``: nn builds on kernels, so kernels must not import nn.
    """

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.w1, self.w3, self.w2 = mlp.w1, mlp.w3, mlp.w2

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class _Conv1DGELU(nn.Module):
    """GPT-2 ``Conv1D`` (weight stored (in, out)) followed by GELU, as one fused GEMM."""

    def __init__(self, conv: nn.Module, approximate: str):
        super().__init__()
        self.weight, self.bias, self.approximate = conv.weight, conv.bias, approximate
        self.nf = getattr(conv, "nf", conv.weight.shape[1])

    def forward(self, x: Tensor) -> Tensor:
        return linear_gelu(x, self.weight.t(), self.bias, self.approximate)


class _FusedRefAttention(nn.Module):
    """``nn.models`` causal self-attention with fused RoPE and routed attention (same weights)."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        self.cfg = attn.cfg
        self.wq, self.wk, self.wv, self.wo = attn.wq, attn.wk, attn.wv, attn.wo  # same names: same state-dict keys
        self._heads = type(attn).heads  # the reference projection to heads, run on these same weights

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self._heads(self, x)  # (B, H, T, Dh), (B, Hkv, T, Dh) x2
        y = routed_attention(rope(q, cos, sin), rope(k, cos, sin), v, causal=True, site="patch:nn.models attention")
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def _replacement(name: str, m: nn.Module, attention: bool = True) -> nn.Module | None:
    cls = type(m).__name__
    if isinstance(m, nn.LayerNorm) and len(m.normalized_shape) == 1:
        return _norm_from(m, "layer")
    if isinstance(m, nn.RMSNorm) and len(m.normalized_shape) == 1:
        return _norm_from(m, "rms")
    if (cls.endswith("RMSNorm") and not cls.startswith("Gemma") and hasattr(m, "variance_epsilon")
            and isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 1):
        return _norm_from(m, "rms")
    kind = _gelu_kind(m)
    if kind is not None:
        return GELU(kind)
    if all(isinstance(getattr(m, a, None), nn.Linear) for a in ("gate_proj", "up_proj", "down_proj")) and \
            type(getattr(m, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation"):
        return _FusedGatedMLP(m)
    if cls == "_SwiGLU" and all(isinstance(getattr(m, a, None), nn.Linear) for a in ("w1", "w2", "w3")):
        return _FusedSwiGLU(m)
    if attention and cls == "_CausalSelfAttention" and hasattr(m, "cfg") and hasattr(m, "wq"):
        return _FusedRefAttention(m)
    return None


def _fuse_linear_gelu(m: nn.Module, apply: bool = True) -> str | None:
    """Fusion inside BERT intermediates and GPT-2 MLPs (in place when ``apply``); the swap label or None."""
    dense, act = getattr(m, "dense", None), getattr(m, "intermediate_act_fn", None)
    if isinstance(dense, nn.Linear) and act is not None and _gelu_kind(act) is not None:
        if apply:
            m.dense = FusedLinearGELU.from_linear(dense, _gelu_kind(act))
            m.intermediate_act_fn = nn.Identity()
        return f"{type(m).__name__}(Linear+GELU) -> FusedLinearGELU"
    conv, act = getattr(m, "c_fc", None), getattr(m, "act", None)
    if type(conv).__name__ == "Conv1D" and act is not None and _gelu_kind(act) is not None:
        if apply:
            m.c_fc = _Conv1DGELU(conv, _gelu_kind(act))
            m.act = nn.Identity()
        return f"{type(m).__name__}(Conv1D+GELU) -> FusedLinearGELU"
    return None


def count_patchable(model: nn.Module) -> int:
    """How many submodules ``patch_`` would replace, without changing ``model``."""
    n, absorbed = 0, set()
    for m in model.modules():
        if _fuse_linear_gelu(m, apply=False):
            n += 1
            absorbed.update(id(getattr(m, a)) for a in ("intermediate_act_fn", "act") if hasattr(m, a))
    for name, m in model.named_modules():
        if name and id(m) not in absorbed and _replacement(name, m) is not None:
            n += 1
    return n


def patch_(model: nn.Module, attention: bool = True) -> PatchSummary:
    """Replace the recognised submodules of ``model`` with fused ones, in place; returns a summary.

    ``attention=False`` leaves attention modules and HF attention implementations as they are.

    Outputs stay equal to the unpatched model within floating-point tolerance. On CPU the fused
    modules run their PyTorch references, so patching is safe everywhere and fast on CUDA.
    """
    if not isinstance(model, nn.Module):
        from torchnitro.errors import InputError

        raise InputError(f"patch_: received a {type(model).__name__}; expected a torch.nn.Module")
    summary = PatchSummary()
    for name, m in list(model.named_modules()):
        label = _fuse_linear_gelu(m)
        if label:
            summary.replaced[label] += 1
            summary.modules.append(name)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            new = _replacement(child_name, child, attention)
            if new is None:
                continue
            new.train(child.training)
            setattr(parent, child_name, new)
            summary.replaced[f"{type(child).__name__} -> {type(new).__name__.lstrip('_')}"] += 1
            summary.modules.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    for name, m in list(model.named_modules()):
        if patch_hf_rope(m):
            summary.replaced[f"{type(m).__name__}(RoPE) -> fused RoPE"] += 1
            summary.modules.append(name)
    if patch_hf_causal_lm_loss(model):
        summary.replaced[f"{type(model).__name__}.loss_function -> fused cross_entropy"] += 1
        summary.notes.append("the LM head still materialises the logits HF returns; for training loops that only "
                             "need the loss, use kernels.fused_linear_cross_entropy(hidden, lm_head.weight, labels)")
    if attention:
        parts = [route_hf_attention(model)]
        n = summary.replaced.get("_CausalSelfAttention -> FusedRefAttention", 0)
        if n:
            parts.append(f"{n} nn.models attention module(s) -> attention policy")
        summary.attention = "; ".join(p for p in parts if p) or None
    return summary
