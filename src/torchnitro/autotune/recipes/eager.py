"""The baseline: the model as given, eager fp32. Always a candidate; wins unless beaten by a margin.

Saved as the state dict plus the model's factory reference; when the model came from a Python
object with no factory, ``export_program`` writes a ``torch.export`` program (``model.pt2``) so the
artifact still loads without the model's code. A model called with structured inputs (a
sentence-transformers feature dict) is exported as an isolated candidate's program is
(``program.export_flat``: flat tensors in and out, the layout and output structure in the meta) and
loaded back to take the same dict and answer in the same structure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Program, Recipe, register_recipe

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
            from torchnitro.autotune.program import load_program

            return load_program(Program("exported", directory / "model.pt2", meta))  # type: ignore[return-value]
        return self.require_model(model).eval()


def export_program(model: nn.Module, example_inputs: tuple[Any, ...], dynamic_dims: dict[int, list[int]],
                   path: Path) -> tuple[dict[str, Any], str | None]:
    """torch.export the model to ``path`` (dynamic dims marked): (the meta ``load`` needs, None), or
    ({}, why it failed)."""
    from torchnitro.autotune.program import export_flat

    try:
        with torch.no_grad():
            return export_flat(model.eval(), tuple(example_inputs), dynamic_dims, path), None
    except Exception as exc:  # noqa: BLE001 - not every model exports; the caller falls back
        return {}, f"{type(exc).__name__}: {exc}"[:300]
