"""Rotary position embedding (Su et al., 2021, RoFormer), half-split pairing as in Llama/GPT-NeoX.

For x = (x1, x2) split at D/2 and angle theta_{t,i}:
    y1 = x1 cos - x2 sin,   y2 = x2 cos + x1 sin
The backward is the rotation by -theta, so one kernel with a sign serves both directions, and one
launch rotates q and k together (``apply_rope``); its tile shape is picked by measurement on the
first CUDA call (``_triton.pick_config``), after which a call is a plan lookup, two allocations and the launch.
q/k may be strided views (B, H, T, D) (e.g. after ``transpose(1, 2)``); only D must be contiguous.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.errors import ShapeError
from torchnitro.kernels import reference
from torchnitro.kernels._common import check_float
from torchnitro.kernels._triton import LazyKernel, cached_plan, cdiv, interpreting, make_plan, next_pow2
from torchnitro.kernels.dispatch import use_triton

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["rope", "apply_rope", "rope_forward", "rope_qk_forward", "RopeFunction", "RopeQKFunction",
           "RotaryEmbedding", "candidates"]


def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, T, HQ, HK, NQG,
                 sqb, sqh, sqt, skb, skh, skt, scb, sct, HALF,
                 SIGN: constexpr, HEADS: constexpr, BLOCK_T: constexpr, BLOCK: constexpr):
    # program (t block, head group, b): q's head groups come first, then k's, so one launch rotates both;
    # the (BLOCK_T, HALF) cos/sin tile is loaded once and applied to HEADS heads
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    g = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = (t[:, None] < T) & (cols[None, :] < HALF)  # (BLOCK_T, BLOCK)
    t64 = t[:, None].to(tl.int64)
    cb = b * scb + t64 * sct + cols[None, :]
    c = tl.load(cos_ptr + cb, mask=m, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cb, mask=m, other=0.0).to(tl.float32) * SIGN
    if g < NQG:
        for i in tl.static_range(HEADS):
            h = (g * HEADS + i).to(tl.int64)
            mh = m & ((t64 * 0 + h) < HQ)
            xb = q_ptr + b * sqb + h * sqh + t64 * sqt + cols[None, :]
            x1 = tl.load(xb, mask=mh, other=0.0).to(tl.float32)
            x2 = tl.load(xb + HALF, mask=mh, other=0.0).to(tl.float32)
            yb = qo_ptr + ((b * HQ + h) * T + t64) * (2 * HALF) + cols[None, :]  # (B, HQ, T, D)
            tl.store(yb, (x1 * c - x2 * s).to(qo_ptr.dtype.element_ty), mask=mh)
            tl.store(yb + HALF, (x2 * c + x1 * s).to(qo_ptr.dtype.element_ty), mask=mh)
    else:
        for i in tl.static_range(HEADS):
            h = ((g - NQG) * HEADS + i).to(tl.int64)
            mh = m & ((t64 * 0 + h) < HK)
            xb = k_ptr + b * skb + h * skh + t64 * skt + cols[None, :]
            x1 = tl.load(xb, mask=mh, other=0.0).to(tl.float32)
            x2 = tl.load(xb + HALF, mask=mh, other=0.0).to(tl.float32)
            yb = ko_ptr + ((b * HK + h) * T + t64) * (2 * HALF) + cols[None, :]  # (B, HK, T, D)
            tl.store(yb, (x1 * c - x2 * s).to(ko_ptr.dtype.element_ty), mask=mh)
            tl.store(yb + HALF, (x2 * c + x1 * s).to(ko_ptr.dtype.element_ty), mask=mh)


_kernel = LazyKernel(_rope_kernel)


def candidates(D: int) -> list[dict[str, int]]:
    """Launch configs (BLOCK_T positions x HEADS heads per program, num_warps) :func:`pick_config` times;
    the first is the default. Tiles are capped at 4096 elements so wide heads stay in registers."""
    half = next_pow2(max(1, D // 2))
    out = []
    for bt, heads, warps in ((16, 4, 4), (8, 8, 4), (16, 8, 4), (32, 4, 4), (32, 4, 8), (32, 8, 8), (64, 2, 8),
                             (64, 4, 8), (16, 2, 4), (8, 4, 2), (4, 8, 4)):
        bt = max(1, min(bt, 4096 // half))
        c = {"BLOCK_T": bt, "HEADS": heads, "num_warps": warps}
        if c not in out:
            out.append(c)
    return out


_MAX_GRID_Z = 65535


def _tables(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, int, int]:
    """Contiguous fp32 tables with (batch stride, time stride); batch stride 0 when shared."""
    if cos.dtype is not torch.float32 or not cos.is_contiguous():
        cos = cos.float().contiguous()
    if sin.dtype is not torch.float32 or not sin.is_contiguous():
        sin = sin.float().contiguous()
    if cos.dim() == 2:
        return cos, sin, 0, cos.stride(0)
    return cos, sin, (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)


def rope_qk_forward(q: Tensor, k: Tensor | None, cos: Tensor, sin: Tensor, sign: int = 1,
                    config: dict[str, int] | None = None) -> tuple[Tensor, Tensor | None]:
    """Rotate ``q`` (B, Hq, T, D) and ``k`` (B, Hk, T, D) (or None) by +theta (sign=1) or -theta (sign=-1)
    in one launch; returns contiguous tensors. ``config`` forces one of :func:`candidates`."""
    if q.shape[0] > _MAX_GRID_Z:  # the batch is grid axis 2 (at most 65535 programs): launch per slice
        parts = []
        for i in range(0, q.shape[0], _MAX_GRID_Z):
            j = i + _MAX_GRID_Z
            per_batch = cos.dim() == 3 and cos.shape[0] > 1
            parts.append(rope_qk_forward(q[i:j], k[i:j] if k is not None else None, cos[i:j] if per_batch else cos,
                                         sin[i:j] if per_batch else sin, sign, config))
        return torch.cat([p[0] for p in parts]), (torch.cat([p[1] for p in parts]) if k is not None else None)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k is None or k.stride(-1) == 1 else k.contiguous()
    B, HQ, T, D = q.shape
    HK = k.shape[1] if k is not None else 0
    c, s, scb, sct = _tables(cos, sin)
    qo = torch.empty(B, HQ, T, D, device=q.device, dtype=q.dtype)
    ko = torch.empty(B, HK, T, D, device=q.device, dtype=k.dtype) if k is not None else None
    kk, kko = (k, ko) if k is not None else (q, qo)
    if B * T * D == 0 or HQ + HK == 0:
        return qo, ko
    sq, sk = q.stride(), kk.stride()
    args = (q, kk, qo, kko, c, s, T, HQ, HK)  # then NQG (from the config), the strides, HALF
    rest = (sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], scb, sct, D // 2)
    key = ("rope", B, HQ, HK, T, D, q.dtype, q.device, sign, interpreting())
    plan = cached_plan(key, config)
    if plan is None:
        plan = make_plan(key, config, ("rope", D, HQ, HK, next_pow2(B * T), q.dtype, str(q.device)), candidates(D),
                         q.device, B * T * D * (HQ + HK), build=lambda cfg: _plan(cfg, B, HQ, HK, T, D, sign),
                         execute=lambda p: _run(p, args, rest))
    _run(plan, args, rest)
    return qo, ko


def _plan(cfg: dict[str, int], B: int, HQ: int, HK: int, T: int, D: int, sign: int) -> tuple:
    """(launch, q's head groups, kwargs) for ``cfg``: programs (t block, head group, batch)."""
    nqg, nkg = cdiv(HQ, cfg["HEADS"]), cdiv(HK, cfg["HEADS"])
    return _kernel[(cdiv(T, cfg["BLOCK_T"]), nqg + nkg, B)], nqg, {"SIGN": sign, "BLOCK": next_pow2(D // 2), **cfg}


def _run(plan: tuple, args: tuple, rest: tuple) -> None:
    launch, nqg, kw = plan
    launch(*args, nqg, *rest, **kw)


def rope_forward(x: Tensor, cos: Tensor, sin: Tensor, sign: int = 1) -> Tensor:
    """Rotate ``x`` (B, H, T, D) by +theta (sign=1) or -theta (sign=-1); returns a contiguous tensor."""
    return rope_qk_forward(x, None, cos, sin, sign)[0]


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return rope_forward(x, cos, sin, 1)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return rope_forward(dy, cos, sin, -1), None, None


class RopeQKFunction(torch.autograd.Function):
    """RoPE on q and k in one launch each way (the backward rotates both gradients by -theta)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return rope_qk_forward(q, k, cos, sin, 1)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        gq, gk = rope_qk_forward(dq, dk, cos, sin, -1)
        return gq, gk, None, None


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
    """RoPE on queries and keys (they may have different head counts, GQA); one launch for both when
    they share batch, length, head size, dtype and device."""
    _check(q, cos, sin)
    _check(k, cos, sin)
    same = (q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:] and q.dtype == k.dtype
            and q.device == k.device)
    if same and use_triton(q, op="rope"):
        return RopeQKFunction.apply(q, k, cos, sin)
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
