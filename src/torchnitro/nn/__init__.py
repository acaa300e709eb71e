"""torchnitro.nn: reference models, the built-in workload zoo, and modules built on fused kernels."""

from __future__ import annotations

from torchnitro.nn.models import (
    MLP, EncoderConfig, ResNetCNN, TransformerConfig, TransformerEncoder, TransformerLM,
)
from torchnitro.nn.layers import (
    GELUMLP, Attention, FusedLinearGELU, GeGLU, LayerNorm, RMSNorm, RotaryEmbedding, SwiGLU, TransformerBlock,
)
from torchnitro.nn.zoo import Builtin, get_builtin, list_builtins, register_builtin

__all__ = [
    "TransformerConfig", "TransformerLM", "EncoderConfig", "TransformerEncoder", "ResNetCNN", "MLP",
    "Builtin", "get_builtin", "list_builtins", "register_builtin",
    "RMSNorm", "LayerNorm", "RotaryEmbedding", "SwiGLU", "GeGLU", "GELUMLP", "FusedLinearGELU", "Attention",
    "TransformerBlock",
]
