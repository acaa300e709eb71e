"""Launch plumbing shared by the row-norm kernels (LayerNorm, RMSNorm): one row of C per block.

Both norms launch the same way: a forward of ROWS rows per program, and a backward whose first stage
runs P persistent programs (PER_SM per SM) that each write one fp32 partial row per parameter,
summed by ``_partials``. The candidate configs :func:`~torchnitro.kernels._triton.pick_config` times,
the plans built from them and the (N, C) row views live here once; the kernels stay in their modules.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor

from torchnitro.kernels._triton import LazyKernel, cdiv, num_programs, row_config

__all__ = ["norm_fwd_candidates", "norm_bwd_candidates", "norm_fwd_plan", "norm_bwd_plan", "as_rows", "shaped_like"]


@functools.lru_cache(maxsize=None)
def norm_fwd_candidates(C: int) -> tuple[dict[str, int], ...]:
    """Forward launch configs ``pick_config`` times for a row-norm kernel (the first, one row per program,
    is the default)."""
    _, w0 = row_config(C)
    out = [{"ROWS": 1, "num_warps": w0}]
    out += [{"ROWS": r, "num_warps": w} for r in (1, 2, 4) for w in (4, 8, 16) if (r, w) != (1, w0)]
    return tuple(out)


@functools.lru_cache(maxsize=None)
def norm_bwd_candidates(C: int) -> tuple[dict[str, int], ...]:
    """Backward configs: PER_SM persistent programs per SM, ROWS rows per loop step (or PREFETCH: the
    next row loaded during this one), num_warps (the first, one program per SM and one row per step, is
    the default)."""
    _, w0 = row_config(C)
    out = [{"PER_SM": 1, "ROWS": 1, "num_warps": w0}]
    for per_sm, rows, warps in ((2, 1, 8), (4, 1, 8), (2, 1, 16), (4, 1, 16), (1, 2, 8), (2, 2, 8), (1, 2, 16),
                                (2, 2, 16), (4, 1, 4), (8, 1, 4), (1, 1, 16), (1, 4, 16), (2, 4, 16)):
        c = {"PER_SM": per_sm, "ROWS": rows, "num_warps": warps}
        if c != out[0]:
            out.append(c)
    for per_sm, warps in ((1, 8), (2, 8), (1, 16), (2, 16)):  # next-row prefetch, one row per step
        out.append({"PER_SM": per_sm, "ROWS": 1, "PREFETCH": 1, "num_warps": warps})
    return tuple(out)


def norm_fwd_plan(kernel: LazyKernel, cfg: dict[str, int], N: int, C: int) -> tuple[Any, dict[str, int]]:
    """(launch, kwargs) of a row-norm forward ``kernel`` for ``cfg`` (one of :func:`norm_fwd_candidates`):
    ROWS rows of ``N`` per program."""
    return kernel[(cdiv(N, cfg["ROWS"]),)], {"BLOCK": row_config(C)[0], **cfg}


def norm_bwd_plan(kernel: LazyKernel, prefetch_kernel: LazyKernel, cfg: dict[str, int], N: int, C: int,
                  device: Any) -> tuple[Any, dict[str, int], int]:
    """(launch, kwargs, P) of a row-norm backward's first stage for ``cfg`` (one of
    :func:`norm_bwd_candidates`): P persistent programs, PER_SM per SM but no more than there are
    ROWS-row steps; ``prefetch_kernel`` (one row per step) for a PREFETCH config."""
    P = max(1, min(cdiv(N, cfg["ROWS"]), cfg["PER_SM"] * num_programs(device)))
    kw = {k: v for k, v in cfg.items() if k not in ("PER_SM", "PREFETCH")}
    if cfg.get("PREFETCH"):
        kernel = prefetch_kernel
        del kw["ROWS"]
    kw["BLOCK"] = row_config(C)[0]
    return kernel[(P,)], kw, P


def as_rows(t: Tensor, C: int) -> Tensor:
    """``t`` as contiguous (N, C) rows; ``t`` itself when it already is (a reshape costs microseconds)."""
    if t.dim() != 2:
        t = t.reshape(-1, C)
    return t if t.is_contiguous() else t.contiguous()


def shaped_like(t2: Tensor, like: Tensor) -> Tensor:
    return t2 if t2.dim() == like.dim() else t2.view(like.shape)
