"""Layers built on the fused kernels: norms, rotary embedding, gated MLPs, Linear+GELU, pre-norm block.

Parameter names match the plain PyTorch modules they replace (``weight``/``bias`` of norms and
Linear layers; ``w1`` gate, ``w3`` up, ``w2`` down of GLU MLPs, as in Llama and ``nn.models``), so
state dicts move between the reference models and these layers.
"""

from __future__ import annotations

from torch import Tensor, nn

from torchnitro.errors import ConfigError
from torchnitro.kernels.layer_norm import LayerNorm
from torchnitro.kernels.linear_gelu import FusedLinearGELU
from torchnitro.kernels.rms_norm import RMSNorm
from torchnitro.kernels.rope import RotaryEmbedding
from torchnitro.kernels.swiglu import geglu, swiglu
from torchnitro.nn.attention import Attention

__all__ = ["RMSNorm", "LayerNorm", "RotaryEmbedding", "SwiGLU", "GeGLU", "GELUMLP", "FusedLinearGELU",
           "Attention", "TransformerBlock", "default_hidden_dim"]


def default_hidden_dim(dim: int, mlp: str) -> int:
    """GLU MLPs: 8/3 * dim rounded up to 64 (same parameter count as a 4x GELU MLP); GELU: 4 * dim."""
    if mlp == "gelu":
        return 4 * dim
    return 64 * -(-int(8 * dim / 3) // 64)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) with the gate fused (Shazeer, 2020)."""

    def __init__(self, dim: int, hidden: int | None = None, bias: bool = False):
        super().__init__()
        hidden = hidden or default_hidden_dim(dim, "swiglu")
        self.w1 = nn.Linear(dim, hidden, bias=bias)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=bias)  # up
        self.w2 = nn.Linear(hidden, dim, bias=bias)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class GeGLU(nn.Module):
    """w2(gelu(w1 x) * w3 x) with the gate fused."""

    def __init__(self, dim: int, hidden: int | None = None, bias: bool = False, approximate: str = "none"):
        super().__init__()
        hidden = hidden or default_hidden_dim(dim, "geglu")
        self.approximate = approximate
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(geglu(self.w1(x), self.w3(x), self.approximate))


class GELUMLP(nn.Module):
    """fc2(gelu(fc1 x)) with fc1 + bias + GELU as one fused GEMM."""

    def __init__(self, dim: int, hidden: int | None = None, bias: bool = True, approximate: str = "none"):
        super().__init__()
        hidden = hidden or default_hidden_dim(dim, "gelu")
        self.fc1 = FusedLinearGELU(dim, hidden, bias=bias, approximate=approximate)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.fc1(x))


_MLPS = {"swiglu": SwiGLU, "geglu": GeGLU, "gelu": GELUMLP}
_NORMS = {"rmsnorm": RMSNorm, "layernorm": LayerNorm}


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm1(x)); out = h + mlp(norm2(h)).

    With ``norm="rmsnorm"`` the second residual add is fused into the RMSNorm kernel.
    """

    def __init__(self, dim: int, heads: int, mlp: str = "swiglu", norm: str = "rmsnorm", rope: bool = True,
                 kv_heads: int | None = None, hidden: int | None = None, causal: bool = True,
                 window: int | None = None, max_seq_len: int = 4096, eps: float = 1e-6):
        super().__init__()
        if mlp not in _MLPS:
            raise ConfigError(f"TransformerBlock: mlp={mlp!r}; expected one of {sorted(_MLPS)}")
        if norm not in _NORMS:
            raise ConfigError(f"TransformerBlock: norm={norm!r}; expected one of {sorted(_NORMS)}")
        self.norm_kind = norm
        self.attn_norm = _NORMS[norm](dim, eps=eps)
        self.attn = Attention(dim, heads, kv_heads, causal=causal, window=window, rope=rope, max_seq_len=max_seq_len)
        self.mlp_norm = _NORMS[norm](dim, eps=eps)
        self.mlp = _MLPS[mlp](dim, hidden)

    def forward(self, x: Tensor) -> Tensor:  # x (B, T, D)
        a = self.attn(self.attn_norm(x))
        if self.norm_kind == "rmsnorm":
            normed, h = self.mlp_norm(a, residual=x)  # h = x + a, normed = rmsnorm(h), one kernel
        else:
            h = x + a
            normed = self.mlp_norm(h)
        return h + self.mlp(normed)
