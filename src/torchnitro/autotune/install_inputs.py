"""What a call to an installed model holds, by path, and what the variant takes there (``autotune/install.py``).

A path names where a value sits in the call: ``("input_ids",)`` for an argument, ``("features", "input_ids")``
for a tensor inside a feature dict. The variant's spec of each tensor comes from the search's example inputs
(their dtypes and shapes, -1 in the dynamic dims) or, for a loaded artifact, from its signature and saved layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LeafSpec", "Path_", "leaves", "spec_from_example", "spec_from_signature", "read_paths", "where", "same",
           "Weights"]

Path_ = tuple[Any, ...]  # where a tensor sits in the call: (argument name, dict key, ...)


@dataclass(frozen=True)
class LeafSpec:
    """One tensor the variant takes: its dtype and shape (-1 = dynamic); None where the artifact did not say."""

    dtype: torch.dtype | None
    shape: tuple[int, ...] | None


def leaves(obj: Any, path: Path_, out: dict[Path_, Any]) -> None:
    """Every tensor and other leaf value of one argument, by path (dicts and lists walked)."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            leaves(v, (*path, k), out)
    elif isinstance(obj, (list, tuple)) and any(isinstance(v, (Tensor, Mapping)) for v in obj):
        for i, v in enumerate(obj):
            leaves(v, (*path, i), out)
    else:
        out[path] = obj


def _shape(t: Tensor, dynamic: list[int]) -> tuple[int, ...]:
    return tuple(-1 if d in dynamic else int(s) for d, s in enumerate(t.shape))


def spec_from_example(names: list[str], example: tuple[Any, ...], dynamic_dims: dict[int, list[int]]
                      ) -> tuple[dict[Path_, LeafSpec], dict[Path_, Any]]:
    """The tensors the variant takes and the other values of the example call, by path."""
    tensors: dict[Path_, LeafSpec] = {}
    others: dict[Path_, Any] = {}
    for i, x in enumerate(example):
        found: dict[Path_, Any] = {}
        leaves(x, (names[i] if i < len(names) else i,), found)
        for path, v in found.items():
            if isinstance(v, Tensor):  # a tensor inside a dict takes its argument's dims, the batch by default
                dims = dynamic_dims.get(i, [] if len(path) == 1 else [0])
                tensors[path] = LeafSpec(v.dtype, _shape(v, dims))
            else:
                others[path] = v
    return tensors, others


def spec_from_signature(names: list[str], signature: dict[str, Any], layout: Any) -> dict[Path_, LeafSpec]:
    """A loaded artifact: the manifest's top-level tensors and the tensors inside its structured inputs
    (``input_fields``: a feature dict's), and the saved layout's paths (shapes unknown: an older artifact)."""
    tensors: dict[Path_, LeafSpec] = {}
    for entry in signature.get("inputs", []):
        tensors[(entry["name"],)] = _leaf_spec(entry)
    for entry in signature.get("input_fields", []):
        tensors[tuple(entry["path"])] = _leaf_spec(entry)
    for p in layout or []:
        head = names[p[0]] if isinstance(p[0], int) and p[0] < len(names) else p[0]
        tensors.setdefault((head, *p[1:]), LeafSpec(None, None))
    return tensors


def _leaf_spec(entry: dict[str, Any]) -> LeafSpec:
    dtype = getattr(torch, str(entry.get("dtype")), None)
    return LeafSpec(dtype if isinstance(dtype, torch.dtype) else None, tuple(int(s) for s in entry.get("shape", [])))


def read_paths(model: nn.Module, example: tuple[Any, ...], names: list[str]) -> set[Path_]:
    """The tensors of a structured example the model reads: a sentence-transformers model writes its outputs
    into the dict it is given, so the example kept from the search holds them too (one eager call tells,
    ``recipes._layout.input_layout``)."""
    from torchnitro.autotune.recipes._layout import input_layout

    layout, _ = input_layout(model, example)
    return {(names[p[0]] if p[0] < len(names) else p[0], *p[1:]) for p in layout.paths}


def where(path: Path_) -> str:
    """A path as the user writes it: ``features['input_ids']``."""
    return str(path[0]) + "".join(f"[{k!r}]" for k in path[1:])


def same(a: Any, b: Any) -> bool:
    """Two non-tensor argument values equal (values that do not compare, and tensors, are not)."""
    try:
        return bool(a == b) if not isinstance(a, Tensor) and not isinstance(b, Tensor) else False
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return False



def _counters(params: list[tuple[str, Tensor]]) -> list[tuple[int, int]]:
    return [(p._version, p.data_ptr()) for _, p in params]


def _sums(params: list[tuple[str, Tensor]]) -> Tensor:
    with torch.no_grad():
        return torch.tensor([[float(p.sum(dtype=torch.float64)), float(torch.linalg.vector_norm(p, dtype=torch.float64))]
                             for _, p in params], dtype=torch.float64).reshape(-1, 2)  # (P, 2)


@dataclass
class Weights:
    """A model's parameters at one moment: each one's version counter (an optimizer step, ``load_state_dict``, any
    in-place update bumps it) and storage (``.half()``, ``.to(device)`` move it), read in microseconds, and its
    float64 sum and norm, one pass over the values. A parameter whose counter or storage moved has changed unless
    its sums are the same: ``load_state_dict`` of the very values (``load(dir, model=m)`` does that) is no change."""

    params: list[tuple[str, Tensor]]
    counters: list[tuple[int, int]]
    sums: Tensor  # (P, 2) float64
    stale: str | None = None  # the first parameter found changed: the model stays changed for these weights

    @classmethod
    def of(cls, model: nn.Module) -> Weights:
        params = list(model.named_parameters())
        return cls(params, _counters(params), _sums(params))

    def changed(self) -> str | None:
        """The name of the first parameter that changed since, else None (the sums are read only where a counter
        or a storage moved, once: where the values are the same, the counters are taken again)."""
        now = _counters(self.params)
        if self.stale is not None or now == self.counters:
            return self.stale
        sums = _sums(self.params)
        self.stale = next((name for (name, _), a, b in zip(self.params, sums, self.sums) if not torch.equal(a, b)), None)
        self.counters = now
        return self.stale
