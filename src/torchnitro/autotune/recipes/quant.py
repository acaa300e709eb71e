"""PyTorch dynamic int8 for Linear layers (weights int8 per tensor, activations quantised per call).

On CPUs with VNNI the int8 GEMMs are fast; the gate (cosine >= 0.99 by default) decides whether the
accuracy loss is acceptable for this model. Not standalone: rebuilt by quantising the eager model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._util import is_linear, linear_view
from torchnitro.hardware import HardwareInfo

__all__ = ["DynamicInt8", "quantize_linear_dynamic"]


def quantize_linear_dynamic(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every nn.Linear (HF Conv1D included, as the Linear it is) dynamic int8."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization deprecation notices
        return torch.ao.quantization.quantize_dynamic(linear_view(model.eval()), {nn.Linear}, dtype=torch.qint8)


@register_recipe
class DynamicInt8(Recipe):
    name = "dynamic-int8"
    isolated_input = "model"  # rewrites modules of the model tree: needs the model object itself
    numeric_class = NumericClass.INT8
    description = "torch.ao dynamic int8 quantisation of nn.Linear and HF Conv1D (CPU)"
    order = 45
    version = "2"  # 2: HF Conv1D quantised as Linear

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        engines = torch.backends.quantized.supported_engines
        if not any(e in engines for e in ("x86", "fbgemm", "onednn", "qnnpack")):
            return f"no quantized CPU engine in this torch build (engines: {engines})"
        return None

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if not any(is_linear(m) for m in model.modules()):
            return "no nn.Linear layers"
        if any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
            return "dynamic int8 kernels run on the CPU only"
        return None

    def build(self, ctx: BuildContext) -> Built:
        q = quantize_linear_dynamic(ctx.model)
        n = sum(1 for m in q.modules() if type(m).__name__ == "Linear" and "quantized" in type(m).__module__)
        return Built(fn=q, notes=f"{n} Linear layers int8")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        if model is None:
            raise ValueError("dynamic-int8 artifacts need the eager model")
        return quantize_linear_dynamic(model)
