"""torchnitro.kernels: fused Triton kernels with PyTorch references, forward and backward.

Every op dispatches per call (see ``dispatch``): Triton on CUDA tensors when triton imports, the
plain PyTorch version in ``reference`` elsewhere; ``TORCHNITRO_KERNELS=reference|triton`` overrides.

    from torchnitro import kernels
    y = kernels.rms_norm(x, weight, eps=1e-6)
    out = kernels.flash_attention(q, k, v, causal=True)
    summary = kernels.patch_(model)
"""

from __future__ import annotations

from torchnitro.kernels import reference
from torchnitro.kernels.cross_entropy import (
    CrossEntropyLoss, FusedLinearCrossEntropyLoss, cross_entropy, fused_linear_cross_entropy,
)
from torchnitro.kernels.dispatch import backend_report, select_backend
from torchnitro.kernels.flash_attention import FlashAttention, flash_attention
from torchnitro.kernels.fp8 import fp8_dequantize, fp8_quantize
from torchnitro.kernels.gelu import GELU, gelu
from torchnitro.kernels.layer_norm import LayerNorm, layer_norm
from torchnitro.kernels.linear_gelu import FusedLinearGELU, linear_gelu
from torchnitro.kernels.patch import PatchSummary, patch_
from torchnitro.kernels.rms_norm import RMSNorm, rms_norm
from torchnitro.kernels.rope import RotaryEmbedding, apply_rope, rope
from torchnitro.kernels.softmax import Softmax, softmax
from torchnitro.kernels.sparsity import SparsityReport, mask_2to4, prune_2to4, sparsify_, to_semi_structured, verify_2to4
from torchnitro.kernels.swiglu import GeGLUActivation, SwiGLUActivation, geglu, swiglu

__all__ = [
    "reference", "select_backend", "backend_report",
    "gelu", "GELU", "layer_norm", "LayerNorm", "rms_norm", "RMSNorm", "rope", "apply_rope", "RotaryEmbedding",
    "swiglu", "geglu", "SwiGLUActivation", "GeGLUActivation", "softmax", "Softmax",
    "cross_entropy", "CrossEntropyLoss", "fused_linear_cross_entropy", "FusedLinearCrossEntropyLoss",
    "flash_attention", "FlashAttention", "linear_gelu", "FusedLinearGELU", "fp8_quantize", "fp8_dequantize",
    "mask_2to4", "prune_2to4", "verify_2to4", "to_semi_structured", "sparsify_", "SparsityReport",
    "patch_", "PatchSummary",
]
