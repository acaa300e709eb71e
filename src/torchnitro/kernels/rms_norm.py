"""RMSNorm with an optional fused residual add, forward and backward.

    h = x (+ residual);  y = h / sqrt(mean(h^2) + eps) * w            (Zhang & Sennrich, 2019)
Backward, with h_hat = h * rstd and g = dy * w:
    dh = rstd * (g - h_hat * mean(g * h_hat)) (+ dh from the residual stream);  dw = sum_rows dy * h_hat
One program per row forward; the backward runs one persistent program per SM that accumulates its
rows' dw in fp32 registers and writes one partial row (Liger-Kernel's layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.kernels import reference
from torchnitro.kernels._common import check_float, check_last_dim, check_same_shape
from torchnitro.kernels._triton import LazyKernel, num_programs, row_config
from torchnitro.kernels.dispatch import use_triton_rows

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["rms_norm", "RMSNorm", "rms_norm_forward", "rms_norm_backward", "RMSNormFunction"]


def _rms_fwd_kernel(x_ptr, r_ptr, h_ptr, w_ptr, y_ptr, rstd_ptr, C, eps,
                    HAS_RES: constexpr, HAS_W: constexpr, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(r_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * C + cols, x.to(h_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
    tl.store(rstd_ptr + row, rstd)
    y = x * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _rms_bwd_kernel(dy_ptr, dh_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, C,
                    HAS_DH: constexpr, HAS_W: constexpr, BLOCK: constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, n_prog):
        base = tl.cast(row, tl.int64) * C
        dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        h = tl.load(h_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        h_hat = h * rstd
        g = dy * w if HAS_W else dy
        dx = rstd * (g - h_hat * (tl.sum(g * h_hat, axis=0) / C))
        if HAS_DH:
            dx += tl.load(dh_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * h_hat
    if HAS_W:
        tl.store(dw_ptr + pid * C + cols, dw, mask=mask)


_fwd = LazyKernel(_rms_fwd_kernel)
_bwd = LazyKernel(_rms_bwd_kernel)


def rms_norm_forward(x: Tensor, weight: Tensor | None, eps: float, residual: Tensor | None = None
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (y, h, rstd): h is x + residual (x itself without residual), rstd is fp32 (N,)."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C).contiguous()
    N = x2.shape[0]
    r2 = residual.reshape(-1, C).contiguous() if residual is not None else None
    h2 = torch.empty_like(x2) if r2 is not None else x2
    y2 = torch.empty_like(x2)
    rstd = torch.empty(N, device=x.device, dtype=torch.float32)
    block, warps = row_config(C)
    if N:
        _fwd[(N,)](x2, r2 if r2 is not None else x2, h2, weight if weight is not None else x2, y2, rstd, C, eps,
                   HAS_RES=r2 is not None, HAS_W=weight is not None, BLOCK=block, num_warps=warps)
    return y2.view(x.shape), h2.view(x.shape), rstd


def rms_norm_backward(dy: Tensor, dh_out: Tensor | None, h: Tensor, weight: Tensor | None, rstd: Tensor
                      ) -> tuple[Tensor, Tensor | None]:
    """Returns (dx, dw); ``dh_out`` is the gradient flowing into the residual-stream output h."""
    C = h.shape[-1]
    h2 = h.reshape(-1, C)
    N = h2.shape[0]
    dy2 = dy.reshape(-1, C).contiguous()
    dh2 = dh_out.reshape(-1, C).contiguous() if dh_out is not None else None
    dx2 = torch.empty_like(h2)
    P = max(1, min(N, num_programs(h.device)))
    dw_part = torch.empty(P, C, device=h.device, dtype=torch.float32) if weight is not None else None
    block, warps = row_config(C)
    if N:
        _bwd[(P,)](dy2, dh2 if dh2 is not None else dy2, h2, weight if weight is not None else h2, rstd, dx2,
                   dw_part if dw_part is not None else rstd, N, C,
                   HAS_DH=dh2 is not None, HAS_W=weight is not None, BLOCK=block, num_warps=warps)
    dw = dw_part.sum(0).to(weight.dtype) if weight is not None and N else (
        torch.zeros_like(weight) if weight is not None else None)
    return dx2.view(h.shape), dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float, residual: Tensor | None):  # type: ignore[override]
        y, h, rstd = rms_norm_forward(x, weight, eps, residual)
        ctx.has_res = residual is not None
        ctx.save_for_backward(h, weight, rstd)
        if residual is None:
            return y
        return y, h

    @staticmethod
    def backward(ctx, dy: Tensor, dh_out: Tensor | None = None):  # type: ignore[override]
        h, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, dh_out, h, weight, rstd)
        return dx, dw, None, (dx if ctx.has_res else None)


def rms_norm(x: Tensor, weight: Tensor | None, eps: float = 1e-6, residual: Tensor | None = None
             ) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm over the last dim of ``x``; with ``residual`` returns ``(rms_norm(x + residual), x + residual)``."""
    check_float("rms_norm", x=x, weight=weight, residual=residual)
    check_last_dim("rms_norm", "weight", weight, x.shape[-1])
    if residual is not None:
        check_same_shape("rms_norm", ("x", "residual"), x, residual)
    if use_triton_rows(x, x.shape[-1], "rms_norm"):
        return RMSNormFunction.apply(x, weight, float(eps), residual)
    return reference.rms_norm(x, weight, eps, residual)


class RMSNorm(nn.Module):
    """RMSNorm over the last ``dim`` features; ``forward(x, residual=None)`` as in :func:`rms_norm`.

    State dict matches ``torch.nn.RMSNorm`` (one ``weight``), so weights load either way.
    """

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype)) if elementwise_affine else None

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
