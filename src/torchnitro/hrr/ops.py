"""Holographic reduced representations (Plate, 1995): the core operations.

Vectors live in the last dimension; every op broadcasts over the leading ones. Binding is circular
convolution, computed through real FFTs: ``bind(a, b) = irfft(rfft(a) * rfft(b), n=d)``. Passing
``n=d`` keeps odd lengths (``irfft`` would otherwise return ``2 * (d // 2)`` samples).

Two inverses exist:

* the *involution* ``a~[i] = a[-i mod d]`` (its spectrum is ``conj(A)``): approximate, but noise
  stays bounded, so it is the default for unbinding;
* the *exact* inverse (spectrum ``1 / A``): exact for one pair, but it amplifies the noise of every
  other term in a superposition wherever ``|A_k|`` is small.

``project`` sets every Fourier magnitude to 1 (a *unitary* vector): then the involution *is* the exact
inverse, binding preserves the norm, and repeated unbinding stays stable.

Half precision: ``torch.fft`` supports float16 only on CUDA with power-of-two lengths; elsewhere
half inputs are computed in float32 and cast back.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

import torch

from torchnitro.errors import BackendUnavailableError, InputError, ShapeError
from torchnitro.hrr import mkl_fft

__all__ = [
    "random", "unitary", "bind", "unbind", "inverse", "exact_inverse", "project", "superpose",
    "normalize", "permute", "unpermute", "permutation", "cosine", "UNBIND_METHODS", "BIND_BACKENDS",
]

UNBIND_METHODS = ("involution", "exact", "projected")
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_EPS = {torch.float16: 1e-4, torch.bfloat16: 1e-4, torch.float32: 1e-12, torch.float64: 1e-30}


def _check_vec(name: str, x: object) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InputError(f"{name}: received {type(x).__name__}, expected a torch.Tensor of shape (..., d)")
    if x.dim() == 0:
        raise ShapeError(f"{name}: received a 0-d tensor, expected shape (..., d) with d >= 1")
    if x.dtype not in _FLOAT_DTYPES:
        raise InputError(
            f"{name}: received dtype {x.dtype}, expected a floating dtype "
            f"(float16, bfloat16, float32, float64); convert with .float()"
        )
    return x


def _check_pair(a: torch.Tensor, b: torch.Tensor, names: tuple[str, str] = ("a", "b")) -> None:
    _check_vec(names[0], a)
    _check_vec(names[1], b)
    if a.shape[-1] != b.shape[-1]:
        raise ShapeError(
            f"{names[0]} has dimension {a.shape[-1]} and {names[1]} has {b.shape[-1]}; "
            "both must share the last dimension d"
        )
    if a.dtype != b.dtype:
        raise InputError(f"{names[0]} is {a.dtype} and {names[1]} is {b.dtype}; cast both to one dtype")
    if a.device != b.device:
        raise InputError(f"{names[0]} is on {a.device} and {names[1]} on {b.device}; move both to one device")


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


def _records_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd is recording and one of the (non-None) operands needs a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# CPU: two same-shape operands up to this many elements each are transformed by one rfft call on
# their stack. MKL sets up a new descriptor per call (~15 us at d = 512-1024, ~65 us at d = 4096),
# which dominates small batches: measured 1.2-1.4x faster binds at batch <= 10 and 1.1x at
# (32, 1024), slower from (100, 512) / (32, 4096) on where the stacking copy costs more.
_STACK_MAX_NUMEL = 32768


def _spectra(x: torch.Tensor, y: torch.Tensor, fft=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``fft(x), fft(y)`` (``fft`` from ``_transforms``, default torch.fft's): fresh tensors the caller
    may modify in place. Through torch.fft small same-shape CPU pairs are stacked into one call."""
    fft = fft or rfft
    # with autograd recording, the in-place product on views of one stacked tensor would hide x and y
    if (fft is rfft and x.shape == y.shape and x.device.type == "cpu" and x.numel() <= _STACK_MAX_NUMEL
            and not _records_grad(x, y)):
        s = rfft(torch.stack((x, y)))  # (2, ..., F): one descriptor instead of two
        return s[0], s[1]
    return fft(x), fft(y)


def irfft(spec: torch.Tensor, d: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """Back to (..., d) real vectors of ``dtype`` (written into ``out`` when given); ``n=d`` keeps odd lengths."""
    res = torch.fft.irfft(spec, n=d, dim=-1)
    res = res if res.dtype == dtype else res.to(dtype)
    return res if out is None else out.copy_(res)


def random(
    n: int | Sequence[int],
    d: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``n`` random vectors of dimension ``d`` with i.i.d. N(0, 1/d) elements, shape (*n, d).

    Drawn on the generator's device (the CPU by default) and then moved, so one seed gives the same
    vectors on every device.
    """
    shape = (n,) if isinstance(n, int) else tuple(n)
    if not isinstance(d, int) or d < 1 or any((not isinstance(s, int)) or s < 0 for s in shape):
        raise InputError(f"random: received n={n!r}, d={d!r}; expected non-negative int(s) n and int d >= 1")
    if dtype not in _FLOAT_DTYPES:
        raise InputError(f"random: received dtype {dtype}, expected a floating dtype")
    gen_device = generator.device if generator is not None else torch.device("cpu")
    x = torch.randn(*shape, d, generator=generator, dtype=torch.float64, device=gen_device)
    x = x.mul_(1.0 / math.sqrt(d)).to(dtype)
    return x.to(device) if device is not None else x


def _kept_irfft(spec: torch.Tensor, d: int, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    return mkl_fft.irfft(spec, d, out)  # spec's precision is the result's: no cast


def _transforms(*tensors: torch.Tensor | None, kept: bool = True):
    """``(rfft(x), irfft(spec, d, dtype, out=None), kept)``: MKL's descriptors kept across calls
    (hrr.mkl_fft) for CPU float32/float64 work without autograd when ``kept`` allows it and no MKL call
    has failed, else torch.fft (which commits a new descriptor per call)."""
    x = tensors[0]
    if (kept and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and _mkl_failed is None
            and not _records_grad(*tensors) and mkl_fft.mkl_available()):
        return mkl_fft.rfft, _kept_irfft, True
    return rfft, irfft, False


def project(x: torch.Tensor) -> torch.Tensor:
    """Make ``x`` unitary: every Fourier coefficient scaled to magnitude 1 (phases kept)."""
    _check_vec("x", x)
    fft, ifft, _ = _transforms(x)
    spec = fft(x)
    mag = spec.abs().clamp_min(_EPS[spec.real.dtype])
    return ifft(spec / mag, x.shape[-1], x.dtype)


def unitary(
    n: int | Sequence[int],
    d: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``n`` random unitary vectors (all Fourier magnitudes 1, unit norm), shape (*n, d)."""
    x = random(n, d, generator=generator, dtype=torch.float64, device=None)
    u = project(x).to(dtype)
    return u.to(device) if device is not None else u


BIND_BACKENDS = ("auto", "torch", "triton", "cuda", "mkl")
# "auto" on CUDA float32 (equal shapes, no autograd) binds through a one-pass GPU kernel: the CUDA
# C++ kernel (hrr.cuda_fft, power-of-two d in [256, 4096]) from CUDA_KERNEL_MIN_ROWS rows (product of
# the leading dims), else the Triton kernel (hrr.fft_kernel) from FFT_KERNEL_MIN_ROWS rows of
# d >= FFT_KERNEL_MIN_D (in practice: where the CUDA kernel cannot be built), else torch.fft.
# Measured side by side on an H100 (benchmarks/hrr_fft_sweep.py, results/hrr_fft_sweep_cuda_h100.md):
# at 64 MiB per operand the CUDA kernel takes 0.24-0.36x torch.fft's time and 0.60-0.71x the Triton
# kernel's (84-95% of copy bandwidth at d = 256-1024, 61-66% at 2048-4096). Small batches are
# launch-bound: at 1000 x 1024 it takes 35 us against 46 (Triton) and 70 (torch.fft, four kernels);
# at 250 x 4096, 60 us against 116 (results/hrr_fft_latency_h100.md), and its normalising form took
# 0.42-0.54x the unfused path's time at 10 and 100 rows (results/hrr_cuda.md, fused paths), so it
# runs from one row
CUDA_KERNEL_MIN_ROWS = 1
FFT_KERNEL_MIN_ROWS = 512
FFT_KERNEL_MIN_D = 1024


def _fft_kernel_reason(x: torch.Tensor, y: torch.Tensor, backend: str = "triton") -> str | None:
    """None when the one-pass kernel of ``backend`` ("triton": hrr.fft_kernel, "cuda": hrr.cuda_fft)
    can bind ``x`` with ``y``, else why not."""
    if backend == "cuda":
        from torchnitro.hrr.cuda_fft import cuda_bind_reason as reason
    else:
        from torchnitro.hrr.fft_kernel import fft_bind_reason as reason
    why = reason(x)
    if why is None and x.shape != y.shape:
        why = f"shapes {tuple(x.shape)} and {tuple(y.shape)} broadcast; the kernel takes equal shapes"
    if why is None and _records_grad(x, y):
        why = "an input requires grad; the kernel has no backward"
    return why


_cuda_failed: str | None = None  # set when building the CUDA kernel failed under "auto": Triton from then on


def _one_pass_kernel(x: torch.Tensor, y: torch.Tensor, backend: str) -> str | None:
    """Which one-pass GPU kernel binds ``x`` with ``y`` under ``backend``: "cuda", "triton" or None
    (none applies, or ``backend`` asks for none). An explicit "cuda"/"triton" that cannot run raises."""
    if backend not in BIND_BACKENDS:
        raise InputError(f"backend: received {backend!r}, expected one of {BIND_BACKENDS}")
    if backend in ("torch", "mkl") or (backend == "auto" and not x.is_cuda):
        return None  # the common CPU call pays two comparisons, not the checks below
    rows = x.numel() // max(x.shape[-1], 1)
    if backend == "cuda" or (backend == "auto" and not _cuda_failed and rows >= CUDA_KERNEL_MIN_ROWS):
        why = _fft_kernel_reason(x, y, "cuda")
        if why is None:
            return "cuda"
        if backend == "cuda":
            raise BackendUnavailableError(f"backend='cuda': {why}; use backend='torch' or 'auto'")
    if backend == "auto" and (x.shape[-1] < FFT_KERNEL_MIN_D or rows < FFT_KERNEL_MIN_ROWS):
        return None
    why = _fft_kernel_reason(x, y, "triton")
    if backend == "triton" and why is not None:
        raise BackendUnavailableError(f"backend='triton': {why}; use backend='torch' or 'auto'")
    return "triton" if why is None else None


def _one_pass(x: torch.Tensor, y: torch.Tensor, backend: str, conj_b: bool,
              normalize: bool = False) -> torch.Tensor | None:
    """``bind(x, y)`` (``conj_b``: with ``y``'s involution; ``normalize``: rows to unit norm) through the
    one-pass GPU kernel ``_one_pass_kernel`` picks, else None."""
    global _cuda_failed
    kernel = _one_pass_kernel(x, y, backend)
    if kernel == "cuda":
        from torchnitro.hrr.cuda_fft import cuda_bind

        try:
            return cuda_bind(x, y, conj_b=conj_b, normalize=normalize)
        except BackendUnavailableError as e:  # NVRTC missing or the build failed
            if backend == "cuda":
                raise
            _cuda_failed = str(e)
            warnings.warn(f"hrr: {e}; binding through the Triton kernel or torch.fft from now on", stacklevel=3)
            kernel = _one_pass_kernel(x, y, backend)
    if kernel != "triton":
        return None
    from torchnitro.hrr.fft_kernel import fft_bind

    return fft_bind(x, y, conj_b=conj_b, normalize=normalize)


def _direct(x: torch.Tensor, y: torch.Tensor, backend: str, conj_b: bool, kernels: bool = True) -> torch.Tensor | None:
    """``bind(x, y)`` (``conj_b``: with ``y``'s involution) without going through full spectra: a one-pass
    GPU kernel or the MKL path where one applies (``kernels``), or the empty result of an empty batch
    (torch.fft rejects one). None: transform the operands."""
    if kernels:
        out = _one_pass(x, y, backend, conj_b)
        if out is None:
            out = _mkl_bind(x, y, backend, conj_b)
        if out is not None:
            return out
    if x.numel() == 0 or y.numel() == 0:
        return torch.empty(torch.broadcast_shapes(x.shape, y.shape), dtype=x.dtype, device=x.device)
    return None


_mkl_failed: str | None = None  # set when an MKL call failed under "auto": later calls use torch.fft


def _mkl_bind(x: torch.Tensor, y: torch.Tensor, backend: str, conj_b: bool) -> torch.Tensor | None:
    """hrr.mkl_fft's bind where ``backend`` asks for it and it applies, else None (use torch.fft)."""
    global _mkl_failed
    if backend not in ("auto", "mkl") or (backend == "auto" and (x.device.type != "cpu" or _mkl_failed)):
        return None
    why = mkl_fft.mkl_bind_reason(x, y)
    if why is None and _records_grad(x, y):
        why = "an input requires grad; the MKL path has no backward"
    if why is not None:
        if backend == "mkl":
            raise BackendUnavailableError(f"backend='mkl': {why}; use backend='torch' or 'auto'")
        return None
    try:
        return mkl_fft._bind(x, y, conj_b)
    except BackendUnavailableError as e:
        if backend == "mkl":
            raise
        _mkl_failed = str(e)
        warnings.warn(f"hrr: the MKL bind path failed ({e}); binding through torch.fft from now on", stacklevel=3)
        return None


def bind(a: torch.Tensor, b: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Circular convolution ``(a * b)[i] = sum_j a[j] b[(i - j) mod d]``, broadcast over leading dims.

    backend: ``"torch"`` (``torch.fft``), ``"mkl"`` (hrr.mkl_fft: CPU float32/float64, MKL
    descriptors kept across calls, rows in cache-sized blocks; equal shapes or one single vector),
    ``"triton"`` (hrr.fft_kernel: CUDA float32, power-of-two d in [16, 4096], equal shapes, one pass
    over memory), ``"cuda"`` (hrr.cuda_fft: the same as a CUDA C++ kernel built with NVRTC, d in
    [256, 4096], 1.4-1.7x the Triton kernel's throughput on an H100) or ``"auto"``: the MKL path on
    the CPU where it applies; on CUDA the CUDA kernel where it applies, else the Triton kernel (from
    ``FFT_KERNEL_MIN_ROWS`` rows of ``d >= FFT_KERNEL_MIN_D``); torch otherwise.
    """
    _check_pair(a, b)
    out = _direct(a, b, backend, conj_b=False)
    if out is not None:
        return out
    fft, ifft, _ = _transforms(a, b, kept=backend == "auto")  # e.g. shapes that broadcast both ways
    A, B = _spectra(a, b, fft)
    spec = A.mul_(B) if A.shape == B.shape else A * B  # in place when no broadcasting is needed
    return ifft(spec, a.shape[-1], a.dtype)


def inverse(a: torch.Tensor) -> torch.Tensor:
    """The involution ``a~[i] = a[-i mod d]``: the approximate inverse used for unbinding."""
    _check_vec("a", a)
    return torch.roll(torch.flip(a, dims=(-1,)), shifts=1, dims=-1)


def exact_inverse(a: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """The exact inverse (spectrum ``1 / A``); ``eps`` floors ``|A_k|^2`` so a zero bin stays finite."""
    _check_vec("a", a)
    fft, ifft, _ = _transforms(a)
    spec = fft(a)
    floor = _EPS[spec.real.dtype] if eps is None else eps
    inv = spec.conj() / (spec.real.square() + spec.imag.square()).clamp_min(floor)
    return ifft(inv, a.shape[-1], a.dtype)


def unbind(c: torch.Tensor, a: torch.Tensor, method: str = "involution", *, backend: str = "auto") -> torch.Tensor:
    """Recover ``b`` from ``c = bind(a, b)`` (plus noise from anything superposed with it).

    method: ``"involution"`` (default, stable), ``"exact"`` (exact for a single pair, noisy in a
    superposition), or ``"projected"`` (unbind with the involution of ``project(a)``: exact when
    ``a`` was unitary, and stable when it was not). backend: as for ``bind`` (the GPU kernels and
    the MKL path run the involution only).
    """
    _check_pair(c, a, ("c", "a"))
    if method not in UNBIND_METHODS:
        raise InputError(f"unbind: received method={method!r}, expected one of {UNBIND_METHODS}")
    if backend in ("triton", "cuda", "mkl") and method != "involution":
        raise BackendUnavailableError(f"backend={backend!r} runs method='involution' only (received {method!r})")
    out = _direct(c, a, backend, conj_b=True, kernels=method == "involution")
    if out is not None:
        return out
    fft, ifft, _ = _transforms(c, a, kept=backend == "auto")  # the other methods, other shapes
    C, A = _spectra(c, a, fft)
    if method == "exact":  # out of place: autograd keeps A for the denominator's gradient
        A = A / (A.real.square() + A.imag.square()).clamp_min(_EPS[A.real.dtype])
    elif method == "projected":
        A = A / A.abs().clamp_min(_EPS[A.real.dtype])
    # conj in place on our own spectrum: a lazy A.conj() would be materialised by mul (an extra
    # clone of the spectrum, ~8% of unbind's time at (1000, 1024) on the 2-core CPU)
    torch.conj_physical_(A)
    spec = C.mul_(A) if C.shape == A.shape else C * A
    return ifft(spec, c.shape[-1], c.dtype)


def normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Scale each vector to unit L2 norm (zero vectors stay zero)."""
    _check_vec("x", x)
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(eps)


def superpose(
    vectors: torch.Tensor,
    weights: torch.Tensor | Sequence[float] | None = None,
    *,
    dim: int = -2,
    normalized: bool = True,
) -> torch.Tensor:
    """Bundle ``vectors`` (..., k, d) along ``dim`` into one vector per batch: ``sum_i w_i v_i``.

    With ``normalized`` (default) the bundle is scaled to unit norm, so its similarity to each member
    is comparable across bundle sizes.
    """
    _check_vec("vectors", vectors)
    if vectors.dim() < 2:
        raise ShapeError(f"superpose: received shape {tuple(vectors.shape)}, expected (..., k, d) with k items")
    axis = dim % vectors.dim()
    if axis == vectors.dim() - 1:
        raise InputError("superpose: dim must not be the vector dimension (the last one); use dim=-2")
    if weights is None:
        out = vectors.sum(dim=axis)
    else:
        w = torch.as_tensor(weights, dtype=vectors.dtype, device=vectors.device)
        k = vectors.shape[axis]
        if w.dim() == 0 or w.shape[-1] != k:
            raise ShapeError(f"superpose: received weights of shape {tuple(w.shape)}, expected (..., {k}) "
                             f"matching the {k} items along dim {dim}")
        shape = list(w.shape) + [1] * (vectors.dim() - 1 - axis)  # broadcast w over the dims after axis
        out = (vectors * w.reshape(shape)).sum(dim=axis)
    return normalize(out) if normalized else out


def permutation(d: int, *, generator: torch.Generator | None = None) -> torch.Tensor:
    """A random permutation of ``range(d)`` (int64), for ``permute(x, perm=...)``."""
    if not isinstance(d, int) or d < 1:
        raise InputError(f"permutation: received d={d!r}, expected an int >= 1")
    return torch.randperm(d, generator=generator)


def _check_perm(perm: torch.Tensor, d: int) -> torch.Tensor:
    if perm.dim() != 1 or perm.shape[0] != d or perm.dtype not in (torch.int64, torch.int32):
        raise ShapeError(f"perm: received {tuple(perm.shape)} {perm.dtype}, expected an int64 permutation of length {d}")
    return perm.long()


def permute(x: torch.Tensor, k: int = 1, *, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Apply a permutation ``k`` times (``k < 0`` applies its inverse).

    Without ``perm`` it is the cyclic shift by ``k`` (cheap, but it commutes with binding:
    ``permute(bind(a, b)) == bind(permute(a), b)``). A random ``perm`` does not.
    """
    _check_vec("x", x)
    if not isinstance(k, int):
        raise InputError(f"permute: received k={k!r}, expected an int")
    if perm is None:
        return torch.roll(x, shifts=k, dims=-1)
    p = _check_perm(perm, x.shape[-1]).to(x.device)
    if k < 0:
        p, k = torch.argsort(p), -k
    out = x
    for _ in range(k):
        out = out.index_select(-1, p)
    return out


def unpermute(x: torch.Tensor, k: int = 1, *, perm: torch.Tensor | None = None) -> torch.Tensor:
    """Undo ``permute(x, k, perm=perm)``."""
    return permute(x, -k, perm=perm)


def cosine(a: torch.Tensor, b: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Cosine similarity over the last dim, broadcast over leading dims: (..., d), (..., d) -> (...)."""
    _check_pair(a, b)
    num = (a * b).sum(-1)
    den = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    return num / den.clamp_min(eps)
