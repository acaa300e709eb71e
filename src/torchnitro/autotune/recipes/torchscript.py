"""TorchScript: trace, freeze (constants folded into the graph), optimize_for_inference (Conv+BN
folding, MKLDNN layout choices on CPU). Standalone: the artifact loads without the model's code."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe

__all__ = ["TorchScript"]


@register_recipe
class TorchScript(Recipe):
    name = "torchscript"
    numeric_class = NumericClass.EXACT
    description = "torch.jit.trace + freeze + optimize_for_inference"
    order = 10

    def build(self, ctx: BuildContext) -> Built:
        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(ctx.model, ctx.example_inputs, check_trace=False, strict=False)
            frozen = torch.jit.freeze(traced.eval())
            try:
                fast = torch.jit.optimize_for_inference(frozen)
            except Exception as exc:  # noqa: BLE001 - some graphs refuse the extra passes; freezing still helps
                fast, note = frozen, f"optimize_for_inference skipped: {type(exc).__name__}"
            else:
                note = ""
        path = ctx.workdir / "model.ts"
        torch.jit.save(fast, str(path))
        return Built(fn=fast, files=["model.ts"], standalone=True, notes=note)

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.load(str(directory / "model.ts"), map_location="cpu").eval()
