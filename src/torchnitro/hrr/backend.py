"""The layer under ``hrr.ops``: input checks, the transforms, which kernel binds, device transfer, top-k.

``ops`` (the math API), ``fused``, ``dispatch`` and ``memory`` build on this module; it imports no
module of that layer, only the kernels below it (``mkl_fft`` at import; ``fft_kernel`` and ``cuda_fft``
on first use, so importing hrr builds nothing GPU-side). ``tests/test_import_graph.py`` keeps the
import graph free of cycles.

Backend names: ``"torch"`` is the plain-PyTorch path (``torch.fft``), ``"mkl"`` the kept-descriptor
CPU path (``hrr.mkl_fft``), ``"triton"`` and ``"cuda"`` the one-pass GPU kernels (``hrr.fft_kernel``,
``hrr.cuda_fft``). A kernel that fails under ``"auto"`` is recorded in ``HEALTH`` with why, warned
about once and skipped from then on; an explicitly requested one raises.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from torchnitro.errors import BackendUnavailableError, InputError, ShapeError
from torchnitro.hrr import mkl_fft

__all__ = [
    "FLOAT_DTYPES", "check_vec", "check_pair", "records_grad", "rfft", "irfft", "spectra", "transforms",
    "BIND_BACKENDS", "CUDA_KERNEL_MIN_ROWS", "FFT_KERNEL_MIN_ROWS", "FFT_KERNEL_MIN_D", "STACK_MAX_NUMEL",
    "KernelHealth", "HEALTH", "fft_kernel_reason", "one_pass_kernel", "one_pass", "mkl_path", "direct",
    "to_device", "to_host", "topk_chunked",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
Transforms = tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], bool]


# --- input checks ---------------------------------------------------------------------------------


def check_vec(name: str, x: object) -> torch.Tensor:
    """``x`` if it is a floating tensor of shape (..., d), else an error naming what it is."""
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name}: received {type(x).__name__}, expected a torch.Tensor of shape (..., d)")
    if x.dim() == 0:
        raise ShapeError(f"{name}: received a 0-d tensor, expected shape (..., d) with d >= 1")
    if x.dtype not in FLOAT_DTYPES:
        raise InputError(
            f"{name}: received dtype {x.dtype}, expected a floating dtype "
            f"(float16, bfloat16, float32, float64); convert with .float()"
        )
    return x


def check_pair(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str] = ("a", "b")) -> None:
    """Two vectors an op can combine: same d, dtype and device."""
    check_vec(names[0], a)
    check_vec(names[1], b)
    if a.shape[-1] != b.shape[-1]:
        raise ShapeError(
            f"{names[0]} has dimension {a.shape[-1]} and {names[1]} has {b.shape[-1]}; "
            "both must share the last dimension d"
        )
    if a.dtype != b.dtype:
        raise InputError(f"{names[0]} is {a.dtype} and {names[1]} is {b.dtype}; cast both to one dtype")
    if a.device != b.device:
        raise InputError(f"{names[0]} is on {a.device} and {names[1]} on {b.device}; move both to one device")


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd is recording and one of the (non-None) operands needs a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --- transforms -----------------------------------------------------------------------------------


def _fft_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the FFT runs in: half only where cuFFT supports it, float32 otherwise."""
    if x.dtype in (torch.float32, torch.float64):
        return x.dtype
    d = x.shape[-1]
    if x.dtype == torch.float16 and x.is_cuda and d & (d - 1) == 0:
        return torch.float16
    return torch.float32


def rfft(x: torch.Tensor) -> torch.Tensor:
    """Half spectrum (..., d // 2 + 1) in the FFT dtype of ``x``."""
    if x.dtype not in (torch.float32, torch.float64):
        x = x.to(_fft_dtype(x))
    return torch.fft.rfft(x, dim=-1)


def irfft(spec: torch.Tensor, d: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Back to (..., d) real vectors of ``dtype`` (written into ``out`` when given); ``n=d`` keeps odd lengths."""
    res = torch.fft.irfft(spec, n=d, dim=-1)
    res = res if res.dtype == dtype else res.to(dtype)
    return res if out is None else out.copy_(res)


def _kept_irfft(spec: torch.Tensor, d: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    return mkl_fft.irfft(spec, d, out)  # spec's precision is the result's: no cast


# CPU, torch.fft: two same-shape operands up to this many elements each are transformed by one call on
# their stack, which saves a descriptor commit; past it the stacking copy costs more than the commit
# (threshold from benchmarks/hrr.py on the 2-core CPU, docs/hrr.md "Operations")
STACK_MAX_NUMEL = 32768


def spectra(x: torch.Tensor, y: torch.Tensor, fft=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fft(x), fft(y)`` (``fft`` from ``transforms``, default torch.fft's): fresh tensors the caller
    may modify in place. Through torch.fft small same-shape CPU pairs are stacked into one call."""
    fft = fft or rfft
    # with autograd recording, the in-place product on views of one stacked tensor would hide x and y
    if (fft is rfft and x.shape == y.shape and x.device.type == "cpu" and x.numel() <= STACK_MAX_NUMEL
            and not records_grad(x, y)):
        s = rfft(torch.stack((x, y)))  # (2, ..., F): one descriptor instead of two
        return s[0], s[1]
    return fft(x), fft(y)


def transforms(*tensors: torch.Tensor | None, kept: bool = True) -> Transforms:
    """``(rfft(x), irfft(spec, d, dtype, out=None), kept)``: MKL's descriptors kept across calls
    (hrr.mkl_fft) for CPU float32/float64 work without autograd when ``kept`` allows it and no MKL call
    has failed, else torch.fft (which commits a new descriptor per call)."""
    x = tensors[0]
    if (kept and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and HEALTH.mkl is None
            and not records_grad(*tensors) and mkl_fft.mkl_available()):
        return mkl_fft.rfft, _kept_irfft, True
    return rfft, irfft, False


# --- which kernel binds ---------------------------------------------------------------------------

BIND_BACKENDS = ("auto", "torch", "triton", "cuda", "mkl")
# "auto" on CUDA float32 (equal shapes, no autograd) binds through a one-pass GPU kernel: the CUDA C++
# kernel (power-of-two d in [256, 4096]) from CUDA_KERNEL_MIN_ROWS rows (the product of the leading
# dims), else the Triton kernel from FFT_KERNEL_MIN_ROWS rows of d >= FFT_KERNEL_MIN_D (in practice:
# where the CUDA kernel cannot be built), else torch.fft. The CUDA kernel runs from one row because its
# single launch beats torch.fft's four at every batch measured; the thresholds come from
# results/hrr_fft_sweep_cuda_h100.md, results/hrr_fft_latency_h100.md and results/hrr_cuda.md
# (docs/hrr.md, "The CUDA C++ kernel")
CUDA_KERNEL_MIN_ROWS = 1
FFT_KERNEL_MIN_ROWS = 512
FFT_KERNEL_MIN_D = 1024


@dataclass
class KernelHealth:
    """Kernels that failed under "auto" in this process, and why; "auto" skips them from then on."""

    cuda: str | None = None  # building the CUDA C++ kernel failed: bind through Triton or torch.fft
    mkl: str | None = None  # an MKL call failed: CPU transforms go through torch.fft


HEALTH = KernelHealth()


def fft_kernel_reason(x: torch.Tensor, y: torch.Tensor, backend: str = "triton") -> str | None:
    """None when the one-pass kernel of ``backend`` ("triton": hrr.fft_kernel, "cuda": hrr.cuda_fft)
    can bind ``x`` with ``y``, else why not."""
    if backend == "cuda":
        from torchnitro.hrr.cuda_fft import cuda_bind_reason as reason
    else:
        from torchnitro.hrr.fft_kernel import fft_bind_reason as reason
    why = reason(x)
    if why is None and x.shape != y.shape:
        why = f"shapes {tuple(x.shape)} and {tuple(y.shape)} broadcast; the kernel takes equal shapes"
    if why is None and records_grad(x, y):
        why = "an input requires grad; the kernel has no backward"
    return why


def one_pass_kernel(x: torch.Tensor, y: torch.Tensor, backend: str) -> str | None:
    """Which one-pass GPU kernel binds ``x`` with ``y`` under ``backend``: "cuda", "triton" or None
    (none applies, or ``backend`` asks for none). An explicit "cuda"/"triton" that cannot run raises."""
    if backend not in BIND_BACKENDS:
        raise InputError(f"backend: received {backend!r}, expected one of {BIND_BACKENDS}")
    if backend in ("torch", "mkl") or (backend == "auto" and not x.is_cuda):
        return None  # the common CPU call pays two comparisons, not the checks below
    rows = x.numel() // max(x.shape[-1], 1)
    if backend == "cuda" or (backend == "auto" and not HEALTH.cuda and rows >= CUDA_KERNEL_MIN_ROWS):
        why = fft_kernel_reason(x, y, "cuda")
        if why is None:
            return "cuda"
        if backend == "cuda":
            raise BackendUnavailableError(f"backend='cuda': {why}; use backend='torch' or 'auto'")
    if backend == "auto" and (x.shape[-1] < FFT_KERNEL_MIN_D or rows < FFT_KERNEL_MIN_ROWS):
        return None
    why = fft_kernel_reason(x, y, "triton")
    if backend == "triton" and why is not None:
        raise BackendUnavailableError(f"backend='triton': {why}; use backend='torch' or 'auto'")
    return "triton" if why is None else None


def one_pass(x: torch.Tensor, y: torch.Tensor, backend: str, conj_b: bool,
             normalize: bool = False) -> torch.Tensor | None:
    """``bind(x, y)`` (``conj_b``: with ``y``'s involution; ``normalize``: rows to unit norm) through the
    one-pass GPU kernel ``one_pass_kernel`` picks, else None."""
    kernel = one_pass_kernel(x, y, backend)
    if kernel == "cuda":
        from torchnitro.hrr.cuda_fft import cuda_bind

        try:
            return cuda_bind(x, y, conj_b=conj_b, normalize=normalize)
        except BackendUnavailableError as e:  # NVRTC missing or the build failed
            if backend == "cuda":
                raise
            HEALTH.cuda = str(e)
            warnings.warn(f"hrr: {e}; binding through the Triton kernel or torch.fft from now on", stacklevel=3)
            kernel = one_pass_kernel(x, y, backend)
    if kernel != "triton":
        return None
    from torchnitro.hrr.fft_kernel import fft_bind

    return fft_bind(x, y, conj_b=conj_b, normalize=normalize)


def mkl_path(x: torch.Tensor, y: torch.Tensor, backend: str, conj_b: bool) -> torch.Tensor | None:
    """hrr.mkl_fft's bind where ``backend`` asks for it and it applies, else None (use torch.fft)."""
    if backend not in ("auto", "mkl") or (backend == "auto" and (x.device.type != "cpu" or HEALTH.mkl)):
        return None
    why = mkl_fft.mkl_bind_reason(x, y)
    if why is None and records_grad(x, y):
        why = "an input requires grad; the MKL path has no backward"
    if why is not None:
        if backend == "mkl":
            raise BackendUnavailableError(f"backend='mkl': {why}; use backend='torch' or 'auto'")
        return None
    try:
        return mkl_fft.mkl_bind(x, y, conj_b=conj_b)
    except BackendUnavailableError as e:
        if backend == "mkl":
            raise
        HEALTH.mkl = str(e)
        warnings.warn(f"hrr: the MKL bind path failed ({e}); binding through torch.fft from now on", stacklevel=3)
        return None


def direct(x: torch.Tensor, y: torch.Tensor, backend: str, conj_b: bool, kernels: bool = True) -> torch.Tensor | None:
    """``bind(x, y)`` (``conj_b``: with ``y``'s involution) without going through full spectra: a one-pass
    GPU kernel or the MKL path where one applies (``kernels``), or the empty result of an empty batch
    (torch.fft rejects one). None: transform the operands."""
    if kernels:
        out = one_pass(x, y, backend, conj_b)
        if out is None:
            out = mkl_path(x, y, backend, conj_b)
        if out is not None:
            return out
    if x.numel() == 0 or y.numel() == 0:
        return torch.empty(torch.broadcast_shapes(x.shape, y.shape), dtype=x.dtype, device=x.device)
    return None


# --- device transfer and top-k --------------------------------------------------------------------


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> accelerator through pinned memory with a non-blocking copy."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        if not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)
    return t.to(device)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Accelerator -> host into pinned memory, non-blocking, then one stream sync before use."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


# target size of one (Q, chunk) score block: big GEMMs, bounded memory. A CPU block stays near the
# caches; a GPU block is larger so that a 1,000 x 100,000 cleanup is a couple of GEMMs, not a dozen.
_SCORE_BYTES = {"cpu": 32 << 20, "cuda": 256 << 20}


def _auto_chunk(q: int, n: int, itemsize: int, device: torch.device | None = None) -> int:
    budget = _SCORE_BYTES["cuda" if device is not None and device.type == "cuda" else "cpu"]
    return max(1024, min(n, budget // max(1, q * itemsize)))


def _topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise top-k; k == 1 is a plain max, a single reduction pass."""
    if k == 1:
        v, i = scores.max(dim=1, keepdim=True)
        return v, i
    return scores.topk(k, dim=1)


def topk_chunked(
    queries: torch.Tensor, unit: torch.Tensor, k: int, chunk_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` dot products of ``queries`` (Q, d) against the rows of ``unit`` (N, d), chunked.

    ``unit`` may live on another device (e.g. pinned host memory): each chunk is copied to the
    queries' device non-blocking. Returns (values (Q, k), indices (Q, k)), best first.
    """
    q, n = queries.shape[0], unit.shape[0]
    chunk = chunk_size or _auto_chunk(q, n, queries.element_size(), queries.device)
    best_v = queries.new_empty((q, 0))
    best_i = torch.empty((q, 0), dtype=torch.long, device=queries.device)
    for start in range(0, n, chunk):
        block = to_device(unit[start:start + chunk], queries.device)
        if block.dtype != queries.dtype:
            block = block.to(queries.dtype)
        scores = queries @ block.T  # (Q, chunk)
        v, i = _topk(scores, min(k, scores.shape[1]))
        if best_v.shape[1] == 0:
            best_v, best_i = v, i + start
            continue
        v, pos = _topk(torch.cat([best_v, v], dim=1), min(k, best_v.shape[1] + v.shape[1]))
        best_i = torch.cat([best_i, i + start], dim=1).gather(1, pos)
        best_v = v
    return best_v, best_i
