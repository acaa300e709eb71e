"""The ``fp8-inference`` recipe: bf16 model whose Linear layers run on FP8 (e4m3) tensor cores.

Every ``nn.Linear`` (and HF ``Conv1D``, as the Linear it is) with features that are multiples of 16
becomes a ``precision.fp8_inference.Fp8InferenceLinear``: e4m3 weights with a scale per output
channel, e4m3 activations with a scale per token computed on each call, ``torch._scaled_mm`` with
row-wise scales and bf16 output. The rest of the model runs in bf16. Other layers stay bf16
``nn.Linear`` (listed in the notes). Numerical class 'int8' (cosine >= 0.99), the class of the
other 8-bit recipes. Needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._util import FloatOutputs, is_linear, linear_view
from torchnitro.hardware import HardwareInfo

__all__ = ["Fp8Inference", "fp8_recipe_reason"]

NEEDS = "needs CUDA sm_89+ for FP8 _scaled_mm"


def fp8_recipe_reason(hw: HardwareInfo) -> str | None:
    """None when the FP8 recipe can run on ``hw``, else why not (starting with what it needs)."""
    if not hasattr(torch, "_scaled_mm"):
        return f"{NEEDS}; torch {torch.__version__} has no torch._scaled_mm"
    if not hw.has_gpu or hw.gpu_capability is None:
        return f"{NEEDS}; no CUDA GPU is visible"
    if tuple(hw.gpu_capability) < (8, 9):
        cap = hw.gpu_capability
        return f"{NEEDS}; {hw.gpu_name} is sm_{cap[0]}{cap[1]}"
    return None


def _convert(model: nn.Module, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    from torchnitro.precision.fp8_inference import to_fp8_inference_

    model = linear_view(model).to(device=device, dtype=torch.bfloat16).eval()
    report = to_fp8_inference_(model)
    return model, {"converted": report.converted, "skipped": report.skipped}


@register_recipe
class Fp8Inference(Recipe):
    name = "fp8-inference"
    isolated_input = "model"  # swaps modules of the model tree: needs the model object itself
    numeric_class = NumericClass.INT8
    description = "bf16 model, Linear layers as FP8 e4m3 (per-channel weights, per-token activations) via _scaled_mm"
    gpu_only = True
    order = 44

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        return fp8_recipe_reason(hw)

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        fits = [m for m in model.modules() if is_linear(m) and m.weight.shape[0] % 16 == 0
                and m.weight.shape[1] % 16 == 0]
        if not fits:
            return "no nn.Linear layer with in/out features that are multiples of 16 (FP8 _scaled_mm's rule)"
        return None

    def build(self, ctx: BuildContext) -> Built:
        model, meta = _convert(ctx.model, ctx.device)
        skipped = meta["skipped"]
        return Built(fn=FloatOutputs(model, torch.bfloat16), meta=meta,
                     notes=f"{len(meta['converted'])} Linear FP8 (e4m3, _scaled_mm)"
                           + (f", {len(skipped)} kept bf16 ({'; '.join(f'{k}: {v}' for k, v in list(skipped.items())[:3])})"
                              if skipped else ""))

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        model = self.require_model(model)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        converted, _ = _convert(model.eval(), device)
        return FloatOutputs(converted, torch.bfloat16)
