"""TorchScript: trace, freeze (constants folded into the graph), optimize_for_inference (Conv+BN
folding, MKLDNN layout choices on CPU). Standalone: the artifact loads without the model's code.
A model called with a feature dict (a SentenceTransformer) is traced as its flat tensors
(``program._flat_model``, as the ONNX export is) and called back through the saved layout."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.failure import clean_line
from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe, register_recipe
from torchnitro.autotune.recipes._layout import is_flat
from torchnitro.autotune.recipes._util import output_kind, restructure

__all__ = ["TorchScript"]


class _FlatOut(nn.Module):
    """The model with its outputs as a flat tuple of tensors: a trace returns no None, namedtuple or HF
    ModelOutput class (it failed on ``(y, None)`` and gave a namedtuple back as a plain tuple)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs: Any) -> tuple[torch.Tensor, ...]:
        out = self.model(*inputs)
        vals = out.values() if isinstance(out, dict) else out
        return tuple(v for v in vals if v is not None)


class _Rebuilt:
    """A flat-output TorchScript module called like the model: eager's structure rebuilt by ``output_kind``."""

    def __init__(self, module: Any, kind: dict[str, Any]):
        self.module, self.kind = module, kind

    def __call__(self, *inputs: Any) -> Any:
        return restructure(self.kind, list(self.module(*inputs)))


def _flat_kind(model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any] | None:
    """``output_kind`` of an output a trace would lose (a class or a None in a tuple) whose values are all
    tensors or None, so flattening it is exact; None otherwise (traced as it is)."""
    out = model(*inputs)
    if isinstance(out, torch.Tensor):
        return None
    kind = output_kind(out)
    vals = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, (tuple, list)) else [0]
    flat = all(v is None or isinstance(v, torch.Tensor) for v in vals)
    return kind if flat and ("class" in kind or "nones" in kind) else None


def _save_loadable(path: Path, fast: Any, note: str, traced: Any) -> tuple[Any, str]:
    """Save ``fast`` (frozen) where ``torch.jit.load`` reads it back, else the plain trace, with the note saying
    why: a frozen graph can hold a constant its own loader refuses ("required keyword attribute 'value' is
    undefined", an HF ViT), and an artifact that does not load is no result."""
    why = ""
    for program in (fast, traced):
        torch.jit.save(program, str(path))
        try:
            torch.jit.load(str(path), map_location="cpu")
        except Exception as exc:  # noqa: BLE001 - the loader's own error, reported in the note or the failure
            why = clean_line(f"{type(exc).__name__}: {exc}", 160)
            continue
        return program, note if program is fast else f"not frozen: the frozen program does not load back ({why})"
    raise RuntimeError(f"the traced program does not load back from its file ({why})")


@register_recipe
class TorchScript(Recipe):
    name = "torchscript"
    numeric_class = NumericClass.EXACT
    description = "torch.jit.trace + freeze + optimize_for_inference"
    order = 10

    def build(self, ctx: BuildContext) -> Built:
        from torchnitro.autotune.program import _flat_model, _Restructured

        with warnings.catch_warnings(), torch.inference_mode(False), torch.no_grad():
            warnings.simplefilter("ignore")
            layout, inputs = None, ctx.example_inputs
            if not is_flat(inputs):  # a feature dict (a SentenceTransformer): traced as its flat tensors
                model, inputs, _, pmeta = _flat_model(ctx.model, inputs, ctx.dynamic_dims)
                kind, layout = pmeta["output_kind"], pmeta["input_layout"]
            else:
                kind = _flat_kind(ctx.model, inputs)
                model = ctx.model if kind is None else _FlatOut(ctx.model)
            traced = torch.jit.trace(model, inputs, check_trace=False, strict=False)
            frozen = torch.jit.freeze(traced.eval())
            try:
                fast = torch.jit.optimize_for_inference(frozen)
            except Exception as exc:  # noqa: BLE001 - some graphs refuse the extra passes; freezing still helps
                fast, note = frozen, f"optimize_for_inference skipped: {type(exc).__name__}"
            else:
                note = ""
        path = ctx.workdir / "model.ts"
        fast, note = _save_loadable(path, fast, note, traced)
        meta = {} if kind is None else {"output_kind": kind}
        if layout is not None:
            meta["input_layout"] = layout
            return Built(fn=_Restructured(fast, kind, layout), files=["model.ts"], meta=meta, standalone=True,
                         notes=note)
        return Built(fn=fast if kind is None else _Rebuilt(fast, kind), files=["model.ts"], meta=meta,
                     standalone=True, notes=note)

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = torch.jit.load(str(directory / "model.ts"), map_location="cpu").eval()
        if meta.get("input_layout") is not None:
            from torchnitro.autotune.program import _Restructured

            return _Restructured(module, meta.get("output_kind"), meta["input_layout"])
        return module if meta.get("output_kind") is None else _Rebuilt(module, meta["output_kind"])
