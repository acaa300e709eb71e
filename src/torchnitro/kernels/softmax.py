"""Softmax over the last dim, forward and backward, one row per program.

    y = exp(x - max x) / sum exp(x - max x);   dx = y * (dy - sum(dy * y))
Rows up to 65536 columns stay in registers (one read, one write per pass).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError
from torchnitro.kernels import reference
from torchnitro.kernels._common import check_float
from torchnitro.kernels._triton import LazyKernel, row_config
from torchnitro.kernels.dispatch import use_triton_rows

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["softmax", "Softmax", "softmax_forward", "softmax_backward", "SoftmaxFunction"]


def _softmax_fwd_kernel(x_ptr, y_ptr, C, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    y = e / tl.sum(e, axis=0)
    tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _softmax_bwd_kernel(dy_ptr, y_ptr, dx_ptr, C, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    dy = tl.load(dy_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    dx = y * (dy - tl.sum(dy * y, axis=0))
    tl.store(dx_ptr + row * C + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


_fwd = LazyKernel(_softmax_fwd_kernel)
_bwd = LazyKernel(_softmax_bwd_kernel)


def softmax_forward(x: Tensor) -> Tensor:
    C = x.shape[-1]
    x2 = x.reshape(-1, C).contiguous()
    y2 = torch.empty_like(x2)
    block, warps = row_config(C)
    if x2.shape[0]:
        _fwd[(x2.shape[0],)](x2, y2, C, BLOCK=block, num_warps=warps)
    return y2.view(x.shape)


def softmax_backward(dy: Tensor, y: Tensor) -> Tensor:
    C = y.shape[-1]
    y2 = y.reshape(-1, C)
    dy2 = dy.reshape(-1, C).contiguous()
    dx2 = torch.empty_like(y2)
    block, warps = row_config(C)
    if y2.shape[0]:
        _bwd[(y2.shape[0],)](dy2, y2, dx2, C, BLOCK=block, num_warps=warps)
    return dx2.view(y.shape)


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        y = softmax_forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        (y,) = ctx.saved_tensors
        return softmax_backward(dy, y)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax of ``x`` over ``dim`` (the fused kernel handles the last dim; others are moved there)."""
    check_float("softmax", x=x)
    if x.dim() == 0:
        raise InputError("softmax: received a 0-d tensor; expected at least 1 dim")
    if use_triton_rows(x, x.shape[dim], "softmax"):
        d = dim % x.dim()
        if d != x.dim() - 1:
            return SoftmaxFunction.apply(x.movedim(d, -1)).movedim(-1, d)
        return SoftmaxFunction.apply(x)
    return reference.softmax(x, dim)


class Softmax(nn.Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return softmax(x, self.dim)
