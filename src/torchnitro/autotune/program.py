"""Self-contained programs for isolated candidates: built from the model in the search's process, loaded
in the child without any class of the user's.

A child process never unpickles the user's model: a model defined in a script without a main guard,
in a notebook, or holding lambdas cannot be rebuilt there, and re-running the user's script to find
its classes would re-run everything in it. Instead the parent hands over one of:

- ``exported``: ``torch.export`` (non-strict, the declared dynamic dims as ``Dim.AUTO``) saved with
  ``torch.export.save``; where export fails, a ``torch.jit.trace`` saved with ``torch.jit.save``
  (kind ``torchscript``). The child's ``ctx.model`` is the loaded module.
- ``onnx``: the ONNX export the ONNX Runtime recipes consume (``recipes.onnx.export_onnx``), made once
  and shared by every recipe that asks for it.
"""

from __future__ import annotations

import copy
import inspect
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchnitro.autotune.failure import Failure, clean_line
from torchnitro.autotune.limits import time_limit, timed_out
from torchnitro.autotune.recipe import Program, Recipe
from torchnitro.autotune.recipes._layout import FlatProgram, flat_call, input_layout, is_flat
from torchnitro.autotune.recipes._util import output_kind, restructure
from torchnitro.autotune.verify import flatten_outputs
from torchnitro.errors import RecipeError

__all__ = ["ISOLATED_INPUTS", "prepare_program", "load_program", "export_flat", "isolation", "Programs"]

ISOLATED_INPUTS = ("exported", "onnx", "model")  # the values of Recipe.isolated_input


def _first_line(exc: BaseException) -> str:
    return clean_line(f"{type(exc).__name__}: {exc}", limit=100)  # two of them fit one reason


class _FlatOutputs(nn.Module):
    """The model with its outputs as a flat tuple of tensors. A saved program then names no output class
    (an HF ``ModelOutput`` is a registered pytree type: loading a program that returns one fails in a child
    that has not imported its library); ``load_program`` rebuilds the structure from ``output_kind``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.train(model.training)  # an exporter may trace dropout by the root's mode

    def forward(self, *inputs: Any) -> tuple[torch.Tensor, ...]:
        return tuple(t for _, t in flatten_outputs(self.model(*inputs)))


class _Restructured(nn.Module):
    """A loaded flat program called like the model: structured inputs flattened by the saved layout
    (a feature dict), eager's output structure rebuilt (dicts by name, as ONNX runners do)."""

    def __init__(self, module: nn.Module, kind: dict[str, Any] | None, layout: Any = None):
        super().__init__()
        self.module, self.kind, self.layout = module, kind, layout

    def forward(self, *inputs: Any) -> Any:
        out = self.module(*flat_call(self.layout, inputs))
        if self.kind is None:
            return out
        return restructure(self.kind, list(out) if isinstance(out, (tuple, list)) else [out])


def _flat_model(model: nn.Module, inputs: tuple[Any, ...],
                dynamic_dims: dict[int, list[int]]) -> tuple[nn.Module, tuple[Any, ...], dict[int, list[int]], dict]:
    """What is exported: the model itself (tensor inputs, tensor output), else ``FlatProgram`` / ``_FlatOutputs``
    with flat tensors in and out; the flat inputs, their dynamic dims, and the program's meta."""
    if is_flat(inputs):
        out = model(*inputs)
        if isinstance(out, torch.Tensor) or not flatten_outputs(out):
            # nothing to flatten (a tensor keeps the model's own names; an output holding no tensor is
            # exported as it is, so the exporters name what they cannot take)
            return model, inputs, dynamic_dims, {}
        return _FlatOutputs(model), inputs, dynamic_dims, {"output_kind": output_kind(out)}
    layout, out = input_layout(model, inputs)
    return (FlatProgram(model, layout), tuple(layout.take(inputs)), layout.dynamic_dims(inputs, dynamic_dims),
            {"output_kind": output_kind(out), "input_layout": layout.to_meta()})


def packs_args(module: nn.Module) -> bool:
    """True when ``module.forward`` takes its inputs as ``*args`` (a user's ``forward(self, *xs)``, an adapter):
    torch.export then takes their dynamic shapes nested in one tuple, as that one parameter."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return bool(params) and params[0].kind == inspect.Parameter.VAR_POSITIONAL


def _save_export(model: nn.Module, module: nn.Module, flat: tuple[Any, ...], dims: dict[int, list[int]],
                 path: Path) -> None:
    from torch.export import Dim

    shapes = tuple({d: Dim.AUTO for d in dims.get(i, [])} if isinstance(x, torch.Tensor) else None
                   for i, x in enumerate(flat))
    # a wrapper's forward(*inputs): the shapes of the packed positional inputs are one nested tuple
    nest = module is not model or packs_args(module)
    ep = torch.export.export(module, flat, dynamic_shapes=(shapes,) if nest else shapes, strict=False)
    torch.export.save(ep, str(path))


def export_flat(model: nn.Module, inputs: tuple[Any, ...], dynamic_dims: dict[int, list[int]],
                path: Path) -> dict[str, Any]:
    """``torch.export`` ``model`` to ``path`` as a child's program is made (structured inputs and outputs
    flattened, the declared dynamic dims as ``Dim.AUTO``); returns the meta ``load_program`` rebuilds the
    model's call and outputs from. Raises what the exporter raises."""
    module, flat, dims, meta = _flat_model(model, inputs, dynamic_dims)
    _save_export(model, module, flat, dims, path)
    return meta


def _export(model: nn.Module, inputs: tuple[Any, ...], dynamic_dims: dict[int, list[int]], directory: Path) -> Program:
    module, flat, dims, meta = _flat_model(model, inputs, dynamic_dims)
    try:
        path = directory / "model.pt2"
        _save_export(model, module, flat, dims, path)
        return Program("exported", path, meta)
    except Exception as exc:  # noqa: BLE001 - TorchScript next
        export_error = _first_line(exc)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(module, flat, check_trace=False, strict=False)
        path = directory / "model.ts"
        torch.jit.save(traced, str(path))
        return Program("torchscript", path, {**meta, "export_error": export_error})
    except Exception as exc:  # noqa: BLE001 - both named in the reason
        raise RecipeError(f"the model could not be exported for the isolated process (torch.export: {export_error}; "
                          f"TorchScript: {_first_line(exc)})") from exc


def prepare_program(kind: str, model: nn.Module, inputs: tuple[Any, ...], dynamic_dims: dict[int, list[int]],
                    directory: Path) -> Program:
    """Build the program of ``kind`` ('exported' or 'onnx') from ``model`` in ``directory``.
    Raises RecipeError naming what failed."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "exported":
        with torch.no_grad():
            return _export(model, inputs, dynamic_dims, directory)
    if kind == "onnx":
        from torchnitro.autotune.recipes.onnx import export_onnx

        path = directory / "model.onnx"
        return Program("onnx", path, export_onnx(model, inputs, path, dynamic_dims))
    raise RecipeError(f"isolated_input: received {kind!r}, expected one of {list(ISOLATED_INPUTS[:2])} "
                      "(or 'model' for a recipe that runs in the search's process)")


def load_program(program: Program) -> nn.Module | None:
    """The module a child's ``ctx.model`` is: the exported or traced program; None for ONNX."""
    if program.kind == "exported":
        module = torch.export.load(str(program.path)).module()
    elif program.kind == "torchscript":
        module = torch.jit.load(str(program.path)).eval()
    else:
        return None
    kind, layout = program.meta.get("output_kind"), program.meta.get("input_layout")
    return module if kind is None and layout is None else _Restructured(module, kind, layout)


def isolation(r: Recipe, isolate_all: bool) -> tuple[bool, str | None]:
    """Whether ``r`` runs in a child process, and the report note when it cannot although asked to."""
    if r.name == "eager" or not (r.isolate or isolate_all):
        return False, None
    if r.isolated_input == "model":
        return False, (f"{r.name} builds from the model object itself (isolated_input='model'), which never "
                       "crosses a process boundary, so it ran in this process")
    if type(r).__module__ == "__main__":
        return False, (f"{r.name} is a recipe class defined in the running script, which a child process does not "
                       "import, so it ran in this process; define it in an importable module to isolate it")
    return True, None


class Programs:
    """The programs of one search: each kind prepared on first request, then shared by every recipe
    that asks for it (its failure too, so a model that does not export fails each recipe in one line)."""

    def __init__(self, model: nn.Module, inputs: tuple[Any, ...], dynamic_dims: dict[int, list[int]],
                 directory: Path):
        self.model, self.inputs, self.dynamic_dims, self.directory = model, inputs, dynamic_dims, directory
        self.done: dict[str, tuple[Program | Failure, float]] = {}  # kind -> program or failure, seconds

    def get(self, kind: str, limit_s: float, remaining_s: float) -> tuple[Program | Failure, float]:
        """The program of ``kind`` and the seconds its preparation took (once per search). Preparing runs under ``min(limit_s, remaining_s)``; cut by the budget it is a budget
        Failure and is tried again by the next recipe that asks."""
        if kind in self.done:
            return self.done[kind]
        t0 = time.perf_counter()
        cap = min(limit_s, remaining_s)
        try:
            with time_limit(cap):
                out: Program | Failure = prepare_program(kind, copy.deepcopy(self.model), self.inputs,
                                                         self.dynamic_dims, self.directory / kind)
        except Exception as exc:  # noqa: BLE001 - the candidate's reason
            if timed_out(exc) is None:
                out = Failure.from_exception(exc)
            elif remaining_s < limit_s:  # an exporter may have wrapped the timeout in an error of its own
                return Failure("", f"budget: preparing the {kind} program took the {cap:.1f} s left of the search "
                                   "budget (raise budget_s)", budget=True), time.perf_counter() - t0
            else:
                out = Failure("", f"preparing the {kind} program for the child process ran past its {cap:.0f} s "
                                  "limit")
        self.done[kind] = (out, time.perf_counter() - t0)
        return self.done[kind]
