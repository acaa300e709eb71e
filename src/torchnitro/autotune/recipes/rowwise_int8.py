"""Int8 Linear with a scale per token row: dynamic per-token activations, per-channel weights.

A per-tensor activation scale is set by the largest value anywhere in the batch, so one token with
an outlier (BERT's [SEP]/[CLS] "attention sink" rows, long text) costs every other token its
resolution, and a range that fits one batch does not fit the next: all-MiniLM-L6-v2 calibrated on
short sentences scored a worst token-row cosine of 0.971 on long text with per-tensor activations.
Each row quantised over its own ``max |x|`` (as LLM.int8 and ZeroQuant do, "per-token dynamic
quantization") fits short and long inputs by construction; the same model held 0.992 there.

    x_q[i, :] = round(x[i, :] / a_i),  a_i = max_j |x[i, j]| / 127         (int8, symmetric)
    W_q[o, :] = round(W[o, :] * s / w_o),  w_o = max_j |W[o, j] s_j| / 127  (int8, SmoothQuant s)
    y[i, o]  = a_i * w_o * sum_j x_q[i, j] W_q[o, j] + b[o]

The int8 x int8 -> int32 GEMM is ``torch._int_mm`` (oneDNN on x86 CPUs); the quantiser is
``torch.quantize_per_channel`` along the rows (one vectorised pass). Same call interface as
``OneDnnInt8Linear``: ``forward(x, gelu=..., add=...)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchnitro.autotune.recipes.onednn_int8 import Int8LinearBase, quiet_quantize

__all__ = ["RowwiseInt8Linear", "rowwise_int8_reason"]


def rowwise_int8_reason() -> str | None:
    """None when the per-token int8 Linear runs here, else why not."""
    from torchnitro.hardware import hardware_info

    if not hasattr(torch, "_int_mm") or not hasattr(torch, "quantize_per_channel"):
        return f"torch {torch.__version__} has no torch._int_mm / torch.quantize_per_channel"
    if not hardware_info().cpu_vnni:
        return "the CPU has no VNNI/AMX int8 dot products (int8 x int8 products could saturate)"
    return None


def _int8_view(q: Tensor) -> Tensor:
    """The qint8 tensor's bytes as a plain int8 tensor, without ``int_repr``'s copy."""
    return torch.empty((0,), dtype=torch.int8).set_(q.untyped_storage(), q.storage_offset(), q.shape, q.stride())


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(N, K)`` float -> ``(N, K)`` int8 and ``(N, 1)`` float32 row scales (symmetric, max |x| -> 127)."""
    lo, hi = torch.aminmax(x, dim=1)  # (N,), (N,)
    scale = torch.maximum(hi, -lo).clamp_(min=1e-8).div_(127.0)  # (N,); an all-zero row keeps a finite scale
    zp = torch.zeros(x.shape[0], dtype=torch.int64)
    q = quiet_quantize(torch.quantize_per_channel, x, scale.double(), zp, 0, torch.qint8)
    return _int8_view(q), scale.unsqueeze(1)


class RowwiseInt8Linear(Int8LinearBase):
    """``y = W x + b`` (optionally ``gelu(.)`` or ``+ residual``) with int8 weights per output channel
    and int8 activations per row, smoothed by ``scale`` per input channel (the weights carry ``W * s``)."""

    def __init__(self, lin: nn.Linear, scale: Tensor | None = None, outliers: Tensor | None = None):
        super().__init__(lin, scale, outliers)
        self.register_buffer("wq", self.__dict__.pop("wq_init"), persistent=False)  # (out, in) int8

    def forward(self, x: Tensor, *, gelu: bool = False, add: Tensor | None = None) -> Tensor:
        """``W x + b``, then ``gelu`` (exact erf) or ``+ add`` (a residual shaped like the output)."""
        lead = x.shape[:-1]
        x2, part = self._prepared(self._rows(x, gelu, add))
        xq, xs = quantize_rows(x2)  # (N, K) int8, (N, 1)
        y = torch._int_mm(xq, self.wq.t()).float()  # (N, out): the exact int32 dot products
        y.mul_(xs)
        y = torch.addcmul(self.bias, y, self.w_scale, out=y) if self.bias is not None else y.mul_(self.w_scale)
        if part is not None:  # the fp32 outlier channels (see Int8LinearBase)
            y.add_(part)
        if gelu:
            torch._C._nn.gelu_(y)
        elif add is not None:
            y.add_(add.reshape(y.shape))
        return y if len(lead) == 1 else y.reshape(*lead, self.out_features)
