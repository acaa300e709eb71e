"""What can be served: a ``ServedModel`` is a batched callable plus its ``ModelSignature``.

``resolve_model(spec)`` accepts
  * a built-in name (``encoder``, ``mlp``, ``minilm`` ... from ``torchnitro.nn.zoo``),
  * an optimize artifact directory (``torchnitro.load(dir)``; its ``signature`` names the tensors); one that
    needs the user's model object (``unservable_reason``) is served through a factory returning
    ``artifact_model(dir, model=...)``,
  * ``module:function`` - a factory returning a ``ServedModel`` (or an ``nn.Module`` plus example
    inputs via a ``ServedModel``), imported in each worker process.
Worker processes call it themselves, so a spec must be a string that resolves the same everywhere.

For an ``nn.Module`` the signature also records what its integer inputs can take
(``add_module_limits``): token ids below the largest embedding's row count, an attention mask of 0/1,
a sequence no longer than the learned position table (or the model's ``cfg.max_seq_len``), so a
bad id is a 400 for its own request instead of an exception in the batch it shares.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError
from torchnitro.serve.protocol import ModelSignature, TensorSpec, datatype_of

__all__ = ["ServedModel", "resolve_model", "signature_from_example", "add_module_limits", "artifact_model",
           "unservable_reason", "check_servable"]


@dataclass
class ServedModel:
    """``fn(*inputs) -> Tensor | tuple[Tensor, ...]`` on batched tensors in signature order."""

    fn: Callable[..., Any]
    signature: ModelSignature
    module: nn.Module | None = None  # the nn.Module behind fn, if any (GPU replicas copy it per device)

    def __call__(self, *inputs: Tensor) -> list[Tensor]:
        out = self.fn(*inputs)
        if isinstance(out, Tensor):
            return [out]
        if isinstance(out, dict):
            return [out[s.name] for s in self.signature.outputs]
        return list(out)


def _names(model: Any, n: int) -> list[str]:
    try:
        params = [p.name for p in inspect.signature(getattr(model, "forward", model)).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[:n] if len(params) >= n else [f"input_{i}" for i in range(n)]


def signature_from_example(name: str, model: Callable[..., Any], example: Sequence[Tensor],
                           dynamic_dims: dict[int, list[int]] | None = None,
                           input_names: Sequence[str] | None = None) -> ModelSignature:
    """Infer a signature by running ``model`` once on ``example`` (batch dim and ``dynamic_dims`` -> -1).

    Output dimensions equal to the example's variable sequence length become -1 as well.
    """
    dyn = dynamic_dims or {}
    names = list(input_names) if input_names else _names(model, len(example))
    ins = []
    seq = None
    for i, (n, t) in enumerate(zip(names, example)):
        dims = set(dyn.get(i, [0])) | {0}
        shape = tuple(-1 if d in dims else s for d, s in enumerate(t.shape))
        if t.dim() > 1 and 1 in dims:
            seq = t.shape[1]
        ins.append(TensorSpec(n, datatype_of(t.dtype), shape))
    with torch.inference_mode():
        out = model(*example)
    outs = [out] if isinstance(out, Tensor) else list(out.values() if isinstance(out, dict) else out)
    onames = list(out) if isinstance(out, dict) else (["output"] if len(outs) == 1 else
                                                      [f"output_{i}" for i in range(len(outs))])
    ospecs = []
    for n, t in zip(onames, outs):
        shape = tuple(-1 if d == 0 or (seq is not None and d == 1 and s == seq) else s
                      for d, s in enumerate(t.shape))
        ospecs.append(TensorSpec(n, datatype_of(t.dtype), shape))
    # a mask input makes padding invisible to each row's result; without one, only equal lengths batch
    return ModelSignature(name, ins, ospecs, padding_safe=any(s.name == "attention_mask" for s in ins))


_INT_TYPES = ("INT64", "INT32", "INT16", "UINT8", "INT8")
_NOT_IDS = {"attention_mask", "token_type_ids", "position_ids"}


def _is_position_table(leaf: str) -> bool:
    return leaf in ("pos", "wpe") or "position" in leaf


def _position_limit(module: nn.Module, tables: dict[str, nn.Embedding]) -> int | None:
    """Longest sequence ``module`` takes: its learned position table, else ``cfg.max_seq_len``."""
    for leaf, m in tables.items():
        if _is_position_table(leaf):
            # RoBERTa-style tables start after the padding index: rows padding_idx+1.. are positions
            return m.num_embeddings - (0 if m.padding_idx is None else m.padding_idx + 1)
    limit = getattr(getattr(module, "cfg", None), "max_seq_len", None)
    return limit if isinstance(limit, int) else None


def add_module_limits(signature: ModelSignature, module: nn.Module) -> ModelSignature:
    """Record on ``signature``'s integer inputs the value range and length ``module`` can take.

    Token ids: ``[0, rows - 1]`` of the largest ``nn.Embedding`` that is not a position or
    token-type table (the vocabulary); ``token_type_ids``:
    the token-type table; ``attention_mask``: 0/1; every variable-length integer input: the position
    limit. Inputs with limits already set are left alone; a module without embeddings gets none.
    """
    tables = {q.rpartition(".")[2].lower(): m for q, m in module.named_modules() if isinstance(m, nn.Embedding)}
    if not tables:
        return signature
    types = next((m.num_embeddings for leaf, m in tables.items() if "token_type" in leaf), None)
    vocab = max((m.num_embeddings for leaf, m in tables.items()
                 if not _is_position_table(leaf) and "token_type" not in leaf), default=None)
    max_len = _position_limit(module, tables)
    for spec in signature.inputs:
        if spec.datatype not in _INT_TYPES:
            continue
        if spec.value_range is None:
            if spec.name == "attention_mask":
                spec.value_range = (0, 1)
            elif spec.name == "token_type_ids":
                spec.value_range = None if types is None else (0, types - 1)
            elif spec.name not in _NOT_IDS and vocab is not None:
                spec.value_range = (0, vocab - 1)
        if spec.max_length is None and spec.ragged and max_len is not None:
            spec.max_length = max_len
    return signature


def _from_builtin(name: str) -> ServedModel:
    from torchnitro.nn.zoo import get_builtin

    b = get_builtin(name)
    model = b.build().eval()
    seq = 7 if b.default_seq else 0  # odd length so sequence dims are told apart from hidden dims
    example = b.inputs(2, seq, 0) if seq else b.inputs(2, 0, 0)

    sig = signature_from_example(name, model, example, b.dynamic_dims)
    return ServedModel(model, sig, module=model)


def _spec_list(items: Any, what: str) -> list[TensorSpec]:
    out = []
    for i, s in enumerate(items or []):
        name = s.get("name", f"{what}_{i}")
        dt = s.get("datatype") or datatype_of(getattr(torch, str(s.get("dtype", "float32")).replace("torch.", "")))
        shape = [int(d) for d in s.get("shape", (-1,))]
        if shape:
            shape[0] = -1  # the server batches requests: dimension 0 is always the batch
        out.append(TensorSpec(name, dt, tuple(shape)))
    return out


def unservable_reason(directory: str | Path, manifest: dict[str, Any]) -> str | None:
    """Why ``torchnitro serve DIR`` cannot load the artifact in ``directory`` on its own (None: it can).

    A recipe that is not standalone (dynamic-int8, bf16, bert-unpad ...) rebuilds its variant from the eager model
    at load time; an artifact made from a Python object records no ``module:function`` to re-create that model, so
    only ``torchnitro.load(dir, model=...)`` can load it, and serve has no model object to pass."""
    if manifest.get("standalone", True) or (manifest.get("model") or {}).get("spec"):
        return None
    d, recipe = str(directory), manifest.get("recipe")
    return (f"artifact {d!r} cannot be served from its directory alone: its recipe {recipe!r} rebuilds the optimized "
            "model from the eager model object at load time, and the model it was made from was a Python object "
            "with no factory reference (manifest.json names no 'module:function' that re-creates it), so serve, "
            "which has only the directory, has no model to rebuild it from. Expected a standalone artifact or one "
            "that names its factory. To serve it: (1) re-run optimize restricted to standalone recipes "
            "(OptimizeConfig(recipes=['onnxruntime', 'openvino', 'torchscript']); CLI: --recipe onnxruntime "
            "--recipe openvino; a TorchScript artifact is served only with --trust-code), or optimize an installed "
            "'module:function' spec instead of the object, so the artifact records how to re-create the model; or "
            "(2) serve it with the model object: in an importable module write `def make(): return "
            f"torchnitro.serve.models.artifact_model({d!r}, model=MyModel())` and run `torchnitro serve "
            "yourmodule:make` (MyModel must be importable there, not defined in a script's __main__)")


def check_servable(spec: Any) -> None:
    """Raise InputError (``unservable_reason``) when ``spec`` is an artifact directory that cannot be served from
    the directory alone, before any worker is started: a worker process would fail only at its start-up.
    Anything else passes. Reads manifest.json as written; ``torchnitro.load`` checks it and its files in full."""
    if not isinstance(spec, (str, Path)) or not Path(spec).is_dir():
        return
    import json

    try:
        manifest = json.loads((Path(spec) / "manifest.json").read_text())
    except (OSError, ValueError):
        return  # not readable as an artifact: the load names what is wrong with it
    why = unservable_reason(spec, manifest) if isinstance(manifest, dict) else None
    if why is not None:
        raise InputError(f"serve: {why}")


def artifact_model(directory: str | Path, model: nn.Module | None = None, *, trust_code: bool = False,
                   threads: int | None = None) -> ServedModel:
    """The artifact in ``directory`` as a ``ServedModel``, named after the directory.

    ``model``: the eager model an artifact that is not standalone rebuilds from (``torchnitro.load(dir, model=...)``;
    its weights are replaced by the artifact's); a ``module:function`` factory returning this serves such an
    artifact (``unservable_reason``). ``trust_code`` and ``threads`` go to ``torchnitro.load``."""
    import torchnitro

    path = Path(directory)
    # model and threads only when given: without them the call is the plain load it always was
    given = {k: v for k, v in (("model", model), ("threads", threads)) if v is not None}
    if model is not None:  # a new instance of the architecture, filled with the artifact's weights
        given["replace_weights"] = True
    loaded = torchnitro.load(path, trust_code=trust_code, **given)
    sig = getattr(loaded, "signature", None)
    if isinstance(sig, dict):
        ins = _spec_list(sig.get("inputs"), "input")
        sig = ModelSignature(path.name, ins, _spec_list(sig.get("outputs"), "output"),
                             padding_safe=any(s.name == "attention_mask" for s in ins))
    if not isinstance(sig, ModelSignature) or not sig.inputs or not sig.outputs:
        raise InputError(f"artifact {str(path)!r} has no usable input/output signature (received {sig!r}); "
                         "re-run `torchnitro optimize` with example inputs so the manifest records them")
    return ServedModel(loaded, sig)


def resolve_model(spec: str | ServedModel, name: str | None = None, *, trust_code: bool = False,
                  threads: int | None = None) -> ServedModel:
    """Turn a model spec (see module docstring) into a ``ServedModel`` named ``name``.

    ``trust_code`` and ``threads`` (an ONNX Runtime / OpenVINO session's intra-op threads: ``--threads``) are
    passed to ``torchnitro.load`` for artifact directories."""
    if isinstance(spec, ServedModel):
        sm = spec
    elif Path(spec).is_dir():
        sm = artifact_model(spec, trust_code=trust_code, threads=threads)
    elif ":" in spec and not spec.startswith(("hf:", "/")):
        mod, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as exc:
            raise InputError(f"model spec {spec!r}: cannot import {attr!r} from {mod!r} ({exc}); "
                             "expected 'package.module:function' returning a ServedModel") from None
        if not callable(factory):
            raise InputError(f"model spec {spec!r}: {attr!r} is a {type(factory).__name__}, expected a "
                             "zero-argument function returning a ServedModel")
        try:
            sm = factory()
        except Exception as exc:  # noqa: BLE001 - the user's factory: report it as bad input
            raise InputError(f"model spec {spec!r}: the factory raised {type(exc).__name__}: {exc}") from exc
        if isinstance(sm, nn.Module) or not isinstance(sm, ServedModel):
            raise InputError(f"model spec {spec!r} returned {type(sm).__name__}, expected a ServedModel "
                             "(wrap the module: ServedModel(module, signature_from_example(...)))")
    else:
        sm = _from_builtin(spec)
    module = sm.module if sm.module is not None else sm.fn
    if isinstance(module, nn.Module):
        add_module_limits(sm.signature, module)
    if name:
        sm.signature.name = name
    return sm
