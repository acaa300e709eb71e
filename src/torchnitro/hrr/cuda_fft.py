"""Bind and unbind in one pass over memory on CUDA: a four-step FFT per row in CUDA C++, compiled at
run time with NVRTC (``torch.cuda._compile_kernel``; no CUDA toolkit needed, the NVRTC that PyTorch's
CUDA wheels ship is enough).

Why a second kernel beside the Triton one (``hrr/fft_kernel.py``): Triton chooses the data layout
itself, and its radix-2 stages exchange values between lanes once per stage whose butterfly pairs sit
in different lanes (5 of the 10 stages at d = 1024, two transforms per row). Those exchanges were a
third of the Triton kernel's instructions, and the kernel is issue-bound. Here the layout is explicit:

* A row of ``d = P * T`` values is held by ``T`` lanes (16 for d <= 512, 32 for 1024 and 2048, 64 =
  two warps for 4096), ``P`` per lane: lane ``t`` holds ``z[T j + t]`` for ``j < P`` (coalesced loads
  and stores, one base pointer per operand and constant offsets).
* Forward transform, four steps: a ``P``-point DFT over ``j`` inside each lane (registers only),
  twiddles ``W_d^(t k1)``, one transpose through shared memory, then ``P / T`` DFTs of ``T`` points
  inside each lane. The inverse runs the same steps backwards, so one row costs two transposes
  instead of ten cross-lane stages, and nothing is bit-reversed: each in-lane DFT's order is
  absorbed by the indexing.
* Twiddles come from a float64-computed table laid out so that a warp's load of one twiddle pair
  reads adjacent 16-byte entries.

It computes what the Triton kernel computes, the same way: ``z = a + i b`` (``b`` read reversed to
unbind), both rows first scaled to a largest magnitude of 1, ``a (*) b = Im(ifft(fft(z)^2)) / 2`` and
an optional unit-norm epilogue. The in-lane DFTs are straight-line code generated here from one
butterfly schedule (:func:`dif_schedule`, :func:`dit_schedule`), with trivial twiddles folded; the
same schedules drive :func:`reference_bind`, a NumPy model of the kernel's exact data movement that
the CPU tests compare with ``numpy.fft`` (the CUDA build itself is tested on a GPU).

Measured on an H100 (``benchmarks/hrr_fft_sweep.py``, results/hrr_fft_sweep_cuda_h100.md), at 64 MiB
per operand: 95% of copy bandwidth at d = 256, 84% at 512, 89% at 1024, 66% at 2048, 62% at 4096;
1.4-1.7x the Triton kernel and 2.8-4.2x ``torch.fft``. SASS per row at d = 1024 (sm_90, counted with
NVRTC's cubin): 84k instructions against the Triton kernel's 134k.

Powers of two ``256 <= d <= 4096``, float32, CUDA, PyTorch with ``torch.cuda._compile_kernel``.
"""

from __future__ import annotations

import ctypes
import math
import threading
from functools import lru_cache

import numpy as np
import torch

from torchnitro.errors import BackendUnavailableError, InputError
from torchnitro.hrr.fft_kernel import kernel_rows
from torchnitro.kernels._triton import next_pow2, pick_config

__all__ = ["cuda_bind", "cuda_bind_reason", "kernel_source", "reference_bind", "lanes_per_row",
           "dif_schedule", "dit_schedule", "MIN_D", "MAX_D",
           "launch_candidates", "TUNE_MIN_ROWS"]

MIN_D, MAX_D = 256, 4096
BLOCK_THREADS = 128
SMEM_LIMIT = 48 * 1024  # static shared memory per block without opting in


def lanes_per_row(d: int) -> int:
    """T: lanes per row, with P = d / T values per lane and P a multiple of T (P / T in-lane DFTs of T
    points after the transpose)."""
    t = 1 << ((d.bit_length() - 1) // 2)  # largest power of two with t * t <= d
    return t


def _layout(d: int, rows: int | None = None) -> tuple[int, int, int, int]:
    """(T, P, Q, rows per block) for d; ``rows`` overrides the default rows per block."""
    t = lanes_per_row(d)
    p = d // t
    per_row = p * (t + 1) * 8  # one float2 per value, each transposed row padded by one against bank conflicts
    most = SMEM_LIMIT // per_row
    if rows is None:
        rows = max(1, min(BLOCK_THREADS // t, most))
    elif rows < 1 or rows > most or rows * t > 1024 or (rows * t) % 32:
        raise InputError(f"cuda_fft: rows_per_block={rows} at d={d}; expected a count of rows filling whole warps, "
                         f"at most {most} (48 KiB of shared memory)")
    return t, p, p // t, rows


def _bitrev(x: int, bits: int) -> int:
    return int(format(x, f"0{bits}b")[::-1], 2) if bits else 0


def dif_schedule(n: int) -> list[tuple[int, int, int]]:
    """Radix-2 decimation in frequency on ``n`` values (natural order in, bit-reversed out): butterflies
    ``(i, j, m)``: ``(x_i, x_j) <- (x_i + x_j, (x_i - x_j) * w^m)`` with ``w = exp(-2 pi i / n)``."""
    out = []
    s = 0
    while (1 << s) < n:
        h_span = n >> (s + 1)
        for blk in range(1 << s):
            for h in range(h_span):
                i = blk * 2 * h_span + h
                out.append((i, i + h_span, h << s))
        s += 1
    return out


def dit_schedule(n: int) -> list[tuple[int, int, int]]:
    """Radix-2 decimation in time (bit-reversed in, natural out): butterflies ``(i, j, m)``:
    ``q = x_j * w^m``, ``(x_i, x_j) <- (x_i + q, x_i - q)``, ``w`` as in :func:`dif_schedule` (conjugate
    it for an inverse transform)."""
    out = []
    span = 1
    while span < n:
        for blk in range(n // (2 * span)):
            for h in range(span):
                i = blk * 2 * span + h
                out.append((i, i + span, h * (n // (2 * span))))
        span *= 2
    return out


def twiddle_tables(d: int) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's twiddles in float64 (rounded once to float32 for the GPU), each lane's at constant
    offsets (see ``_twiddles`` for the layout on the GPU): ``fwd[t, r] = w^(t k1(r))`` for lane ``t`` and register ``r``
    holding ``k1 = bitrev(r)`` after the first DFT; ``inv[u, q T + tt] = conj(w^(tt (u + T q)))`` for
    lane ``u`` after the transpose. ``w = exp(-2 pi i / d)``; both ``(T, P)``."""
    t_lanes, p, q, _ = _layout(d)
    k1_of_reg = np.array([_bitrev(r, p.bit_length() - 1) for r in range(p)])
    lanes = np.arange(t_lanes)
    fwd = np.exp(-2j * np.pi * ((lanes[:, None] * k1_of_reg[None, :]) % d) / d)
    tt = np.tile(np.arange(t_lanes), q)
    k1 = lanes[:, None] + t_lanes * np.repeat(np.arange(q), t_lanes)[None, :]
    inv = np.exp(2j * np.pi * ((tt[None, :] * k1) % d) / d)
    return fwd, inv


# ---------------------------------------------------------------------------------------------------
# NumPy model of the kernel's data movement (what the CPU tests check against numpy.fft)
# ---------------------------------------------------------------------------------------------------

def _np_dif(x: np.ndarray, n: int, inverse: bool) -> None:
    sign = 1.0 if inverse else -1.0
    for i, j, m in dif_schedule(n):
        u, v = x[..., i].copy(), x[..., j].copy()
        x[..., i] = u + v
        x[..., j] = (u - v) * np.exp(sign * 2j * np.pi * m / n)


def _np_dit(x: np.ndarray, n: int, inverse: bool) -> None:
    sign = 1.0 if inverse else -1.0
    for i, j, m in dit_schedule(n):
        q = x[..., j] * np.exp(sign * 2j * np.pi * m / n)
        u = x[..., i].copy()
        x[..., i] = u + q
        x[..., j] = u - q


def reference_bind(a: np.ndarray, b: np.ndarray, conj_b: bool = False) -> np.ndarray:
    """The kernel's algorithm on rows ``(n, d)`` in float64 NumPy, value for value in the same places:
    lane ``t``'s registers are ``regs[:, t, :]``, the shared-memory tile is ``tile[:, k1, t]``."""
    n_rows, d = a.shape
    t_lanes, p, q, _ = _layout(d)
    logp = p.bit_length() - 1
    bb = b[:, (-np.arange(d)) % d] if conj_b else b
    ma = np.abs(a).max(axis=1, keepdims=True)
    mb = np.abs(bb).max(axis=1, keepdims=True)
    za = np.where(ma > 0, a / np.where(ma > 0, ma, 1), 0)
    zb = np.where(mb > 0, bb / np.where(mb > 0, mb, 1), 0)
    z = za + 1j * zb
    lanes = np.arange(t_lanes)
    # registers: regs[row, lane t, j] = z[T j + t]
    regs = np.stack([z[:, t_lanes * np.arange(p) + t] for t in lanes], axis=1)
    _np_dif(regs, p, inverse=False)  # register r now holds k1 = bitrev_P(r)
    k1_of_reg = np.array([_bitrev(r, logp) for r in range(p)])
    tw_fwd, tw_inv = twiddle_tables(d)
    regs = regs * tw_fwd
    tile = np.zeros((n_rows, p, t_lanes), dtype=complex)  # tile[k1][t]
    tile[:, k1_of_reg, :] = regs.transpose(0, 2, 1)
    # lane u takes k1 = u + T q' for q' < Q, all T values of t: y[row, u, q' * T + t]
    y = np.concatenate([tile[:, lanes + t_lanes * qq, :] for qq in range(q)], axis=2)
    for qq in range(q):
        seg = y[:, :, qq * t_lanes:(qq + 1) * t_lanes]
        _np_dif(seg, t_lanes, inverse=False)
        y[:, :, qq * t_lanes:(qq + 1) * t_lanes] = seg
    y = y * y
    for qq in range(q):
        seg = y[:, :, qq * t_lanes:(qq + 1) * t_lanes]
        _np_dit(seg, t_lanes, inverse=True)
        y[:, :, qq * t_lanes:(qq + 1) * t_lanes] = seg
    y = y * tw_inv
    for qq in range(q):
        tile[:, lanes + t_lanes * qq, :] = y[:, :, qq * t_lanes:(qq + 1) * t_lanes]
    regs = tile[:, k1_of_reg, :].transpose(0, 2, 1).copy()  # lane t, register r <- tile[bitrev(r)][t]
    _np_dit(regs, p, inverse=True)  # natural j out
    res = np.empty((n_rows, d))
    for t in lanes:
        res[:, t_lanes * np.arange(p) + t] = regs[:, t, :].imag
    return res * (ma * mb * 0.5 / d)


# ---------------------------------------------------------------------------------------------------
# CUDA source
# ---------------------------------------------------------------------------------------------------

def _f(x: float) -> str:
    return f"{x:.9e}f"


def _twiddle(m: int, n: int, inverse: bool) -> tuple[float, float] | str:
    """w^m for w = exp(-+2 pi i / n): 'one', 'mi' (-i), 'pi' (+i) or (cos, sin)."""
    m %= n
    if m == 0:
        return "one"
    if 4 * m == n:
        return "pi" if inverse else "mi"
    ang = (2.0 if inverse else -2.0) * math.pi * m / n
    return math.cos(ang), math.sin(ang)


def _mul(re: str, im: str, w: tuple[float, float] | str) -> list[str]:
    """Statements multiplying (re, im) in place by w."""
    if w == "one":
        return []
    if w == "mi":  # (x + iy)(-i) = y - ix
        return [f"{{ float t_ = {re}; {re} = {im}; {im} = -t_; }}"]
    if w == "pi":  # (x + iy)(i) = -y + ix
        return [f"{{ float t_ = {re}; {re} = -{im}; {im} = t_; }}"]
    c, s = w
    return [f"{{ float t_ = {re}; {re} = fmaf({re}, {_f(c)}, -{im} * {_f(s)}); "
            f"{im} = fmaf(t_, {_f(s)}, {im} * {_f(c)}); }}"]


def _dft_function(name: str, n: int, dif: bool, inverse: bool) -> str:
    lines = [f"__device__ __forceinline__ void {name}(float* xr, float* xi) {{"]
    sched = dif_schedule(n) if dif else dit_schedule(n)
    for i, j, m in sched:
        w = _twiddle(m, n, inverse)
        if dif:
            lines.append(f"  {{ float ur = xr[{i}], ui = xi[{i}], vr = xr[{j}], vi = xi[{j}];"
                         f" xr[{i}] = ur + vr; xi[{i}] = ui + vi; xr[{j}] = ur - vr; xi[{j}] = ui - vi; }}")
            lines += ["  " + s for s in _mul(f"xr[{j}]", f"xi[{j}]", w)]
        else:
            lines += ["  " + s for s in _mul(f"xr[{j}]", f"xi[{j}]", w)]
            lines.append(f"  {{ float ur = xr[{i}], ui = xi[{i}], qr = xr[{j}], qi = xi[{j}];"
                         f" xr[{i}] = ur + qr; xi[{i}] = ui + qi; xr[{j}] = ur - qr; xi[{j}] = ui - qi; }}")
    lines.append("}")
    return "\n".join(lines)


def kernel_source(d: int, conj_b: bool, normalize: bool, rows_per_block: int | None = None,
                  min_blocks: int | None = None, eps: float = 1e-12) -> tuple[str, str, int, int]:
    """(CUDA C++ source, kernel name, threads per block, rows per block) for one variant.
    ``min_blocks`` is __launch_bounds__' second argument (blocks per SM the registers must allow);
    ``eps`` (normalize only) is compiled in."""
    t, p, q, rows = _layout(d, rows_per_block)
    logp = p.bit_length() - 1
    name = f"hrr_bind_{d}_{int(conj_b)}_{int(normalize)}_{rows}_{min_blocks or 0}"
    bounds = f"ROWS * T, {min_blocks}" if min_blocks else "ROWS * T"
    k1_of_reg = [_bitrev(r, logp) for r in range(p)]
    parts = [
        _dft_function(f"dif{p}_fwd", p, dif=True, inverse=False),
        _dft_function(f"dit{p}_inv", p, dif=False, inverse=True),
    ]
    if t != p:
        parts += [_dft_function(f"dif{t}_fwd", t, dif=True, inverse=False),
                  _dft_function(f"dit{t}_inv", t, dif=False, inverse=True)]
    fwd_twiddle_store = "\n".join(
        ["  const float4* twf = tw + t;  // forward twiddles, two per float4, lanes adjacent (coalesced)"]
        + [f"  {{ const float4 w = __ldg(twf + {r // 2} * T);"
           f" float xr = zr[{r}]; zr[{r}] = fmaf(xr, w.x, -zi[{r}] * w.y); zi[{r}] = fmaf(xr, w.y, zi[{r}] * w.x);"
           f" xr = zr[{r + 1}]; zr[{r + 1}] = fmaf(xr, w.z, -zi[{r + 1}] * w.w);"
           f" zi[{r + 1}] = fmaf(xr, w.w, zi[{r + 1}] * w.z); }}" if r else
           "  { const float4 w = __ldg(twf); const float xr = zr[1];"
           " zr[1] = fmaf(xr, w.z, -zi[1] * w.w); zi[1] = fmaf(xr, w.w, zi[1] * w.z); }"
           for r in range(0, p, 2)]
        + [f"  tile[{k}][t] = make_float2(zr[{r}], zi[{r}]);" for r, k in enumerate(k1_of_reg)])
    if conj_b:  # the involution b[(D - n) mod D], n = T j + t: from D - t downwards, except b[0] at t = j = 0
        b_pointers = ("  const float* brow = b + src_row * (long long)sb;\n"
                      "  const float* bp = brow + (D - t);")
        b_loads = ("  zi[0] = __ldg(brow + ((D - t) & (D - 1)));\n#pragma unroll\n"
                   "  for (int j = 1; j < P; ++j) zi[j] = __ldg(bp - T * j);")
    else:
        b_pointers = "  const float* bp = b + src_row * (long long)sb + t;"
        b_loads = "#pragma unroll\n  for (int j = 0; j < P; ++j) zi[j] = __ldg(bp + T * j);"
    inv_load = "\n".join(f"  {{ const float2 v = tile[{k}][t]; zr[{r}] = v.x; zi[{r}] = v.y; }}"
                          for r, k in enumerate(k1_of_reg))
    body = f"""
#define D {d}
#define T {t}
#define P {p}
#define Q {q}
#define ROWS {rows}
#define LANES (T < 32 ? T : 32)  // lanes of a row within one warp
#define WARPS (T / LANES)  // warps per row
#if WARPS > 1
#define SYNC() __syncthreads()
#else
#define SYNC() __syncwarp()
#endif
#define EPS {_f(eps)}

extern "C" __global__ void __launch_bounds__({bounds}) {name}(
    const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ out,
    const float4* __restrict__ tw, int n_rows, int sa, int sb, int so) {{
  __shared__ float2 tile_all[ROWS][P][T + 1];
#if WARPS > 1
  __shared__ float red[ROWS][2][WARPS];
#endif
  const int t = threadIdx.x % T;
  const int local_row = threadIdx.x / T;
  const long long row = (long long)blockIdx.x * ROWS + local_row;
  const bool live = row < n_rows;
  const long long src_row = live ? row : (long long)n_rows - 1;  // a row past the end reads the last, stores nothing
  float2 (*tile)[T + 1] = tile_all[local_row];
  float zr[P], zi[P];
  // one base pointer per operand, the P values at constant offsets T j from it
  const float* ap = a + src_row * (long long)sa + t;
{b_pointers}
  float ma = 0.f, mb = 0.f;
#pragma unroll
  for (int j = 0; j < P; ++j) {{
    zr[j] = __ldg(ap + T * j);
    ma = fmaxf(ma, fabsf(zr[j]));
  }}
{b_loads}
#pragma unroll
  for (int j = 0; j < P; ++j) mb = fmaxf(mb, fabsf(zi[j]));
  // a NaN stays in the row through the scaling below and spreads to every output; an inf makes the
  // scale 0 and itself NaN
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) {{
    ma = fmaxf(ma, __shfl_xor_sync(0xffffffffu, ma, o));
    mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, o));
  }}
#if WARPS > 1  // a row spans several warps: combine their maxima through shared memory
  if (threadIdx.x % 32 == 0) {{ red[local_row][0][t / 32] = ma; red[local_row][1][t / 32] = mb; }}
  __syncthreads();
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {{ ma = fmaxf(ma, red[local_row][0][w]); mb = fmaxf(mb, red[local_row][1][w]); }}
#endif
  const float sa_ = ma > 0.f ? 1.f / ma : 0.f;
  const float sb_ = mb > 0.f ? 1.f / mb : 0.f;
#pragma unroll
  for (int j = 0; j < P; ++j) {{ zr[j] *= sa_; zi[j] *= sb_; }}
  dif{p}_fwd(zr, zi);  // register r holds k1 = bitrev(r): the twiddles and the tile take that order
{fwd_twiddle_store}
  SYNC();
  // lane u now owns k1 = u + T q for q < Q, with all T values of t: yr[q * T + t]
#pragma unroll
  for (int qq = 0; qq < Q; ++qq) {{
#pragma unroll
    for (int tt = 0; tt < T; ++tt) {{
      const float2 v = tile[t + T * qq][tt];
      zr[qq * T + tt] = v.x;
      zi[qq * T + tt] = v.y;
    }}
  }}
#pragma unroll
  for (int qq = 0; qq < Q; ++qq) {{
    dif{t}_fwd(zr + qq * T, zi + qq * T);
  }}
#pragma unroll
  for (int i = 0; i < P; ++i) {{  // Z^2: its inverse holds 2 a (*) b in the imaginary part
    const float xr = zr[i], xi = zi[i];
    zr[i] = fmaf(xr, xr, -xi * xi);
    zi[i] = 2.f * xr * xi;
  }}
#pragma unroll
  for (int qq = 0; qq < Q; ++qq) {{
    dit{t}_inv(zr + qq * T, zi + qq * T);
  }}
  SYNC();
  const float4* twi = tw + (D / 2) + t;  // inverse twiddles, two per float4, lanes adjacent
#pragma unroll
  for (int i = 0; i < P; i += 2) {{
    const float4 w = __ldg(twi + (i / 2) * T);
    if (i % T != 0) {{  // tt = 0 has the twiddle 1
      const float xr = zr[i];
      zr[i] = fmaf(xr, w.x, -zi[i] * w.y);
      zi[i] = fmaf(xr, w.y, zi[i] * w.x);
    }}
    const float xr = zr[i + 1];
    zr[i + 1] = fmaf(xr, w.z, -zi[i + 1] * w.w);
    zi[i + 1] = fmaf(xr, w.w, zi[i + 1] * w.z);
  }}
#pragma unroll
  for (int qq = 0; qq < Q; ++qq) {{
#pragma unroll
    for (int tt = 0; tt < T; ++tt) tile[t + T * qq][tt] = make_float2(zr[qq * T + tt], zi[qq * T + tt]);
  }}
  SYNC();
{inv_load}
  dit{p}_inv(zr, zi);  // natural order: register j holds n = T j + t
  const float scale = (ma * mb) * (0.5f / D);
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < P; ++j) {{ zi[j] *= scale; ss = fmaf(zi[j], zi[j], ss); }}
{"" if not normalize else '''
#pragma unroll
  for (int o = LANES / 2; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
#if WARPS > 1
  SYNC();  // every read of red above is done
  if (threadIdx.x % 32 == 0) red[local_row][0][t / 32] = ss;
  __syncthreads();
  ss = 0.f;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) ss += red[local_row][0][w];
#endif
  const float inv = 1.f / fmaxf(sqrtf(ss), EPS);
#pragma unroll
  for (int j = 0; j < P; ++j) zi[j] *= inv;'''}
  if (live) {{
    float* op = out + row * (long long)so + t;
#pragma unroll
    for (int j = 0; j < P; ++j) op[T * j] = zi[j];
  }}
}}
"""
    src = "\n\n".join(parts) + "\n" + body
    return src, name, rows * t, rows


# ---------------------------------------------------------------------------------------------------
# build and launch
# ---------------------------------------------------------------------------------------------------

_LOCK = threading.Lock()
_KERNELS: dict[tuple, "_Launcher"] = {}
_TWIDDLES: dict[tuple[int, torch.device], torch.Tensor] = {}


@lru_cache(maxsize=1)
def _compile_available() -> str | None:
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if not hasattr(torch.cuda, "_compile_kernel"):
        return f"torch {torch.__version__} has no torch.cuda._compile_kernel (NVRTC)"
    return None


def cuda_bind_reason(a: torch.Tensor) -> str | None:
    """None when :func:`cuda_bind` can run on ``a``, else why not."""
    d = a.shape[-1] if a.dim() else 0
    if not a.is_cuda:
        return f"the tensor is on {a.device}; the kernel needs CUDA"
    why = _compile_available()
    if why is not None:
        return why
    if a.dtype != torch.float32:
        return f"dtype {a.dtype}; the kernel computes float32 only"
    if d < MIN_D or d > MAX_D or d & (d - 1):
        return f"d={d}; the kernel needs a power of two in [{MIN_D}, {MAX_D}]"
    return None


class _Launcher:
    """One built kernel, launched through the driver's ``cuLaunchKernel`` with argument arrays built
    here: the launcher that ``torch.cuda._compile_kernel`` returns opens ``libcuda`` on every call,
    which cost about 20 us per launch (benchmarks/hrr_fft_sweep.py, batch 1000)."""

    _lib = None

    def __init__(self, fn, threads: int, rows: int) -> None:
        self.fn, self.threads, self.rows = fn, threads, rows
        self.func = getattr(fn, "func", None)
        if self.func is not None and _Launcher._lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            lib.cuLaunchKernel.restype = ctypes.c_int
            _Launcher._lib = lib

    def __call__(self, n: int, tensors: tuple[torch.Tensor, ...], ints: tuple[int, ...]) -> None:
        grid = (n + self.rows - 1) // self.rows
        if self.func is None:  # another PyTorch's kernel object: its own launcher
            self.fn(grid=(grid, 1, 1), block=(self.threads, 1, 1), args=[*tensors, *ints])
            return
        vals = [ctypes.c_void_p(t.data_ptr()) for t in tensors] + [ctypes.c_int(i) for i in ints]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        dev = tensors[0].device
        if dev.index is not None and dev.index != torch.cuda.current_device():
            with torch.cuda.device(dev):  # the driver launches into the calling thread's current context
                return self(n, tensors, ints)
        stream = torch.cuda.current_stream(dev).cuda_stream
        rc = self._lib.cuLaunchKernel(self.func, grid, 1, 1, self.threads, 1, 1, 0, stream, params, None)
        if rc != 0:
            raise RuntimeError(f"hrr.cuda_fft: cuLaunchKernel failed with CUDA error {rc}")


def _kernel(d: int, conj_b: bool, normalize: bool, device: torch.device, rows: int | None, min_blocks: int | None,
            eps: float) -> _Launcher:
    key = (d, conj_b, normalize, device, rows, min_blocks, eps if normalize else None)
    k = _KERNELS.get(key)
    if k is None:
        with _LOCK:
            k = _KERNELS.get(key)
            if k is None:
                src, name, threads, rows = kernel_source(d, conj_b, normalize, rows, min_blocks, eps)
                try:
                    with torch.cuda.device(device):
                        fn = torch.cuda._compile_kernel(src, name, nvcc_options=["-std=c++17"])
                    k = _Launcher(fn, threads, rows)
                except Exception as exc:  # NVRTC missing, or a build error
                    raise BackendUnavailableError(f"hrr.cuda_fft: building the d={d} kernel failed: {exc}") from exc
                _KERNELS[key] = k
    return k


def _twiddles(d: int, device: torch.device) -> torch.Tensor:
    key = (d, device)
    if key not in _TWIDDLES:
        fwd, inv = twiddle_tables(d)
        # (T, P) -> float4 entries [P / 2][T]: lane t's pair (r, r + 1) at (r / 2) T + t, so a warp's
        # load of one pair reads adjacent 16-byte entries, one L1 line per warp rather than one per lane
        # (the layouts tried: docs/hrr.md, "The CUDA C++ kernel")
        parts = [np.stack([x.real, x.imag], axis=-1).reshape(x.shape[0], x.shape[1] // 2, 4).transpose(1, 0, 2)
                 for x in (fwd, inv)]
        table = np.concatenate([x.reshape(-1) for x in parts])
        _TWIDDLES[key] = torch.from_numpy(np.ascontiguousarray(table)).float().to(device).reshape(-1, 2)
    return _TWIDDLES[key]


def cuda_bind(a: torch.Tensor, b: torch.Tensor, *, conj_b: bool = False, normalize: bool = False,
              eps: float = 1e-12, rows_per_block: int | None = None, min_blocks: int | None = None) -> torch.Tensor:
    """``bind(a, b)`` (``conj_b=True``: ``unbind(a, b)``) for same-shape float32 CUDA tensors ``(..., d)``
    in one kernel; ``normalize=True`` scales each result row to unit L2 norm in the same pass.
    ``rows_per_block`` and ``min_blocks`` (blocks per SM the register count must allow) override the
    launch defaults (benchmarks/hrr_fft_sweep.py)."""
    a2, b2, out = kernel_rows("cuda_bind", a, b, cuda_bind_reason(a) if a.shape == b.shape else None)
    n, d = out.shape
    if n == 0:
        return out.reshape(a.shape)
    if max(a2.stride(0), b2.stride(0)) >= 2**31:
        a2, b2 = a2.contiguous(), b2.contiguous()  # row strides travel as int (rows are offset in 64 bits)
    if n >= 2**31:
        raise InputError(f"cuda_bind: {n} rows; the kernel takes fewer than 2**31")
    if not (eps > 0 and math.isfinite(eps)):
        raise InputError(f"cuda_bind: eps={eps}; expected a positive finite float")
    tensors = (a2, b2, out, _twiddles(d, a.device))
    ints = (n, a2.stride(0), b2.stride(0), out.stride(0))
    if rows_per_block is None and min_blocks is None and n >= TUNE_MIN_ROWS:
        def run(cfg: dict[str, int | None]) -> None:
            _kernel(d, conj_b, normalize, a.device, cfg["rows"], cfg["min_blocks"], float(eps))(n, tensors, ints)

        key = ("hrr_cuda_bind", d, conj_b, normalize, next_pow2(n), str(a.device))
        cfg = pick_config(key, launch_candidates(d), run, a.device, n * d)
        rows_per_block, min_blocks = cfg["rows"], cfg["min_blocks"]
    launch = _kernel(d, conj_b, normalize, a.device, rows_per_block, min_blocks, float(eps))
    launch(n, tensors, ints)
    return out.reshape(a.shape)


TUNE_MIN_ROWS = 4096  # smaller batches are launch-bound: the default layout, no timing


def launch_candidates(d: int) -> list[dict[str, int | None]]:
    """Launch layouts :func:`pick_config` times for large batches at ``d``: rows per block that fit 48 KiB
    of shared memory and whole warps, times ``__launch_bounds__`` minimum blocks per SM (None: the
    compiler's choice). The first is the default layout."""
    t, _, _, rows0 = _layout(d)
    out: list[dict[str, int | None]] = [{"rows": rows0, "min_blocks": None}]
    for rows in (1, 2, 4, 8):
        try:
            _layout(d, rows)
        except InputError:
            continue
        for mb in (None, 4, 6):
            c = {"rows": rows, "min_blocks": mb}
            if c not in out and rows * t * (mb or 1) <= 2048:  # min_blocks x threads within an SM's 2048
                out.append(c)
    return out
