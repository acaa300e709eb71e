"""Timing the finalists the way they will run: the rules the final comparison follows.

- A candidate whose recipe is ``isolate=True`` (its own native runtime: ONNX Runtime, OpenVINO) and
  whose artifact is standalone is timed alone, in a fresh child process that loads the artifact
  from its directory (``Recipe.load(dir, meta, None)``) and the timing inputs from a tensor file:
  the search process never creates that runtime's session, so its thread pool cannot steal the
  cores from eager (``bench.isolated.ChildTimer``; rounds alternate eager here and the candidate there).
- Eager's p50 inside the comparison must match eager alone (its search-time p50, measured before any
  candidate ran) within ``max(5%, 2 x eager's cv)``, at most 25%; otherwise the comparison is redone
  once after ``SETTLE_S`` and the report says so (``check_eager``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from torchnitro.autotune.recipe import Recipe
from torchnitro.bench.isolated import ChildTimer
from torchnitro.bench.timing import Timing

__all__ = ["runs_alone", "start_alone", "load_standalone", "EagerCheck", "check_eager", "SETTLE_S", "MIN_BAND",
           "MAX_BAND"]

SETTLE_S = 2.0  # pause before redoing a comparison whose eager drifted (let a burst of other load pass)
MIN_BAND = 0.05  # eager inside the comparison may differ from eager alone by this much, or 2 x its cv
MAX_BAND = 0.25  # ... but never more: past that, eager alone was too noisy to vouch for the comparison


def runs_alone(recipe: Recipe, standalone: bool) -> bool:
    """Whether the final comparison times this candidate in its own process."""
    return bool(recipe.isolate) and standalone


def load_standalone(recipe: str, directory: str, meta: dict[str, Any]) -> Callable[..., Any]:
    """Child side: ``module:qualname`` of the recipe class -> its artifact loaded without the user's model."""
    mod, _, qual = recipe.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj().load(Path(directory), meta, None)


def start_alone(recipe: Recipe, directory: Path, meta: dict[str, Any], inputs: Path, *, threads: int,
                device: str) -> ChildTimer:
    """Start the child process that times ``recipe``'s artifact in ``directory`` (returns at once)."""
    cls = type(recipe)
    return ChildTimer("torchnitro.autotune.fair:load_standalone",
                      {"recipe": f"{cls.__module__}:{cls.__qualname__}", "directory": str(directory), "meta": meta},
                      inputs, threads=threads, device=device, log=inputs.parent / f"_timing_{recipe.name}.log")


@dataclass(frozen=True)
class EagerCheck:
    """Eager alone against eager inside the comparison."""

    alone_ms: float  # eager's search-time p50, measured before any candidate ran
    inside_ms: float  # eager's p50 inside the comparison
    band: float  # allowed relative difference

    @property
    def drift(self) -> float:
        return self.inside_ms / self.alone_ms - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.drift) <= self.band

    def text(self) -> str:
        return (f"eager p50 alone {self.alone_ms:.3f} ms, inside the comparison {self.inside_ms:.3f} ms "
                f"({self.drift:+.1%}; allowed ±{self.band:.1%})")


def check_eager(alone_ms: float, alone_cv: float | None, inside: Timing) -> EagerCheck:
    """Compare eager's p50 inside the comparison with eager alone; the band is ``max(5%, 2 x cv)`` of eager
    alone, at most 25%."""
    if not alone_ms or alone_ms <= 0:
        from torchnitro.errors import InputError

        raise InputError(f"eager's p50 alone must be a positive number of ms; received {alone_ms!r}")
    return EagerCheck(alone_ms, inside.median * 1e3, min(MAX_BAND, max(MIN_BAND, 2.0 * (alone_cv or 0.0))))
