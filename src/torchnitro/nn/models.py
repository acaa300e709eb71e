"""Reference models: the default workloads of ``optimize``, the benchmarks and the memory planner.

All are plain PyTorch (no custom kernels), so they are their own reference. Shapes are commented
at the line: B batch, T sequence, D model dim, H heads, Dh head dim, V vocab.

- ``TransformerLM``: pre-norm decoder LM (RMSNorm, RoPE, SwiGLU, SDPA, tied embeddings).
- ``TransformerEncoder``: pre-norm bidirectional encoder (LayerNorm, GELU MLP, learned positions).
- ``ResNetCNN``: a small ResNet-style conv net (Conv+BN+ReLU blocks) for vision recipes.
- ``MLP``: Linear+GELU stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "TransformerConfig", "TransformerLM", "TransformerEncoder", "EncoderConfig",
    "ResNetCNN", "MLP", "rope_cache", "apply_rope",
]


@dataclass
class TransformerConfig:
    vocab_size: int = 8192  # small vocab keeps the embedding from dominating tiny test models
    dim: int = 256  # model width D
    n_layers: int = 4  # number of pre-norm blocks
    n_heads: int = 4  # query heads H; head dim = dim // n_heads
    n_kv_heads: int | None = None  # GQA: fewer K/V heads; None means n_heads
    ffn_dim: int | None = None  # SwiGLU hidden size; None: 8/3 * dim rounded up to a multiple of 64
    max_seq_len: int = 1024  # RoPE cache length
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-6  # RMSNorm epsilon
    tie_embeddings: bool = True  # share the input embedding and the LM head (saves V*D params)
    dropout: float = 0.0  # reference models train without dropout by default

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        kv = self.kv_heads
        if self.n_heads % kv:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={kv}")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_dim is not None:
            return self.ffn_dim
        return 64 * math.ceil(int(8 * self.dim / 3) / 64)


def rope_cache(seq_len: int, head_dim: int, theta: float = 10000.0, device=None) -> tuple[Tensor, Tensor]:
    """cos/sin tables of shape (T, Dh/2) for rotary embeddings (Su et al., 2021)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)  # (T, Dh/2)
    return freqs.cos(), freqs.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate pairs (x[..., :Dh/2], x[..., Dh/2:]) by position angle; x is (B, H, T, Dh)."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # (T, Dh/2), broadcast over B, H
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        hd, kv = cfg.head_dim, cfg.kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * hd, bias=False)
        self.wk = nn.Linear(cfg.dim, kv * hd, bias=False)
        self.wv = nn.Linear(cfg.dim, kv * hd, bias=False)
        self.wo = nn.Linear(cfg.n_heads * hd, cfg.dim, bias=False)

    def heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Project (B, T, D) to q (B, H, T, Dh) and k, v (B, Hkv, T, Dh), before RoPE."""
        B, T, _ = x.shape
        c = self.cfg
        q = self.wq(x).view(B, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, T, Dh)
        k = self.wk(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)  # (B, Hkv, T, Dh)
        v = self.wv(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        return q, k, v

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.heads(x)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.cfg.kv_heads != self.cfg.n_heads)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)  # gate
        self.w3 = nn.Linear(dim, hidden, bias=False)  # up
        self.w2 = nn.Linear(hidden, dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlockRef(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = _CausalSelfAttention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = _SwiGLU(cfg.dim, cfg.hidden_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TransformerLM(nn.Module):
    """Decoder-only LM: tokens (B, T) int64 -> logits (B, T, V)."""

    def __init__(self, cfg: TransformerConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or TransformerConfig(**overrides)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(TransformerBlockRef(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_cache(cfg.max_seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens: received shape {tuple(tokens.shape)}, expected (batch, seq)")
        T = tokens.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.cfg.max_seq_len}")
        x = self.embed(tokens)  # (B, T, D)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.lm_head(self.norm(x))  # (B, T, V)


@dataclass
class EncoderConfig:
    vocab_size: int = 8192  # token vocabulary
    dim: int = 256  # model width
    n_layers: int = 4  # number of blocks
    n_heads: int = 4  # attention heads
    ffn_dim: int = 1024  # GELU MLP hidden size (4x, BERT-style)
    max_seq_len: int = 512  # learned position table length
    norm_eps: float = 1e-5  # LayerNorm epsilon


class _EncoderBlock(nn.Module):
    def __init__(self, cfg: EncoderConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.dim, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, Dh)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TransformerEncoder(nn.Module):
    """Bidirectional encoder: tokens (B, T) int64 -> hidden states (B, T, D)."""

    def __init__(self, cfg: EncoderConfig | None = None, **overrides):
        super().__init__()
        cfg = cfg or EncoderConfig(**overrides)
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.blocks = nn.ModuleList(_EncoderBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)

    def forward(self, tokens: Tensor) -> Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens: received shape {tuple(tokens.shape)}, expected (batch, seq)")
        T = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(T, device=tokens.device))  # (B, T, D)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Identity()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNetCNN(nn.Module):
    """Images (B, 3, H, W) -> logits (B, classes). Three stages of two basic blocks."""

    def __init__(self, num_classes: int = 10, width: int = 32):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        chans = [width, width * 2, width * 4]
        layers, cin = [], width
        for i, c in enumerate(chans):
            layers += [_BasicBlock(cin, c, 1 if i == 0 else 2), _BasicBlock(c, c, 1)]
            cin = c
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(cin, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"images: received shape {tuple(x.shape)}, expected (batch, channels, H, W)")
        y = self.layers(self.stem(x))  # (B, C, H', W')
        return self.head(y.mean(dim=(2, 3)))


class MLP(nn.Module):
    """(B, in_dim) -> (B, out_dim) through Linear+GELU layers."""

    def __init__(self, in_dim: int = 512, hidden: int = 1024, out_dim: int = 512, n_layers: int = 3):
        super().__init__()
        dims = [in_dim] + [hidden] * (n_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, x: Tensor) -> Tensor:
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x
