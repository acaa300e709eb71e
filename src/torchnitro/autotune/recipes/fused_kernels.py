"""The ``fused-kernels`` recipe: swap norms, activations and gated MLPs for Triton kernels, and hand
attention to the attention policy (``kernels.attention_policy``: torch SDPA unless the call needs a
sliding window or a one-time measurement on this GPU shows our flash kernel faster), so the candidate
never runs slower attention than the eager model.

GPU only: on CPU the fused modules run their PyTorch references, so the candidate would be the
eager model again. Numerics are EXACT up to float reassociation (same dtype, fp32 accumulation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from torch import nn

from torchnitro.autotune.recipe import Built, BuildContext, NumericClass, Recipe, register_recipe
from torchnitro.hardware import HardwareInfo

__all__ = ["FusedKernelsRecipe"]


@register_recipe
class FusedKernelsRecipe(Recipe):
    name = "fused-kernels"
    isolated_input = "model"  # rewrites modules of the model tree: needs the model object itself
    numeric_class = NumericClass.EXACT
    description = ("Triton RMSNorm/LayerNorm/GELU/SwiGLU/Linear+GELU via kernels.patch_; attention on SDPA or our "
                   "flash kernel, whichever the attention policy measures faster")
    gpu_only = True

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        reason = super().unavailable_reason(hw)
        if reason:
            return f"{reason} (on CPU the fused modules fall back to the eager PyTorch ops)"
        from torchnitro.kernels._triton import triton_importable

        if not triton_importable():
            return "the 'triton' package does not import; pip install 'torchnitro[gpu]'"
        return None

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        from torchnitro.kernels.patch import count_patchable

        if count_patchable(model) == 0 and not hasattr(model, "set_attn_implementation"):
            return "no LayerNorm/RMSNorm/GELU/gated-MLP/attention modules that kernels.patch_ recognises"
        return None

    def build(self, ctx: BuildContext) -> Built:
        from torchnitro.kernels.patch import patch_

        model = ctx.model.to(ctx.device)
        summary = patch_(model)
        from torchnitro.kernels.attention_policy import policy_summary

        return Built(fn=model, meta={"replaced": dict(summary.replaced), "attention_policy": policy_summary()},
                     notes=f"{summary.total} modules fused" + (f"; {summary.attention}" if summary.attention else ""))

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        from torchnitro.kernels.patch import patch_

        model = self.require_model(model)
        patch_(model)
        return model
