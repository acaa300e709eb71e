"""TensorRT through torch_tensorrt (GPU, when the package is installed).

Compiled with the dynamo frontend for the example input shapes (fp32 and fp16 kernels allowed, so
the numerical class is 'reduced'), run in a subprocess during the search, and saved as an exported
program (``model.ep``) that loads without the model's code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.hardware import HardwareInfo

__all__ = ["TensorRT"]


@register_recipe
class TensorRT(Recipe):
    name = "tensorrt"
    numeric_class = NumericClass.REDUCED
    description = "torch_tensorrt (dynamo frontend), fp16 kernels allowed"
    gpu_only = True
    isolate = True
    order = 38

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        if not hw.has_gpu:
            return "needs a CUDA GPU; none is visible"
        if importlib.util.find_spec("torch_tensorrt") is None:
            return "torch_tensorrt is not installed (pip install torch-tensorrt matching your torch)"
        return None

    def build(self, ctx: BuildContext) -> Built:
        import torch_tensorrt

        inputs = [x for x in ctx.example_inputs]
        trt = torch_tensorrt.compile(ctx.model, ir="dynamo", inputs=inputs,
                                     enabled_precisions={torch.float32, torch.float16})
        torch_tensorrt.save(trt, str(ctx.workdir / "model.ep"), inputs=inputs)
        return Built(fn=trt, files=["model.ep"], standalone=True, notes="dynamo frontend, fp16 allowed")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        import torch_tensorrt  # noqa: F401  (registers the TensorRT runtime ops)

        return torch.export.load(str(directory / "model.ep")).module()
