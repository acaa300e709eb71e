"""bf16 Linear on oneDNN with the weight prepacked once and GELU / the residual add in the GEMM epilogue.

``F.linear`` on bf16 CPU tensors reaches oneDNN too, but reorders the weight into oneDNN's blocked
layout on every call and writes the output before a separate GELU or add pass reads it back. Here
the weight is reordered once (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's CPU
freezing does) and ``torch.ops.mkldnn._linear_pointwise`` applies the post-op while the output tile
is still in registers. Same call interface as the int8 Linears (``forward(x, gelu=..., add=...)``),
so ``_unpad.PackedLayer`` fuses its epilogues on it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchnitro.autotune.recipes.onednn_int8 import SharesPackedWeight

__all__ = ["OneDnnBf16Linear", "onednn_bf16_reason", "prepack_bf16_", "Bf16ComputeLinear", "bf16_compute_",
           "chain_bf16_"]


def onednn_bf16_reason() -> str | None:
    """None when the prepacked oneDNN bf16 Linear runs here, else why not."""
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")):
        return f"torch {torch.__version__} has no torch.ops.mkldnn._linear_pointwise / _reorder_linear_weight"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return "oneDNN reports no native bf16 on this CPU"
    return None


class OneDnnBf16Linear(SharesPackedWeight, nn.Module):
    """``y = W x + b`` in bf16 (then ``gelu`` or ``+ add``) with ``W`` in oneDNN's prepacked layout."""

    fused_epilogue = True  # forward takes gelu= / add= (see _unpad.PackedLayer)

    def __init__(self, lin: nn.Linear):
        super().__init__()
        w = lin.weight.detach().to(torch.bfloat16)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)  # opaque oneDNN tensor (see __deepcopy__)
        self.bias = None if lin.bias is None else lin.bias.detach().to(torch.bfloat16).clone()
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: Tensor, *, gelu: bool = False, add: Tensor | None = None) -> Tensor:
        """``W x + b``, then ``gelu`` (exact erf) or ``+ add`` (a residual shaped like the output)."""
        if gelu and add is not None:
            raise ValueError("OneDnnBf16Linear: fuse either gelu or a residual add, not both")
        if x.shape[-1] != self.in_features or x.dtype != torch.bfloat16:
            raise ValueError(f"OneDnnBf16Linear: received {x.dtype} input of shape {tuple(x.shape)}, expected "
                             f"torch.bfloat16 (..., {self.in_features})")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).contiguous()
        if add is not None:
            y = torch.ops.mkldnn._linear_pointwise.binary(x2, add.reshape(-1, self.out_features).contiguous(),
                                                          self.packed, self.bias, "add")
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "gelu" if gelu else "none", [], "none")
        return y if len(lead) == 1 else y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Bf16ComputeLinear(nn.Module):
    """An fp32-in, fp32-out Linear computed by ``OneDnnBf16Linear`` (bf16 GEMM, fp32 accumulation, GELU in
    its epilogue; a residual is added in fp32 after): for the few Linears of an int8 variant that int8
    cannot keep within the gate, where bf16's rounding (8 bits of mantissa, against int8's 256 levels per
    tensor) costs far less accuracy and half the time of fp32."""

    fused_epilogue = True  # forward takes gelu= / add= (see _unpad.PackedLayer)
    out_dtype = torch.float32  # what forward returns: bf16 where the Linear after it computes in bf16 (chain_bf16_)

    def __init__(self, lin: nn.Linear):
        super().__init__()
        self.lin = OneDnnBf16Linear(lin)
        self.in_features, self.out_features = lin.in_features, lin.out_features

    def forward(self, x: Tensor, *, gelu: bool = False, add: Tensor | None = None) -> Tensor:
        """fp32 or bf16 ``x`` (bf16: handed on by a chained Linear, no conversion) -> ``out_dtype``."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"Bf16ComputeLinear: received {x.dtype} input, expected torch.float32 or torch.bfloat16")
        y = self.lin(x.to(torch.bfloat16), gelu=gelu)  # (..., out) bf16
        if add is None and self.out_dtype == torch.bfloat16:
            return y
        y = y.float()
        y = y if add is None else y.add_(add.reshape(y.shape))  # the residual is added in fp32
        return y if self.out_dtype == torch.float32 else y.to(self.out_dtype)


def bf16_compute_(model: nn.Module) -> list[str]:
    """Swap the fp32 ``nn.Linear`` parts of every ``PackedLayer`` in ``model`` (those an int8 plan kept in
    fp32) for ``Bf16ComputeLinear``; returns their qualified names."""
    from torchnitro.autotune.recipes._unpad import PackedLayer

    done = []
    for name, layer in model.named_modules():
        if not isinstance(layer, PackedLayer):
            continue
        for part in _PARTS:
            lin = getattr(layer, part)
            if type(lin) is nn.Linear and lin.weight.dtype == torch.float32 and lin.weight.device.type == "cpu":
                setattr(layer, part, Bf16ComputeLinear(lin))
                done.append(f"{name}.{part}" if name else part)
    return done


_PARTS = ("qkv", "out", "ffn_in", "ffn_out")  # the Linears of _unpad.PackedLayer


def chain_bf16_(model: nn.Module) -> list[str]:
    """Where a ``PackedLayer``'s FFN down-projection computes in bf16 (``Bf16ComputeLinear``), let its
    up-projection (oneDNN int8 or ``Bf16ComputeLinear``) return bf16: the int8 GEMM then writes its GELU
    output as bf16 directly, a bf16 one keeps it, instead of an fp32 ``(N, 4D)`` written, read back and
    converted (the same bf16 values reach the down-projection either way). Returns the up-projections' names."""
    from torchnitro.autotune.recipes._unpad import PackedLayer
    from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear

    done = []
    for name, layer in model.named_modules():
        if (isinstance(layer, PackedLayer) and isinstance(layer.ffn_out, Bf16ComputeLinear)
                and isinstance(layer.ffn_in, (OneDnnInt8Linear, Bf16ComputeLinear))):
            layer.ffn_in.out_dtype = torch.bfloat16
            done.append(f"{name}.ffn_in" if name else "ffn_in")
    return done


def prepack_bf16_(model: nn.Module) -> int:
    """Swap the bf16 Linears of every ``PackedLayer`` in ``model`` for ``OneDnnBf16Linear`` (the HF
    modules they came from stay as they are, for calls the padding-free path hands back). Returns how
    many were swapped."""
    from torchnitro.autotune.recipes._unpad import PackedLayer

    n = 0
    for layer in model.modules():
        if not isinstance(layer, PackedLayer):
            continue
        for part in _PARTS:
            lin = getattr(layer, part)
            if isinstance(lin, nn.Linear) and lin.weight.dtype == torch.bfloat16 and lin.weight.device.type == "cpu":
                setattr(layer, part, OneDnnBf16Linear(lin))
                n += 1
    return n
