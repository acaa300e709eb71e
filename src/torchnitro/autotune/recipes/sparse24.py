"""The ``sparse-2:4`` recipe: Linear weights pruned to 2:4 and run on sparse tensor cores (bf16).

In every group of 4 consecutive input weights the 2 of largest magnitude are kept
(``kernels.sparsity.prune_2to4``) and the layer becomes a ``kernels.sparsity.SemiSparseLinear``
(``torch.sparse.to_sparse_semi_structured``: cuSPARSELt where torch has it, else CUTLASS). Layers with
features that are not multiples of 64, and the output head (``lm_head``: often tied to the
embedding, and the layer pruning hurts most), stay dense bf16.

Pruning changes what the model computes, beyond what the int8 gate allows, unless the model was
trained 2:4-sparse. So the recipe has its own numerical class, 'pruned', and is opt-in: it is never
part of a search without an explicit recipe list (``default = False``); the user names it
(``torchnitro optimize -r sparse-2:4``, ``OptimizeConfig(recipes=[..., "sparse-2:4"])``) and may set
the class gate (``tolerances={"pruned": {"cosine": ...}}``) or a ``metric_fn``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._util import FloatOutputs, is_linear, linear_view
from torchnitro.hardware import HardwareInfo

__all__ = ["Sparse24", "sparse_recipe_reason", "sparsify_linears_"]

SKIP = ("lm_head",)


def sparse_recipe_reason(hw: HardwareInfo) -> str | None:
    """None when 2:4 semi-structured sparse matmuls can run on ``hw``, else why not."""
    from torchnitro.kernels.sparsity import SPARSE_NEEDS, semi_structured_reason

    if not hw.has_gpu or hw.gpu_capability is None:
        return f"{SPARSE_NEEDS}; no CUDA GPU is visible"
    if tuple(hw.gpu_capability) < (8, 0):
        cap = hw.gpu_capability
        return f"{SPARSE_NEEDS}; {hw.gpu_name} is sm_{cap[0]}{cap[1]}"
    return semi_structured_reason()


def _eligible(name: str, m: nn.Module) -> str | None:
    """Why Linear ``name`` stays dense, or None."""
    if any(name == s or name.endswith("." + s) for s in SKIP):
        return "output head (kept dense)"
    o, i = m.weight.shape
    if o % 64 or i % 64:
        return f"shape (out={o}, in={i}): semi-structured sparse needs multiples of 64"
    return None


def sparsify_linears_(model: nn.Module, backend: str = "auto") -> dict[str, Any]:
    """Swap every eligible ``nn.Linear`` of ``model`` for a ``SemiSparseLinear`` in place; returns
    ``{"converted": [...], "sparse": n on sparse kernels, "skipped": {name: why}}``."""
    from torchnitro.kernels.sparsity import SemiSparseLinear

    converted, skipped, sparse = [], {}, 0
    for name, m in list(model.named_modules()):
        if type(m) is not nn.Linear:
            continue
        why = _eligible(name, m)
        if why is not None:
            skipped[name] = why
            continue
        new = SemiSparseLinear(m, backend=backend)
        model.set_submodule(name, new)
        converted.append(name)
        sparse += int(new.sparse)
    return {"converted": converted, "sparse": sparse, "skipped": skipped}


def _convert(model: nn.Module, device: torch.device) -> tuple[nn.Module, dict[str, Any]]:
    model = linear_view(model).to(device=device, dtype=torch.bfloat16).eval()
    return model, sparsify_linears_(model)


@register_recipe
class Sparse24(Recipe):
    name = "sparse-2:4"
    isolated_input = "model"  # swaps modules of the model tree: needs the model object itself
    numeric_class = NumericClass.PRUNED
    description = ("OPT-IN (class 'pruned'): bf16 model, Linear weights pruned 2:4 on sparse tensor cores "
                   "(cuSPARSELt/CUTLASS)")
    gpu_only = True
    default = False  # pruning changes results: only when the user names it
    order = 45

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        return sparse_recipe_reason(hw)

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        if not any(is_linear(m) for m in model.modules()):
            return "no nn.Linear layers"
        if not any(type(m) is nn.Linear and _eligible(n, m) is None for n, m in linear_view(model).named_modules()):
            return "no nn.Linear layer with in/out features that are multiples of 64 (besides the output head)"
        return None

    def build(self, ctx: BuildContext) -> Built:
        model, meta = _convert(ctx.model, ctx.device)
        dense = len(meta["converted"]) - meta["sparse"]
        return Built(fn=FloatOutputs(model, torch.bfloat16), meta=meta,
                     notes=f"{len(meta['converted'])} Linear pruned 2:4 ({meta['sparse']} on sparse kernels"
                           + (f", {dense} dense after the sparse path was refused" if dense else "")
                           + f"), {len(meta['skipped'])} kept dense bf16")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        model = self.require_model(model)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        converted, _ = _convert(model.eval(), device)
        return FloatOutputs(converted, torch.bfloat16)
