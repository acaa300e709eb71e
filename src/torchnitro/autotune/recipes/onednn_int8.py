"""Int8 Linear on oneDNN's fused kernels (x86 CPUs with VNNI/AMX int8 dot products).

``torch.ops.onednn.qlinear_pointwise`` (the kernel PyTorch's x86 PT2E quantization lowers to) runs
a uint8 x int8 GEMM whose epilogue dequantises with per-channel weight scales, adds the bias and
can apply GELU or add a residual before writing fp32, so a separate GELU or residual-add pass over
the output is not needed. Around it:

* **Dynamic activation range.** Each call quantises its input per tensor over its own range,
  so no calibration range is baked in and unusual inputs never clip.
* **SmoothQuant.** Where the ``x / s`` multiply is not folded into the layer before, the native
  quantiser (``kernels.cpu_int8``: smoothing, zeroed outlier columns, range and uint8 in two passes
  over the input, which it never writes) applies it; where that kernel cannot be built, torch ops do
  (the multiply in place on a temporary, ``index_fill``, ``aminmax``, ``quantize_per_tensor``).
* **Residual sums in place.** ``accumulate=True`` lets oneDNN's "sum" post-op write ``W x + b + r``
  into the caller's temporary ``r`` instead of a new output.

Measured on a 2-core AVX512-VNNI VM at MiniLM shapes (4096 tokens): 1.3-1.8x less time per GEMM
than fbgemm's dynamic Linear before any fusion (docs/optimize_results.md).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable

import torch
from torch import Tensor, nn

from torchnitro.kernels.cpu_int8 import cpu_int8_reason, quantize_u8

__all__ = ["SharesPackedWeight", "Int8LinearBase", "OneDnnInt8Linear", "onednn_int8_reason", "quiet_quantize"]

# torch.quantize_per_tensor / _per_channel are the vectorised CPU quantisers torch has (the decomposed ops take
# 4-5 passes). Their deprecation notice (issued once per process) is not actionable for users of this module.
_quiet = [True]


def quiet_quantize(fn: Callable[..., Tensor], *args: Any) -> Tensor:
    """``fn(*args)`` (``torch.quantize_per_tensor`` or ``_per_channel``), the first call without the notice."""
    if _quiet[0]:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"torch\.quantize_per_tensor", category=UserWarning)
            q = fn(*args)
        _quiet[0] = False
        return q
    return fn(*args)


def onednn_int8_reason() -> str | None:
    """None when the fused oneDNN int8 Linear runs here, else why not."""
    from torchnitro.hardware import hardware_info

    if not hasattr(torch.ops.onednn, "qlinear_pointwise") or not hasattr(torch.ops.onednn, "qlinear_prepack"):
        return f"torch {torch.__version__} has no torch.ops.onednn.qlinear_pointwise"
    if not hasattr(torch, "quantize_per_tensor"):
        return f"torch {torch.__version__} has no torch.quantize_per_tensor (the activation quantiser used here)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not hardware_info().cpu_vnni:
        return "the CPU has no VNNI/AMX int8 dot products (uint8 x int8 products could saturate)"
    return None


def _uint8_view(q: Tensor) -> Tensor:
    """The quint8 tensor's bytes as a plain uint8 tensor, without ``int_repr``'s copy (a slow scalar
    loop: 0.8 ms for 4096 x 384 here, more than the quantisation itself)."""
    return torch.empty((0,), dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


class SharesPackedWeight:
    """``deepcopy`` shares ``self.packed``: an opaque oneDNN tensor that cannot be copied and is never written."""

    def __deepcopy__(self, memo: dict) -> Any:
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.__dict__.update({k: (v if k == "packed" else copy.deepcopy(v, memo)) for k, v in self.__dict__.items()})
        return new


class Int8LinearBase(nn.Module):
    """What the int8 Linears here share: int8 weights per output channel (symmetric) smoothed by
    ``scale`` per input channel (SmoothQuant: they carry ``W * s``), fp32 bias, and the checks of a
    ``forward(x, gelu=..., add=...)`` call.

    ``outliers``: input channels computed in fp32 beside the int8 GEMM (LLM.int8's decomposition,
    Dettmers et al., 2022): a few channels whose activations are an order of magnitude above the rest
    (MiniLM's FFN down-projections: one channel at 17-24 where the others stay under 6) set the per-tensor
    activation scale and cost every other channel its resolution. Their columns leave the int8 weight
    (so they do not set its per-channel scales either) and ``x[:, outliers] @ W[:, outliers].T`` is added
    in fp32 (a ``(N, k)`` by ``(k, out)`` GEMM, k a few channels)."""

    fused_epilogue = True  # forward takes gelu= / add= (see _unpad.PackedLayer)
    inplace = False  # the caller passes a temporary: the smoothing multiply may overwrite it
    # the dtype forward returns: bf16 where the Linear after it computes in bf16 (onednn_bf16.chain_bf16_)
    out_dtype = torch.float32
    weight = None  # no fp32 weight; HF code that reads .weight for a dtype (T5's wo) then leaves its input as is

    def __init__(self, lin: nn.Linear, scale: Tensor | None = None, outliers: Tensor | None = None):
        super().__init__()
        w = lin.weight.detach().float()
        k = lin.in_features
        s = torch.ones(k) if scale is None else scale.detach().float().reshape(k)
        if not bool((s > 0).all()) or not bool(torch.isfinite(s).all()):
            raise ValueError(f"{type(self).__name__}: smoothing scales must be finite and > 0 "
                             f"(got min {float(s.min())})")
        ws = w * s  # (out, in): the smoothed weights
        idx = None if outliers is None or not outliers.numel() else outliers.detach().long().reshape(-1)
        if idx is not None and (int(idx.min()) < 0 or int(idx.max()) >= k):
            raise ValueError(f"{type(self).__name__}: outlier channels must lie in [0, {k}); received {idx.tolist()}")
        self.register_buffer("out_idx", idx, persistent=False)  # (k_out,) or None
        # (k_out, out) fp32 columns of the smoothed weight, or None
        self.register_buffer("w_out", None if idx is None else ws[:, idx].t().contiguous(), persistent=False)
        if idx is not None:
            ws = ws.index_fill(1, idx, 0.0)
        self.register_buffer("w_scale", (ws.abs().amax(1) / 127.0).clamp(min=1e-12), persistent=False)  # (out,)
        self.wq_init = torch.round(ws / self.w_scale[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
        self.smoothed = scale is not None
        self.register_buffer("inv_smooth", 1.0 / s, persistent=False)
        self.bias = None if lin.bias is None else nn.Parameter(lin.bias.detach().float().clone(), requires_grad=False)
        self.in_features, self.out_features = k, lin.out_features

    def _rows(self, x: Tensor, gelu: bool, add: Tensor | None) -> Tensor:
        """``x`` checked and viewed as ``(N, in)`` contiguous rows."""
        name = type(self).__name__
        if gelu and add is not None:
            raise ValueError(f"{name}: fuse either gelu or a residual add, not both")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{name}: received input of shape {tuple(x.shape)}, expected (..., {self.in_features})")
        if x.dtype != torch.float32:
            raise TypeError(f"{name}: received {x.dtype} input, expected torch.float32")
        x2 = x.reshape(-1, self.in_features)
        return x2 if x2.is_contiguous() else x2.contiguous()

    def _smooth(self, x: Tensor) -> Tensor:
        if not self.smoothed:
            return x
        return x.mul_(self.inv_smooth) if self.inplace else x * self.inv_smooth

    def _split(self, x2: Tensor) -> tuple[Tensor, Tensor | None]:
        """The smoothed rows for the int8 GEMM (outlier channels zeroed) and the smoothed outlier columns
        ``(N, k_out)`` for ``w_out`` (None without outliers). Never writes to the caller's tensor unless ``inplace``."""
        owned = self.inplace or self.smoothed  # _smooth returns a new tensor unless in place
        x2 = self._smooth(x2)
        if self.out_idx is None:
            return x2, None
        xo = x2.index_select(1, self.out_idx)  # (N, k_out)
        x2 = x2 if owned else x2.clone()
        return x2.index_fill_(1, self.out_idx, 0.0), xo

    def _prepared(self, x2: Tensor) -> tuple[Tensor, Tensor | None]:
        """``_split``'s rows and the outlier channels' fp32 product ``(N, out)`` (None without outliers)."""
        x2, xo = self._split(x2)
        return x2, None if xo is None else xo @ self.w_out  # (N, k_out) @ (k_out, out)

    def extra_repr(self) -> str:
        k = 0 if self.out_idx is None else self.out_idx.numel()
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
                + (f", fp32 outlier channels={k}" if k else ""))


class OneDnnInt8Linear(SharesPackedWeight, Int8LinearBase):
    """``y = W x + b`` (optionally ``gelu(.)`` or ``+ residual``) with int8 weights (per output channel,
    symmetric) and uint8 activations (per tensor, asymmetric, range taken from each call's input),
    smoothed by ``scale`` per input channel (SmoothQuant: the weights carry ``W * s``)."""

    takes_out_dtype = True  # forward(..., out_dtype=) overrides out_dtype for one call
    takes_accumulate = True  # forward(..., add=r, accumulate=True) may write the result into r (see forward)

    def __init__(self, lin: nn.Linear, scale: Tensor | None = None, outliers: Tensor | None = None):
        super().__init__(lin, scale, outliers)
        # opaque oneDNN layout: not a buffer (see __deepcopy__)
        self.packed = torch.ops.onednn.qlinear_prepack(self.__dict__.pop("wq_init"), None)
        self.register_buffer("w_zp", torch.zeros_like(self.w_scale, dtype=torch.int64), persistent=False)
        # for the native quantiser (kernels.cpu_int8), which reads the caller's rows as they are: the smoothing
        # 1/s per input column, 0 at the outlier columns, and the outlier columns' weights times 1/s
        col = self.inv_smooth.clone()
        if self.out_idx is not None:
            col[self.out_idx] = 0.0
        self.register_buffer("col_scale", None if (col == 1).all() else col.contiguous(), persistent=False)  # (in,)
        self.register_buffer("w_out_raw", None if self.out_idx is None else
                             (self.w_out * self.inv_smooth[self.out_idx, None]).contiguous(), persistent=False)

    def _quantize(self, x: Tensor) -> tuple[Tensor, float, int]:
        """Already smoothed rows -> uint8 rows (per tensor, asymmetric), their scale and zero point."""
        lo, hi = torch.aminmax(x)
        lo_f, hi_f = min(float(lo), 0.0), max(float(hi), 0.0)  # the range must contain 0 (exact zero point)
        scale = max(hi_f - lo_f, 1e-8) / 255.0
        zp = int(min(255, max(0, round(-lo_f / scale))))
        return _uint8_view(quiet_quantize(torch.quantize_per_tensor, x, scale, zp, torch.quint8)), scale, zp

    def forward(self, x: Tensor, *, gelu: bool = False, add: Tensor | None = None,
                out_dtype: torch.dtype | None = None, accumulate: bool = False) -> Tensor:
        """``W x + b``, then ``gelu`` (exact erf) or ``+ add`` (a (N, out) residual) in the GEMM epilogue;
        written as ``out_dtype`` (default ``self.out_dtype``). ``accumulate``: the caller's ``add`` is a
        temporary the sum may be written into (oneDNN's "sum" post-op: no output allocation), where it is
        contiguous fp32 and the output fp32; the result is returned either way."""
        want = self.out_dtype if out_dtype is None else out_dtype
        lead = x.shape[:-1]
        x2 = self._rows(x, gelu, add)
        # xo @ wo: the outlier channels' fp32 product (N, k_out) @ (k_out, out), added in place where it can be
        if cpu_int8_reason() is None:  # smoothing, outlier columns and quantisation in two passes over x2
            qx, sx, zx = quantize_u8(x2, self.col_scale)
            xo = None if self.out_idx is None else x2.index_select(1, self.out_idx)  # unsmoothed: w_out_raw
            wo = self.w_out_raw
        else:
            x2, xo = self._split(x2)
            wo = self.w_out
            qx, sx, zx = self._quantize(x2)
        into = (accumulate and add is not None and want == torch.float32 and add.dtype == torch.float32
                and add.is_contiguous())
        if into:
            acc = add.view(-1, self.out_features)  # (N, out): the GEMM adds into it
            if xo is not None:
                acc.addmm_(xo, wo)
            y = torch.ops.onednn.qlinear_pointwise.binary(
                qx, sx, zx, self.packed, self.w_scale, self.w_zp, acc, self.bias, 1.0, 0, torch.float32, 1.0, 0,
                "sum", 1.0, "none", [], "none")
            return y if len(lead) == 1 else y.view(*lead, self.out_features)
        if xo is not None and not gelu:  # the outlier channels' product joins the residual
            add = xo @ wo if add is None else torch.addmm(add.reshape(-1, self.out_features), xo, wo)
        if add is not None:
            y = torch.ops.onednn.qlinear_pointwise.binary(
                qx, sx, zx, self.packed, self.w_scale, self.w_zp, add.reshape(-1, self.out_features).contiguous(),
                self.bias, 1.0, 0, torch.float32, 1.0, 0, "add", 1.0, "none", [], "none")
        elif xo is not None:  # oneDNN has no add-then-GELU epilogue: add, then GELU in place
            y = torch.ops.onednn.qlinear_pointwise(qx, sx, zx, self.packed, self.w_scale, self.w_zp, self.bias, 1.0,
                                                   0, torch.float32, "none", [], "none")
            torch._C._nn.gelu_(y.addmm_(xo, wo))
        else:  # the GEMM writes out_dtype itself: a bf16 consumer needs no conversion pass
            y = torch.ops.onednn.qlinear_pointwise(qx, sx, zx, self.packed, self.w_scale, self.w_zp, self.bias, 1.0,
                                                   0, want, "gelu" if gelu else "none", [], "none")
        y = y if y.dtype == want else y.to(want)
        return y if len(lead) == 1 else y.reshape(*lead, self.out_features)
