"""Second stage of the row-reduction backwards (LayerNorm, RMSNorm): sum per-program partial rows.

The first stage leaves ``P`` fp32 partial rows (one per persistent program, P ~ a few x #SMs); one
launch here sums them column-wise and writes each result in its parameter's dtype, instead of a
``sum(0)`` plus a cast per parameter (two to four launches, which dominate at 4096 x 4096).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from torchnitro.kernels._triton import LazyKernel, cdiv

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel)
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["sum_partials", "partials_launcher"]

_BLOCK_P, _BLOCK_C = 32, 32  # 128 programs at C = 4096: most SMs share the read


def _col_sum_kernel(a_ptr, b_ptr, oa_ptr, ob_ptr, P, C, HAS_B: constexpr, BLOCK_P: constexpr, BLOCK_C: constexpr):
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    acc_a = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK_P, BLOCK_C), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        m = (rows[:, None] < P) & cmask[None, :]
        off = rows[:, None].to(tl.int64) * C + cols[None, :]  # (BLOCK_P, BLOCK_C) of the (P, C) partials
        acc_a += tl.load(a_ptr + off, mask=m, other=0.0)
        if HAS_B:
            acc_b += tl.load(b_ptr + off, mask=m, other=0.0)
    tl.store(oa_ptr + cols, tl.sum(acc_a, axis=0).to(oa_ptr.dtype.element_ty), mask=cmask)
    if HAS_B:
        tl.store(ob_ptr + cols, tl.sum(acc_b, axis=0).to(ob_ptr.dtype.element_ty), mask=cmask)


_kernel = LazyKernel(_col_sum_kernel)


def sum_partials(a: Tensor, a_dtype: torch.dtype, b: Tensor | None = None, b_dtype: torch.dtype | None = None
                 ) -> tuple[Tensor, Tensor | None]:
    """Column sums of fp32 partials ``a`` (P, C) (and ``b``, same shape) as (C,) tensors of the given dtypes."""
    P, C = a.shape
    oa = torch.empty(C, device=a.device, dtype=a_dtype)
    ob = torch.empty(C, device=a.device, dtype=b_dtype or a_dtype) if b is not None else None
    if P == 0:
        oa.zero_()
        if ob is not None:
            ob.zero_()
        return oa, ob
    _kernel[(cdiv(C, _BLOCK_C),)](a, b if b is not None else a, oa, ob if ob is not None else oa, P, C,
                                  HAS_B=b is not None, BLOCK_P=_BLOCK_P, BLOCK_C=_BLOCK_C, num_warps=4)
    return oa, ob


def partials_launcher(C: int, has_b: bool) -> tuple[Any, dict[str, Any]]:
    """(launch, kwargs) of the column-sum for partial rows of ``C``, for a caller's launch plan:
    ``launch(a, b or a, out_a, out_b or out_a, P, C, **kwargs)`` with P >= 1."""
    return _kernel[(cdiv(C, _BLOCK_C),)], {"HAS_B": has_b, "BLOCK_P": _BLOCK_P, "BLOCK_C": _BLOCK_C, "num_warps": 4}
