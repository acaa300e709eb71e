"""GELU, exact (erf) and tanh-approximate, forward and backward in one elementwise pass each.

y = x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))                        (Hendrycks & Gimpel, 2016)
tanh form: y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
dy/dx (exact) = Phi(x) + x phi(x);  tanh is computed as 2 sigmoid(2z) - 1 (no libdevice call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError
from torchnitro.kernels import reference
from torchnitro.kernels._common import check_approximate, check_float
from torchnitro.kernels._triton import LazyKernel, cdiv
from torchnitro.kernels.dispatch import use_triton

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["gelu", "GELU", "gelu_forward", "gelu_backward", "GeluFunction"]

BLOCK = 1024


def _gelu_fwd_kernel(x_ptr, y_ptr, n, APPROX: constexpr, BLOCK: constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if APPROX:
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0))) - 1.0
        y = 0.5 * x * (1.0 + t)
    else:
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def _gelu_bwd_kernel(dy_ptr, x_ptr, dx_ptr, n, APPROX: constexpr, BLOCK: constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if APPROX:
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        t = 2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0))) - 1.0
        dz = 0.7978845608028654 * (1.0 + 0.134145 * x * x)
        g = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dz
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf = 0.3989422804014327 * tl.exp(-0.5 * x * x)
        g = cdf + x * pdf
    tl.store(dx_ptr + offs, (dy * g).to(dx_ptr.dtype.element_ty), mask=mask)


_fwd = LazyKernel(_gelu_fwd_kernel)
_bwd = LazyKernel(_gelu_bwd_kernel)


def _check_out(op: str, out: Tensor, like: Tensor) -> Tensor:
    if not out.is_contiguous() or out.numel() != like.numel():
        raise InputError(f"{op}: out has shape {tuple(out.shape)} (contiguous: {out.is_contiguous()}); expected "
                         f"a contiguous tensor of {like.numel()} elements, like the input")
    return out


def gelu_forward(x: Tensor, approximate: str = "none", out: Tensor | None = None) -> Tensor:
    """gelu(x), contiguous; written into ``out`` when given (contiguous, x's size; ``out`` may be a
    contiguous ``x`` itself: each element is read before it is written)."""
    x = x.contiguous()
    y = torch.empty_like(x) if out is None else _check_out("gelu_forward", out, x)
    n = x.numel()
    if n:
        _fwd[(cdiv(n, BLOCK),)](x, y, n, APPROX=approximate == "tanh", BLOCK=BLOCK)
    return y


def gelu_backward(dy: Tensor, x: Tensor, approximate: str = "none", out: Tensor | None = None) -> Tensor:
    """dy * gelu'(x), contiguous; written into ``out`` when given (as in :func:`gelu_forward`; ``out``
    may be a contiguous ``x`` or ``dy``)."""
    dy, x = dy.contiguous(), x.contiguous()
    dx = torch.empty_like(x) if out is None else _check_out("gelu_backward", out, x)
    n = x.numel()
    if n:
        _bwd[(cdiv(n, BLOCK),)](dy, x, dx, n, APPROX=approximate == "tanh", BLOCK=BLOCK)
    return dx


class GeluFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, approximate: str) -> Tensor:  # type: ignore[override]
        ctx.approximate = approximate
        ctx.save_for_backward(x)
        return gelu_forward(x, approximate)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        return gelu_backward(dy, x, ctx.approximate), None


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU of ``x`` (any shape); ``approximate`` is ``'none'`` (erf) or ``'tanh'``."""
    check_float("gelu", x=x)
    check_approximate("gelu", approximate)
    if use_triton(x, op="gelu"):
        return GeluFunction.apply(x, approximate)
    return reference.gelu(x, approximate)


class GELU(nn.Module):
    """Drop-in for ``torch.nn.GELU`` backed by the fused kernel."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        check_approximate("GELU", approximate)
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return gelu(x, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
