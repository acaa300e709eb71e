"""Multi-head attention (GQA/MQA, causal, sliding window, RoPE) on the faster of torch SDPA and our flash kernel."""

from __future__ import annotations

from torch import Tensor, nn

from torchnitro.errors import ConfigError, ShapeError
from torchnitro.kernels.attention_policy import ATTENTION_BACKENDS, attention
from torchnitro.kernels.rope import RotaryEmbedding

__all__ = ["Attention"]


class Attention(nn.Module):
    """Self-attention: (B, T, dim) -> (B, T, dim).

    ``kv_heads`` < ``heads`` gives grouped-query attention (1 = multi-query). ``rope=True`` rotates
    q and k with a :class:`RotaryEmbedding` of ``max_seq_len`` positions. ``window`` limits each query
    to the previous ``window`` keys (sliding-window attention).

    ``backend``: ``"auto"`` routes each call with :mod:`torchnitro.kernels.attention_policy` (torch SDPA
    unless a feature only our kernel has, a sliding window, or a measurement on this GPU says ours is
    faster); ``"sdpa"`` / ``"flash"`` force one.
    """

    def __init__(self, dim: int, heads: int, kv_heads: int | None = None, causal: bool = True,
                 window: int | None = None, rope: bool = True, max_seq_len: int = 4096, rope_theta: float = 10000.0,
                 bias: bool = False, backend: str = "auto"):
        super().__init__()
        if backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"Attention: backend={backend!r}; expected one of {list(ATTENTION_BACKENDS)}")
        kv_heads = kv_heads or heads
        if dim % heads or heads % kv_heads:
            raise ConfigError(f"Attention: dim={dim}, heads={heads}, kv_heads={kv_heads}; expected dim divisible by "
                              "heads and heads divisible by kv_heads")
        self.dim, self.heads, self.kv_heads, self.head_dim = dim, heads, kv_heads, dim // heads
        self.causal, self.window, self.backend = causal, window, backend
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=bias)
        self.rotary = RotaryEmbedding(self.head_dim, max_seq_len, rope_theta) if rope else None

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3 or x.shape[-1] != self.dim:
            raise ShapeError(f"Attention: input {tuple(x.shape)}; expected (batch, seq, {self.dim})")
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.wk(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = self.wv(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, k)
        y = attention(q, k, v, causal=self.causal, window=self.window, backend=self.backend,
                      site="nn.Attention")  # (B, H, T, Dh)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, heads={self.heads}, kv_heads={self.kv_heads}, causal={self.causal}, "
                f"window={self.window}, backend={self.backend!r}")


