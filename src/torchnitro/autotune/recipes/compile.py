"""torch.compile (Inductor): default and max-autotune modes; reduce-overhead (CUDA graphs) on GPU.

Not standalone: ``load`` compiles the rebuilt eager model again (Inductor's own on-disk cache makes
that faster than the first time). With dynamic dims the first call at a new size recompiles; the
search times that call separately (``first_call_ms`` in the report).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe

__all__ = ["CompileDefault", "CompileMaxAutotune", "CompileReduceOverhead"]


class _Compile(Recipe):
    mode: ClassVar[str | None] = None
    numeric_class = NumericClass.EXACT

    def _compile(self, model: nn.Module) -> Callable[..., Any]:
        return torch.compile(model, mode=self.mode)

    def build(self, ctx: BuildContext) -> Built:
        fn = self._compile(ctx.model)
        return Built(fn=fn, meta={"mode": self.mode}, notes=f"mode={self.mode or 'default'}")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return self._compile(self.require_model(model).eval())


@register_recipe
class CompileDefault(_Compile):
    name = "compile"
    description = "torch.compile, default mode (Inductor)"
    order = 30


@register_recipe
class CompileMaxAutotune(_Compile):
    name = "compile-max-autotune"
    mode = "max-autotune"
    description = "torch.compile mode=max-autotune (benchmarks GEMM/conv choices; slow to build)"
    default = False  # minutes of autotuning on a small CPU: opt in with --recipe compile-max-autotune
    order = 60


@register_recipe
class CompileReduceOverhead(_Compile):
    name = "compile-reduce-overhead"
    mode = "reduce-overhead"
    description = "torch.compile mode=reduce-overhead (CUDA graphs around the compiled graph)"
    gpu_only = True
    order = 35

    def _compile(self, model: nn.Module) -> Callable[..., Any]:
        compiled = torch.compile(model, mode=self.mode)

        def call(*xs: Any) -> Any:  # CUDA-graph outputs are overwritten by the next replay: hand out copies
            torch.compiler.cudagraph_mark_step_begin()
            out = compiled(*xs)
            return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)

        return call
