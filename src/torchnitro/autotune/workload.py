"""What a search works on: held-out and timing inputs, eager references, the recipe list, progress."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.inputs import ModelInfo, input_signature, random_like
from torchnitro.autotune.recipe import EAGER, CandidateFiles, Recipe, all_recipes, get_recipe
from torchnitro.autotune.recipes._util import output_kind
from torchnitro.autotune.report import Report
from torchnitro.autotune.verify import clone_outputs
from torchnitro.bench.timing import Timing
from torchnitro.errors import InputError

__all__ = ["Workload", "SearchOutcome", "prepare_workload", "select_recipes", "objective_stat", "objective_text",
           "SearchProgress"]


@dataclass
class Workload:
    """Inputs and eager references shared by every candidate."""

    example_inputs: tuple[Any, ...]
    held_out: list[tuple[Any, ...]]  # verification inputs (seeds differ from the timing inputs)
    references: list[list[tuple[str, Tensor]]]  # eager fp32 outputs on held_out, flattened, on CPU
    reference_raw: list[Any]
    timing_sets: list[tuple[Any, ...]]  # the example inputs first, then one set per declared size
    items_per_call: int
    output_kind: dict[str, Any]
    dynamic_dims: dict[int, list[int]]
    eager_outputs: list[tuple[str, Tensor]] = field(default_factory=list)


@dataclass
class SearchOutcome:
    report: Report
    recipe: Recipe
    fn: Callable[..., Any]
    candidate: CandidateFiles  # the chosen recipe's files (dir None: nothing on disk)
    workload: Workload
    tmp: Any = None  # TemporaryDirectory kept alive while the files are in use


def _resized(t: Tensor, dims: Sequence[int], sizes: Sequence[int]) -> Tensor:
    """``t`` repeated or cut so that its ``dims`` (those it has) take ``sizes``."""
    shape = list(t.shape)
    for d, size in zip(sorted(dims), sizes):
        if d < t.dim():
            shape[d] = int(size)
    reps = [max(1, -(-n // o)) if o else 1 for n, o in zip(shape, t.shape)]
    return t.repeat(*reps)[tuple(slice(0, n) for n in shape)]


def _resize(inputs: tuple[Any, ...], dyn: dict[int, list[int]], sizes: Sequence[int], seed: int) -> tuple[Any, ...]:
    """Random inputs like ``inputs`` whose dynamic dims take ``sizes`` (dims in order: batch, seq, ...);
    the tensors of a feature dict take its input's dims."""
    out = []
    for i, t in enumerate(inputs):
        if isinstance(t, Tensor) and i in dyn:
            out.append(_resized(t, dyn[i], sizes))
        elif isinstance(t, Mapping) and i in dyn:
            out.append({k: _resized(v, dyn[i], sizes) if isinstance(v, Tensor) else v for k, v in t.items()})
        else:
            out.append(t)
    return random_like(tuple(out), seed)


def _first_tensor(x: Any) -> Tensor | None:
    """``x`` when it is a tensor, the first tensor of a feature dict, else None."""
    if isinstance(x, Mapping):
        return next((v for v in x.values() if isinstance(v, Tensor)), None)
    return x if isinstance(x, Tensor) else None


def prepare_workload(model: nn.Module, example_inputs: tuple[Any, ...], info: ModelInfo, cfg: OptimizeConfig,
                     device: torch.device, *, recheck: bool = False) -> Workload:
    """Held-out and timing inputs plus eager references. ``recheck``: one held-out set only, for
    re-checking a cached winner (the full search already verified every size)."""
    dyn = cfg.dynamic_dims if cfg.dynamic_dims is not None else dict(info.dynamic_dims)
    first = next((f for f in map(_first_tensor, example_inputs) if f is not None), None)
    base = [int(first.shape[d]) for d in sorted(dyn.get(0, [])) if d < first.dim()] if first is not None else []

    def make(sizes: Sequence[int], seed: int) -> tuple[Any, ...]:
        if info.make_inputs is not None and len(sizes) >= 1:
            return tuple(info.make_inputs(int(sizes[0]), int(sizes[1]) if len(sizes) > 1 else (info.seq or 0), seed))
        return _resize(example_inputs, dyn, sizes, seed)

    n_held = 1 if recheck else cfg.held_out
    held = [make(base, cfg.seed + k) if base else random_like(example_inputs, cfg.seed + k) for k in range(n_held)]
    if base and not recheck:  # one smaller size too: a candidate that baked the example's shape in fails here, not in serving
        held.append(make([max(1, b // 2) for b in base], cfg.seed + 99))
    for k, shape in enumerate([] if recheck else cfg.shapes):
        held.append(make(shape, cfg.seed + 200 + k))
    timing_sets = [example_inputs] + [make(shape, 0) for shape in cfg.shapes]
    to = lambda xs: tuple(x.to(device) if isinstance(x, Tensor) else x for x in xs)  # noqa: E731
    held = [to(h) for h in held]
    timing_sets = [to(s) for s in timing_sets]
    refs, raws = [], []
    with torch.inference_mode():
        try:  # recheck: the first held-out set doubles as the probe of the output structure
            eager_out = model(*(held[0] if recheck else timing_sets[0]))
        except Exception as exc:
            raise InputError(
                f"the model raised {type(exc).__name__}: {exc} on its example inputs ({input_signature(example_inputs)}); "
                "expected it to run in eval mode on them. Check the input shapes/dtypes (--input SHAPE:DTYPE) "
                "or the model factory.") from exc
        kind = output_kind(eager_out)
        if not kind["names"]:
            raise InputError(f"the model returned {type(eager_out).__name__} with no tensors; expected tensor outputs: "
                             "a tensor, or a tuple, list, dict, dataclass or HF ModelOutput holding tensors")
        eager_flat = clone_outputs(eager_out)
        for i, h in enumerate(held):
            raw = eager_out if (recheck and i == 0) else model(*h)
            refs.append(eager_flat if (recheck and i == 0) else clone_outputs(raw))
            raws.append(raw)
    items = sum(int(s[0].shape[0]) if isinstance(s[0], Tensor) and s[0].dim() else 1 for s in timing_sets)
    return Workload(timing_sets[0], held, refs, raws, timing_sets, items, kind, dyn, eager_flat)


def select_recipes(cfg: OptimizeConfig) -> list[Recipe]:
    """Recipes to try, eager first. Unknown names raise RecipeError listing the known ones."""
    if cfg.recipes is not None:
        chosen = [get_recipe(n) for n in cfg.recipes]
    else:
        chosen = [r for r in all_recipes() if r.default]
    for n in cfg.exclude:
        get_recipe(n)
    chosen = [r for r in chosen if r.name not in cfg.exclude and r.name != EAGER]
    return [get_recipe(EAGER)] + sorted(chosen, key=lambda r: (r.order, r.name))


def objective_stat(t: dict[str, Any] | Timing, cfg: OptimizeConfig) -> float:
    """Seconds per call of the objective statistic (throughput ranks like p50 at a fixed batch)."""
    d = t.to_dict() if isinstance(t, Timing) else t
    return d["p99_s"] if (cfg.objective == "latency" and cfg.percentile == "p99") else d["median_s"]


def objective_text(cfg: OptimizeConfig, wl: Workload) -> str:
    sizes = " + ".join(input_signature(s) for s in wl.timing_sets)
    if cfg.objective == "throughput":
        return f"throughput (items/s) on {sizes}"
    return f"latency {cfg.percentile} on {sizes}"


class SearchProgress:
    """The search's progress bar: on a terminal, and in a Jupyter notebook (rich draws it there through
    ipywidgets, and asks for it when it is missing); nothing when the output is a file or a pipe."""

    def __init__(self, show: bool, total: int):
        self.p = None
        if not show:
            return
        from rich.console import Console

        console = Console(stderr=True)
        if sys.stderr.isatty() or console.is_jupyter:
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.p = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                              console=console, transient=True)
            self.p.start()
            self.task = self.p.add_task("optimize", total=total)

    def step(self, text: str, advance: int = 0) -> None:
        if self.p is not None:
            self.p.update(self.task, description=text, advance=advance)

    def close(self) -> None:
        if self.p is not None:
            self.p.stop()
