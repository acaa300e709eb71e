"""Bind and unbind in one pass over memory: a radix-2 FFT per row inside one Triton kernel.

``torch.fft`` binds through four tensor-sized passes (``rfft(a)``, ``rfft(b)``, the product and
``irfft``, which also clones its input), so at large batches a bind moves about four times the
bytes it must. This kernel reads ``a`` and ``b`` once and writes the result once; the transforms
run in registers:

* forward: decimation in frequency, natural order in, bit-reversed spectrum out;
* the pointwise product (``conj`` of the second spectrum for unbinding) in that same order;
* inverse: decimation in time, bit-reversed in, natural order out, so no bit reversal is ever done.

Each stage views the row as ``(M, 2, H)`` blocks (``M = 2**s``, ``H = N / 2**(s+1)``), splits the
pairs, applies the butterfly with twiddles read from a float64-accurate table, and joins them
back. Powers of two ``16 <= d <= 4096``, float32, CUDA (or ``TRITON_INTERPRET=1`` for tests).
"""

from __future__ import annotations

import math

import torch

from torchnitro.errors import InputError, ShapeError
from torchnitro.kernels._triton import LazyKernel, cdiv, interpreting, triton_importable

try:
    import triton.language as tl
    from triton.language import constexpr
except Exception:  # pragma: no cover - triton missing: fft_bind_reason() says so
    tl = constexpr = None  # type: ignore[assignment]

__all__ = ["fft_bind", "fft_bind_reason", "MIN_D", "MAX_D"]

MIN_D, MAX_D = 16, 4096


def _fft_bind_kernel(a_ptr, b_ptr, out_ptr, twr_ptr, twi_ptr, n_rows, sa, sb, so,
                     N: constexpr, LOGN: constexpr, CONJ_B: constexpr, R: constexpr):
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    cols = tl.arange(0, N)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    ar = tl.load(a_ptr + rows64[:, None] * sa + cols[None, :], mask=ok, other=0.0)
    br = tl.load(b_ptr + rows64[:, None] * sb + cols[None, :], mask=ok, other=0.0)
    ai = tl.zeros((R, N), dtype=tl.float32)
    bi = tl.zeros((R, N), dtype=tl.float32)
    # forward, decimation in frequency: (u, v) -> (u + v, (u - v) w^j), w = exp(-2 pi i / 2H)
    for s in tl.static_range(LOGN):
        # (R, 1 << s, 2, N >> (s + 1)) blocks with M = 2**s, H = N / 2**(s+1), written inline: an annotated
        # constexpr cannot be reassigned across the unrolled iterations
        j = tl.arange(0, N >> (s + 1)) << s  # twiddle index in the N-point table
        wr = tl.load(twr_ptr + j)[None, None, :]
        wi = tl.load(twi_ptr + j)[None, None, :]
        uar, va_r = tl.split(tl.permute(tl.reshape(ar, (R, 1 << s, 2, N >> (s + 1))), (0, 1, 3, 2)))
        uai, vai = tl.split(tl.permute(tl.reshape(ai, (R, 1 << s, 2, N >> (s + 1))), (0, 1, 3, 2)))
        ubr, vbr = tl.split(tl.permute(tl.reshape(br, (R, 1 << s, 2, N >> (s + 1))), (0, 1, 3, 2)))
        ubi, vbi = tl.split(tl.permute(tl.reshape(bi, (R, 1 << s, 2, N >> (s + 1))), (0, 1, 3, 2)))
        dar, dai = uar - va_r, uai - vai
        dbr, dbi = ubr - vbr, ubi - vbi
        ar = tl.reshape(tl.permute(tl.join(uar + va_r, dar * wr - dai * wi), (0, 1, 3, 2)), (R, N))
        ai = tl.reshape(tl.permute(tl.join(uai + vai, dar * wi + dai * wr), (0, 1, 3, 2)), (R, N))
        br = tl.reshape(tl.permute(tl.join(ubr + vbr, dbr * wr - dbi * wi), (0, 1, 3, 2)), (R, N))
        bi = tl.reshape(tl.permute(tl.join(ubi + vbi, dbr * wi + dbi * wr), (0, 1, 3, 2)), (R, N))
    if CONJ_B:
        bi = -bi
    pr = ar * br - ai * bi
    pi = ar * bi + ai * br
    # inverse, decimation in time: (p, q) -> (p + q conj(w)^j, p - q conj(w)^j), stages reversed
    for k in tl.static_range(LOGN):
        j2 = tl.arange(0, N >> (LOGN - k)) << (LOGN - 1 - k)
        cr = tl.load(twr_ptr + j2)[None, None, :]
        ci = -tl.load(twi_ptr + j2)[None, None, :]
        ppr, qpr = tl.split(tl.permute(tl.reshape(pr, (R, 1 << (LOGN - 1 - k), 2, N >> (LOGN - k))), (0, 1, 3, 2)))
        ppi, qpi = tl.split(tl.permute(tl.reshape(pi, (R, 1 << (LOGN - 1 - k), 2, N >> (LOGN - k))), (0, 1, 3, 2)))
        tr = qpr * cr - qpi * ci
        ti = qpr * ci + qpi * cr
        pr = tl.reshape(tl.permute(tl.join(ppr + tr, ppr - tr), (0, 1, 3, 2)), (R, N))
        pi = tl.reshape(tl.permute(tl.join(ppi + ti, ppi - ti), (0, 1, 3, 2)), (R, N))
    tl.store(out_ptr + rows64[:, None] * so + cols[None, :], pr * (1.0 / N), mask=ok)


_kernel = LazyKernel(_fft_bind_kernel)
_TWIDDLES: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _twiddles(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (d, device)
    if key not in _TWIDDLES:
        m = torch.arange(d // 2, dtype=torch.float64)
        ang = -2.0 * math.pi * m / d  # computed in float64, rounded once to float32
        _TWIDDLES[key] = (torch.cos(ang).float().to(device), torch.sin(ang).float().to(device))
    return _TWIDDLES[key]


def fft_bind_reason(a: torch.Tensor) -> str | None:
    """None when ``fft_bind`` runs on ``a``, else why not."""
    d = a.shape[-1] if a.dim() else 0
    if not triton_importable():
        return "Triton is not importable"
    if not (a.is_cuda or interpreting()):
        return f"the tensor is on {a.device}; the kernel needs CUDA (or TRITON_INTERPRET=1)"
    if a.dtype != torch.float32:
        return f"dtype {a.dtype}; the kernel computes float32 only"
    if d < MIN_D or d > MAX_D or d & (d - 1):
        return f"d={d}; the kernel needs a power of two in [{MIN_D}, {MAX_D}]"
    return None


def _rows_per_program(d: int) -> int:
    """2048 values per program: measured best at d = 1024 (2 rows) and d = 4096 (1 row) on an H100
    (benchmarks/hrr_fft_sweep.py, results/hrr_fft_sweep.md)."""
    return max(1, 2048 // d)


def fft_bind(a: torch.Tensor, b: torch.Tensor, *, conj_b: bool = False, rows_per_program: int | None = None,
             num_warps: int | None = None) -> torch.Tensor:
    """``bind(a, b)`` (``conj_b=True``: ``bind(a, inverse(b))``, i.e. ``unbind(a, b)``) for same-shape
    float32 tensors ``(..., d)``, one kernel, one pass over memory. ``rows_per_program`` (a power of
    two) and ``num_warps`` override the launch heuristics (benchmarks/hrr_fft_sweep.py)."""
    if a.shape != b.shape:
        raise ShapeError(f"fft_bind: received shapes {tuple(a.shape)} and {tuple(b.shape)}; expected equal shapes "
                         "(broadcasting goes through hrr.bind)")
    why = fft_bind_reason(a)
    if why is not None:
        raise InputError(f"fft_bind: {why}")
    if a.device != b.device or b.dtype != a.dtype:
        raise InputError(f"fft_bind: a is {a.dtype} on {a.device}, b is {b.dtype} on {b.device}; expected the same")
    d = a.shape[-1]
    a2 = a.reshape(-1, d)
    b2 = b.reshape(-1, d)
    a2 = a2 if a2.stride(-1) == 1 else a2.contiguous()
    b2 = b2 if b2.stride(-1) == 1 else b2.contiguous()
    n = a2.shape[0]
    out = torch.empty((n, d), dtype=torch.float32, device=a.device)
    if n == 0:
        return out.reshape(a.shape)
    twr, twi = _twiddles(d, a.device)
    r = rows_per_program or _rows_per_program(d)
    if r & (r - 1):
        raise InputError(f"fft_bind: rows_per_program={r}; expected a power of two")
    warps = num_warps or 4  # the H100 sweep: 4 warps beat 8 at d = 1024 (R=2) and d = 4096 (R=1)
    _kernel[(cdiv(n, r),)](a2, b2, out, twr, twi, n, a2.stride(0), b2.stride(0), out.stride(0),
                                  N=d, LOGN=d.bit_length() - 1, CONJ_B=conj_b, R=r, num_warps=warps)
    return out.reshape(a.shape)
