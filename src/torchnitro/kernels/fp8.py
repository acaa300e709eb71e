"""FP8 (e4m3 / e5m2) quantize and dequantize with per-tensor or per-row scales (Micikevicius et al., 2022).

    s = amax / fp8_max  (per tensor, or per row of the last dim);  q = fp8(clamp(x / s, -max, max));  x ~= q * s
Per-tensor: one pass for amax (block maxima reduced with an atomic max), one pass to scale and cast.
Per-row: one pass per row. The Triton interpreter rounds fp32 -> fp8 wrongly, so while interpreting the
kernel writes the scaled, clamped fp32 values and the launcher casts them with torch (same math,
different rounding site); on a GPU the kernel writes FP8 directly. Quantization is not differentiable
(use a straight-through estimator around it if training through it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from torchnitro.errors import InputError
from torchnitro.kernels import reference
from torchnitro.kernels._common import check_float
from torchnitro.kernels._triton import LazyKernel, interpreting, row_config
from torchnitro.kernels.dispatch import use_triton, use_triton_rows
from torchnitro.kernels.reference import FP8_MAX

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["fp8_quantize", "fp8_dequantize", "fp8_quantize_forward", "fp8_dequantize_forward", "fp8_recipe_cast",
           "FP8_DTYPES"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
BLOCK = 1024


def _amax_kernel(x_ptr, amax_ptr, n, BLOCK: constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.atomic_max(amax_ptr, tl.max(tl.abs(x), axis=0))


def _scale_cast_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, n, FMAX: constexpr, BLOCK: constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    scale = tl.maximum(tl.load(amax_ptr), 1e-12) / FMAX
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(s_ptr, scale)


def _row_quant_kernel(x_ptr, q_ptr, s_ptr, C, FMAX: constexpr, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < C
    x = tl.load(x_ptr + row * C + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FMAX
    q = tl.minimum(tl.maximum(x / scale, -FMAX), FMAX)
    tl.store(q_ptr + row * C + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def _dequant_kernel(q_ptr, s_ptr, y_ptr, n, C, PER_ROW: constexpr, BLOCK: constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PER_ROW:
        s = tl.load(s_ptr + offs // C, mask=mask, other=0.0)
    else:
        s = tl.load(s_ptr)
    tl.store(y_ptr + offs, (q * s).to(y_ptr.dtype.element_ty), mask=mask)


def _recipe_cast_kernel(x_ptr, amax_ptr, prev_ptr, q_ptr, s_ptr, inv_ptr, n, FMAX: constexpr, MARGIN_DIV: constexpr,
                        BLOCK: constexpr):
    # scale = fmax / amax / 2**margin; amax == 0 -> 1; non-finite amax -> the previous scale
    a = tl.load(amax_ptr)
    prev = tl.load(prev_ptr)
    finite = a == a and a < float("inf")
    raw = tl.minimum(FMAX / tl.where(a > 0, a, 1.0) / MARGIN_DIV, 3.4028234663852886e38)
    scale = tl.where(finite, tl.where(a > 0, raw, 1.0), prev)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    q = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
    tl.store(q_ptr + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    if tl.program_id(0) == 0:
        tl.store(s_ptr, scale)
        tl.store(inv_ptr, 1.0 / scale)


_amax = LazyKernel(_amax_kernel)
_recipe_cast = LazyKernel(_recipe_cast_kernel)
_scale_cast = LazyKernel(_scale_cast_kernel)
_row_quant = LazyKernel(_row_quant_kernel)
_dequant = LazyKernel(_dequant_kernel)


def fp8_quantize_forward(x: Tensor, dtype: torch.dtype, per_row: bool) -> tuple[Tensor, Tensor]:
    fmax = FP8_MAX[dtype]
    x = x.contiguous()
    stage_fp32 = interpreting()  # the interpreter's fp32 -> fp8 rounding is wrong: cast on the host
    q = torch.empty(x.shape, device=x.device, dtype=torch.float32 if stage_fp32 else dtype)
    if per_row:
        C = x.shape[-1]
        rows = x.numel() // max(C, 1)
        s = torch.empty(*x.shape[:-1], 1, device=x.device, dtype=torch.float32)
        block, warps = row_config(C)
        if rows:
            _row_quant[(rows,)](x, q, s, C, FMAX=fmax, BLOCK=block, num_warps=warps)
    else:
        n = x.numel()
        amax = torch.zeros((), device=x.device, dtype=torch.float32)
        s = torch.empty((), device=x.device, dtype=torch.float32)
        grid = ((n + BLOCK - 1) // BLOCK,)
        if n:
            _amax[grid](x, amax, n, BLOCK=BLOCK)
            _scale_cast[grid](x, amax, q, s, n, FMAX=fmax, BLOCK=BLOCK)
    return (q.to(dtype) if stage_fp32 else q), s


def fp8_recipe_cast(x: Tensor, prev_scale: Tensor, dtype: torch.dtype, margin: int = 0
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Dynamic-recipe cast in two passes: ``(q, scale, inv_scale, amax)``.

    Same math as ``torchnitro.precision.fp8``: ``scale = fp8_max / amax / 2**margin`` (1 when amax is 0,
    ``prev_scale`` when amax is inf/NaN), ``q = fp8(clamp(x * scale))``. Pass one reduces amax with an
    atomic max; pass two derives the scale on the device (no host sync) and casts. ``x`` must be on
    a device Triton runs on (CUDA, or CPU under ``TRITON_INTERPRET=1``).
    """
    fmax = FP8_MAX[dtype]
    x = x.contiguous()
    n = x.numel()
    stage_fp32 = interpreting()
    q = torch.empty(x.shape, device=x.device, dtype=torch.float32 if stage_fp32 else dtype)
    amax = torch.zeros((), device=x.device, dtype=torch.float32)
    s = torch.empty((), device=x.device, dtype=torch.float32)
    inv = torch.empty((), device=x.device, dtype=torch.float32)
    grid = (max(1, (n + BLOCK - 1) // BLOCK),)
    if n:
        _amax[grid](x, amax, n, BLOCK=BLOCK)
    _recipe_cast[grid](x, amax, prev_scale.reshape(()).float(), q, s, inv, n, FMAX=fmax,
                       MARGIN_DIV=float(2.0 ** margin), BLOCK=BLOCK)
    return (q.to(dtype) if stage_fp32 else q), s, inv, amax


def fp8_dequantize_forward(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    q = q.contiguous()
    if interpreting():
        q = q.float()  # the interpreter cannot load fp8 faithfully: upcast first (exact)
    y = torch.empty(q.shape, device=q.device, dtype=dtype)
    n = q.numel()
    per_row = scale.numel() > 1
    if n:
        _dequant[((n + BLOCK - 1) // BLOCK,)](q, scale.contiguous().float(), y, n, max(q.shape[-1], 1),
                                              PER_ROW=per_row, BLOCK=BLOCK)
    return y


def _fp8_native(t: Tensor) -> bool:
    """Triton converts to/from FP8 natively from compute capability 8.9 (Ada, Hopper); older GPUs use torch."""
    return t.device.type != "cuda" or torch.cuda.get_device_capability(t.device) >= (8, 9)


def fp8_quantize(x: Tensor, dtype: torch.dtype = torch.float8_e4m3fn, per_row: bool = False) -> tuple[Tensor, Tensor]:
    """Scaled cast of ``x`` to FP8; returns (q, scale) with fp32 ``scale`` of shape () or (..., 1)."""
    check_float("fp8_quantize", x=x)
    if dtype not in FP8_DTYPES:
        raise InputError(f"fp8_quantize: dtype={dtype}; expected torch.float8_e4m3fn or torch.float8_e5m2")
    if per_row and x.dim() == 0:
        raise InputError("fp8_quantize: per_row=True on a 0-d tensor; expected at least 1 dim")
    if _fp8_native(x) and use_triton_rows(x, x.shape[-1] if per_row else 1, "fp8_quantize"):
        return fp8_quantize_forward(x, dtype, per_row)
    return reference.fp8_quantize(x, dtype, per_row)


def fp8_dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """q * scale in ``dtype``; ``scale`` is () (per tensor) or q.shape[:-1] + (1,) (per row)."""
    if q.dtype not in FP8_DTYPES:
        raise InputError(f"fp8_dequantize: q has dtype {q.dtype}; expected an FP8 tensor from fp8_quantize")
    if scale.numel() != 1 and tuple(scale.shape) != (*q.shape[:-1], 1):
        raise InputError(f"fp8_dequantize: scale {tuple(scale.shape)} does not fit q {tuple(q.shape)}; expected () "
                         f"or {(*q.shape[:-1], 1)}")
    if _fp8_native(q) and use_triton(q, op="fp8_dequantize"):
        return fp8_dequantize_forward(q, scale, dtype)
    return reference.fp8_dequantize(q, scale, dtype)
