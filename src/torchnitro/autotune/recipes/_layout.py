"""Structured model inputs (a feature dict, nested tuples) as the flat tensors a graph runtime takes.

A sentence-transformers model is called as ``model(features)`` with one dict of tensors; ONNX,
``torch.export`` programs and OpenVINO take a flat list of tensors. ``InputLayout`` records where
each tensor sits in the structured call (a path of keys and indices, JSON-safe, saved in the
artifact's meta); ``FlatProgram`` is the model called with flat tensors (and returning flat
tensors), which is what gets exported; a runner flattens each structured call with ``layout.take``.

**Keys the model writes.** A sentence-transformers model writes its outputs (``token_embeddings``,
``sentence_embedding``) into the very dict it was given and returns it, so after one eager call the
example dict also holds outputs. ``input_layout`` calls the model once on a fresh copy of the
inputs and leaves out every key whose value the call replaced or added: those are outputs, not
inputs. ``FlatProgram`` rebuilds fresh containers on every call, so nothing outside is written to.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError

__all__ = ["InputLayout", "FlatProgram", "is_flat", "input_layout", "flat_call", "tensor_leaves"]

Key = int | str


def is_flat(inputs: Sequence[Any]) -> bool:
    """Every input is a tensor: the model's positional inputs already are the runtime's inputs."""
    return all(isinstance(x, Tensor) for x in inputs)


def _walk(obj: Any, path: list[Key], out: list[tuple[list[Key], Tensor]]) -> None:
    if isinstance(obj, Tensor):
        out.append((path, obj))
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _walk(v, [*path, k], out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, [*path, i], out)
    # any other leaf (None, a number, a string) is a constant of the call, not an input


def tensor_leaves(inputs: Sequence[Any]) -> list[Tensor]:
    """Every tensor in ``inputs``, however nested in dicts, lists and tuples."""
    out: list[tuple[list[Key], Tensor]] = []
    _walk(tuple(inputs), [], out)
    return [t for _, t in out]


def _template(obj: Any) -> Any:
    """``obj``'s containers as plain dicts/lists/tuples, tensors replaced by None (filled per call)."""
    if isinstance(obj, Tensor):
        return None
    if isinstance(obj, Mapping):
        return {k: _template(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_template(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_template(v) for v in obj)
    return copy.deepcopy(obj)


def _fresh(obj: Any) -> Any:
    """New containers around the same tensors (a model that writes into its dict writes into the copy)."""
    if isinstance(obj, Mapping):
        return {k: _fresh(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fresh(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_fresh(v) for v in obj)
    return obj


def _fill(node: Any, path: list[Key], got: dict[tuple[Key, ...], Tensor]) -> Any:
    if tuple(path) in got:
        return got[tuple(path)]
    if isinstance(node, dict):
        return {k: _fill(v, [*path, k], got) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        items = [_fill(v, [*path, i], got) for i, v in enumerate(node)]
        return items if isinstance(node, list) else tuple(items)
    return node


def _written(before: Any, after: Any, path: list[Key], out: set[tuple[Key, ...]]) -> None:
    """Paths of the mapping entries the call replaced or added (compared by object identity)."""
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        for k, v in after.items():
            if k not in before or (isinstance(v, Tensor) and before[k] is not v):
                out.add((*path, k))
            elif isinstance(v, (Mapping, list)):
                _written(before[k], v, [*path, k], out)
    elif isinstance(before, list) and isinstance(after, list):
        for i, (b, a) in enumerate(zip(before, after)):
            _written(b, a, [*path, i], out)


@dataclass
class InputLayout:
    """Where each runtime input sits in the structured call: ``paths[j]`` leads to tensor ``j``."""

    paths: list[list[Key]]
    template: Any = None  # the call's containers with tensors replaced by None (this process only)

    def to_meta(self) -> list[list[Key]]:
        return [list(p) for p in self.paths]

    @classmethod
    def from_meta(cls, meta: Any) -> InputLayout | None:
        return None if meta is None else cls([list(p) for p in meta])

    def take(self, inputs: Sequence[Any]) -> list[Tensor]:
        """The flat tensors of one structured call (keys beyond the layout's are ignored)."""
        out = []
        for p in self.paths:
            x: Any = inputs
            for depth, k in enumerate(p):
                try:
                    x = x[k]
                except (KeyError, IndexError, TypeError) as exc:
                    where = "inputs" + "".join(f"[{q!r}]" for q in p[:depth])
                    raise InputError(f"{where}: received {type(x).__name__} without {k!r}; expected the structure "
                                     f"the model was optimized with (tensors at {self.keys()})") from exc
            if not isinstance(x, Tensor):
                raise InputError(f"inputs{''.join(f'[{q!r}]' for q in p)}: received {type(x).__name__}; expected a "
                                 "tensor as in the example inputs")
            out.append(x)
        return out

    def keys(self) -> list[str]:
        return ["".join(f"[{k!r}]" for k in p) for p in self.paths]

    def rebuild(self, tensors: Sequence[Tensor]) -> tuple[Any, ...]:
        """The structured call (fresh containers) with ``tensors`` at their paths."""
        got = {tuple(p): t for p, t in zip(self.paths, tensors)}
        return tuple(_fill(self.template, [], got))

    def dynamic_dims(self, inputs: Sequence[Any], declared: Mapping[int, Sequence[int]]) -> dict[int, list[int]]:
        """The dynamic dims of each flat tensor: a top-level tensor keeps its declared dims; a tensor inside
        a structure takes its input's declared dims, or dim 0 (the batch) where none are declared."""
        leaves = self.take(inputs)
        out = {}
        for j, (p, t) in enumerate(zip(self.paths, leaves)):
            dims = declared.get(p[0], [] if len(p) == 1 else [0])
            out[j] = [d for d in dims if d < t.dim()]
        return out


def input_layout(model: nn.Module, inputs: Sequence[Any]) -> tuple[InputLayout, Any]:
    """The layout of ``inputs`` for ``model`` and the model's output on them (one eager call on fresh
    containers; keys that call writes are outputs and are left out, see the module docstring)."""
    before = _fresh(tuple(inputs))
    call = _fresh(before)
    with torch.no_grad():
        out = model(*call)
    written: set[tuple[Key, ...]] = set()
    for i, (b, a) in enumerate(zip(before, call)):
        _written(b, a, [i], written)
    leaves: list[tuple[list[Key], Tensor]] = []
    for i, x in enumerate(before):
        _walk(x, [i], leaves)
    paths = [p for p, _ in leaves if not any(tuple(p[:len(w)]) == w for w in written)]
    template = _template(before)
    for w in written:  # an input the model overwrites is no input: the call must not need it
        node: Any = template
        for k in w[:-1]:
            node = node[k]
        if isinstance(node, dict):
            node.pop(w[-1], None)
    if not paths:
        raise InputError("the example inputs hold no tensor the model reads; expected tensors (or dicts/lists of "
                         "them) as the model's inputs")
    return InputLayout(paths, template), out


class FlatProgram(nn.Module):
    """``model`` called with flat tensors (rebuilt into its structured call) and returning a flat tuple of
    tensors (``verify.flatten_outputs`` order): what a graph runtime is exported from."""

    def __init__(self, model: nn.Module, layout: InputLayout):
        super().__init__()
        self.model, self.layout = model, layout
        self.train(model.training)  # an exporter may trace dropout by the root's mode

    def forward(self, *tensors: Tensor) -> tuple[Tensor, ...]:
        from torchnitro.autotune.verify import flatten_outputs

        out = self.model(*self.layout.rebuild(tensors))
        return tuple(t for _, t in flatten_outputs(out))


def flat_call(layout_meta: Any, inputs: Sequence[Any]) -> Sequence[Any]:
    """A runner's inputs: flattened by the saved layout where the model took structured inputs, else as given."""
    layout = InputLayout.from_meta(layout_meta)
    return inputs if layout is None else layout.take(inputs)
