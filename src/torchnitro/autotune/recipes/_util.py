"""Small helpers shared by the built-in recipes (no recipes here)."""

from __future__ import annotations

from typing import Any, Callable

import copy
import dataclasses
import sys

import torch
from torch import Tensor, nn

__all__ = ["cast_floats", "has_module", "restructure", "output_kind", "FloatOutputs", "is_hf_conv1d", "is_linear",
           "linear_view"]


def cast_floats(xs: tuple[Any, ...], dtype: torch.dtype) -> tuple[Any, ...]:
    """Cast floating-point tensors to ``dtype``; integer inputs (token ids, masks) stay as they are."""
    return tuple(x.to(dtype) if isinstance(x, Tensor) and x.is_floating_point() else x for x in xs)


def _to_fp32(out: Any) -> Any:
    if isinstance(out, Tensor):
        return out.float() if out.is_floating_point() else out
    if isinstance(out, tuple):
        return tuple(_to_fp32(o) for o in out)
    if isinstance(out, list):
        return [_to_fp32(o) for o in out]
    if isinstance(out, dict):
        vals = {k: _to_fp32(v) for k, v in out.items()}
        if type(out) is dict:
            return vals
        new = copy.copy(out)  # its own class: an HF ModelOutput keeps its fields (a user reads .logits)
        for k, v in vals.items():
            new[k] = v
        return new
    return out


class FloatOutputs:
    """Call ``model`` with floating inputs cast to ``dtype``; return float32 outputs like eager."""

    def __init__(self, model: Callable[..., Any], dtype: torch.dtype):
        self.model, self.dtype = model, dtype

    def __call__(self, *xs: Any) -> Any:
        return _to_fp32(self.model(*cast_floats(xs, self.dtype)))


def has_module(model: nn.Module, kinds: tuple[type, ...]) -> bool:
    return any(isinstance(m, kinds) for m in model.modules())


def is_hf_conv1d(m: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's projections): a Linear whose weight is stored
    ``(in, out)``; found by class, so transformers is never imported here."""
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers.")
            and isinstance(w, Tensor) and w.dim() == 2)


def is_linear(m: nn.Module) -> bool:
    """An ``nn.Linear`` or an HF ``Conv1D`` (the same math): what the int8 recipes quantise."""
    return type(m) is nn.Linear or is_hf_conv1d(m)


def linear_view(model: nn.Module) -> nn.Module:
    """``model`` itself when it has no HF ``Conv1D``; else a copy with each ``Conv1D`` replaced by the
    ``nn.Linear`` it is (weight transposed, same output up to float reassociation), so recipes that
    select ``nn.Linear`` (int8, oneDNN) see GPT-2's projections too."""
    names = [n for n, m in model.named_modules() if n and is_hf_conv1d(m)]
    if not names:
        return model
    out = copy.deepcopy(model)
    for n in names:
        conv = out.get_submodule(n)
        nx, nf = conv.weight.shape  # (in, out)
        lin = nn.Linear(nx, nf, bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(conv.weight.t())  # (out, in)
            if conv.bias is not None:
                lin.bias.copy_(conv.bias)
        out.set_submodule(n, lin)
    return out


def output_kind(out: Any) -> dict[str, Any]:
    """Describe the eager output structure (JSON-safe) so flat runtimes (ONNX) can rebuild it."""
    from torchnitro.autotune.verify import flatten_outputs

    names = [n for n, _ in flatten_outputs(out)]
    if isinstance(out, Tensor):
        return {"kind": "tensor", "names": names}
    cls = type(out)
    named = {} if cls in (dict, tuple, list) else {"class": f"{cls.__module__}:{cls.__qualname__}"}
    if isinstance(out, dict) or hasattr(out, "keys") or dataclasses.is_dataclass(out):
        return {"kind": "dict", "names": names, **named}
    if isinstance(out, (tuple, list)) and any(v is None for v in out) \
            and all(v is None or isinstance(v, Tensor) for v in out):  # (y, None): None kept in its place
        named["nones"] = [i for i, v in enumerate(out) if v is None]
    return {"kind": "tuple", "names": names, **named}


def _output_class(ref: str | None, base: type) -> type | None:
    """The class ``output_kind`` recorded ("module:qualname"), looked up only among modules this process
    has already imported (an artifact names a class; loading it never imports or runs code); None when absent."""
    if not ref:
        return None
    mod, _, qual = ref.partition(":")
    obj: Any = sys.modules.get(mod)
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, type) and issubclass(obj, base) else None


def restructure(kind: dict[str, Any], flat: list[Tensor]) -> Any:
    """Flat tensors -> the eager structure recorded by ``output_kind``."""
    if kind.get("kind") == "tensor" and len(flat) == 1:
        return flat[0]
    if kind.get("kind") == "dict":
        out = dict(zip(kind["names"], flat))
        cls = _output_class(kind.get("class"), object)
        if cls is not None and dataclasses.is_dataclass(cls):  # a user's dataclass; fields left None were not flat
            return cls(**{f.name: out.get(f.name) for f in dataclasses.fields(cls) if f.init})
        return cls(**out) if cls is not None and issubclass(cls, dict) else out  # an HF ModelOutput by attribute too
    items: list[Any] = list(flat)
    for i in kind.get("nones", []):
        if i <= len(items):
            items.insert(i, None)
    cls = _output_class(kind.get("class"), tuple)
    if cls is not None and hasattr(cls, "_fields") and len(cls._fields) == len(items):  # a namedtuple
        return cls(*items)
    return tuple(items)
