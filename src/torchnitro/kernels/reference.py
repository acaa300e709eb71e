"""Plain PyTorch versions of every fused op: the CPU fallback and the oracle of the tests.

Each function has the same signature and semantics as the public op in ``torchnitro.kernels``.
Reductions run in fp32 and results are cast back to the input dtype, as the Triton kernels do.
Shapes: N rows, C columns (hidden size), V vocab, B batch, H heads, T sequence, D head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "gelu", "linear_gelu", "layer_norm", "rms_norm", "rope", "swiglu", "geglu", "softmax",
    "cross_entropy", "fused_linear_cross_entropy", "flash_attention", "sliding_window_mask",
    "fp8_quantize", "fp8_dequantize", "FP8_MAX",
]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU (Hendrycks & Gimpel, 2016): x * Phi(x); ``approximate='tanh'`` uses the tanh form."""
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None = None, approximate: str = "none") -> Tensor:
    """gelu(x @ W^T + b); x (..., K), W (N, K), b (N,)."""
    return F.gelu(F.linear(x, weight, bias), approximate=approximate)


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim (Ba et al., 2016), statistics in fp32."""
    C = x.shape[-1]
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (C,), w, b, eps).to(x.dtype)


def rms_norm(
    x: Tensor, weight: Tensor | None, eps: float = 1e-6, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm (Zhang & Sennrich, 2019): x / sqrt(mean(x^2) + eps) * w.

    With ``residual``, first forms h = x + residual and returns (rms_norm(h), h), the pre-norm
    block's "add then normalise" step.
    """
    h = x if residual is None else x + residual
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    y = y.to(x.dtype)
    return y if residual is None else (y, h)


def _rope_tables(cos: Tensor, sin: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    # (T, D/2) -> (1, 1, T, D/2); (B, T, D/2) -> (B, 1, T, D/2)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    return cos.float(), sin.float()


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding (Su et al., 2021), half-split pairing (x[..., :D/2], x[..., D/2:]).

    x (B, H, T, D); cos/sin (T, D/2) or (B, T, D/2).
    """
    d = x.shape[-1] // 2
    c, s = _rope_tables(cos, sin, x)
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up (Shazeer, 2020)."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """gelu(gate) * up (Shazeer, 2020)."""
    return (F.gelu(gate.float(), approximate=approximate) * up.float()).to(gate.dtype)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    return torch.softmax(x.float(), dim=dim).to(x.dtype)


def cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Token-level cross-entropy; logits (N, V), target (N,). Returns fp32."""
    return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)


def fused_linear_cross_entropy(
    x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, ignore_index: int = -100,
    reduction: str = "mean", label_smoothing: float = 0.0,
) -> Tensor:
    """cross_entropy(x @ W^T + b, target) with the full (N, V) logits materialised."""
    return cross_entropy(F.linear(x, weight, bias), target, ignore_index, reduction, label_smoothing)


def sliding_window_mask(tq: int, tk: int, causal: bool, window: int | None, device=None) -> Tensor | None:
    """Boolean (Tq, Tk) mask, True = attend. ``window`` keeps keys with |q - k| < window
    (and k <= q when causal); positions are aligned at the top-left, like SDPA's ``is_causal``."""
    if window is None and not causal:
        return None
    qi = torch.arange(tq, device=device)[:, None]
    ki = torch.arange(tk, device=device)[None, :]
    keep = torch.ones(tq, tk, dtype=torch.bool, device=device)
    if causal:
        keep &= ki <= qi
    if window is not None:
        keep &= (qi - ki) < window
        if not causal:
            keep &= (ki - qi) < window
    return keep


def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, causal: bool = False, window: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """softmax(q k^T * scale + mask) v through ``scaled_dot_product_attention``.

    q (B, H, Tq, D); k, v (B, Hkv, Tk, D) with H a multiple of Hkv (GQA/MQA).
    """
    H, Hkv = q.shape[1], k.shape[1]
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    mask = sliding_window_mask(q.shape[2], k.shape[2], causal, window, q.device)
    if mask is not None and causal and window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=H != Hkv)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=H != Hkv)


def fp8_quantize(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, per_row: bool = False,
                 scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Scaled cast to FP8: q = clamp(x / s, +-max) with s = amax / max (per tensor, or per row of
    the last dim). Returns (q, s); ``s`` is fp32, shape () or (..., 1). A given ``scale`` is used as is."""
    fmax = FP8_MAX[dtype]
    xf = x.float()
    if scale is None:
        amax = xf.abs().amax(dim=-1, keepdim=True) if per_row else xf.abs().amax()
        scale = torch.clamp(amax, min=1e-12) / fmax
    q = torch.clamp(xf / scale, -fmax, fmax).to(dtype)
    return q, scale.float()


def fp8_dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """x ~= q * s, cast to ``dtype``."""
    return (q.float() * scale).to(dtype)
