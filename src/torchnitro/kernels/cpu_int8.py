"""Fused activation quantiser for int8 GEMMs on the CPU: a small C kernel (``cpu_int8.c``), built and cached as
``cpu_attention`` builds its kernel (same compiler, flags, cache and OpenMP runtime), called via ctypes.

    q, scale, zp = quantize_u8(x, col_scale)   # (N, K) fp32 -> (N, K) uint8, per tensor, asymmetric

``y = x * col_scale`` (per input column: SmoothQuant's ``1/s``, 0 for a column computed in fp32 elsewhere), then
``torch.quantize_per_tensor(y, scale, zp, torch.quint8)`` over ``y``'s own range (``[min(0, min y), max(0, max y)]``
over 255 steps), as two passes over ``x`` instead of torch's four to six (multiply, zero columns, aminmax,
quantise). ``quantize_u8_reference`` is the same in torch ops: the fallback and the test oracle.

Where no compiler is found or the build fails, ``cpu_int8_reason()`` says why in one line; callers use the
reference then.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from torchnitro.kernels.cpu_attention import load_native

__all__ = ["cpu_int8_reason", "quantize_u8", "quantize_u8_reference"]

_SOURCE = Path(__file__).with_name("cpu_int8.c")
_ABI = 1  # tn_q8_abi() of the C source this loader speaks to
_state: dict[str, object] = {}


@dataclass
class _Kernel:
    lib: ctypes.CDLL
    path: Path


def _open(path: Path) -> _Kernel:
    lib = ctypes.CDLL(str(path))
    if lib.tn_q8_abi() != _ABI:
        raise RuntimeError(f"{path.name} speaks ABI {lib.tn_q8_abi()}, this loader {_ABI}")
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.tn_quantize_u8.argtypes = [vp, i64, i64, i64, vp, vp, vp, vp, ctypes.c_int]
    lib.tn_quantize_u8.restype = ctypes.c_int
    return _Kernel(lib, path)


def _kernel() -> _Kernel | None:
    return load_native(_state, _SOURCE, _open, "native int8 quantiser")  # type: ignore[return-value]


def cpu_int8_reason() -> str | None:
    """None when the native quantiser runs here, else why not (one line)."""
    return None if _kernel() is not None else str(_state.get("reason"))


def _check(x: Tensor, col_scale: Tensor | None) -> None:
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError("quantize_u8: x must be a 2-D float32 CPU tensor (N, K), received "
                         + (f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, Tensor) else type(x).__name__))
    if x.stride(1) != 1 or (x.shape[0] > 1 and x.stride(0) < x.shape[1]):
        raise ValueError(f"quantize_u8: x's rows must be contiguous (stride (>= {x.shape[1]}, 1)), received strides "
                         f"{tuple(x.stride())}; pass x.contiguous()")
    if col_scale is not None and (col_scale.dtype != torch.float32 or col_scale.shape != (x.shape[1],)
                                  or not col_scale.is_contiguous() or col_scale.device.type != "cpu"):
        raise ValueError(f"quantize_u8: col_scale must be a contiguous float32 CPU tensor of shape ({x.shape[1]},), "
                         f"received {col_scale.dtype} {tuple(col_scale.shape)}")


def quantize_u8_reference(x: Tensor, col_scale: Tensor | None = None) -> tuple[Tensor, float, int]:
    """``quantize_u8`` in torch ops: ``(N, K)`` uint8, scale, zero point."""
    y = x if col_scale is None else x * col_scale
    lo, hi = torch.aminmax(y)
    lo_f, hi_f = min(float(lo), 0.0), max(float(hi), 0.0)  # the range must contain 0 (exact zero point)
    scale = max(hi_f - lo_f, 1e-8) / 255.0
    zp = int(min(255, max(0, round(-lo_f / scale))))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor", category=UserWarning)
        q = torch.quantize_per_tensor(y.contiguous(), scale, zp, torch.quint8)
    return q.int_repr(), scale, zp


def quantize_u8(x: Tensor, col_scale: Tensor | None = None) -> tuple[Tensor, float, int]:
    """``(N, K)`` fp32 rows (contiguous rows; any row stride) times ``col_scale`` ``(K,)`` -> ``(N, K)`` uint8, the
    scale and the zero point (per tensor, asymmetric, the range holding 0). Raises ``RuntimeError`` with
    ``cpu_int8_reason()`` where the kernel is not available (callers check it first), ``ValueError`` for a
    non-finite input."""
    _check(x, col_scale)
    k = _kernel()
    if k is None:
        raise RuntimeError(str(_state.get("reason")))
    n, c = x.shape
    q = torch.empty((n, c), dtype=torch.uint8)
    scale, zp = ctypes.c_double(), ctypes.c_int64()
    rc = k.lib.tn_quantize_u8(x.data_ptr(), n, c, x.stride(0) if n > 1 else c,
                              None if col_scale is None else col_scale.data_ptr(), q.data_ptr(),
                              ctypes.byref(scale), ctypes.byref(zp), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"quantize_u8: the input's range is not finite (received a tensor with inf or nan, "
                         f"shape {tuple(x.shape)}); expected finite activations")
    return q, scale.value, zp.value
