"""Reduced precision: bf16 (CPUs with AVX512-BF16/AMX, or a GPU with bf16) and fp16 (GPU).

The model's floating-point weights are cast; floating inputs are cast on the way in and outputs come
back as fp32 so callers see eager's dtypes. Numerical class 'reduced' (cosine >= 0.999 by default).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._util import FloatOutputs
from torchnitro.hardware import HardwareInfo

__all__ = ["BF16", "FP16"]


class _Cast(Recipe):
    dtype: ClassVar[torch.dtype]
    numeric_class = NumericClass.REDUCED

    def build(self, ctx: BuildContext) -> Built:
        return Built(fn=FloatOutputs(ctx.model.to(self.dtype), self.dtype), notes=f"weights and activations {self.dtype}")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        if model is None:
            raise ValueError(f"{self.name} artifacts need the eager model")
        return FloatOutputs(model.to(self.dtype), self.dtype)


@register_recipe
class BF16(_Cast):
    name = "bf16"
    dtype = torch.bfloat16
    description = "model cast to bfloat16 (native on AVX512-BF16/AMX CPUs and Ampere+ GPUs)"
    order = 25

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        if hw.has_gpu:
            return None if torch.cuda.is_bf16_supported() else f"GPU {hw.gpu_name} has no native bf16"
        if not hw.cpu_bf16:
            return "this CPU has no avx512_bf16/amx_bf16: bf16 would be emulated and slower than fp32"
        return None


@register_recipe
class FP16(_Cast):
    name = "fp16"
    dtype = torch.float16
    description = "model cast to float16 (GPU tensor cores)"
    gpu_only = True
    order = 26
