"""Turn what a user typed into a model and example inputs (shared by optimize, analyze and serve).

Model specs:

* a built-in name (``encoder``, ``lm``, ``cnn``, ``mlp``; ``minilm`` and ``hf-*`` with the hf extra)
* ``module.path:function`` or ``path/to/file.py:function``: a zero-argument factory returning an
  ``nn.Module`` or ``(module, example_inputs)``
* ``hf:/path/to/local/folder``: a local Hugging Face folder (``--text``, ``--batch``, ``--seq``)

Input specs (``--input``): ``32x128:int64``, ``8x3x224x224`` (float32), ``32x128:int64:0-30522``
(integers drawn from [0, 30522)).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from torchnitro.errors import ConfigError, InputError

__all__ = ["ModelInfo", "InputSpec", "parse_input_spec", "model_and_inputs", "rebuild_model", "random_like",
           "signature_of", "input_signature", "forward_params", "inputs_from_mapping", "KeywordCall", "keyword_call",
           "default_dynamic_dims"]

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32, "float16": torch.float16,
    "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "long": torch.int64, "int32": torch.int32,
    "int": torch.int32, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}


@dataclass
class ModelInfo:
    """Where a model came from and how to make more inputs for it."""

    spec: str | None  # re-buildable reference ('encoder', 'pkg.mod:fn', 'hf:/path'); None for a Python object
    name: str  # for reports
    make_inputs: Callable[[int, int, int], tuple[Any, ...]] | None = None  # (batch, seq, seed) -> inputs
    dynamic_dims: dict[int, list[int]] = field(default_factory=dict)  # input index -> dims that vary
    batch: int | None = None
    seq: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # JSON-safe details (hf path, text, ...)


@dataclass(frozen=True)
class InputSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    low: int = 0  # integer range [low, high) for integer dtypes
    high: int = 2

    def make(self, seed: int) -> Tensor:
        g = torch.Generator().manual_seed(seed)
        if self.dtype == torch.bool:
            return torch.randint(0, 2, self.shape, generator=g).bool()
        if not self.dtype.is_floating_point:
            return torch.randint(self.low, self.high, self.shape, generator=g).to(self.dtype)
        return torch.randn(self.shape, generator=g).to(self.dtype)


_SPEC_RE = re.compile(r"^(\d+(?:x\d+)*)(?::([a-z0-9]+))?(?::(-?\d+)-(-?\d+))?$")


def parse_input_spec(text: str) -> InputSpec:
    """``'32x128:int64'`` -> InputSpec((32, 128), torch.int64)."""
    m = _SPEC_RE.match(text.strip().lower())
    if not m:
        raise InputError(
            f"--input {text!r} is not an input spec; expected SHAPE[:DTYPE[:LOW-HIGH]] such as '32x128:int64', "
            "'8x3x224x224' (float32) or '32x128:int64:0-30522'. Fix the spec (dimensions joined by 'x').")
    dims = tuple(int(d) for d in m.group(1).split("x"))
    if any(d <= 0 for d in dims):
        raise InputError(f"--input {text!r} has a zero dimension; expected positive sizes such as '32x128'")
    name = m.group(2) or "float32"
    if name not in _DTYPES:
        raise InputError(f"--input {text!r}: unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    dtype = _DTYPES[name]
    low, high = (int(m.group(3)), int(m.group(4))) if m.group(3) is not None else (0, 2)
    if high <= low:
        raise InputError(f"--input {text!r}: integer range {low}-{high} is empty; expected LOW < HIGH")
    return InputSpec(dims, dtype, low, high)


def _import_factory(spec: str) -> Callable[[], Any]:
    mod_name, _, fn_name = spec.rpartition(":")
    if not mod_name or not fn_name:
        raise InputError(f"--model {spec!r}: expected 'module.path:function' or 'file.py:function'")
    if mod_name.endswith(".py"):
        path = Path(mod_name)
        if not path.is_file():
            raise InputError(f"--model {spec!r}: file {str(path)!r} does not exist; pass an existing .py file")
        uspec = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(uspec)  # type: ignore[arg-type]
        sys.modules[path.stem] = module  # so pickling (isolated candidates) finds these classes
        uspec.loader.exec_module(module)  # type: ignore[union-attr]
    else:
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(mod_name)
        except ModuleNotFoundError as exc:
            raise InputError(
                f"--model {spec!r}: cannot import module {mod_name!r} ({exc}); expected an importable module "
                "(run from the folder that contains it, or install the package)") from exc
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise InputError(f"--model {spec!r}: module {mod_name!r} has no callable {fn_name!r}")
    return fn


def _sized(specs: Sequence[InputSpec]) -> Callable[[int, int, int], tuple[Tensor, ...]]:
    def make(batch: int, seq: int, seed: int) -> tuple[Tensor, ...]:
        out = []
        for i, s in enumerate(specs):
            shape = list(s.shape)
            shape[0] = batch
            if len(shape) > 1 and seq > 0 and s.dtype in (torch.int64, torch.int32, torch.bool):
                shape[1] = seq
            out.append(InputSpec(tuple(shape), s.dtype, s.low, s.high).make(seed * 1000 + i))
        return tuple(out)

    return make


def model_and_inputs(
    spec: str | None = None,
    input_specs: Sequence[str] = (),
    *,
    text: Sequence[str] | str | None = None,
    batch: int | None = None,
    seq: int | None = None,
) -> tuple[nn.Module, tuple[Any, ...], ModelInfo]:
    """A model spec (see the module docstring) -> ``(model in eval mode, example inputs, info)``."""
    from torchnitro.nn.zoo import DEFAULT_BUILTIN

    spec = spec or DEFAULT_BUILTIN
    parsed = [parse_input_spec(s) for s in input_specs]
    if spec.startswith("hf:"):
        return _hf_model_and_inputs(spec, text, batch, seq)
    if ":" not in spec:
        return _builtin_model_and_inputs(spec, parsed, batch, seq)
    return _factory_model_and_inputs(spec, parsed, batch, seq)


def _hf_model_and_inputs(spec: str, text: Sequence[str] | str | None, batch: int | None,
                         seq: int | None) -> tuple[nn.Module, tuple[Any, ...], ModelInfo]:
    """``hf:/path``: a local Hugging Face folder, its tokenizer making the inputs."""
    path = spec[3:]
    if not Path(path).exists():
        raise InputError(f"--model {spec!r}: folder {path!r} does not exist; expected a local Hugging Face folder")
    try:
        from torchnitro import hf
    except ImportError as exc:
        raise InputError(f"--model {spec!r} needs the hf extra ({exc}); install with: pip install 'torchnitro[hf]'") from exc
    b, s = batch or 1, seq or 128
    model, inputs, details = hf.load_hf(path, text, batch=b, seq=s)
    make = details.pop("make_inputs", None)
    info = ModelInfo(spec, f"hf:{Path(path).name}", make, {0: [0, 1], 1: [0, 1]}, b, s,
                     {k: v for k, v in details.items() if isinstance(v, (str, int, float, bool, list, type(None)))})
    if text is not None:
        info.extra["text"] = [text] if isinstance(text, str) else list(text)
    return model.eval(), tuple(inputs), info


def _builtin_model_and_inputs(spec: str, parsed: Sequence[InputSpec], batch: int | None,
                              seq: int | None) -> tuple[nn.Module, tuple[Any, ...], ModelInfo]:
    """A built-in name: the zoo builds the model and its inputs (``--input`` is refused)."""
    from torchnitro.nn.zoo import get_builtin

    bi = get_builtin(spec)
    b = batch or bi.default_batch
    s = seq if seq is not None else bi.default_seq
    model = bi.build().eval()
    inputs = tuple(bi.inputs(b, s, 0))
    if parsed:
        raise InputError(f"--input was given with built-in model {spec!r}, which makes its own inputs; "
                         "use --batch/--seq to size them, or drop --input")
    return model, inputs, ModelInfo(spec, spec, bi.inputs, dict(bi.dynamic_dims), b, s)


def mask_index(model: Any, inputs: tuple[Any, ...], named: int | str | None = None) -> int | None:
    """Which input is the attention mask: ``named`` (an index or a forward argument name), else the
    forward argument called ``attention_mask``, else the second input of a token model (integer ids
    and a 0/1 tensor of the same shape). None when there is none."""
    params = [p.name for p in forward_params(model)]
    if named is not None:
        i = named if isinstance(named, int) else (params.index(named) if named in params else None)
        if i is None or not 0 <= i < len(inputs) or not isinstance(inputs[i], Tensor):
            raise ConfigError(f"padding_mask: received {named!r}; expected the index or forward-argument name of a "
                              f"tensor input (forward arguments: {params[:len(inputs)]}, {len(inputs)} inputs given)")
        return i
    if "attention_mask" in params[:len(inputs)]:
        i = params.index("attention_mask")
        if isinstance(inputs[i], Tensor) and inputs[i].dim() == 2:
            return i
    if len(inputs) >= 2 and all(isinstance(t, Tensor) and t.dim() == 2 for t in inputs[:2]):
        ids, mask = inputs[0], inputs[1]
        if (not ids.is_floating_point() and tuple(ids.shape) == tuple(mask.shape) and not mask.is_floating_point()
                and bool(((mask == 0) | (mask == 1)).all())):
            return 1
    return None


def _mask_in(x: Any) -> Tensor | None:
    """``x`` itself when it is a tensor, its ``attention_mask`` when it is a feature dict."""
    if isinstance(x, Tensor):
        return x
    m = x.get("attention_mask") if isinstance(x, Mapping) else None
    return m if isinstance(m, Tensor) and m.dim() == 2 else None


def default_dynamic_dims(model: Any, inputs: tuple[Any, ...], padding_mask: int | str | None = None
                         ) -> dict[int, list[int]]:
    """The dims that vary between calls of a model given as an object: the batch (dim 0) of every tensor
    input, and, where the inputs carry an attention mask (``mask_index``, or a feature dict's
    ``attention_mask``), the sequence (dim 1) of every input laid out ``(B, T, ...)`` like the mask and of
    the feature dict holding it: a tokenizer pads each call to its own longest sentence, so a variant
    that baked the example's length in (an ONNX or OpenVINO graph) failed on the user's next batch."""
    dyn = {i: [0] for i, t in enumerate(inputs) if isinstance(t, Tensor) and t.dim() > 0}
    i = mask_index(model, inputs, padding_mask)
    in_dict = [k for k, x in enumerate(inputs) if isinstance(x, Mapping) and _mask_in(x) is not None]
    mask = inputs[i] if i is not None else _mask_in(inputs[in_dict[0]]) if in_dict else None
    if mask is None or mask.dim() != 2:
        return dyn
    for k, t in enumerate(inputs):
        if isinstance(t, Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == tuple(mask.shape):
            dyn[k] = [0, 1]
    for k in in_dict:
        dyn[k] = [0, 1]  # every tensor in the dict; the layout keeps the dims each one has
    return dyn


def _factory_model_and_inputs(spec: str, parsed: list[InputSpec], batch: int | None,
                              seq: int | None) -> tuple[nn.Module, tuple[Any, ...], ModelInfo]:
    """``file.py:function`` or ``module:function``: the factory's model, with its inputs or ``--input``'s."""
    if Path(spec).exists() and not spec.endswith(".py"):
        raise InputError(f"--model {spec!r} looks like a path; expected 'file.py:function', 'module:function', "
                         "'hf:/path' or a built-in name")
    result = _import_factory(spec)()
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        model, inputs = result[0], tuple(result[1]) if isinstance(result[1], (tuple, list)) else (result[1],)
    elif isinstance(result, nn.Module):
        model, inputs = result, ()
    else:
        raise InputError(f"--model {spec!r} returned {type(result).__name__}; expected an nn.Module or "
                         "(nn.Module, example_inputs)")
    make = None
    if parsed:
        if batch is not None:
            parsed = [InputSpec((batch, *p.shape[1:]), p.dtype, p.low, p.high) for p in parsed]
        make = _sized(parsed)
        inputs = tuple(p.make(i) for i, p in enumerate(parsed))
    if not inputs:
        raise InputError(f"--model {spec!r} gave no example inputs; pass --input SHAPE:DTYPE once per model "
                         "input (e.g. --input 32x128:int64), or return (model, inputs) from the factory")
    dyn = default_dynamic_dims(model, inputs)
    return model.eval(), inputs, ModelInfo(spec, spec, make, dyn, int(inputs[0].shape[0]) if dyn else None, seq)


def rebuild_model(spec: str, extra: dict[str, Any] | None = None) -> nn.Module:
    """The eager model for a recorded spec (used by ``load`` for non-standalone artifacts)."""
    extra = extra or {}
    if spec.startswith("hf:"):
        model, _, _ = model_and_inputs(spec, text=extra.get("text"), batch=1, seq=8)
        return model
    if ":" not in spec:
        from torchnitro.nn.zoo import get_builtin

        return get_builtin(spec).build().eval()
    result = _import_factory(spec)()
    return (result[0] if isinstance(result, tuple) else result).eval()


def random_like(inputs: tuple[Any, ...], seed: int) -> tuple[Any, ...]:
    """Fresh inputs of the same shapes/dtypes, for held-out inputs when no input generator is known:
    floats with the example's mean/std; a right-padded attention mask with new lengths; integer
    tensors laid out like that mask (token ids) drawn from the example's own real tokens, padded
    with its pad value (uniform ids over the vocabulary range are not text: int8 calibrated on the
    example failed them at cosine 0.58-0.95 on MiniLM); other integers uniform within the
    example's range. Tensors inside a feature dict are handled the same way."""
    g = torch.Generator().manual_seed(seed)
    return tuple(_random_group(list(inputs), g))


def _random_group(items: list[Any], g: torch.Generator) -> list[Any]:
    """``items`` (one input tuple, or one feature dict's values) made afresh; see ``random_like``."""
    old = next((t for t in items if isinstance(t, Tensor) and _is_prefix_mask(t)), None)
    new = None
    if old is not None:  # new sentence lengths, still right-padded
        lens = torch.randint(1, old.shape[1] + 1, (old.shape[0],), generator=g)  # (B,)
        new = (torch.arange(old.shape[1])[None] < lens[:, None]).to(old.dtype)  # (B, T)
    out = []
    for t in items:
        if old is not None and t is old:
            out.append(new)
        elif (new is not None and isinstance(t, Tensor) and not t.dtype.is_floating_point and t.dtype != torch.bool
              and t.shape == old.shape and t.numel()):
            out.append(_tokens_like(t, old, new, g))
        else:
            out.append(_random_one(t, g))
    return out


def _tokens_like(ids: Tensor, old: Tensor, new: Tensor, g: torch.Generator) -> Tensor:
    """``(B, T)`` ids at ``new``'s real positions drawn from ``ids``' real tokens under ``old``."""
    real = ids[old != 0]  # (N,) the example's real tokens
    pads = ids[old == 0]
    pad = int(pads.mode().values) if pads.numel() else 0
    pick = real[torch.randint(0, real.numel(), ids.shape, generator=g)]  # (B, T)
    return torch.where(new != 0, pick, torch.full_like(pick, pad)).to(ids.dtype)


def _random_one(t: Any, g: torch.Generator) -> Any:
    if isinstance(t, Mapping):  # a feature dict (sentence-transformers): its tensors, keys kept
        return dict(zip(t.keys(), _random_group(list(t.values()), g)))
    if not isinstance(t, Tensor):
        return t
    if t.dtype == torch.bool or t.numel() == 0:
        return t.clone()
    if t.dtype.is_floating_point:
        x = t.float()
        std = float(x.std()) if x.numel() > 1 else 1.0
        return (torch.randn(t.shape, generator=g) * (std or 1.0) + float(x.mean())).to(t.dtype)
    lo, hi = int(t.min()), int(t.max())
    return torch.randint(lo, hi + 1, t.shape, generator=g).to(t.dtype)


def _is_prefix_mask(t: Tensor) -> bool:
    """A (B, T) 0/1 integer tensor whose rows are ones then zeros: a right-padded attention mask
    (token_type_ids of single sentences are all zeros and stay as they are)."""
    if t.dim() != 2 or t.dtype.is_floating_point or t.shape[1] < 2 or not bool(((t == 0) | (t == 1)).all()):
        return False
    if not bool((t[:, 0] == 1).all()):
        return False
    return bool((t[:, 1:] <= t[:, :-1]).all())


class KeywordCall(nn.Module):
    """A model whose forward takes inputs by keyword only (``forward(self, *, input_ids, attention_mask)``),
    called by position: every recipe, program and gate works on positional inputs. ``call_names`` are the
    keywords in the order the positional inputs come; ``forward_params`` reports them as its arguments."""

    def __init__(self, model: nn.Module, names: Sequence[str]):
        super().__init__()
        self.model, self.call_names = model, list(names)
        self.train(model.training)

    def forward(self, *xs: Any) -> Any:
        return self.model(**dict(zip(self.call_names, xs)))


def keyword_call(model: Any, mapping: Mapping[str, Any]) -> KeywordCall | None:
    """``model`` in a ``KeywordCall`` when ``mapping`` names keyword-only forward arguments (which a tuple
    cannot pass), else None. The keywords come in forward's order; a required keyword-only argument the
    mapping lacks is named in an ``InputError``."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError, AttributeError):
        return None
    kwonly = [p for p in params if p.kind == p.KEYWORD_ONLY]
    if not any(p.name in mapping for p in kwonly):
        return None
    missing = [p.name for p in kwonly if p.default is inspect.Parameter.empty and p.name not in mapping]
    known = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    unknown = [k for k in mapping if k not in known]
    if missing or (unknown and not any(p.kind == p.VAR_KEYWORD for p in params)):
        raise InputError(f"example_inputs: received a dict with keys {list(mapping)}; {type(model).__name__}.forward "
                         f"takes {sorted(known)}" + (f", and requires {missing} by keyword" if missing else "")
                         + (f", so {unknown} cannot be passed" if unknown else ""))
    names = [p.name for p in params if p.name in mapping] + [k for k in mapping if k not in known]
    return KeywordCall(model, names)


def forward_params(model: Any) -> list[inspect.Parameter]:
    """``model.forward``'s arguments that can be passed by position, in order ([] when unknown)."""
    names = getattr(model, "call_names", None)
    if isinstance(model, KeywordCall) and names is not None:
        return [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError, AttributeError):
        return []
    return [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def inputs_from_mapping(model: Any, mapping: Mapping[str, Any]) -> tuple[Any, ...]:
    """A tokenizer's output (a dict or ``BatchEncoding`` of tensors) -> the positional inputs of
    ``model.forward``: each key at its argument's position, skipped arguments at their default.

    A forward that takes one dict argument (a sentence-transformers model's feature dict) gets the
    mapping itself as its one input."""
    params = forward_params(model)
    names = [p.name for p in params]
    keys = list(mapping.keys())
    if not keys:
        raise InputError("example_inputs: received an empty dict; expected the model's inputs by argument name, "
                         "e.g. a tokenizer's output {'input_ids': ..., 'attention_mask': ...}")
    unknown = [k for k in keys if k not in names]
    if unknown:
        if len(names) == 1 and names[0] not in keys:  # forward(features: dict)
            return (dict(mapping),)
        raise InputError(f"example_inputs: received a dict with keys {keys}; {type(model).__name__}.forward takes "
                         f"{names}, so {unknown} cannot be passed. Drop those keys or pass a tuple in forward's order")
    last = max(names.index(k) for k in keys)
    out: list[Any] = []
    for p in params[:last + 1]:
        if p.name in mapping:
            out.append(mapping[p.name])
        elif p.default is not inspect.Parameter.empty:
            out.append(p.default)
        else:
            raise InputError(f"example_inputs: the dict has no {p.name!r}, which {type(model).__name__}.forward "
                             f"requires (received keys {keys})")
    return tuple(out)


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"{str(x.dtype).replace('torch.', '')}[{'x'.join(map(str, x.shape))}]"
    if isinstance(x, Mapping):  # a feature dict: its entries, so that reports and cache keys tell shapes apart
        return f"dict({', '.join(f'{k}: {_describe(v)}' for k, v in x.items())})"
    return type(x).__name__


def input_signature(inputs: tuple[Any, ...]) -> str:
    """'int64[8x128], float32[8x3x64x64]', a feature dict as 'dict(input_ids: int64[8x30], ...)' (cache keys
    and reports)."""
    return ", ".join(_describe(t) for t in inputs)


def _fields(x: Any, path: list[Any], dims: list[int], out: list[dict[str, Any]]) -> None:
    """Every tensor inside one structured input (dicts, lists, tuples), by path."""
    if isinstance(x, Tensor):
        out.append({"name": path[0] + "".join(f"[{k!r}]" for k in path[1:]), "path": path,
                    "dtype": str(x.dtype).replace("torch.", ""),
                    "shape": [-1 if d in dims else int(s) for d, s in enumerate(x.shape)]})
    elif isinstance(x, Mapping):
        for k, v in x.items():
            _fields(v, [*path, k], dims, out)
    elif isinstance(x, (list, tuple)):
        for k, v in enumerate(x):
            _fields(v, [*path, k], dims, out)


def signature_of(model: nn.Module, inputs: tuple[Any, ...], outputs: list[tuple[str, Tensor]],
                 dynamic_dims: dict[int, list[int]], other_outputs: Sequence[list[tuple[str, Tensor]]] = ()) -> dict[str, Any]:
    """Input names/dtypes/shapes (-1 where dynamic) and output names/dtypes/shapes, for the manifest.

    ``input_fields``: the tensors inside structured inputs (a feature dict), each with its path (argument name,
    then keys), dtype and shape; such a tensor varies in its input's declared dims, or the batch where none are
    declared (as ``recipes._layout.InputLayout.dynamic_dims``). ``inputs`` must be the call as the user makes it:
    a model that writes its outputs into its feature dict has not yet written into it."""
    names = [p.name for p in forward_params(model)]
    ins: list[dict[str, Any]] = []
    fields: list[dict[str, Any]] = []
    for i, t in enumerate(inputs):
        name = names[i] if i < len(names) else f"input_{i}"
        if not isinstance(t, Tensor):
            _fields(t, [name], dynamic_dims.get(i, [0]), fields)
            continue
        dyn = set(dynamic_dims.get(i, []))
        ins.append({"name": name, "dtype": str(t.dtype).replace("torch.", ""),
                    "shape": [-1 if d in dyn else int(s) for d, s in enumerate(t.shape)]})
    outs = []
    for k, (n, t) in enumerate(outputs):  # an output dim that changes with the input size is dynamic
        shape = [int(s) for s in t.shape]
        for other in other_outputs:
            if k < len(other) and other[k][1].dim() == len(shape):
                shape = [-1 if s != int(o) else s for s, o in zip(shape, other[k][1].shape)]
        outs.append({"name": n, "dtype": str(t.dtype).replace("torch.", ""), "shape": shape})
    return {"inputs": ins, "outputs": outs, **({"input_fields": fields} if fields else {})}
