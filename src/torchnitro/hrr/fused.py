"""Fused HRR paths: bind + superpose and bind + normalize, computed in the Fourier domain.

Math. With ``K_j = rfft(key_j)`` and ``V_j = rfft(value_j)``::

    bind_superpose(keys, values, w) = sum_j w_j (key_j * value_j) = irfft(sum_j w_j K_j V_j, n=d)

so ``k`` pairs cost one inverse FFT instead of ``k`` (the time-domain (..., k, d) bound tensor is
never built). The norm of the result follows from Parseval without going back to the time domain::

    ||x||^2 = (|X_0|^2 + 2 sum_{0<f<d/2} |X_f|^2 + [d even] |X_{d/2}|^2) / d

Backends:

* ``"torch"``: the spectral sum above in plain PyTorch (any device, float32/float64);
* ``"triton"`` (CUDA, float32): one kernel per batch row multiplies and accumulates the k spectra in
  registers, so the (..., k, d//2+1) complex product tensor is not materialised either, and applies
  the Parseval normalisation in the same launch; ``TRITON_INTERPRET=1`` runs it on the CPU for tests.
* ``"auto"``: Triton on CUDA float32 for ``bind_superpose`` from ``TRITON_MIN_PAIRS`` (batch x k)
  pairs, else torch: the kernel path costs about the same whatever the size, so it pays only for
  large batches. ``bind_normalize`` under "auto" on CUDA takes a one-pass FFT bind kernel with its
  normalising epilogue where one applies; its spectral Triton form was slower than the plain
  ``normalize(bind(a, b))`` and runs only when asked for.

On the CPU inputs are processed in blocks of batch rows whose spectra fit in ~2 MiB, so no full-size
intermediate exists there either. Without autograd the transforms use MKL's kept descriptors
(hrr.mkl_fft) and every batch is blocked; through torch.fft, which commits a descriptor per call,
only large ones are. Parseval normalisation in the spectrum was slower on the CPU than normalising
the time-domain result, so on the CPU ``bind_normalize`` uses the plain path. The measurements
behind each rule: docs/hrr.md, "Fused paths" (benchmarks/hrr.py, results/hrr_cpu*.md, results/hrr_cuda*.md).
"""

from __future__ import annotations

import math

import torch

from torchnitro.errors import BackendUnavailableError, InputError, ShapeError
from torchnitro.hrr import backend as hb
from torchnitro.hrr import ops
from torchnitro.kernels._triton import LazyKernel, interpreting, next_pow2, triton_importable

try:
    import triton.language as tl
    from triton.language import constexpr
except Exception:  # pragma: no cover - triton missing: only the torch backend runs
    tl = constexpr = None  # type: ignore[assignment]

__all__ = ["bind_superpose", "bind_normalize", "bind_superpose_reference", "BACKENDS", "NORMALIZE_BACKENDS",
           "TRITON_MIN_PAIRS"]

BACKENDS = ("auto", "torch", "triton")
NORMALIZE_BACKENDS = ("auto", "torch", "triton", "cuda")
TRITON_MIN_PAIRS = 8192  # batch x k from which "auto" takes the Triton kernel on CUDA (docs/hrr.md, "Fused paths")


def bind_superpose_reference(
    keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None = None, *, normalized: bool = False
) -> torch.Tensor:
    """The unfused oracle: ``superpose(bind(keys, values), weights)`` over the pair axis (-2)."""
    return ops.superpose(ops.bind(keys, values), weights, normalized=normalized)


def _bind_mac_kernel(k_ptr, v_ptr, w_ptr, o_ptr, n_pairs, n_freq, d,
                     skb, skj, svb, svj, swb, swj,
                     NORMALIZE: constexpr, EVEN: constexpr, BLOCK: constexpr):
    """One program per batch row: O[f] = sum_j w_j K_j[f] V_j[f] (complex, interleaved re/im).

    Optional Parseval normalisation: a second pass scales O by 1 / ||irfft(O)||.
    """
    row = tl.program_id(0).to(tl.int64)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for f0 in range(0, n_freq, BLOCK):
        f = f0 + tl.arange(0, BLOCK)
        m = f < n_freq
        acc_re = tl.zeros([BLOCK], dtype=tl.float32)
        acc_im = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(0, n_pairs):
            kb = k_ptr + row * skb + j * skj + 2 * f
            vb = v_ptr + row * svb + j * svj + 2 * f
            kr = tl.load(kb, mask=m, other=0.0)
            ki = tl.load(kb + 1, mask=m, other=0.0)
            vr = tl.load(vb, mask=m, other=0.0)
            vi = tl.load(vb + 1, mask=m, other=0.0)
            w = tl.load(w_ptr + row * swb + j * swj)
            acc_re += w * (kr * vr - ki * vi)
            acc_im += w * (kr * vi + ki * vr)
        ob = o_ptr + row * 2 * n_freq + 2 * f
        tl.store(ob, acc_re, mask=m)
        tl.store(ob + 1, acc_im, mask=m)
        if NORMALIZE:
            # bins 0 and (for even d) d/2 count once, every other bin twice (its mirror image)
            once = (f == 0) | ((f == n_freq - 1) & EVEN)
            mult = tl.where(once, 1.0, 2.0)
            sq += tl.where(m, mult * (acc_re * acc_re + acc_im * acc_im), 0.0)
    if NORMALIZE:
        total = tl.sum(sq, axis=0) / d
        scale = 1.0 / tl.sqrt(tl.maximum(total, 1e-30))
        for f0 in range(0, n_freq, BLOCK):
            f = f0 + tl.arange(0, BLOCK)
            m = f < n_freq
            ob = o_ptr + row * 2 * n_freq + 2 * f
            tl.store(ob, tl.load(ob, mask=m, other=0.0) * scale, mask=m)
            tl.store(ob + 1, tl.load(ob + 1, mask=m, other=0.0) * scale, mask=m)


_bind_mac = LazyKernel(_bind_mac_kernel)


def _row_strides(x: torch.Tensor, batch: int) -> tuple[int, int]:
    """(row stride, pair stride) in float elements of a (B or 1, k or 1, F, 2) real view."""
    sb = 0 if x.shape[0] == 1 and batch > 1 else x.stride(0)
    sj = 0 if x.shape[1] == 1 else x.stride(1)
    return sb, sj


def _spectral_mac_triton(K: torch.Tensor, V: torch.Tensor, w: torch.Tensor, d: int, normalize: bool) -> torch.Tensor:
    """K, V: complex64 (B|1, k|1, F); w: float32 (B|1, k|1). Returns complex64 (B, F)."""
    batch = max(K.shape[0], V.shape[0])
    pairs, n_freq = max(K.shape[1], V.shape[1]), K.shape[-1]
    kr, vr = torch.view_as_real(K.contiguous()), torch.view_as_real(V.contiguous())
    w = w.contiguous()
    out = torch.empty((batch, n_freq, 2), dtype=torch.float32, device=K.device)
    skb, skj = _row_strides(kr, batch)
    svb, svj = _row_strides(vr, batch)
    swb = 0 if w.shape[0] == 1 else w.stride(0)
    swj = 0 if w.shape[1] == 1 else w.stride(1)
    block = min(1024, next_pow2(n_freq))
    _bind_mac[(batch,)](kr, vr, w, out, pairs, n_freq, d, skb, skj, svb, svj, swb, swj,
                        NORMALIZE=normalize, EVEN=d % 2 == 0, BLOCK=block, num_warps=4 if block <= 512 else 8)
    return torch.view_as_complex(out)


def _broadcast(s1: torch.Size, s2: torch.Size) -> torch.Size | None:
    """``torch.broadcast_shapes(s1, s2)``, or None where they do not broadcast. Plain Python: the torch
    function goes through symbolic-shape checks that cost ~10 us, a tenth of a small CPU bind_superpose."""
    n = max(len(s1), len(s2))
    out = []
    for x, y in zip((1,) * (n - len(s1)) + tuple(s1), (1,) * (n - len(s2)) + tuple(s2)):
        if x != y and x != 1 and y != 1:
            return None
        out.append(y if x == 1 else x)
    return torch.Size(out)


def _pick_backend(backend: str, x: torch.Tensor, pairs: int | None = None) -> str:
    """The backend to run; ``pairs`` (batch x k) lets "auto" skip Triton where launch cost dominates."""
    if backend not in BACKENDS:
        raise InputError(f"backend: received {backend!r}, expected one of {BACKENDS}")
    if backend == "torch" or (backend == "auto" and not x.is_cuda):
        return "torch"  # no Triton checks for the common CPU call
    triton_ok = triton_importable() and (x.is_cuda or interpreting()) and x.dtype == torch.float32
    if backend == "triton" and not triton_ok:
        raise BackendUnavailableError(
            f"backend='triton' needs Triton and a float32 CUDA tensor (or TRITON_INTERPRET=1); received a "
            f"{x.dtype} tensor on {x.device}. Use backend='auto' or 'torch'.")
    if backend == "auto":
        big = pairs is not None and pairs >= TRITON_MIN_PAIRS
        return "triton" if triton_ok and x.is_cuda and big else "torch"
    return backend


def _parseval_norm(spec: torch.Tensor, d: int) -> torch.Tensor:
    p = spec.real.square() + spec.imag.square()
    mult = torch.full((spec.shape[-1],), 2.0, dtype=p.dtype, device=p.device)
    mult[0] = 1.0
    if d % 2 == 0:
        mult[-1] = 1.0
    return ((p * mult).sum(-1, keepdim=True) / d).sqrt()


_BLOCK_BYTES = 2 << 20  # CPU: spectra of one block of rows (~2 MiB) stay in cache; measured best of 0.5/2/8 MiB


def _as_rows(x: torch.Tensor, batch_shape: torch.Size, batch: int) -> torch.Tensor | None:
    """(B, k|1, d) view of an operand with the full batch, (k|1, d) for a shared one, None otherwise."""
    lead = x.shape[:-2]
    if math.prod(lead) == 1:
        return x.reshape(x.shape[-2], x.shape[-1])
    if lead == batch_shape:
        return x.reshape(batch, x.shape[-2], x.shape[-1])
    return None


def _blocked_applies(keys: torch.Tensor, values: torch.Tensor, lead: torch.Size, kept: bool) -> bool:
    """Batch rows to block over, and (through torch.fft, which commits a descriptor per call) enough of
    them to pay for the blocks; with MKL's kept descriptors (``kept``) blocks always pay."""
    F = keys.shape[-1] // 2 + 1
    itemsize = 2 * keys.element_size()
    big = kept or math.prod(lead) * F * itemsize > 2 * _BLOCK_BYTES
    batch_shape = lead[:-1]
    rows_ok = all(math.prod(x.shape[:-2]) == 1 or x.shape[:-2] == batch_shape for x in (keys, values))
    return big and len(batch_shape) >= 1 and rows_ok


def _blocked_spectral_sum(keys: torch.Tensor, values: torch.Tensor, weights: torch.Tensor | None,
                          lead: torch.Size, normalized: bool, fft, ifft) -> torch.Tensor:
    """CPU: the spectral sum over blocks of batch rows, so no full-size spectrum is ever allocated.

    Shared operands (no batch dims) are transformed once. ``fft``/``ifft`` come from
    ``hrr.backend.transforms``. Blocks keep the spectra in cache (docs/hrr.md, "Fused paths").
    """
    d, batch_shape = keys.shape[-1], lead[:-1]
    B, k, F = math.prod(batch_shape), lead[-1], keys.shape[-1] // 2 + 1
    kr, vr = _as_rows(keys, batch_shape, B), _as_rows(values, batch_shape, B)
    if kr is None or vr is None:  # pragma: no cover - excluded by _blocked_applies
        raise ShapeError(f"bind_superpose: cannot split keys {tuple(keys.shape)} / values {tuple(values.shape)} into rows")
    in_place = not hb.records_grad(keys, values, weights)  # autograd needs both spectra as they were
    k_shared = fft(kr) if kr.dim() == 2 else None
    v_shared = fft(vr) if vr.dim() == 2 else None
    w = None if weights is None else weights.expand(*batch_shape, k).reshape(B, k)
    rows = max(1, _BLOCK_BYTES // (k * F * 2 * keys.element_size()))
    out = torch.empty((B, d), dtype=keys.dtype, device=keys.device)
    for s in range(0, B, rows):
        kb = k_shared if k_shared is not None else fft(kr[s:s + rows])
        vb = v_shared if v_shared is not None else fft(vr[s:s + rows])
        if in_place and k_shared is None:
            prod = kb.mul_(vb)  # (rows, k, F), into this block's own spectrum
        elif in_place and v_shared is None:
            prod = vb.mul_(kb)
        else:
            prod = kb * vb
        if w is not None:
            prod.mul_(w[s:s + rows].to(prod.real.dtype).unsqueeze(-1))
        spec = prod.sum(-2)
        if normalized:
            spec = spec / _parseval_norm(spec, d).clamp_min(1e-30)
        ifft(spec, d, keys.dtype, out=out[s:s + rows])
    return out.reshape(*batch_shape, d)


def bind_superpose(
    keys: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None = None,
    *,
    normalized: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """``sum_j w_j bind(keys_j, values_j)`` over the pair axis: (..., k, d) x (..., k, d) -> (..., d).

    ``keys`` and ``values`` broadcast against each other (e.g. shared (k, d) roles with (B, k, d)
    fillers); ``weights`` is (..., k). ``normalized`` scales each result to unit norm.
    """
    hb.check_pair(keys, values, ("keys", "values"))
    if keys.dim() < 2 or values.dim() < 2:
        raise ShapeError(f"bind_superpose: received keys {tuple(keys.shape)} and values {tuple(values.shape)}, "
                         "expected (..., k, d) for both")
    d = keys.shape[-1]
    lead = _broadcast(keys.shape[:-1], values.shape[:-1])
    if lead is None:
        raise ShapeError(f"bind_superpose: keys {tuple(keys.shape)} and values {tuple(values.shape)} "
                         "do not broadcast")
    k = lead[-1]
    if weights is not None:
        weights = torch.as_tensor(weights, dtype=keys.dtype, device=keys.device)
        if weights.dim() == 0 or weights.shape[-1] != k:
            raise ShapeError(f"bind_superpose: received weights {tuple(weights.shape)}, expected (..., {k})")
    chosen = _pick_backend(backend, keys, pairs=math.prod(lead))
    fft, ifft, kept = hb.transforms(keys, values, weights)
    if chosen == "torch" and not keys.is_cuda and _blocked_applies(keys, values, lead, kept):
        return _blocked_spectral_sum(keys, values, weights, lead, normalized, fft, ifft)
    K, V = fft(keys), fft(values)
    if chosen == "triton":
        batch_shape = lead[:-1]
        B = math.prod(batch_shape)
        w = torch.ones((1, k), dtype=torch.float32, device=keys.device) if weights is None else weights
        w = w.float().expand(*batch_shape, k).reshape(B, k) if w.dim() > 1 else w.float().reshape(1, k)
        K2 = K.expand(*lead, K.shape[-1]).reshape(B, k, -1) if K.shape[:-1] != lead else K.reshape(B, k, -1)
        V2 = V.expand(*lead, V.shape[-1]).reshape(B, k, -1) if V.shape[:-1] != lead else V.reshape(B, k, -1)
        spec = _spectral_mac_triton(K2, V2, w, d, normalized).reshape(*batch_shape, -1)
        return hb.irfft(spec, d, keys.dtype)
    prod = K * V  # (..., k, F)
    if weights is not None:
        prod = prod * weights.to(prod.real.dtype).unsqueeze(-1)
    spec = prod.sum(-2)
    if normalized:
        spec = spec / _parseval_norm(spec, d).clamp_min(1e-30)
    return ifft(spec, d, keys.dtype)


def bind_normalize(a: torch.Tensor, b: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``normalize(bind(a, b))``.

    * ``"auto"``: on CUDA float32, same shapes, no autograd, a one-pass bind kernel normalises each
      row before its one store, where ``hrr.bind``'s "auto" would take one (see ``hrr.backend.one_pass``);
      the plain path otherwise. The result is written once and never re-read, which made it faster
      than the unfused path at every size measured (docs/hrr.md, "Fused paths").
    * ``"cuda"`` / ``"triton"``: that one-pass kernel (raising where it does not apply); ``"triton"``
      falls back to the spectral kernel (multiply, Parseval scaling, one launch) for shapes the FFT
      kernel does not take.
    * ``"torch"``: ``ops.normalize(ops.bind(a, b))``, unfused.
    """
    hb.check_pair(a, b)
    if backend not in NORMALIZE_BACKENDS:
        raise InputError(f"backend: received {backend!r}, expected one of {NORMALIZE_BACKENDS}")
    if backend in ("auto", "cuda"):
        out = hb.one_pass(a, b, backend, conj_b=False, normalize=True)  # "cuda" raises where it does not apply
        return out if out is not None else ops.normalize(ops.bind(a, b))
    if backend == "triton" and _pick_backend(backend, a) == "triton":
        if hb.fft_kernel_reason(a, b) is None:
            from torchnitro.hrr.fft_kernel import fft_bind

            return fft_bind(a, b, normalize=True)
        return bind_superpose(a.unsqueeze(-2), b.unsqueeze(-2), normalized=True, backend="triton")
    return ops.normalize(ops.bind(a, b))
