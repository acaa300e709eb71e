"""The baseline: the model as given, eager fp32. Always a candidate; wins unless beaten by a margin."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe

__all__ = ["Eager"]


@register_recipe
class Eager(Recipe):
    name = "eager"
    numeric_class = NumericClass.EXACT
    description = "the model as given (eager PyTorch, fp32): the baseline every candidate is checked against"
    order = 0

    def build(self, ctx: BuildContext) -> Built:
        return Built(fn=ctx.model)

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        if model is None:
            raise ValueError("the eager recipe needs the model")
        return model.eval()
