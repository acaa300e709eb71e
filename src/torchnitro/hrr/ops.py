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
from typing import Sequence

import torch

from torchnitro.errors import BackendUnavailableError, InputError, ShapeError
from torchnitro.hrr.backend import BIND_BACKENDS, FLOAT_DTYPES, check_pair, check_vec, direct, spectra, transforms

__all__ = [
    "random", "unitary", "bind", "unbind", "inverse", "exact_inverse", "project", "superpose",
    "normalize", "permute", "unpermute", "permutation", "cosine", "UNBIND_METHODS", "BIND_BACKENDS",
]

UNBIND_METHODS = ("involution", "exact", "projected")
_EPS = {torch.float16: 1e-4, torch.bfloat16: 1e-4, torch.float32: 1e-12, torch.float64: 1e-30}


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
    if dtype not in FLOAT_DTYPES:
        raise InputError(f"random: received dtype {dtype}, expected a floating dtype")
    gen_device = generator.device if generator is not None else torch.device("cpu")
    x = torch.randn(*shape, d, generator=generator, dtype=torch.float64, device=gen_device)
    x = x.mul_(1.0 / math.sqrt(d)).to(dtype)
    return x.to(device) if device is not None else x


def project(x: torch.Tensor) -> torch.Tensor:
    """Make ``x`` unitary: every Fourier coefficient scaled to magnitude 1 (phases kept)."""
    check_vec("x", x)
    fft, ifft, _ = transforms(x)
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


def bind(a: torch.Tensor, b: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """Circular convolution ``(a * b)[i] = sum_j a[j] b[(i - j) mod d]``, broadcast over leading dims.

    backend: ``"torch"`` (``torch.fft``), ``"mkl"`` (hrr.mkl_fft: CPU float32/float64, MKL
    descriptors kept across calls, rows in cache-sized blocks; equal shapes or one single vector),
    ``"triton"`` (hrr.fft_kernel: CUDA float32, power-of-two d in [16, 4096], equal shapes, one pass
    over memory), ``"cuda"`` (hrr.cuda_fft: the same as a CUDA C++ kernel built with NVRTC, d in
    [256, 4096], 1.4-1.7x the Triton kernel's throughput on an H100) or ``"auto"``: the MKL path on
    the CPU where it applies; on CUDA the CUDA kernel where it applies, else the Triton kernel (from
    ``backend.FFT_KERNEL_MIN_ROWS`` rows of ``d >= backend.FFT_KERNEL_MIN_D``); torch otherwise.
    """
    check_pair(a, b)
    out = direct(a, b, backend, conj_b=False)
    if out is not None:
        return out
    fft, ifft, _ = transforms(a, b, kept=backend == "auto")  # e.g. shapes that broadcast both ways
    A, B = spectra(a, b, fft)
    spec = A.mul_(B) if A.shape == B.shape else A * B  # in place when no broadcasting is needed
    return ifft(spec, a.shape[-1], a.dtype)


def inverse(a: torch.Tensor) -> torch.Tensor:
    """The involution ``a~[i] = a[-i mod d]``: the approximate inverse used for unbinding."""
    check_vec("a", a)
    return torch.roll(torch.flip(a, dims=(-1,)), shifts=1, dims=-1)


def exact_inverse(a: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """The exact inverse (spectrum ``1 / A``); ``eps`` floors ``|A_k|^2`` so a zero bin stays finite."""
    check_vec("a", a)
    fft, ifft, _ = transforms(a)
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
    check_pair(c, a, ("c", "a"))
    if method not in UNBIND_METHODS:
        raise InputError(f"unbind: received method={method!r}, expected one of {UNBIND_METHODS}")
    if backend in ("triton", "cuda", "mkl") and method != "involution":
        raise BackendUnavailableError(f"backend={backend!r} runs method='involution' only (received {method!r})")
    out = direct(c, a, backend, conj_b=True, kernels=method == "involution")
    if out is not None:
        return out
    fft, ifft, _ = transforms(c, a, kept=backend == "auto")  # the other methods, other shapes
    C, A = spectra(c, a, fft)
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
    check_vec("x", x)
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
    check_vec("vectors", vectors)
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
    check_vec("x", x)
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
    check_pair(a, b)
    num = (a * b).sum(-1)
    den = torch.linalg.vector_norm(a, dim=-1) * torch.linalg.vector_norm(b, dim=-1)
    return num / den.clamp_min(eps)
