"""LayerNorm over the last dim, forward and backward (Ba et al., 2016).

    y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps)
Backward with x_hat = (x - mean) * rstd and g = dy * w:
    dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g));  dw = sum dy * x_hat;  db = sum dy
Forward: one program per row. Backward: persistent programs accumulate dw/db partials in fp32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.kernels import reference
from torchnitro.kernels._common import check_float, check_last_dim
from torchnitro.kernels._triton import LazyKernel, num_programs, row_config
from torchnitro.kernels.dispatch import use_triton_rows

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["layer_norm", "LayerNorm", "layer_norm_forward", "layer_norm_backward", "LayerNormFunction"]


def _ln_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, C, eps,
                   HAS_W: constexpr, HAS_B: constexpr, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / C
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / C + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _ln_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, C,
                   HAS_W: constexpr, BLOCK: constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(pid, n_rows, n_prog):
        base = tl.cast(row, tl.int64) * C
        dy = tl.load(dy_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w if HAS_W else dy
        c1 = tl.sum(g * x_hat, axis=0) / C
        c2 = tl.sum(g, axis=0) / C
        dx = rstd * (g - x_hat * c1 - c2)
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
    tl.store(dw_ptr + pid * C + cols, dw, mask=mask)
    tl.store(db_ptr + pid * C + cols, db, mask=mask)


_fwd = LazyKernel(_ln_fwd_kernel)
_bwd = LazyKernel(_ln_bwd_kernel)


def layer_norm_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
                       ) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (y, mean, rstd); mean and rstd are fp32 (N,)."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C).contiguous()
    N = x2.shape[0]
    y2 = torch.empty_like(x2)
    mean = torch.empty(N, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    block, warps = row_config(C)
    if N:
        _ln_launch = _fwd[(N,)]
        _ln_launch(x2, weight if weight is not None else x2, bias if bias is not None else x2, y2, mean, rstd,
                   C, eps, HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block, num_warps=warps)
    return y2.view(x.shape), mean, rstd


def layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dw, db) with dw/db in fp32 (the caller casts to the parameter dtypes)."""
    C = x.shape[-1]
    x2 = x.reshape(-1, C).contiguous()
    N = x2.shape[0]
    dy2 = dy.reshape(-1, C).contiguous()
    dx2 = torch.empty_like(x2)
    P = max(1, min(N, num_programs(x.device)))
    dw_part = torch.zeros(P, C, device=x.device, dtype=torch.float32)
    db_part = torch.zeros_like(dw_part)
    block, warps = row_config(C)
    if N:
        _bwd[(P,)](dy2, x2, weight if weight is not None else x2, mean, rstd, dx2, dw_part, db_part, N, C,
                   HAS_W=weight is not None, BLOCK=block, num_warps=warps)
    return dx2.view(x.shape), dw_part.sum(0), db_part.sum(0)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:  # type: ignore[override]
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.has_b = bias is not None
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd)
        dw = dw.to(weight.dtype) if weight is not None else None
        db = db.to(x.dtype) if ctx.has_b else None
        return dx, dw, db, None


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, eps: float = 1e-5) -> Tensor:
    """LayerNorm over the last dim of ``x`` with optional affine ``weight``/``bias`` of shape (C,)."""
    check_float("layer_norm", x=x, weight=weight, bias=bias)
    check_last_dim("layer_norm", "weight", weight, x.shape[-1])
    check_last_dim("layer_norm", "bias", bias, x.shape[-1])
    if use_triton_rows(x, x.shape[-1], "layer_norm"):
        return LayerNormFunction.apply(x, weight, bias, float(eps))
    return reference.layer_norm(x, weight, bias, eps)


class LayerNorm(nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` over the last dim (same ``weight``/``bias`` names)."""

    def __init__(self, dim: int, eps: float = 1e-5, elementwise_affine: bool = True, bias: bool = True,
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.dim, self.eps = dim, eps
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(dim, **kw)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(dim, **kw)) if elementwise_affine and bias else None

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}"
