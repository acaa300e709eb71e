"""Gated activations of GLU MLPs: SwiGLU = silu(gate) * up, GeGLU = gelu(gate) * up (Shazeer, 2020).

One elementwise pass forward; backward recomputes the activation from (gate, up) instead of saving
it, so the op stores nothing beyond its inputs:
    d gate = dy * up * act'(gate),   d up = dy * act(gate)
    silu'(g) = s (1 + g (1 - s)) with s = sigmoid(g).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.kernels import reference
from torchnitro.kernels._common import check_approximate, check_float, check_same_shape
from torchnitro.kernels._triton import LazyKernel
from torchnitro.kernels.dispatch import use_triton

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = [
    "swiglu", "geglu", "SwiGLUActivation", "GeGLUActivation", "glu_forward", "glu_backward", "GLUFunction",
    "ACT_SILU", "ACT_GELU", "ACT_GELU_TANH",
]

ACT_SILU, ACT_GELU, ACT_GELU_TANH = 0, 1, 2
BLOCK = 1024


def _glu_fwd_kernel(g_ptr, u_ptr, y_ptr, n, ACT: constexpr, BLOCK: constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = g / (1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0))))
    tl.store(y_ptr + offs, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


def _glu_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, ACT: constexpr, BLOCK: constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        s = 1.0 / (1.0 + tl.exp(-g))
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    else:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        t = 2.0 / (1.0 + tl.exp(tl.minimum(-2.0 * z, 80.0))) - 1.0
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    tl.store(dg_ptr + offs, (dy * u * da).to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + offs, (dy * a).to(du_ptr.dtype.element_ty), mask=mask)


_fwd = LazyKernel(_glu_fwd_kernel)
_bwd = LazyKernel(_glu_bwd_kernel)


def glu_forward(gate: Tensor, up: Tensor, act: int) -> Tensor:
    gate, up = gate.contiguous(), up.contiguous()
    y = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _fwd[((n + BLOCK - 1) // BLOCK,)](gate, up, y, n, ACT=act, BLOCK=BLOCK)
    return y


def glu_backward(dy: Tensor, gate: Tensor, up: Tensor, act: int) -> tuple[Tensor, Tensor]:
    dy = dy.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _bwd[((n + BLOCK - 1) // BLOCK,)](dy, gate, up, dg, du, n, ACT=act, BLOCK=BLOCK)
    return dg, du


class GLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, act: int) -> Tensor:  # type: ignore[override]
        gate, up = gate.contiguous(), up.contiguous()
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return glu_forward(gate, up, act)

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        gate, up = ctx.saved_tensors
        dg, du = glu_backward(dy, gate, up, ctx.act)
        return dg, du, None


def _check(op: str, gate: Tensor, up: Tensor) -> None:
    check_float(op, gate=gate, up=up)
    check_same_shape(op, ("gate", "up"), gate, up)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, elementwise; ``gate`` and ``up`` have the same shape."""
    _check("swiglu", gate, up)
    if use_triton(gate, op="swiglu"):
        return GLUFunction.apply(gate, up, ACT_SILU)
    return reference.swiglu(gate, up)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """gelu(gate) * up, elementwise; ``approximate`` is ``'none'`` or ``'tanh'``."""
    _check("geglu", gate, up)
    check_approximate("geglu", approximate)
    if use_triton(gate, op="geglu"):
        return GLUFunction.apply(gate, up, ACT_GELU_TANH if approximate == "tanh" else ACT_GELU)
    return reference.geglu(gate, up, approximate)


class SwiGLUActivation(nn.Module):
    """``forward(gate, up) -> silu(gate) * up``."""

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return swiglu(gate, up)


class GeGLUActivation(nn.Module):
    """``forward(gate, up) -> gelu(gate) * up``."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        check_approximate("GeGLUActivation", approximate)
        self.approximate = approximate

    def forward(self, gate: Tensor, up: Tensor) -> Tensor:
        return geglu(gate, up, self.approximate)
