"""LayerNorm over the last dim, forward and backward (Ba et al., 2016).

    y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(var + eps)
Backward with x_hat = (x - mean) * rstd and g = dy * w:
    dx = rstd * (g - x_hat * mean(g * x_hat) - mean(g));  dw = sum dy * x_hat;  db = sum dy
Forward: ROWS rows per program. Backward: persistent programs (PER_SM per SM) each accumulate dw/db
partials in fp32 over their rows, then one launch sums the partials (``_partials``).
The launch config of each is picked by measurement on the first CUDA call (``_triton.pick_config``);
after that a call is a plan lookup, the allocations and the launches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.kernels import reference
from torchnitro.kernels._common import check_float, check_last_dim
from torchnitro.kernels._partials import partials_launcher
from torchnitro.kernels._norm import (as_rows, norm_bwd_candidates, norm_bwd_plan, norm_fwd_candidates,
                                     norm_fwd_plan, shaped_like)
from torchnitro.kernels._triton import LazyKernel, cached_plan, interpreting, make_plan, next_pow2
from torchnitro.kernels.dispatch import use_triton_rows

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["layer_norm", "LayerNorm", "layer_norm_forward", "layer_norm_backward", "LayerNormFunction",
           "fwd_candidates", "bwd_candidates"]


def _ln_fwd_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, C, eps,
                   HAS_W: constexpr, HAS_B: constexpr, BLOCK: constexpr, ROWS: constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    if HAS_W:  # loaded once per ROWS rows
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    for i in tl.static_range(ROWS):  # unrolled: the next row's loads overlap this row's reductions
        row = pid * ROWS + i
        ok = (cols * 0 + row) < N
        m = mask & ok
        x = tl.load(x_ptr + row * C + cols, mask=m, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=0) / C
        xc = tl.where(m, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / C + eps)
        tl.store(mean_ptr + row, mean, mask=row < N)
        tl.store(rstd_ptr + row, rstd, mask=row < N)
        y = xc * rstd
        if HAS_W:
            y = y * w
        if HAS_B:
            y = y + b
        tl.store(y_ptr + row * C + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _ln_bwd_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, C,
                   HAS_W: constexpr, BLOCK: constexpr, ROWS: constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    for r0 in range(pid * ROWS, n_rows, n_prog * ROWS):
        for i in tl.static_range(ROWS):
            row = tl.cast(r0 + i, tl.int64)
            ok = (cols * 0 + row) < n_rows
            m = mask & ok
            base = row * C
            dy = tl.load(dy_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + base + cols, mask=m, other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + row, mask=row < n_rows, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
            x_hat = tl.where(m, (x - mean) * rstd, 0.0)
            g = dy * w if HAS_W else dy
            c1 = tl.sum(g * x_hat, axis=0) / C
            c2 = tl.sum(g, axis=0) / C
            dx = rstd * (g - x_hat * c1 - c2)
            tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=m)
            dw += dy * x_hat
            db += dy
    tl.store(dw_ptr + pid * C + cols, dw, mask=mask)
    tl.store(db_ptr + pid * C + cols, db, mask=mask)


def _ln_bwd_prefetch_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_ptr, db_ptr, n_rows, C,
                            HAS_W: constexpr, BLOCK: constexpr):
    """As ``_ln_bwd_kernel`` with one row per step, loading the next row before this row's reductions
    (software pipelining: one program per SM otherwise waits a DRAM latency per row)."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    db = tl.zeros((BLOCK,), dtype=tl.float32)
    first = pid.to(tl.int64)
    m0 = mask & ((cols * 0 + first) < n_rows)
    dy = tl.load(dy_ptr + first * C + cols, mask=m0, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + first * C + cols, mask=m0, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + first, mask=first < n_rows, other=0.0)
    rstd = tl.load(rstd_ptr + first, mask=first < n_rows, other=0.0)
    for r in range(pid, n_rows, n_prog):
        cur = tl.cast(r, tl.int64)
        nxt = cur + n_prog
        mn = mask & ((cols * 0 + nxt) < n_rows)
        dy_n = tl.load(dy_ptr + nxt * C + cols, mask=mn, other=0.0).to(tl.float32)
        x_n = tl.load(x_ptr + nxt * C + cols, mask=mn, other=0.0).to(tl.float32)
        mean_n = tl.load(mean_ptr + nxt, mask=nxt < n_rows, other=0.0)
        rstd_n = tl.load(rstd_ptr + nxt, mask=nxt < n_rows, other=0.0)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w if HAS_W else dy
        c1 = tl.sum(g * x_hat, axis=0) / C
        c2 = tl.sum(g, axis=0) / C
        dx = rstd * (g - x_hat * c1 - c2)
        tl.store(dx_ptr + cur * C + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * x_hat
        db += dy
        dy, x, mean, rstd = dy_n, x_n, mean_n, rstd_n
    tl.store(dw_ptr + pid * C + cols, dw, mask=mask)
    tl.store(db_ptr + pid * C + cols, db, mask=mask)


_fwd = LazyKernel(_ln_fwd_kernel)
_bwd = LazyKernel(_ln_bwd_kernel)
_bwd_prefetch = LazyKernel(_ln_bwd_prefetch_kernel)


fwd_candidates, bwd_candidates = norm_fwd_candidates, norm_bwd_candidates  # launch configs pick_config times


def _run_fwd(plan: tuple, args: tuple, has_w: bool, has_b: bool) -> None:
    launch, kw = plan
    launch(*args, HAS_W=has_w, HAS_B=has_b, **kw)


def layer_norm_forward(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                       config: dict[str, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (y, mean, rstd); mean and rstd are fp32 (N,). ``config`` forces one of
    :func:`fwd_candidates` (default: picked by measurement on CUDA, see ``_triton.pick_config``)."""
    C = x.shape[-1]
    x2 = as_rows(x, C)
    N = x2.shape[0]
    y2 = torch.empty_like(x2)
    mean = torch.empty(N, device=x.device, dtype=torch.float32)
    rstd = torch.empty(N, device=x.device, dtype=torch.float32)
    if N:
        has_w, has_b = weight is not None, bias is not None
        args = (x2, weight if has_w else x2, bias if has_b else x2, y2, mean, rstd, N, C, eps)
        key = ("layer_norm_fwd", N, C, x.dtype, x.device, has_w, has_b, interpreting())
        plan = cached_plan(key, config)
        if plan is None:
            plan = make_plan(key, config, ("layer_norm_fwd", C, next_pow2(N), x.dtype, has_w, has_b, str(x.device)),
                             fwd_candidates(C), x.device, N * C, build=lambda cfg: norm_fwd_plan(_fwd, cfg, N, C),
                             execute=lambda p: _run_fwd(p, args, has_w, has_b))
        _run_fwd(plan, args, has_w, has_b)
    return shaped_like(y2, x), mean, rstd


def _bwd_plan(cfg: dict[str, int], N: int, C: int, device: torch.device) -> tuple:
    """(launch, kwargs, P, sum launch, sum kwargs) of the backward for ``cfg``: P persistent programs,
    then the column sums of their dw and db partials."""
    return norm_bwd_plan(_bwd, _bwd_prefetch, cfg, N, C, device) + partials_launcher(C, True)


def _run_bwd(plan: tuple, args: tuple, has_w: bool, w_dtype: torch.dtype, b_dtype: torch.dtype
             ) -> tuple[Tensor, Tensor]:
    launch, kw, P, sum_launch, sum_kw = plan
    x2 = args[1]
    C = args[-1]
    dw_part = torch.empty(P, C, device=x2.device, dtype=torch.float32)  # sized by the config
    db_part = torch.empty(P, C, device=x2.device, dtype=torch.float32)
    dw = torch.empty(C, device=x2.device, dtype=w_dtype)
    db = torch.empty(C, device=x2.device, dtype=b_dtype)
    launch(*args[:6], dw_part, db_part, *args[6:], HAS_W=has_w, **kw)
    sum_launch(dw_part, db_part, dw, db, P, C, **sum_kw)
    return dw, db


def layer_norm_backward(dy: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor, rstd: Tensor,
                        bias_dtype: torch.dtype | None = None, config: dict[str, int] | None = None
                        ) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dw, db): dw in ``weight``'s dtype (fp32 without weight), db in ``bias_dtype``
    (fp32 when None). ``config`` forces one of :func:`bwd_candidates`."""
    C = x.shape[-1]
    x2 = as_rows(x, C)
    N = x2.shape[0]
    dy2 = as_rows(dy, C)
    dx2 = torch.empty_like(x2)
    has_w = weight is not None
    w_dtype, b_dtype = weight.dtype if has_w else torch.float32, bias_dtype or torch.float32
    if not N:
        return (shaped_like(dx2, x), torch.zeros(C, device=x.device, dtype=w_dtype),
                torch.zeros(C, device=x.device, dtype=b_dtype))
    # kernel arguments but the partials (inserted by _run_bwd): dy, x, w, mean, rstd, dx, | dw, db, | n_rows, C
    args = (dy2, x2, weight if has_w else x2, mean, rstd, dx2, N, C)
    key = ("layer_norm_bwd", N, C, x.dtype, x.device, has_w, interpreting())
    plan = cached_plan(key, config)
    if plan is None:  # a config is timed with both stages: P changes the cost of the second
        plan = make_plan(key, config, ("layer_norm_bwd", C, next_pow2(N), x.dtype, has_w, str(x.device)),
                         bwd_candidates(C), x.device, N * C, build=lambda cfg: _bwd_plan(cfg, N, C, x.device),
                         execute=lambda p: _run_bwd(p, args, has_w, w_dtype, b_dtype))
    dw, db = _run_bwd(plan, args, has_w, w_dtype, b_dtype)
    return shaped_like(dx2, x), dw, db


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:  # type: ignore[override]
        y, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.b_dtype = bias.dtype if bias is not None else None
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd, ctx.b_dtype)
        return dx, dw if weight is not None else None, db if ctx.b_dtype is not None else None, None


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
