"""KServe v2 / Open Inference Protocol (JSON) <-> tensors, with validation and padding.

A model's ``ModelSignature`` names its inputs and outputs with datatypes and shapes (``-1`` for a
variable dimension; dimension 0 is always the batch). ``parse_infer_request`` turns a request body
into an ``InferItem`` (tensors in signature order, validated: names, datatypes, ranks, fixed dims,
empty dims, element counts, element types (no strings, no fractions for integer types, integers in
the type's range), NaN, and what the model itself can take: a value range such as token ids below
the embedding's size, a longest sequence such as the position table's length); every problem
raises ``InputError`` whose message names the tensor, what was received, what was expected and the
fix (the server answers it with HTTP 400).

Variable-length sequences (dimension 1 is ``-1``) are padded to the longest in a batch with the
input's ``pad_value`` (0 for token ids and attention masks) and outputs that carry that dimension
are cut back to each request's own length (``split_outputs``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from torchnitro.errors import InputError

try:  # orjson parses and writes JSON (and numpy arrays) several times faster than the stdlib
    import orjson
except ImportError:  # pragma: no cover - the serve extra installs it
    orjson = None

__all__ = ["DATATYPES", "TensorSpec", "ModelSignature", "InferItem", "parse_infer_request",
           "encode_infer_response", "assemble", "split_outputs", "datatype_of", "priority_level",
           "array_from_bytes"]

# v2 datatype name -> torch dtype
DATATYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool, "UINT8": torch.uint8, "INT8": torch.int8, "INT16": torch.int16,
    "INT32": torch.int32, "INT64": torch.int64, "FP16": torch.float16, "BF16": torch.bfloat16,
    "FP32": torch.float32, "FP64": torch.float64,
}
_NAMES = {v: k for k, v in DATATYPES.items()}
_NP = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
       "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}


def datatype_of(dtype: torch.dtype) -> str:
    if dtype not in _NAMES:
        raise InputError(f"dtype {dtype} has no KServe v2 datatype; expected one of {sorted(DATATYPES)}")
    return _NAMES[dtype]


@dataclass
class TensorSpec:
    name: str
    datatype: str  # v2 name: "FP32", "INT64", ...
    shape: tuple[int, ...]  # dim 0 is the batch (-1); -1 marks any variable dimension
    pad_value: float = 0  # value for padding a variable dim 1 up to the batch's longest
    # inclusive [low, high] of values the model can take (token ids: its embedding's rows), so an
    # out-of-range id is a 400 for its request instead of an exception for its whole batch
    value_range: tuple[float, float] | None = None
    max_length: int | None = None  # longest dimension 1 the model can take (its position table)

    def __post_init__(self) -> None:
        if self.datatype not in DATATYPES:
            raise InputError(f"tensor {self.name!r}: datatype {self.datatype!r} is unknown; "
                             f"expected one of {sorted(DATATYPES)}")
        self.shape = tuple(int(d) for d in self.shape)

    @property
    def dtype(self) -> torch.dtype:
        return DATATYPES[self.datatype]

    @property
    def ragged(self) -> bool:
        """Dimension 1 varies per request: pad on the way in, unpad on the way out."""
        return len(self.shape) > 1 and self.shape[1] == -1

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


@dataclass
class ModelSignature:
    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    allow_nan: bool = False  # reject NaN/inf in float inputs with a 400 unless the model wants them
    # padding a ragged input leaves each row's result unchanged (the model takes an attention mask,
    # or is position-wise); if False, only requests of exactly equal length share a batch
    padding_safe: bool = False
    platform: str = "pytorch_torchnitro"
    versions: list[str] = field(default_factory=lambda: ["1"])

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "versions": self.versions, "platform": self.platform,
                "inputs": [s.to_dict() for s in self.inputs], "outputs": [s.to_dict() for s in self.outputs]}


@dataclass
class InferItem:
    """One request's validated tensors (signature order) and its request-level parameters."""

    tensors: list[Tensor]
    rows: int  # dimension 0 shared by every input
    length: int | None  # the request's dimension 1 when inputs are ragged
    id: str | None = None
    priority: int = 0  # as sent, Triton's meaning: 0 = the model's default level, 1 = most urgent
    timeout_ms: float | None = None  # from parameters.timeout, which is in microseconds as in Triton
    outputs: tuple[str, ...] | None = None  # outputs the client asked for, in its order (None: all)
    binary_outputs: frozenset[str] = frozenset()  # outputs to send as raw bytes (binary extension)


def _bad(msg: str) -> InputError:
    return InputError(msg)


def _to_tensor(spec: TensorSpec, obj: dict[str, Any], allow_nan: bool) -> Tensor:
    name = spec.name
    shape = obj.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise _bad(f"input {name!r}: shape {shape!r} is not a list of non-negative integers; "
                   f"expected a shape like {list(spec.shape)} (-1 = any size)")
    if obj.get("datatype") != spec.datatype:
        raise _bad(f"input {name!r}: datatype {obj.get('datatype')!r} received, expected {spec.datatype!r}; "
                   "send the datatype from GET /v2/models/<name>")
    if len(shape) != len(spec.shape):
        raise _bad(f"input {name!r}: received shape {shape} (rank {len(shape)}), expected rank "
                   f"{len(spec.shape)} shape {list(spec.shape)} (-1 = any size)")
    for i, (got, want) in enumerate(zip(shape, spec.shape)):
        if want != -1 and got != want:
            raise _bad(f"input {name!r}: dimension {i} is {got}, expected {want} "
                       f"(received shape {shape}, expected {list(spec.shape)})")
    if shape[0] < 1:
        raise _bad(f"input {name!r}: batch dimension is 0; send at least one row")
    if 0 in shape:
        raise _bad(f"input {name!r}: received shape {shape} with an empty dimension, expected every "
                   "dimension >= 1 (an empty sequence has nothing to compute)")
    if spec.max_length is not None and len(shape) > 1 and shape[1] > spec.max_length:
        raise _bad(f"input {name!r}: dimension 1 (length) is {shape[1]}, this model takes at most "
                   f"{spec.max_length}; truncate or split the sequence")
    data = obj.get("data")
    if not isinstance(data, (list, np.ndarray)):  # an ndarray: raw bytes read by serve.binary
        raise _bad(f"input {name!r}: 'data' must be a (flat or nested) JSON list, received "
                   f"{type(data).__name__}")
    n = math.prod(shape)
    if isinstance(data, np.ndarray) and data.dtype == _NP.get(spec.datatype):  # raw bytes, already typed
        return _checked(name, spec, data, shape, n, allow_nan)
    try:
        if spec.datatype in _NP:  # numpy reads a list of numbers ~3x faster than torch.tensor
            arr = np.asarray(data)  # its own type first: strings, fractions, ranges are checked
            if arr.dtype == object:
                raise ValueError("ragged nested lists or mixed element types")
        else:
            t = torch.tensor(data, dtype=spec.dtype)
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise _bad(f"input {name!r}: 'data' could not be read as {spec.datatype}: {exc}; "
                   "send numbers only, in a list") from None
    if spec.datatype in _NP:  # checked in numpy: each torch op per request costs more than this check
        if arr.size != n:
            raise _bad(f"input {name!r}: 'data' has {arr.size} elements, shape {shape} needs {n}")
        return _checked(name, spec, _cast(name, spec.datatype, arr), shape, n, allow_nan)
    if t.numel() != n:
        raise _bad(f"input {name!r}: 'data' has {t.numel()} elements, shape {shape} needs {n}")
    t = t.reshape(shape)
    if t.is_floating_point() and not allow_nan and not bool(torch.isfinite(t).all()):
        raise _bad(f"input {name!r}: contains NaN or infinity; this model expects finite values")
    if spec.value_range is not None:
        _check_range(name, spec.value_range, t.float().numpy())
    return t


def _checked(name: str, spec: TensorSpec, arr: np.ndarray, shape: list[int], n: int, allow_nan: bool) -> Tensor:
    """A flat array of the input's own dtype -> its tensor, after the checks on values."""
    if arr.size != n:
        raise _bad(f"input {name!r}: 'data' has {arr.size} elements, shape {shape} needs {n}")
    arr = arr.reshape(shape)
    if arr.dtype.kind == "f" and not allow_nan and not np.isfinite(arr).all():
        raise _bad(f"input {name!r}: contains NaN or infinity; this model expects finite values")
    if spec.value_range is not None:
        _check_range(name, spec.value_range, arr)
    return torch.from_numpy(arr)


def array_from_bytes(name: str, datatype: Any, raw: bytes | memoryview) -> np.ndarray:
    """Raw little-endian bytes of one input (binary HTTP, gRPC raw contents) -> a writable flat array
    of its datatype (BF16 -> float32), for ``parse_infer_request`` as that input's ``data``."""
    if datatype == "BF16":  # numpy has no bfloat16: widen exactly through torch
        if len(raw) % 2:
            raise _bad(f"input {name!r}: {len(raw)} bytes of BF16 data, expected a multiple of 2")
        return torch.frombuffer(bytearray(raw), dtype=torch.bfloat16).float().numpy() if len(raw) else \
            np.zeros(0, np.float32)
    if datatype not in _NP:
        raise _bad(f"input {name!r}: datatype {datatype!r} cannot be sent as raw bytes here; "
                   f"expected one of {sorted([*_NP, 'BF16'])}")
    dtype = np.dtype(_NP[datatype]).newbyteorder("<")
    if len(raw) % dtype.itemsize:
        raise _bad(f"input {name!r}: {len(raw)} bytes of {datatype} data, expected a multiple of "
                   f"{dtype.itemsize}")
    arr = np.frombuffer(raw, dtype=dtype)
    return arr.astype(arr.dtype.newbyteorder("="))  # a native, writable copy (torch needs writable)


# element kinds (numpy dtype.kind) each v2 datatype accepts from JSON: numbers only, never strings;
# a float for an integer type only when it has no fractional part (101.0, not 101.7)
_KINDS = {"BOOL": "b", "FP16": "iuf", "FP32": "iuf", "FP64": "iuf"}
_KIND_NAMES = {"U": "strings", "S": "strings", "b": "booleans", "f": "numbers with fractions", "O": "objects"}


def _cast(name: str, datatype: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` (as JSON gave it) converted to ``datatype``, refusing what would change its values."""
    target = _NP[datatype]
    kind = arr.dtype.kind
    if datatype == "BOOL" and kind in "iu" and bool(((arr == 0) | (arr == 1)).all()):
        return arr.astype(target)
    if kind not in _KINDS.get(datatype, "iuf"):
        raise _bad(f"input {name!r}: received {_KIND_NAMES.get(kind, arr.dtype.name)} "
                   f"(e.g. {arr.reshape(-1)[0].item()!r}), expected {datatype} values as JSON "
                   f"{'true/false' if datatype == 'BOOL' else 'numbers'}; send the numbers themselves")
    if np.issubdtype(target, np.integer):
        if kind == "f":
            if not np.isfinite(arr).all() or bool((arr != np.floor(arr)).any()):
                bad = arr[~np.isfinite(arr) | (arr != np.floor(arr))].reshape(-1)[0].item()
                raise _bad(f"input {name!r}: received {bad!r} for {datatype}, expected whole numbers; "
                           "round on the client if that is what you mean")
        info = np.iinfo(target)
        if arr.size and (arr.min() < info.min or arr.max() >= info.max + 1):  # + 1: exact for floats too
            raise _bad(f"input {name!r}: received values in [{arr.min()}, {arr.max()}], {datatype} holds "
                       f"[{info.min}, {info.max}]")
    elif kind == "f" and target != np.float64:
        with np.errstate(over="ignore"):  # out of range -> inf: the NaN/inf check rejects it
            return arr.astype(target)
    return arr.astype(target, copy=False)


def _check_range(name: str, bounds: tuple[float, float], arr: np.ndarray) -> None:
    low, high = bounds
    if arr.size and (arr.min() < low or arr.max() > high):
        raise _bad(f"input {name!r}: received values in [{arr.min()}, {arr.max()}], this model takes "
                   f"[{low:g}, {high:g}] (e.g. token ids must be below its vocabulary size)")


def parse_infer_request(body: bytes | str | dict[str, Any], sig: ModelSignature) -> InferItem:
    """Validate a v2 infer request body against ``sig``; raises ``InputError`` on any problem."""
    if isinstance(body, dict):
        req = body
    else:
        try:
            req = _loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise _bad(f"request body is not valid JSON ({exc}); expected "
                       '{"inputs": [{"name", "shape", "datatype", "data"}, ...]}') from None
        except RecursionError:
            raise _bad("request body nests JSON too deeply to read; expected tensor data as a flat "
                       "or shape-nested list") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise _bad("request body must be a JSON object with an 'inputs' list, received "
                   f"{type(req).__name__}{'' if not isinstance(req, dict) else ' without inputs'}")
    given: dict[str, dict[str, Any]] = {}
    for obj in req["inputs"]:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise _bad(f"each input must be an object with a 'name'; received {str(obj)[:80]!r}")
        given[obj["name"]] = obj
    want = [s.name for s in sig.inputs]
    missing, unknown = [n for n in want if n not in given], sorted(set(given) - set(want))
    if missing or unknown:
        raise _bad(f"inputs received {sorted(given)}, expected {want}"
                   + (f"; missing {missing}" if missing else "") + (f"; unknown {unknown}" if unknown else ""))
    tensors = [_to_tensor(s, given[s.name], sig.allow_nan) for s in sig.inputs]
    rows = {t.shape[0] for t in tensors}
    if len(rows) != 1:
        raise _bad(f"inputs disagree on the batch dimension: {[list(t.shape) for t in tensors]}; "
                   "every input needs the same number of rows")
    lengths = {t.shape[1] for s, t in zip(sig.inputs, tensors) if s.ragged}
    if len(lengths) > 1:
        raise _bad(f"variable-length inputs disagree on dimension 1: {[list(t.shape) for t in tensors]}; "
                   "pad them to the same length")
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise _bad(f"'parameters' must be an object, received {type(params).__name__}")
    priority = params.get("priority", 0)
    timeout = params.get("timeout")
    if not isinstance(priority, int) or isinstance(priority, bool) or priority < 0:
        raise _bad(f"parameters.priority: received {priority!r}, expected an integer >= 0 (Triton's levels: "
                   "1 = most urgent, 0 = the model's default)")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise _bad(f"parameters.timeout: received {timeout!r}, expected a positive number of microseconds "
                   "(Triton's unit: 5000 = 5 ms)")
    rid = req.get("id")
    wanted, binary = _requested_outputs(req, params, sig)
    return InferItem(tensors, rows.pop(), lengths.pop() if lengths else None,
                     None if rid is None else str(rid), priority, None if timeout is None else timeout / 1e3,
                     wanted, binary)


def priority_level(priority: int, levels: int, default: int) -> int:
    """Triton's request priority -> the batcher's level (0 = most urgent of ``levels``).

    As Triton does: 0, or a value beyond the model's levels, means the default level; 1 is the most
    urgent, ``levels`` the least.
    """
    return default if priority == 0 or priority > levels else priority - 1


def _requested_outputs(req: dict[str, Any], params: dict[str, Any],
                       sig: ModelSignature) -> tuple[tuple[str, ...] | None, frozenset[str]]:
    """(outputs asked for, those to send binary): request ``outputs`` with per-output
    ``parameters.binary_data``, or ``parameters.binary_data_output`` for all."""
    names = [s.name for s in sig.outputs]
    every = params.get("binary_data_output", False)
    if not isinstance(every, bool):
        raise _bad(f"parameters.binary_data_output: received {every!r}, expected true or false")
    asked = req.get("outputs")
    if asked is None:
        return None, frozenset(names if every else ())
    if not isinstance(asked, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str) for o in asked):
        raise _bad(f"'outputs' must be a list of objects with a 'name', received {str(asked)[:80]!r}")
    wanted = tuple(o["name"] for o in asked)
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise _bad(f"outputs requested {list(wanted)}, this model has {names}; unknown {unknown}")
    binary = {o["name"] for o in asked if (o.get("parameters") or {}).get("binary_data", every) is True}
    return wanted, frozenset(binary)


def _loads(body: bytes | str) -> Any:
    if orjson is not None:
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass  # the stdlib also reads NaN/Infinity literals (answered with a clear 400 later)
    return json.loads(body)


def encode_infer_response(sig: ModelSignature, outputs: Sequence[Tensor], rid: str | None) -> bytes:
    outs = []
    for spec, t in zip(sig.outputs, outputs):
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        if orjson is not None:  # numpy view, flattened by numpy (a view when contiguous): no torch ops
            data = t.detach().numpy().reshape(-1)
        else:
            data = t.detach().reshape(-1).tolist()
        outs.append({"name": spec.name, "datatype": spec.datatype, "shape": list(t.shape), "data": data})
    body: dict[str, Any] = {"model_name": sig.name, "model_version": sig.versions[0], "outputs": outs}
    if rid is not None:
        body["id"] = rid
    if orjson is not None:
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(body, allow_nan=True).encode()


def assemble(items: Sequence[InferItem], sig: ModelSignature,
             buffers: list[Tensor] | None = None) -> tuple[list[Tensor], int | None]:
    """Stack requests into batch tensors, padding ragged inputs to the longest length.

    With ``buffers`` (one flat tensor per input, reused across batches) the batch is written into
    views of them and no new memory is allocated unless a buffer is too small (then it is grown
    in place of the list entry). Returns ``(batch tensors, padded length or None)``.
    """
    rows = sum(it.rows for it in items)
    lengths = [it.length for it in items if it.length is not None]
    padded = max(lengths) if lengths else None
    out: list[Tensor] = []
    for k, spec in enumerate(sig.inputs):
        first = items[0].tensors[k]
        shape = [rows, *first.shape[1:]]
        if spec.ragged:
            shape[1] = padded
        n = math.prod(shape)
        if buffers is not None:
            if buffers[k].numel() < n or buffers[k].dtype != spec.dtype:
                buffers[k] = torch.empty(max(n, 2 * buffers[k].numel()), dtype=spec.dtype,
                                         pin_memory=buffers[k].is_pinned())
            dst = buffers[k][:n].view(shape)
        else:
            dst = torch.empty(shape, dtype=spec.dtype)
        if all(it.tensors[k].dtype == dst.dtype and (not spec.ragged or it.tensors[k].shape[1] == padded)
               for it in items):  # nothing to pad: one copy for the whole batch, straight into dst
            torch.cat([it.tensors[k] for it in items], out=dst)
            out.append(dst)
            continue
        r = 0
        for it in items:
            src = it.tensors[k]
            m = src.shape[0]
            if spec.ragged and src.shape[1] != padded:
                dst[r:r + m, : src.shape[1]].copy_(src)
                dst[r:r + m, src.shape[1]:].fill_(spec.pad_value)
            else:
                dst[r:r + m].copy_(src)
            r += m
        out.append(dst)
    return out, padded


def split_outputs(outputs: Sequence[Tensor], items: Sequence[InferItem], sig: ModelSignature,
                  padded: int | None) -> list[list[Tensor]]:
    """Per request, its rows of every output; ragged outputs are cut back to its own length."""
    res: list[list[Tensor]] = [[] for _ in items]
    rows = [it.rows for it in items]
    for spec, t in zip(sig.outputs, outputs):
        parts = t.split(rows) if t.shape[0] == sum(rows) else _rows(t, rows)  # one call: views per request
        unpad = spec.ragged and padded is not None and t.dim() > 1 and t.shape[1] == padded
        for i, (it, part) in enumerate(zip(items, parts)):
            if unpad and it.length is not None and it.length != padded:
                part = part[:, : it.length]
            res[i].append(part)
    return res


def _rows(t: Tensor, rows: list[int]) -> list[Tensor]:
    """Per-request slices when ``t`` has a different row count than the batch (sliced as before)."""
    out, r = [], 0
    for m in rows:
        out.append(t[r:r + m])
        r += m
    return out
