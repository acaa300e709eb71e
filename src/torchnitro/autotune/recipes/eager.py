"""The baseline: the model as given, eager fp32. Always a candidate; wins unless beaten by a margin.

Saved as the state dict plus the model's factory reference; when the model came from a Python
object with no factory, ``export_program`` writes a ``torch.export`` program (``model.pt2``) so the
artifact still loads without the model's code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe

__all__ = ["Eager", "export_program"]


@register_recipe
class Eager(Recipe):
    name = "eager"
    numeric_class = NumericClass.EXACT
    description = "the model as given (eager PyTorch, fp32): the baseline every candidate is checked against"
    order = 0

    def build(self, ctx: BuildContext) -> Built:
        return Built(fn=ctx.model)

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        if meta.get("exported"):
            return torch.export.load(str(directory / "model.pt2")).module()
        return self.require_model(model).eval()


def export_program(model: nn.Module, example_inputs: tuple[Any, ...], dynamic_dims: dict[int, list[int]],
                   path: Path) -> str | None:
    """torch.export the model to ``path`` (dynamic dims marked); returns None, or why it failed."""
    from torch.export import Dim

    shapes = tuple({d: Dim.AUTO for d in dynamic_dims.get(i, [])} if isinstance(x, torch.Tensor) else None
                   for i, x in enumerate(example_inputs))
    try:
        from torchnitro.autotune.program import packs_args

        ep = torch.export.export(model.eval(), tuple(example_inputs),
                                 dynamic_shapes=(shapes,) if packs_args(model) else shapes)
        torch.export.save(ep, str(path))
    except Exception as exc:  # noqa: BLE001 - not every model exports; the caller falls back
        return f"{type(exc).__name__}: {exc}"[:300]
    return None
