"""``Fp8InferenceLinear``: an inference-only ``nn.Linear`` whose matmul runs on FP8 (e4m3) tensor cores.

Weights are quantised once, per output channel (row); activations are quantised on every call, per
token (row), from that row's own ``max |x|`` (dynamic scaling: no calibration, an outlier token costs
only its own row's resolution):

    x_q[i, :] = e4m3(x[i, :] / a_i),  a_i = max_j |x[i, j]| / 448
    W_q[o, :] = e4m3(W[o, :] / w_o),  w_o = max_j |W[o, j]| / 448
    y[i, o]  = a_i * w_o * sum_j x_q[i, j] W_q[o, j]  (+ b[o])          fp32 accumulation, bf16 out

Backends:

- ``scaled_mm``: ``torch._scaled_mm`` with row-wise scales (CUDA capability >= 8.9: Ada, Hopper):
  ``scale_a`` (M, 1) fp32, ``scale_b`` (1, N) fp32 (the dequantisation scales ``a``, ``w``), the
  second operand column-major (``W_q`` stored (N, K) row-major, passed as its transpose), K and N
  multiples of 16 (M is padded to a multiple of 16 where needed), bf16 output. The activation cast
  is the one-pass Triton row kernel of ``torchnitro.kernels.fp8``.
- ``emulated``: the same quantised operands, dequantised and multiplied in fp32 (the products of
  two e4m3 values are exact in fp32, so only the summation order differs). It runs anywhere and is
  how the numerics are tested on CPU; it is not faster.

``auto`` takes ``scaled_mm`` where it runs and otherwise ``emulated``; a ``scaled_mm`` call that fails
at run time warns once and the layer continues emulated. Training FP8 lives in ``float8_linear``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchnitro.errors import BackendUnavailableError, InputError
from torchnitro.kernels import reference

__all__ = ["Fp8InferenceLinear", "to_fp8_inference_", "fp8_inference_reason", "quantize_weight_rows",
           "quantize_activation_rows", "Fp8SwapReport", "FP8_MIN_CAPABILITY"]

E4M3 = torch.float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer
_BACKENDS = ("auto", "scaled_mm", "emulated")
_warned: set[str] = set()


def fp8_inference_reason(device: torch.device | str | None = None) -> str | None:
    """None when ``torch._scaled_mm`` FP8 matmuls run on ``device`` (default: the current GPU), else why not."""
    if not hasattr(torch, "_scaled_mm"):
        return f"needs CUDA sm_89+ for FP8 _scaled_mm; torch {torch.__version__} has no torch._scaled_mm"
    if not torch.cuda.is_available():
        return "needs CUDA sm_89+ for FP8 _scaled_mm; no CUDA GPU is visible"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return f"needs CUDA sm_89+ for FP8 _scaled_mm; the tensors are on {dev.type}"
    cap = torch.cuda.get_device_capability(dev)
    if tuple(cap) < FP8_MIN_CAPABILITY:
        return f"needs CUDA sm_89+ for FP8 _scaled_mm; {torch.cuda.get_device_name(dev)} is sm_{cap[0]}{cap[1]}"
    return None


def quantize_weight_rows(weight: Tensor) -> tuple[Tensor, Tensor]:
    """``(N, K)`` weight -> ``(N, K)`` e4m3 and ``(N,)`` fp32 dequantisation scales (one per output channel)."""
    if weight.dim() != 2:
        raise InputError(f"quantize_weight_rows: weight has shape {tuple(weight.shape)}; expected 2-d (out, in)")
    q, s = reference.fp8_quantize(weight.detach().float(), E4M3, per_row=True)  # (N, K), (N, 1)
    return q, s.reshape(-1)


def quantize_activation_rows(x2: Tensor) -> tuple[Tensor, Tensor]:
    """``(M, K)`` activations -> ``(M, K)`` e4m3 and ``(M, 1)`` fp32 scales, one per token row.

    On CUDA the one-pass Triton row kernel; where it fails (or off CUDA) the PyTorch reference,
    which computes the same scales and casts."""
    if x2.is_cuda and "triton-quant" not in _warned:
        try:
            from torchnitro.kernels.fp8 import fp8_quantize

            return fp8_quantize(x2, E4M3, per_row=True)
        except Exception as exc:  # noqa: BLE001 - a failing fast path falls back, it must not take the model down
            _warned.add("triton-quant")
            warnings.warn(f"Fp8InferenceLinear: the Triton activation cast failed ({type(exc).__name__}: {exc}); "
                          "using the PyTorch cast", stacklevel=2)
    return reference.fp8_quantize(x2, E4M3, per_row=True)


@dataclass
class Fp8SwapReport:
    converted: list[str] = field(default_factory=list)  # Linear layers now FP8
    skipped: dict[str, str] = field(default_factory=dict)  # layer name -> why it stays an nn.Linear


class Fp8InferenceLinear(nn.Module):
    """``y = x W^T + b`` with e4m3 weights (per-channel scales) and e4m3 activations (per-token scales).

    Build with ``Fp8InferenceLinear(linear)``; the source layer is not changed. Output dtype is
    ``out_dtype`` (bf16: what the row-wise ``_scaled_mm`` writes), cast to the input's dtype when that
    differs, so the layer drops into a bf16 model as is."""

    def __init__(self, linear: nn.Linear, backend: str = "auto", out_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        if backend not in _BACKENDS:
            raise InputError(f"Fp8InferenceLinear: backend={backend!r}; expected one of {list(_BACKENDS)}")
        n, k = linear.weight.shape
        if backend == "scaled_mm" and (n % 16 or k % 16):
            raise InputError(f"Fp8InferenceLinear: weight (out={n}, in={k}); scaled_mm needs both multiples of 16. "
                             "Keep this layer an nn.Linear or use backend='auto'")
        self.in_features, self.out_features = k, n
        self.backend, self.out_dtype = backend, out_dtype
        wq, ws = quantize_weight_rows(linear.weight)
        self.register_buffer("weight_fp8", wq)  # (N, K) row-major: its .t() is the column-major (K, N) mat2
        self.register_buffer("weight_scale", ws.reshape(1, n).contiguous())  # (1, N) fp32
        bias = linear.bias.detach().to(out_dtype) if linear.bias is not None else None
        self.register_buffer("bias", bias)  # (N,) in out_dtype, or None
        self._hw_failed = False
        self._checked: dict[torch.device, bool] = {}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, backend={self.backend}"

    def uses_scaled_mm(self, device: torch.device) -> bool:
        """Whether a call on ``device`` takes ``torch._scaled_mm`` (else the emulated path)."""
        if self.backend == "emulated" or self._hw_failed:
            return False
        if device in self._checked:  # the capability check costs host time on every layer call otherwise
            return self._checked[device]
        why = fp8_inference_reason(device) if device.type == "cuda" else "needs CUDA sm_89+ for FP8 _scaled_mm"
        if why is not None and self.backend == "scaled_mm":
            raise BackendUnavailableError(f"Fp8InferenceLinear(backend='scaled_mm'): {why}. Use backend='auto'")
        self._checked[device] = why is None
        return why is None

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise InputError(f"Fp8InferenceLinear: input has {x.shape[-1]} features in its last dim; expected "
                             f"{self.in_features}")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        y = None
        if x2.shape[0] and self.uses_scaled_mm(x2.device):
            y = self._scaled_mm(x2)
        if y is None:
            y = self._emulated(x2)
        if self.bias is not None:
            y = y + self.bias
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        return y.reshape(*lead, self.out_features)

    def _scaled_mm(self, x2: Tensor) -> Tensor | None:
        """``(M, N)`` in ``out_dtype`` from the FP8 tensor cores; None (after one warning) when the call fails."""
        m = x2.shape[0]
        pad = (-m) % 16
        if pad:  # keep every _scaled_mm dimension a multiple of 16; zero rows get a finite scale
            x2 = F.pad(x2, (0, 0, 0, pad))
        try:
            xq, xs = quantize_activation_rows(x2)  # (M', K) e4m3, (M', 1) fp32
            y = torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=xs, scale_b=self.weight_scale,
                                 out_dtype=self.out_dtype)
        except Exception as exc:  # noqa: BLE001 - an unsupported shape/build must not crash the model
            if self.backend == "scaled_mm":
                raise BackendUnavailableError(f"Fp8InferenceLinear: torch._scaled_mm failed on (M={m}, "
                                              f"K={self.in_features}, N={self.out_features}): {exc}") from exc
            self._hw_failed = True
            if "scaled_mm" not in _warned:
                _warned.add("scaled_mm")
                warnings.warn(f"Fp8InferenceLinear: torch._scaled_mm failed ({type(exc).__name__}: {exc}); this layer "
                              "continues on the emulated FP8 path (same numerics, not faster)", stacklevel=3)
            return None
        y = y[0] if isinstance(y, tuple) else y  # (M', N)
        return y[:m] if pad else y

    def _emulated(self, x2: Tensor) -> Tensor:
        """The same quantised operands, dequantised and multiplied in fp32: ``(M, N)`` in ``out_dtype``."""
        xq, xs = reference.fp8_quantize(x2, E4M3, per_row=True)  # (M, K), (M, 1)
        w = self.weight_fp8.float() * self.weight_scale.reshape(-1, 1)  # (N, K)
        return ((xq.float() * xs) @ w.t()).to(self.out_dtype)


def _fits(lin: nn.Linear) -> str | None:
    n, k = lin.weight.shape
    if n % 16 or k % 16:
        return f"shape (out={n}, in={k}): FP8 _scaled_mm needs both multiples of 16"
    return None


def to_fp8_inference_(model: nn.Module, *, backend: str = "auto", skip: tuple[str, ...] = (),
                      out_dtype: torch.dtype = torch.bfloat16) -> Fp8SwapReport:
    """Replace every ``nn.Linear`` of ``model`` (in place) by an ``Fp8InferenceLinear``; returns what it did.

    Layers whose features are not multiples of 16, or whose qualified name ends with an entry of
    ``skip``, stay ``nn.Linear`` and are listed with the reason."""
    if not isinstance(model, nn.Module) or type(model) is nn.Linear:
        raise InputError(f"to_fp8_inference_: received {type(model).__name__}; expected a model containing "
                         "nn.Linear layers (wrap a bare Linear, or use Fp8InferenceLinear(linear))")
    report = Fp8SwapReport()
    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear:
            continue
        why = "name is in skip" if any(name == s or name.endswith("." + s) for s in skip) else _fits(mod)
        if why is not None:
            report.skipped[name] = why
            continue
        model.set_submodule(name, Fp8InferenceLinear(mod, backend=backend, out_dtype=out_dtype))
        report.converted.append(name)
    return report
