"""The recipe interface and registry of ``torchnitro.autotune`` (the engine behind ``torchnitro.optimize``).

A recipe turns an eager fp32 model into a candidate: something callable like the model. It says
whether it can run on this machine (``unavailable_reason``) and whether it fits this model
(``inapplicable_reason``), declares its numerical class (which sets the default verification
tolerance), builds the candidate, and saves/loads it as an artifact.

Recipes register with ``@register_recipe``; ``get_recipe("name")`` raises ``RecipeError`` naming
the unknown key and listing the known ones.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from torchnitro.errors import RecipeError
from torchnitro.hardware import HardwareInfo

__all__ = [
    "EAGER", "NumericClass", "Program", "BuildContext", "CandidateFiles", "Built", "Recipe", "register_recipe",
    "get_recipe", "list_recipes", "all_recipes", "unregister_recipe",
]


EAGER = "eager"  # the baseline recipe: always a candidate, the reference the others are checked against


class NumericClass(str, enum.Enum):
    """How far a recipe's numerics may drift from eager fp32; sets the default gate."""

    EXACT = "exact"  # same math up to float reassociation: rel error <= 1e-4
    REDUCED = "reduced"  # bf16/fp16: cosine >= 0.999
    INT8 = "int8"  # quantized: cosine >= 0.99
    PRUNED = "pruned"  # weights pruned (2:4): opt-in only (recipes of this class have default = False); cosine >= 0.9


@dataclass
class Program:
    """A self-contained program built from the model in the search's process, for a recipe that runs in
    a child process: no class of the user's crosses the process boundary (see ``Recipe.isolated_input``)."""

    kind: str  # 'exported' (torch.export.save), 'torchscript' (torch.jit.save) or 'onnx' (an ONNX file)
    path: Path
    meta: dict[str, Any] = field(default_factory=dict)  # JSON-safe, e.g. the ONNX export's output structure


@dataclass
class BuildContext:
    """Everything a recipe needs to build one candidate."""

    model: nn.Module  # a private deep copy of the user's model, eval mode, fp32; the recipe may mutate it
    # (in a child process: the loaded 'exported'/'torchscript' program; None for an 'onnx' recipe)
    example_inputs: tuple[Any, ...]  # inputs the model runs on (also the shapes to specialise for)
    hardware: HardwareInfo
    device: torch.device
    workdir: Path  # empty directory for this candidate's files (ONNX graphs, TorchScript, ...)
    dynamic_dims: dict[int, list[int]] = field(default_factory=dict)  # input index -> dims that vary
    config: Any = None  # the OptimizeConfig of the search (threads, budget, ...)
    program: Program | None = None  # in a child process: what the recipe's isolated_input asked for (else None)


@dataclass
class CandidateFiles:
    """A candidate's files and what loading them needs: one record from the build to the artifact and back."""

    dir: Path | None = None  # folder holding ``files`` (None: nothing on disk)
    files: list[str] = field(default_factory=list)  # paths relative to ``dir``: the artifact's candidate/ folder
    meta: dict[str, Any] = field(default_factory=dict)  # whatever ``Recipe.load`` needs (JSON-serialisable)
    standalone: bool = False  # True when ``Recipe.load`` needs no eager model (TorchScript, ONNX, ...)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (an entry of the search cache)."""
        return {"dir": str(self.dir or ""), "files": list(self.files), "meta": self.meta, "standalone": self.standalone}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CandidateFiles:
        return cls(Path(d["dir"]) if d["dir"] else None, list(d["files"]), dict(d["meta"]), bool(d["standalone"]))

    def load(self, recipe: Recipe, eager: nn.Module | None) -> Callable[..., Any]:
        """The candidate rebuilt by ``recipe``; a recipe that rebuilds from the eager model gets a private
        copy of ``eager`` (it may convert it: bf16, int8), so the caller's stays fp32 for saving."""
        model = None if self.standalone or eager is None else copy.deepcopy(eager)
        return recipe.load(self.dir, self.meta, model)  # type: ignore[arg-type]


@dataclass
class Built:
    """A built candidate."""

    fn: Callable[..., Any]  # call like the model: fn(*inputs) -> outputs (same structure as eager)
    files: list[str] = field(default_factory=list)  # files in workdir that form the artifact
    meta: dict[str, Any] = field(default_factory=dict)  # whatever ``load`` needs (JSON-serialisable)
    standalone: bool = False  # True when ``load`` needs no user model code (TorchScript, ONNX, ...)
    notes: str = ""  # shown in the report (e.g. "12/48 layers kept in fp32")

    def files_in(self, workdir: Path) -> CandidateFiles:
        """The record of this candidate's files, which the build wrote into ``workdir``."""
        return CandidateFiles(workdir, list(self.files), dict(self.meta), self.standalone)


class Recipe:
    """Base class. Subclasses set the class attributes and implement ``build`` and ``load``."""

    name: ClassVar[str]
    numeric_class: ClassVar[NumericClass] = NumericClass.EXACT
    description: ClassVar[str] = ""
    isolate: ClassVar[bool] = False  # build and first call in a subprocess (native code that may crash)
    # what build() needs in that subprocess, prepared once per search in the parent and shared: 'exported'
    # (ctx.model is the torch.export program's module, a TorchScript trace where export fails), 'onnx'
    # (ctx.program is the ONNX export), or 'model' (the model object itself: never sent to another
    # process, so the recipe runs in the search's process even under isolate_all)
    isolated_input: ClassVar[str] = "exported"
    gpu_only: ClassVar[bool] = False
    default: ClassVar[bool] = True  # part of a search with no explicit recipe list (False: slow, opt in by name)
    order: ClassVar[int] = 50  # search order, low first (cheap and likely winners early, for the budget)
    version: ClassVar[str] = "1"  # bump when the variant a recipe builds changes: its cached results are then stale

    def unavailable_reason(self, hw: HardwareInfo) -> str | None:
        """None when the recipe can run on this machine, else a one-line reason."""
        if self.gpu_only and not hw.has_gpu:
            return "needs a CUDA GPU; none is visible"
        return None

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        """None when the recipe fits this model, else a one-line reason (e.g. 'no Conv2d layers')."""
        return None

    def build(self, ctx: BuildContext) -> Built:
        raise NotImplementedError

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        """Rebuild a saved candidate from ``directory``; ``model`` is the rebuilt eager model when
        the artifact is not standalone (state dict + factory), else None."""
        raise NotImplementedError

    def require_model(self, model: nn.Module | None) -> nn.Module:
        """``model`` for ``load`` of a recipe that rebuilds from the eager model; raises if it is missing."""
        if model is None:
            raise RecipeError(f"{self.name} artifacts are rebuilt from the eager model; pass it to load(), "
                              "e.g. torchnitro.load(dir, model=MyModel(), replace_weights=True) for a fresh instance")
        return model


_REGISTRY: dict[str, Recipe] = {}


def unregister_recipe(name: str) -> None:
    """Remove a recipe (tests register throw-away recipes and remove them afterwards)."""
    _REGISTRY.pop(name, None)


def register_recipe(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: instantiate and register a recipe under ``cls.name``."""
    name = getattr(cls, "name", None)
    if not name:
        raise TypeError(f"{cls.__name__} has no 'name'")
    if name in _REGISTRY:
        raise ValueError(f"recipe {name!r} is already registered by {type(_REGISTRY[name]).__name__}")
    _REGISTRY[name] = cls()
    return cls


def _ensure_loaded() -> None:
    import torchnitro.autotune.recipes  # noqa: F401  (registers the built-in recipes)


def get_recipe(name: str) -> Recipe:
    _ensure_loaded()
    if name not in _REGISTRY:
        raise RecipeError(f"unknown recipe {name!r}; known recipes: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def list_recipes() -> list[str]:
    _ensure_loaded()
    return list(_REGISTRY)


def all_recipes() -> list[Recipe]:
    _ensure_loaded()
    return list(_REGISTRY.values())
