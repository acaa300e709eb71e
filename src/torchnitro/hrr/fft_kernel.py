"""Bind and unbind in one pass over memory: a radix-2 FFT per row inside one Triton kernel.

``torch.fft`` binds through four tensor-sized passes (``rfft(a)``, ``rfft(b)``, the product and
``irfft``, which also clones its input), so at large batches a bind moves about four times the
bytes it must. This kernel reads ``a`` and ``b`` once and writes the result once; everything in
between stays in registers (and the exchanges Triton inserts between stages).

One complex FFT carries both inputs. With ``z = a + i b``, ``z (*) z = a (*) a - b (*) b + 2i a (*) b``
(``(*)`` circular convolution), so ``a (*) b = Im(ifft(fft(z)**2)) / 2``: one forward and one inverse
transform per row instead of two forward and one inverse, and no pairing of frequency ``k`` with
``-k`` (which would need a gather across threads):

* forward: decimation in frequency, natural order in, bit-reversed spectrum out;
* the pointwise square in that same order;
* inverse: decimation in time, bit-reversed in, natural order out, so no bit reversal is ever done.

Unbinding loads ``b`` reversed (``b[-n]``, whose spectrum is ``conj(B)``). Both rows are first scaled
to a largest magnitude of 1: the square puts ``a (*) a - b (*) b`` in the real part, and without the
scaling its rounding would swamp ``a (*) b`` when the two norms differ by orders of magnitude. A row
with NaN or inf gives NaN, a zero row gives exact zeros, and rows never mix.

Each stage views the row as ``(M, 2, H)`` blocks (``M = 2**s``, ``H = N / 2**(s+1)``), splits the
pairs, applies the butterfly with twiddles read from a float64-accurate table (skipped where they are
all 1), and joins them back. On an H100 this runs 1.4x (d = 1024) and 1.3x (d = 4096) faster than the
earlier three-transform kernel (results/hrr_fft_sweep_*.md). A radix-4 version of the same algorithm
issued 1.2x fewer instructions than this one but ran slower: Triton lowered its stage exchanges to
shared memory with a barrier each, where most radix-2 exchanges stay in warp shuffles.

Powers of two ``16 <= d <= 4096``, float32, CUDA (or ``TRITON_INTERPRET=1`` for tests).
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


def _fft_bind_kernel(a_ptr, b_ptr, out_ptr, twr_ptr, twi_ptr, n_rows, sa, sb, so, eps,
                     N: constexpr, LOGN: constexpr, CONJ_B: constexpr, R: constexpr, NORMALIZE: constexpr):
    # shapes are written inline: an annotated constexpr cannot be reassigned across unrolled iterations
    pid = tl.program_id(0)
    rows = pid * R + tl.arange(0, R)
    cols = tl.arange(0, N)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    if CONJ_B:
        bcols = (N - cols) & (N - 1)  # the involution b[-n]: its spectrum is conj(B)
    else:
        bcols = cols
    a = tl.load(a_ptr + rows64[:, None] * sa + cols[None, :], mask=ok, other=0.0)
    b = tl.load(b_ptr + rows64[:, None] * sb + bcols[None, :], mask=ok, other=0.0)
    ma = tl.max(tl.abs(a), axis=1)
    mb = tl.max(tl.abs(b), axis=1)
    zr = a * tl.where(ma > 0, 1.0 / ma, 0.0)[:, None]
    zi = b * tl.where(mb > 0, 1.0 / mb, 0.0)[:, None]
    # forward, decimation in frequency: (M, 2, H) blocks, M = 2**s, H = N / 2**(s+1);
    # (u, v) -> (u + v, (u - v) w^h), w = exp(-2 pi i / 2H), w^h is entry h * M of the table
    for s in tl.static_range(LOGN):
        ur, vr = tl.split(tl.permute(tl.reshape(zr, (R, 1 << s, 2, N >> (s + 1))), (0, 1, 3, 2)))
        ui, vi = tl.split(tl.permute(tl.reshape(zi, (R, 1 << s, 2, N >> (s + 1))), (0, 1, 3, 2)))
        dr, di = ur - vr, ui - vi
        if s < LOGN - 1:  # the last stage has H = 1: its twiddle is 1
            h = tl.arange(0, N >> (s + 1)) << s
            wr, wi = tl.load(twr_ptr + h)[None, None, :], tl.load(twi_ptr + h)[None, None, :]
            dr, di = dr * wr - di * wi, dr * wi + di * wr
        zr = tl.reshape(tl.permute(tl.join(ur + vr, dr), (0, 1, 3, 2)), (R, N))
        zi = tl.reshape(tl.permute(tl.join(ui + vi, di), (0, 1, 3, 2)), (R, N))
    # Z**2, whose inverse has 2 a (*) b as its imaginary part
    pr = zr * zr - zi * zi
    pi = 2.0 * zr * zi
    # inverse, decimation in time: (p, q) -> (p + q u^h, p - q u^h), u = conj(w), the forward's stages mirrored
    for k in tl.static_range(LOGN):
        ppr, qpr = tl.split(tl.permute(tl.reshape(pr, (R, 1 << (LOGN - 1 - k), 2, N >> (LOGN - k))), (0, 1, 3, 2)))
        ppi, qpi = tl.split(tl.permute(tl.reshape(pi, (R, 1 << (LOGN - 1 - k), 2, N >> (LOGN - k))), (0, 1, 3, 2)))
        if k > 0:  # the first stage has H = 1: its twiddle is 1
            h = tl.arange(0, N >> (LOGN - k)) << (LOGN - 1 - k)
            cr, ci = tl.load(twr_ptr + h)[None, None, :], -tl.load(twi_ptr + h)[None, None, :]
            qpr, qpi = qpr * cr - qpi * ci, qpr * ci + qpi * cr
        pr = tl.reshape(tl.permute(tl.join(ppr + qpr, ppr - qpr), (0, 1, 3, 2)), (R, N))
        pi = tl.reshape(tl.permute(tl.join(ppi + qpi, ppi - qpi), (0, 1, 3, 2)), (R, N))
    # only the imaginary part is stored: the compiler drops the last stage's real half
    res = pi * (ma * mb * (0.5 / N))[:, None]
    if NORMALIZE:  # hrr.bind_normalize: each row to unit L2 norm before the one store (ops.normalize's eps)
        res = res / tl.maximum(tl.sqrt(tl.sum(res * res, axis=1)), eps)[:, None]
    tl.store(out_ptr + rows64[:, None] * so + cols[None, :], res, mask=ok)


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


def kernel_rows(name: str, a: torch.Tensor, b: torch.Tensor,
                why: str | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The checks and row views both one-pass bind kernels share: ``a`` and ``b`` as ``(n, d)`` rows
    with unit stride along ``d``, and an empty float32 ``(n, d)`` result. ``why`` is the kernel's
    reason for refusing ``a`` (None: it runs)."""
    if a.shape != b.shape:
        raise ShapeError(f"{name}: received shapes {tuple(a.shape)} and {tuple(b.shape)}; expected equal shapes "
                         "(broadcasting goes through hrr.bind)")
    if why is not None:
        raise InputError(f"{name}: {why}")
    if a.device != b.device or b.dtype != a.dtype:
        raise InputError(f"{name}: a is {a.dtype} on {a.device}, b is {b.dtype} on {b.device}; expected the same")
    d = a.shape[-1]
    a2, b2 = a.reshape(-1, d), b.reshape(-1, d)
    a2 = a2 if a2.stride(-1) == 1 else a2.contiguous()
    b2 = b2 if b2.stride(-1) == 1 else b2.contiguous()
    return a2, b2, torch.empty((a2.shape[0], d), dtype=torch.float32, device=a.device)


def _launch(d: int) -> tuple[int, int]:
    """(rows per program, warps). Measured on an H100 (benchmarks/hrr_fft_sweep.py,
    results/hrr_fft_sweep_warps_*.md): one row on one warp at d = 1024 (61% of copy bandwidth
    against 54% for two rows on four warps: no exchange crosses a warp, so none needs shared memory
    or a barrier), one row on four warps at d = 2048 and 4096; 2048 values on four warps elsewhere."""
    if d == 1024:
        return 1, 1
    return max(1, 2048 // d), 4


def fft_bind(a: torch.Tensor, b: torch.Tensor, *, conj_b: bool = False, normalize: bool = False,
             eps: float = 1e-12, rows_per_program: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """``bind(a, b)`` (``conj_b=True``: ``bind(a, inverse(b))``, i.e. ``unbind(a, b)``) for same-shape
    float32 tensors ``(..., d)``, one kernel, one pass over memory. ``normalize=True`` scales each
    result row to unit L2 norm in the same pass (``ops.normalize(..., eps)``: rows with norm below
    ``eps`` are divided by ``eps``). ``rows_per_program`` (a power of two) and ``num_warps`` override the
    launch heuristics (benchmarks/hrr_fft_sweep.py)."""
    a2, b2, out = kernel_rows("fft_bind", a, b, fft_bind_reason(a) if a.shape == b.shape else None)
    n, d = out.shape
    if n == 0:
        return out.reshape(a.shape)
    twr, twi = _twiddles(d, a.device)
    r0, w0 = _launch(d)
    r = rows_per_program or r0
    if r & (r - 1):
        raise InputError(f"fft_bind: rows_per_program={r}; expected a power of two")
    warps = num_warps or w0
    _kernel[(cdiv(n, r),)](a2, b2, out, twr, twi, n, a2.stride(0), b2.stride(0), out.stride(0), float(eps),
                           N=d, LOGN=d.bit_length() - 1, CONJ_B=conj_b, R=r, NORMALIZE=normalize,
                           num_warps=warps)
    return out.reshape(a.shape)
