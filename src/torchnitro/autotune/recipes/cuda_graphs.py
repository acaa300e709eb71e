"""CUDA graphs: capture the eager model once per input shape into static buffers and replay it.

Replay removes per-kernel launch overhead (the win for small batches). Inputs are copied into the
static input buffers; outputs live in static buffers that the next replay overwrites, so every call
returns copies (the gate calls each candidate twice and compares to catch exactly that bug).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe

__all__ = ["CudaGraphs", "GraphedModule"]


class GraphedModule:
    """One captured CUDA graph per distinct input signature (shapes, dtypes)."""

    def __init__(self, model: nn.Module, max_graphs: int = 8, warmup: int = 3):
        self.model, self.max_graphs, self.warmup = model, max_graphs, warmup
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, list[Tensor], Any]] = {}
        self.pool = None

    def _capture(self, xs: tuple[Any, ...]) -> tuple[torch.cuda.CUDAGraph, list[Tensor], Any]:
        static_in = [x.clone() if isinstance(x, Tensor) else x for x in xs]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(self.warmup):  # lazy init (cuBLAS handles, autotuning) must not be captured
                self.model(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), torch.inference_mode():
            static_out = self.model(*static_in)
        self.pool = graph.pool()
        return graph, static_in, static_out

    def __call__(self, *xs: Any) -> Any:
        key = tuple((tuple(x.shape), x.dtype) if isinstance(x, Tensor) else repr(x) for x in xs)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.max_graphs:  # too many shapes: run eagerly rather than capture forever
                return self.model(*xs)
            entry = self.graphs[key] = self._capture(xs)
        graph, static_in, static_out = entry
        for dst, src in zip(static_in, xs):
            if isinstance(dst, Tensor):
                dst.copy_(src, non_blocking=True)
        graph.replay()
        return torch.utils._pytree.tree_map(lambda t: t.clone() if isinstance(t, Tensor) else t, static_out)


@register_recipe
class CudaGraphs(Recipe):
    name = "cuda-graphs"
    numeric_class = NumericClass.EXACT
    description = "CUDA graph capture/replay per input shape (static buffers, outputs copied)"
    gpu_only = True
    order = 32

    def build(self, ctx: BuildContext) -> Built:
        return Built(fn=GraphedModule(ctx.model), notes="one graph per input shape (max 8)")

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return GraphedModule(self.require_model(model).cuda().eval())
