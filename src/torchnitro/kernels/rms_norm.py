"""RMSNorm with an optional fused residual add, forward and backward.

    h = x (+ residual);  y = h / sqrt(mean(h^2) + eps) * w            (Zhang & Sennrich, 2019)
Backward, with h_hat = h * rstd and g = dy * w:
    dh = rstd * (g - h_hat * mean(g * h_hat)) (+ dh from the residual stream);  dw = sum_rows dy * h_hat
ROWS rows per program forward; the backward runs PER_SM persistent programs per SM, each accumulating
its rows' dw in fp32 registers and writing one partial row (Liger-Kernel's layout), then one launch
sums the partials (``_partials``). Launch configs are picked by measurement on the first CUDA call
(``_triton.pick_config``); after that a call is a plan lookup, the allocations and the launches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.kernels import reference
from torchnitro.kernels._common import check_float, check_last_dim, check_same_shape
from torchnitro.kernels._partials import partials_launcher
from torchnitro.kernels._norm import (as_rows, norm_bwd_candidates, norm_bwd_plan, norm_fwd_candidates,
                                     norm_fwd_plan, shaped_like)
from torchnitro.kernels._triton import LazyKernel, cached_plan, interpreting, make_plan, next_pow2
from torchnitro.kernels.dispatch import use_triton_rows

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["rms_norm", "RMSNorm", "rms_norm_forward", "rms_norm_backward", "RMSNormFunction",
           "fwd_candidates", "bwd_candidates"]


def _rms_fwd_kernel(x_ptr, r_ptr, h_ptr, w_ptr, y_ptr, rstd_ptr, N, C, eps,
                    HAS_RES: constexpr, HAS_W: constexpr, BLOCK: constexpr, ROWS: constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    if HAS_W:  # loaded once per ROWS rows
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(ROWS):  # unrolled: the next row's loads overlap this row's reduction
        row = pid * ROWS + i
        m = mask & ((cols * 0 + row) < N)
        x = tl.load(x_ptr + row * C + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            x += tl.load(r_ptr + row * C + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(h_ptr + row * C + cols, x.to(h_ptr.dtype.element_ty), mask=m)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / C + eps)
        tl.store(rstd_ptr + row, rstd, mask=row < N)
        y = x * rstd
        if HAS_W:
            y = y * w
        tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _rms_bwd_kernel(dy_ptr, dh_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, C,
                    HAS_DH: constexpr, HAS_W: constexpr, BLOCK: constexpr, ROWS: constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for r0 in range(pid * ROWS, n_rows, n_prog * ROWS):
        for i in tl.static_range(ROWS):
            row = tl.cast(r0 + i, tl.int64)
            m = mask & ((cols * 0 + row) < n_rows)
            base = row * C
            dy = tl.load(dy_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            h = tl.load(h_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
            h_hat = h * rstd
            g = dy * w if HAS_W else dy
            dx = rstd * (g - h_hat * (tl.sum(g * h_hat, axis=0) / C))
            if HAS_DH:
                dx += tl.load(dh_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
            dw += dy * h_hat
    if HAS_W:
        tl.store(dw_ptr + pid * C + cols, dw, mask=mask)


def _rms_bwd_prefetch_kernel(dy_ptr, dh_ptr, h_ptr, w_ptr, rstd_ptr, dx_ptr, dw_ptr, n_rows, C,
                             HAS_DH: constexpr, HAS_W: constexpr, BLOCK: constexpr):
    """As ``_rms_bwd_kernel`` with one row per step, loading the next row's dy and h before this row's
    reduction (software pipelining: one program per SM otherwise waits a DRAM latency per row)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid.to(tl.int64)
    m0 = mask & ((cols * 0 + first) < n_rows)
    dy = tl.load(dy_ptr + first * C + cols, mask=m0, other=0.0).to(tl.float32)
    h = tl.load(h_ptr + first * C + cols, mask=m0, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + first, mask=first < n_rows, other=0.0)
    for r in range(pid, n_rows, n_prog):
        cur = tl.cast(r, tl.int64)
        nxt = cur + n_prog
        mn = mask & ((cols * 0 + nxt) < n_rows)
        dy_n = tl.load(dy_ptr + nxt * C + cols, mask=mn, other=0.0).to(tl.float32)
        h_n = tl.load(h_ptr + nxt * C + cols, mask=mn, other=0.0).to(tl.float32)
        rstd_n = tl.load(rstd_ptr + nxt, mask=nxt < n_rows, other=0.0)
        h_hat = h * rstd
        g = dy * w if HAS_W else dy
        dx = rstd * (g - h_hat * (tl.sum(g * h_hat, axis=0) / C))
        if HAS_DH:
            dx += tl.load(dh_ptr + cur * C + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + cur * C + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * h_hat
        dy, h, rstd = dy_n, h_n, rstd_n
    if HAS_W:
        tl.store(dw_ptr + pid * C + cols, dw, mask=mask)


_fwd = LazyKernel(_rms_fwd_kernel)
_bwd = LazyKernel(_rms_bwd_kernel)
_bwd_prefetch = LazyKernel(_rms_bwd_prefetch_kernel)


fwd_candidates, bwd_candidates = norm_fwd_candidates, norm_bwd_candidates  # launch configs pick_config times


def _run_fwd(plan: tuple, args: tuple, has_r: bool, has_w: bool) -> None:
    launch, kw = plan
    launch(*args, HAS_RES=has_r, HAS_W=has_w, **kw)


def rms_norm_forward(x: Tensor, weight: Tensor | None, eps: float, residual: Tensor | None = None,
                     config: dict[str, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (y, h, rstd): h is x + residual (x itself without residual), rstd is fp32 (N,).
    ``config`` forces one of :func:`fwd_candidates` (default: picked by measurement on CUDA)."""
    C = x.shape[-1]
    x2 = as_rows(x, C)
    N = x2.shape[0]
    r2 = as_rows(residual, C) if residual is not None else None
    h2 = torch.empty_like(x2) if r2 is not None else x2
    y2 = torch.empty_like(x2)
    rstd = torch.empty(N, device=x.device, dtype=torch.float32)
    if N:
        has_r, has_w = r2 is not None, weight is not None
        args = (x2, r2 if has_r else x2, h2, weight if has_w else x2, y2, rstd, N, C, eps)
        key = ("rms_norm_fwd", N, C, x.dtype, x.device, has_r, has_w, interpreting())
        plan = cached_plan(key, config)
        if plan is None:
            plan = make_plan(key, config, ("rms_norm_fwd", C, next_pow2(N), x.dtype, has_r, has_w, str(x.device)),
                             fwd_candidates(C), x.device, N * C, build=lambda cfg: norm_fwd_plan(_fwd, cfg, N, C),
                             execute=lambda p: _run_fwd(p, args, has_r, has_w))
        _run_fwd(plan, args, has_r, has_w)
    return shaped_like(y2, x), shaped_like(h2, x), rstd


def _bwd_plan(cfg: dict[str, int], N: int, C: int, device: torch.device, has_w: bool) -> tuple:
    """(launch, kwargs, P, sum launch, sum kwargs) of the backward for ``cfg``: P persistent programs,
    then the column sum of their dw partials."""
    sums = partials_launcher(C, False) if has_w else (None, None)
    return norm_bwd_plan(_bwd, _bwd_prefetch, cfg, N, C, device) + sums


def _run_bwd(plan: tuple, args: tuple, weight: Tensor | None, has_dh: bool) -> Tensor | None:
    launch, kw, P, sum_launch, sum_kw = plan
    C = args[-1]
    dw_part = dw = None
    if weight is not None:
        dw_part = torch.empty(P, C, device=weight.device, dtype=torch.float32)
        dw = torch.empty(C, device=weight.device, dtype=weight.dtype)
    launch(*args[:6], dw_part if dw_part is not None else args[4], *args[6:], HAS_DH=has_dh, HAS_W=weight is not None,
           **kw)
    if dw_part is not None:
        sum_launch(dw_part, dw_part, dw, dw, P, C, **sum_kw)
    return dw


def rms_norm_backward(dy: Tensor, dh_out: Tensor | None, h: Tensor, weight: Tensor | None, rstd: Tensor,
                      config: dict[str, int] | None = None) -> tuple[Tensor, Tensor | None]:
    """Returns (dx, dw); ``dh_out`` is the gradient flowing into the residual-stream output h.
    ``config`` forces one of :func:`bwd_candidates`."""
    C = h.shape[-1]
    h2 = as_rows(h, C)
    N = h2.shape[0]
    dy2 = as_rows(dy, C)
    dh2 = as_rows(dh_out, C) if dh_out is not None else None
    dx2 = torch.empty_like(h2)
    if not N:
        dw = torch.zeros(C, device=h.device, dtype=weight.dtype) if weight is not None else None
        return shaped_like(dx2, h), dw
    has_dh, has_w = dh2 is not None, weight is not None
    # kernel arguments but dw_ptr (inserted by _run_bwd): dy, dh, h, w, rstd, dx, | dw, | n_rows, C
    args = (dy2, dh2 if has_dh else dy2, h2, weight if has_w else h2, rstd, dx2, N, C)
    key = ("rms_norm_bwd", N, C, h.dtype, h.device, has_dh, has_w, interpreting())
    plan = cached_plan(key, config)
    if plan is None:  # a config is timed with both stages: P changes the cost of the second
        plan = make_plan(key, config, ("rms_norm_bwd", C, next_pow2(N), h.dtype, has_dh, has_w, str(h.device)),
                         bwd_candidates(C), h.device, N * C, build=lambda cfg: _bwd_plan(cfg, N, C, h.device, has_w),
                         execute=lambda p: _run_bwd(p, args, weight, has_dh))
    dw = _run_bwd(plan, args, weight, has_dh)
    return shaped_like(dx2, h), dw


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
