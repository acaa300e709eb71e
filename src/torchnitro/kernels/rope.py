"""Rotary position embedding (Su et al., 2021, RoFormer), half-split pairing as in Llama/GPT-NeoX.

For x = (x1, x2) split at D/2 and angle theta_{t,i}:
    y1 = x1 cos - x2 sin,   y2 = x2 cos + x1 sin
The backward is the rotation by -theta, so one kernel with a sign serves both directions.
q/k may be strided views (B, H, T, D) (e.g. after ``transpose(1, 2)``); only D must be contiguous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.errors import ShapeError
from torchnitro.kernels import reference
from torchnitro.kernels._common import check_float
from torchnitro.kernels._triton import LazyKernel, next_pow2
from torchnitro.kernels.dispatch import use_triton

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["rope", "apply_rope", "rope_forward", "RopeFunction", "RotaryEmbedding"]


def _rope_kernel(x_ptr, cos_ptr, sin_ptr, y_ptr, H, T, sxb, sxh, sxt, scb, sct, HALF,
                 SIGN: constexpr, BLOCK_H: constexpr, BLOCK: constexpr):
    pid = tl.program_id(0)  # one (b, t) position: cos/sin are read once and applied to every head
    t = pid % T
    b = pid // T
    cols = tl.arange(0, BLOCK)
    cmask = cols < HALF
    cb = b.to(tl.int64) * scb + t.to(tl.int64) * sct
    c = tl.load(cos_ptr + cb + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s = (tl.load(sin_ptr + cb + cols, mask=cmask, other=0.0).to(tl.float32) * SIGN)[None, :]
    for h0 in range(0, H, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        m = (h[:, None] < H) & cmask[None, :]
        xb = x_ptr + b.to(tl.int64) * sxb + h[:, None].to(tl.int64) * sxh + t.to(tl.int64) * sxt + cols[None, :]
        x1 = tl.load(xb, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(xb + HALF, mask=m, other=0.0).to(tl.float32)
        yb = y_ptr + ((b.to(tl.int64) * H + h[:, None]) * T + t) * (2 * HALF) + cols[None, :]  # (B, H, T, D)
        tl.store(yb, (x1 * c - x2 * s).to(y_ptr.dtype.element_ty), mask=m)
        tl.store(yb + HALF, (x2 * c + x1 * s).to(y_ptr.dtype.element_ty), mask=m)


_kernel = LazyKernel(_rope_kernel)


def _tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """Contiguous fp32 tables with (batch stride, time stride); batch stride 0 when shared."""
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    if cos.dim() == 2:
        return cos, sin, 0, cos.stride(0)
    return cos, sin, (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)


def rope_forward(x: Tensor, cos: Tensor, sin: Tensor, sign: int = 1) -> Tensor:
    """Rotate ``x`` (B, H, T, D) by +theta (sign=1) or -theta (sign=-1); returns a contiguous tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, H, T, D = x.shape
    c, s, scb, sct = _tables(cos, sin)
    y = torch.empty(B, H, T, D, device=x.device, dtype=x.dtype)
    if y.numel():
        block = next_pow2(D // 2)
        block_h = min(next_pow2(H), max(1, 4096 // block))
        _kernel[(B * T,)](x, c, s, y, H, T, x.stride(0), x.stride(1), x.stride(2), scb, sct, D // 2,
                          SIGN=sign, BLOCK_H=block_h, BLOCK=block, num_warps=4 if block_h * block <= 2048 else 8)
    return y


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return rope_forward(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return rope_forward(dy, cos, sin, -1), None, None


def _check(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    check_float("rope", x=x, cos=cos, sin=sin)
    if x.dim() != 4 or x.shape[-1] % 2:
        raise ShapeError(f"rope: x has shape {tuple(x.shape)}; expected (B, H, T, D) with even D")
    B, _, T, D = x.shape
    ok2 = cos.dim() == 2 and tuple(cos.shape) == (T, D // 2)
    ok3 = cos.dim() == 3 and tuple(cos.shape[1:]) == (T, D // 2) and cos.shape[0] in (1, B)
    if not (ok2 or ok3) or cos.shape != sin.shape:
        raise ShapeError(
            f"rope: cos {tuple(cos.shape)} / sin {tuple(sin.shape)} do not fit x {tuple(x.shape)}; expected "
            f"({T}, {D // 2}) or ({B} or 1, {T}, {D // 2}); slice the tables to the sequence length"
        )


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Apply RoPE to ``x`` (B, H, T, D) with tables cos/sin of shape (T, D/2) or (B, T, D/2)."""
    _check(x, cos, sin)
    if use_triton(x, op="rope"):
        return RopeFunction.apply(x, cos, sin)
    return reference.rope(x, cos, sin)


def apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE on queries and keys (they may have different head counts, GQA)."""
    return rope(q, cos, sin), rope(k, cos, sin)


class RotaryEmbedding(nn.Module):
    """Holds cos/sin tables (max_seq_len, head_dim/2); ``forward(q, k, offset=0)`` rotates both."""

    def __init__(self, head_dim: int, max_seq_len: int = 4096, theta: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ShapeError(f"RotaryEmbedding: head_dim={head_dim}; expected an even number")
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)  # (T, D/2)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, q: Tensor, k: Tensor, offset: int = 0) -> tuple[Tensor, Tensor]:
        T = q.shape[2]
        if offset + T > self.max_seq_len:
            raise ShapeError(
                f"RotaryEmbedding: positions up to {offset + T} requested; the table holds max_seq_len="
                f"{self.max_seq_len}; build it with a larger max_seq_len"
            )
        cos, sin = self.cos[offset:offset + T], self.sin[offset:offset + T]
        return apply_rope(q, k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"
