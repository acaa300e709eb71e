"""Bind and unbind on the CPU through MKL's DFTI, with descriptors kept across calls and rows in blocks.

``torch.fft`` on an x86 CPU build runs MKL, but commits a new DFTI descriptor for every call (15-70 us
at d = 512-4096, three times per bind) and makes four passes over tensor-sized buffers: ``rfft(a)``,
``rfft(b)``, the product and ``irfft``. At a batch of 1,000 rows of d = 4096 those buffers are 16 MiB
each, so every pass streams from L3 or DRAM. This path calls the same MKL routines (``DftiCompute*``,
the ones ``torch.fft`` calls, exported by ``libtorch_cpu``) through ``ctypes``:

* a descriptor per (d, rows, precision, threads, direction) is committed once and kept (per thread,
  least recently used out first);
* rows go through in blocks of about ``BLOCK_BYTES`` of input, so the two half spectra of a block
  (``rfft(a)``, ``rfft(b)``), their product and ``irfft`` stay in the core's L2 cache; the block's
  result is written straight into the output tensor;
* a batch is cut into blocks of equal size (give or take a row): a steady batch size reuses at most
  two descriptors per direction, and a new size costs one commit (what ``torch.fft`` pays on every
  call).

``rfft`` and ``irfft`` give the other CPU transforms (``hrr.backend.transforms``: project, the exact and
projected unbinds, shapes that broadcast both ways, hrr.fused's spectral sum) the same kept descriptors.

The results match ``torch.fft``'s to rounding (the same MKL transforms and ``1 / d`` scale; MKL
may pick other kernels for other block sizes): ``tests/hrr/test_mkl_fft.py`` compares them. float32
and float64, any d >= 1, equal shapes or a single vector against a batch.
Available where torch was built with MKL and ``libtorch_cpu`` exports DFTI (the x86-64 Linux wheels);
``mkl_bind_reason`` says why not elsewhere. ``ctypes`` releases the GIL for each transform.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from collections import OrderedDict

import numpy as np
import torch

from torchnitro.errors import BackendUnavailableError, InputError, ShapeError

__all__ = ["mkl_available", "mkl_bind", "mkl_bind_reason", "rfft", "irfft", "block_rows", "BLOCK_BYTES"]

# input bytes per block, operand and thread: 256 KiB keeps a block's share of a, b, both half spectra
# and the result (~1.3 MiB) in a 2 MiB L2 per core; MKL splits a block's transforms over the threads.
# benchmarks/hrr_mkl_blocks.py (results/hrr_mkl_blocks_t*.md) measured it
BLOCK_BYTES = 256 * 1024
# descriptors per thread; each holds its twiddles and workspace: 0.01-0.03 MiB of RSS at block size,
# 0.1-0.5 MiB for a 1000-row transform of d = 1024-4096 (as mkl_fft.rfft makes for hrr.fused)
_CACHE_SIZE = 64

_PRECISION = {torch.float32: "s", torch.float64: "d"}  # DftiCreateDescriptor_{s,d}_1d
_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}
_REAL = {v: k for k, v in _COMPLEX.items()}

# mkl_dfti.h: configuration parameters and values
_FORWARD_DOMAIN_REAL = 33
_BACKWARD_SCALE, _NUMBER_OF_TRANSFORMS, _CONJUGATE_EVEN_STORAGE = 5, 7, 10
_PLACEMENT, _INPUT_DISTANCE, _OUTPUT_DISTANCE, _THREAD_LIMIT = 11, 14, 15, 27
_COMPLEX_COMPLEX, _NOT_INPLACE = 39, 44

_LONG = ctypes.c_long  # MKL_LONG: long in both the LP64 and ILP64 interfaces on Linux
_PTR = ctypes.c_void_p


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(libtorch_cpu with DFTI, None) or (None, why not)."""
    if not sys.platform.startswith("linux"):
        return None, f"platform {sys.platform}; the MKL path loads libtorch_cpu.so (Linux only)"
    if not torch.backends.mkl.is_available():
        return None, "this torch build has no MKL"
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        names = ("DftiCreateDescriptor_s_1d", "DftiCreateDescriptor_d_1d", "DftiSetValue",
                 "DftiCommitDescriptor", "DftiComputeForward", "DftiComputeBackward",
                 "DftiFreeDescriptor", "DftiErrorMessage")
        funcs = [getattr(lib, n) for n in names]
    except (OSError, AttributeError) as e:
        return None, f"libtorch_cpu does not export MKL's DFTI ({e})"
    for f in funcs[:-1]:
        f.restype = _LONG
    funcs[-1].restype = ctypes.c_char_p
    return lib, None


def mkl_available() -> bool:
    return _library()[0] is not None


def _check(status: int) -> None:
    """A DFTI status to an exception carrying MKL's own message."""
    if status:
        msg = _library()[0].DftiErrorMessage(_LONG(status)).decode(errors="replace")
        raise BackendUnavailableError(f"MKL DFTI call failed with status {status}: {msg}")


class _Descriptor:
    """One committed DFTI descriptor: ``rows`` real transforms of length ``d``, out of place."""

    def __init__(self, d: int, rows: int, dtype: torch.dtype, threads: int, forward: bool) -> None:
        lib = _library()[0]
        self.handle = _PTR()
        # kept on the instance: __del__ may run at interpreter exit, after module globals are cleared
        self._free, self._byref = lib.DftiFreeDescriptor, ctypes.byref
        create = getattr(lib, f"DftiCreateDescriptor_{_PRECISION[dtype]}_1d")
        _check(create(ctypes.byref(self.handle), ctypes.c_int(_FORWARD_DOMAIN_REAL), _LONG(d)))
        try:
            half = d // 2 + 1  # complex values per spectrum row (CCE storage)
            setv, h = lib.DftiSetValue, self.handle
            _check(setv(h, ctypes.c_int(_PLACEMENT), ctypes.c_int(_NOT_INPLACE)))
            _check(setv(h, ctypes.c_int(_CONJUGATE_EVEN_STORAGE), ctypes.c_int(_COMPLEX_COMPLEX)))
            _check(setv(h, ctypes.c_int(_THREAD_LIMIT), _LONG(threads)))
            if rows > 1:
                _check(setv(h, ctypes.c_int(_NUMBER_OF_TRANSFORMS), _LONG(rows)))
                _check(setv(h, ctypes.c_int(_INPUT_DISTANCE), _LONG(d if forward else half)))
                _check(setv(h, ctypes.c_int(_OUTPUT_DISTANCE), _LONG(half if forward else d)))
            if not forward:
                _check(setv(h, ctypes.c_int(_BACKWARD_SCALE), ctypes.c_double(1.0 / d)))
            _check(lib.DftiCommitDescriptor(h))
        except BackendUnavailableError:
            self.free()
            raise
        self._compute = lib.DftiComputeForward if forward else lib.DftiComputeBackward

    def __call__(self, src: int, dst: int) -> None:
        _check(self._compute(self.handle, _PTR(src), _PTR(dst)))

    def free(self) -> None:
        handle = getattr(self, "handle", None)
        if handle:
            self._free(self._byref(handle))
            handle.value = None

    __del__ = free


class _Cache(threading.local):
    def __init__(self) -> None:
        self.plans: OrderedDict[tuple, _Descriptor] = OrderedDict()


_cache = _Cache()


def _plan(d: int, rows: int, dtype: torch.dtype, forward: bool, threads: int | None = None) -> _Descriptor:
    """The kept descriptor; ``threads`` (default torch's count) is part of the key, since a descriptor's
    thread limit is fixed at commit."""
    threads = torch.get_num_threads() if threads is None else threads
    key = (d, rows, dtype, threads, forward)
    plans = _cache.plans
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _Descriptor(d, rows, dtype, threads, forward)
        if len(plans) > _CACHE_SIZE:
            plans.popitem(last=False)[1].free()
    else:
        plans.move_to_end(key)
    return plan


def block_rows(d: int, dtype: torch.dtype, block_bytes: int = BLOCK_BYTES, threads: int = 1) -> int:
    """Rows per block: the largest power of two whose input fits ``block_bytes`` per thread (at least 1)."""
    rows = max(1, block_bytes * threads // (d * (8 if dtype == torch.float64 else 4)))
    return 1 << (rows.bit_length() - 1)


def _blocks(n: int, rows: int):
    """(start, count) covering ``range(n)`` in ``ceil(n / rows)`` blocks whose sizes differ by at most one
    (no short tail block; at most two descriptor sizes per batch size)."""
    nblocks = -(-n // rows)
    base, extra = divmod(n, nblocks)
    start = 0
    for i in range(nblocks):
        count = base + (i < extra)
        yield start, count
        start += count


def _shape_reason(a: torch.Tensor, b: torch.Tensor) -> str | None:
    d = a.shape[-1] if a.dim() else 0
    if b.dim() == 0 or d == 0 or b.shape[-1] != d or not (
            a.shape == b.shape or a.numel() == d or b.numel() == d):
        return (f"shapes {tuple(a.shape)} and {tuple(b.shape)}; the MKL path takes equal shapes (..., d) "
                "with d >= 1, or one single vector (d,) against a batch")
    return None


def _platform_reason(a: torch.Tensor, b: torch.Tensor) -> str | None:
    why = _library()[1]
    if why is None and (a.device.type != "cpu" or b.device.type != "cpu"):
        why = f"tensors on {a.device} and {b.device}; the MKL path runs on the CPU"
    if why is None and (a.dtype not in _PRECISION or b.dtype != a.dtype):
        why = f"dtypes {a.dtype} and {b.dtype}; the MKL path takes two float32 or two float64 tensors"
    return why


def mkl_bind_reason(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when ``mkl_bind`` runs on ``a`` and ``b``, else why not."""
    return _platform_reason(a, b) or _shape_reason(a, b)


def mkl_bind(a: torch.Tensor, b: torch.Tensor, *, conj_b: bool = False, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    """``bind(a, b)`` (``conj_b=True``: ``unbind(a, b)``, the involution of ``b``) for float32/float64
    CPU tensors ``(..., d)`` of equal shapes, or one of them a single vector (its spectrum is computed
    once). No autograd. ``block_bytes``: input bytes per block and thread (benchmarks/hrr_mkl_blocks.py)."""
    why = _shape_reason(a, b)
    if why is not None:
        raise ShapeError(f"mkl_bind: {why}")
    why = _platform_reason(a, b)
    if why is not None:
        raise BackendUnavailableError(f"mkl_bind: {why}")
    if block_bytes < 1:
        raise InputError(f"mkl_bind: block_bytes={block_bytes}, expected a positive byte count")
    return _bind(a, b, conj_b, block_bytes)


def _bind(a: torch.Tensor, b: torch.Tensor, conj_b: bool, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    """``mkl_bind``'s work, once its inputs are checked."""
    d, dtype = a.shape[-1], a.dtype
    # x: the operand with the rows; y: the other, or a single vector whose spectrum is ``shared``
    x, y, conj_x, conj_y = (b, a, conj_b, False) if a.shape != b.shape and a.numel() == d else (a, b, False, conj_b)
    lead = max(0, y.dim() - x.dim())  # a single vector with more leading dims broadcasts them out
    out = torch.empty((1,) * lead + tuple(x.shape), dtype=dtype)
    n = x.numel() // d
    if n == 0:
        return out
    x, y = x.resolve_neg().contiguous(), y.resolve_neg().contiguous()
    cdtype, threads = _COMPLEX[dtype], torch.get_num_threads()
    shared = None
    if x.shape != y.shape:
        shared = torch.empty(1, d // 2 + 1, dtype=cdtype)
        _plan(d, 1, dtype, True, threads)(y.data_ptr(), shared.data_ptr())
        if conj_y:
            torch.conj_physical_(shared)
    rows = min(block_rows(d, dtype, block_bytes, threads), n)
    spec_x = torch.empty(rows, d // 2 + 1, dtype=cdtype)  # (rows, F): reused by every block (none is larger)
    spec_y = torch.empty_like(spec_x) if shared is None else shared
    row_bytes = d * x.element_size()
    px, py, po, sx, sy = x.data_ptr(), y.data_ptr(), out.data_ptr(), spec_x.data_ptr(), spec_y.data_ptr()
    conj, mul = torch.conj_physical_, torch.Tensor.mul_
    if threads == 1:
        # NumPy's product on the same memory costs less per call than torch's: binds measured 1.03-1.2x
        # faster at 1 thread; with more threads torch's product runs on all of them and wins
        spec_x, spec_y = spec_x.numpy(), spec_y.numpy()
        conj, mul = (lambda v: np.conjugate(v, out=v)), (lambda u, v: np.multiply(u, v, out=u))
    for start, count in _blocks(n, rows):
        fwd, bwd = _plan(d, count, dtype, True, threads), _plan(d, count, dtype, False, threads)
        offset = start * row_bytes
        fwd(px + offset, sx)
        vx = spec_x if count == rows else spec_x[:count]
        if conj_x:
            conj(vx)
        vy = spec_y
        if shared is None:
            fwd(py + offset, sy)
            vy = spec_y if count == rows else spec_y[:count]
            if conj_y:
                conj(vy)
        mul(vx, vy)
        bwd(sx, po + offset)
    return out


def rfft(x: torch.Tensor) -> torch.Tensor:
    """``torch.fft.rfft(x, dim=-1)`` for a float32/float64 CPU tensor through a kept descriptor (one
    per (d, rows)); no autograd. For callers that checked ``mkl_available()``."""
    if x.dtype not in _COMPLEX or x.device.type != "cpu" or x.dim() == 0:
        raise InputError(f"mkl_fft.rfft: received a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}, "
                         "expected float32/float64 (..., d) on the CPU")
    d = x.shape[-1]
    x = x.resolve_neg().contiguous()  # the data pointer must hold the values themselves
    out = torch.empty(*x.shape[:-1], d // 2 + 1, dtype=_COMPLEX[x.dtype])
    if x.numel():
        _plan(d, x.numel() // d, x.dtype, True)(x.data_ptr(), out.data_ptr())
    return out


def irfft(spec: torch.Tensor, d: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.fft.irfft(spec, n=d, dim=-1)`` for a complex64/128 CPU tensor through a kept descriptor,
    written into ``out`` (contiguous, ``(..., d)``) when given; no autograd."""
    if spec.dtype not in _REAL or spec.device.type != "cpu" or spec.dim() == 0 or d < 1 or spec.shape[-1] != d // 2 + 1:
        raise InputError(f"mkl_fft.irfft: received a {spec.dtype} tensor of shape {tuple(spec.shape)} on "
                         f"{spec.device}, expected complex64/128 (..., {d // 2 + 1}) on the CPU for d = {d}")
    dtype = _REAL[spec.dtype]
    if out is None:
        out = torch.empty(*spec.shape[:-1], d, dtype=dtype)
    elif out.shape != (*spec.shape[:-1], d) or out.dtype != dtype or not out.is_contiguous():
        raise ShapeError(f"mkl_fft.irfft: out is {out.dtype} {tuple(out.shape)} (contiguous: {out.is_contiguous()}), "
                         f"expected contiguous {dtype} {(*spec.shape[:-1], d)}")
    spec = spec.resolve_conj().resolve_neg().contiguous()  # a lazy conjugate is not in memory yet
    if spec.numel():
        _plan(d, spec.numel() // spec.shape[-1], dtype, False)(spec.data_ptr(), out.data_ptr())
    return out
