"""The KServe v2 / Triton binary tensor data extension over HTTP.

A request with an ``Inference-Header-Content-Length: N`` header carries N bytes of JSON, then the
raw bytes of every input whose JSON says ``"parameters": {"binary_data_size": K}``, in the order of
the ``inputs`` list (little-endian, row-major; BOOL is one byte per element). ``read_request``
turns those bytes into numpy arrays in place of ``data``, so they go through the same validation as
JSON numbers (``protocol.parse_infer_request``): shape, element count, NaN, the model's limits.

Outputs come back binary when the request says ``"parameters": {"binary_data_output": true}`` or,
per output, ``"outputs": [{"name": ..., "parameters": {"binary_data": true}}]`` (what
``tritonclient.http`` sends by default): ``encode_response`` writes the JSON header with
``binary_data_size`` per binary output, then their bytes, and returns the header's length for the
``Inference-Header-Content-Length`` response header.

A client's binary requests mostly repeat the same JSON header byte for byte (same names, shapes,
sizes and parameters; no ``id``), and so do the answers' headers. ``BinaryParser`` keeps what a
header decided (validated shapes, where each input's bytes lie, parameters, outputs asked for) and
``encode_response`` keeps the answer header it wrote (and which outputs follow it), so a repeat costs
a dict lookup instead of a JSON parse, the shape and parameter checks and a JSON write: a repeated
request's inputs are read straight from the body's bytes (``fast_input``), a repeated answer is the
kept header and each output tensor's bytes. The checks on the data itself (size, NaN, the model's
value limits) still run on every request.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from torchnitro.errors import InputError
from torchnitro.serve.protocol import (_NP, InferItem, ModelSignature, TensorSpec, _check_range, _loads,
                                      array_from_bytes, encode_infer_response, orjson, parse_infer_request)

__all__ = ["read_request", "encode_response", "BinaryParser", "fast_input"]

_MAX_CACHED = 256  # distinct headers kept (per parser, and for answers); beyond it the cache starts afresh
_MAX_HEADER = 4096  # longer request headers are not kept: the cache holds at most 256 x 4 KB

_LE = sys.byteorder == "little"


def _header_length(declared: bytes | str, body_len: int) -> int:
    text = declared.decode() if isinstance(declared, bytes) else declared
    if not text.isdigit() or int(text) > body_len:
        raise InputError(f"Inference-Header-Content-Length: received {text!r} for a {body_len}-byte body, "
                         "expected the byte length of the JSON header at the start of the body")
    return int(text)


def read_request(body: bytes, declared: bytes | str) -> dict[str, Any]:
    """The JSON header of a binary request with each binary input's bytes as an ndarray ``data``."""
    return _read(body, _header_length(declared, len(body)), {})


def _read(body: bytes, n: int, where: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """``read_request`` for an ``n``-byte header; records each binary input's (offset, size) in ``where``."""
    try:
        req = _loads(body[:n])
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"the first {n} bytes (Inference-Header-Content-Length) are not valid JSON ({exc}); "
                         "expected the JSON request header there") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise InputError("the JSON header must be an object with an 'inputs' list")
    view, off = memoryview(body), n
    for obj in req["inputs"]:
        size = ((obj.get("parameters") or {}) if isinstance(obj, dict) else {}).get("binary_data_size")
        if size is None:
            continue
        name = obj.get("name")
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or off + size > len(body):
            raise InputError(f"input {name!r}: binary_data_size {size!r} does not fit the {len(body) - off} "
                             "bytes left in the body; expected the byte size of this input's data")
        if "data" in obj:
            raise InputError(f"input {name!r}: has both 'data' and binary_data_size; send one of them")
        obj["data"] = array_from_bytes(name, obj.get("datatype"), view[off:off + size])
        where[name] = (off, size)
        off += size
    if off != len(body):
        raise InputError(f"the body has {len(body) - off} bytes after the last binary input; expected "
                         "Inference-Header-Content-Length plus the binary_data_size of every binary input")
    return req


@dataclass(frozen=True)
class _Plan:
    """What one binary request header decided: all of the request but its input bytes."""

    sig: ModelSignature
    size: int  # body length: header + every input's bytes
    slices: tuple[tuple[int, int], ...]  # (offset, size) of each signature input's bytes
    shapes: tuple[list[int], ...]  # each input's validated shape
    counts: tuple[int, ...]  # elements per input
    rows: int
    length: int | None
    priority: int
    timeout_ms: float | None
    outputs: tuple[str, ...] | None
    binary_outputs: frozenset[str]


def fast_input(spec: TensorSpec, buf: bytes | memoryview, off: int, shape: list[int], count: int,
               allow_nan: bool) -> Tensor:
    """One input of a request whose layout a kept header fixed: a view of its bytes (no parse, no
    dtype object built per call), checked for NaN and the model's value limits as
    ``protocol._checked`` does, then copied once into a writable tensor. Little-endian hosts only
    (parsers keep layouts only there)."""
    flat = np.frombuffer(buf, _NP[spec.datatype], count, off)
    if flat.dtype.kind == "f" and not allow_nan and not np.isfinite(flat).all():
        raise InputError(f"input {spec.name!r}: contains NaN or infinity; this model expects finite values")
    arr = flat.reshape(shape)
    if spec.value_range is not None:
        _check_range(spec.name, spec.value_range, arr)
    return torch.from_numpy(arr.copy())


class BinaryParser:
    """``parse(body, declared, sig)`` -> ``InferItem`` for a binary-extension request, with the
    decisions of a header seen before reused (module docstring). One per server: keyed by model
    name and header bytes."""

    def __init__(self, max_entries: int = _MAX_CACHED):
        self.max_entries = max_entries
        self._plans: dict[tuple[str, bytes], _Plan] = {}

    def parse(self, body: bytes, declared: bytes | str, sig: ModelSignature) -> InferItem:
        n = _header_length(declared, len(body))
        key = (sig.name, body[:n])
        plan = self._plans.get(key)
        if plan is not None and plan.sig is sig and len(body) == plan.size:
            tensors = [fast_input(spec, body, off, shape, count, sig.allow_nan)
                       for spec, (off, _), shape, count in zip(sig.inputs, plan.slices, plan.shapes, plan.counts)]
            return InferItem(tensors, plan.rows, plan.length, None, plan.priority, plan.timeout_ms, plan.outputs,
                             plan.binary_outputs)
        where: dict[str, tuple[int, int]] = {}
        item = parse_infer_request(_read(body, n, where), sig)
        if (_LE and item.id is None and n <= _MAX_HEADER
                and all(s.name in where and s.datatype in _NP for s in sig.inputs)):
            if len(self._plans) >= self.max_entries:
                self._plans.clear()
            shapes = tuple(list(t.shape) for t in item.tensors)
            self._plans[key] = _Plan(sig, len(body), tuple(where[s.name] for s in sig.inputs), shapes,
                                     tuple(t.numel() for t in item.tensors), item.rows, item.length, item.priority,
                                     item.timeout_ms, item.outputs, item.binary_outputs)
        return item


_HEADS: dict[tuple[Any, ...], bytes] = {}  # answer headers of all-binary, id-less answers


def _bytes(t: Tensor) -> bytes:
    """A CPU tensor's bytes as a kept answer layout sends them (little-endian host, no bf16); no
    ``detach`` (a new tensor object per call) for the usual output computed without grad."""
    return (t.detach() if t.requires_grad else t).numpy().tobytes()


def _raw(t: Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    arr = t.numpy()
    return (arr if _LE else arr.astype(arr.dtype.newbyteorder("<"))).tobytes()


# all-binary, id-less answers by (model, version, outputs asked, binary outputs, each output's shape
# and dtype): (answer header, which outputs in which order); their bytes are the tensors' own
_FAST: dict[tuple[Any, ...], tuple[bytes, tuple[int, ...]]] = {}


def encode_response(sig: ModelSignature, outputs: Sequence[Tensor], item: InferItem) -> tuple[bytes, int | None]:
    """(body, JSON header length or None): plain JSON unless outputs were chosen or asked binary."""
    if item.outputs is None and not item.binary_outputs:
        return encode_infer_response(sig, outputs, item.id), None
    if item.id is None:  # a repeat of an answer layout seen before: its header and the raw bytes
        key = (sig.name, sig.versions[0], item.outputs, item.binary_outputs,
               *[(t.shape, t.dtype, t.is_cpu) for t in outputs])
        hit = _FAST.get(key)
        if hit is not None:
            header, picks = hit
            return b"".join([header, *[_bytes(outputs[i]) for i in picks]]), len(header)
        body, n = _encode(sig, outputs, item)
        if n is not None and _LE and all(t.device.type == "cpu" and t.dtype == s.dtype and t.dtype != torch.bfloat16
                                         for s, t in zip(sig.outputs, outputs)):
            names = [s.name for s in sig.outputs]
            order = item.outputs if item.outputs is not None else names
            if all(name in item.binary_outputs for name in order):
                if len(_FAST) >= _MAX_CACHED:
                    _FAST.clear()
                _FAST[key] = (body[:n], tuple(names.index(name) for name in order))
        return body, n
    return _encode(sig, outputs, item)


def _encode(sig: ModelSignature, outputs: Sequence[Tensor], item: InferItem) -> tuple[bytes, int | None]:
    """``encode_response`` without the kept answer layouts."""
    by_name = {spec.name: (spec, t) for spec, t in zip(sig.outputs, outputs)}
    order = item.outputs if item.outputs is not None else [s.name for s in sig.outputs]
    if item.id is None and all(name in item.binary_outputs for name in order):
        key = (sig.name, sig.versions[0],
               *((name, by_name[name][0].datatype, *by_name[name][1].shape) for name in order))
        header = _HEADS.get(key)
        blobs = [_raw(by_name[name][1].to(by_name[name][0].dtype)) for name in order]
        if header is None:
            if len(_HEADS) >= _MAX_CACHED:
                _HEADS.clear()
            header = _HEADS[key] = _header(sig, item, [
                {"name": name, "datatype": by_name[name][0].datatype, "shape": list(by_name[name][1].shape),
                 "parameters": {"binary_data_size": len(blob)}} for name, blob in zip(order, blobs)])
        return header + b"".join(blobs), len(header)
    blobs, outs = [], []
    for name in order:
        spec, t = by_name[name]
        if name in item.binary_outputs:
            blob = _raw(t.to(spec.dtype))
            blobs.append(blob)
            outs.append({"name": name, "datatype": spec.datatype, "shape": list(t.shape),
                         "parameters": {"binary_data_size": len(blob)}})
        else:
            outs.append(json.loads(encode_infer_response(ModelSignature(sig.name, [], [spec]), [t], None))
                        ["outputs"][0])
    header = _header(sig, item, outs)
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)


def _header(sig: ModelSignature, item: InferItem, outs: list[dict[str, Any]]) -> bytes:
    head: dict[str, Any] = {"model_name": sig.name, "model_version": sig.versions[0], "outputs": outs}
    if item.id is not None:
        head["id"] = item.id
    return orjson.dumps(head) if orjson is not None else json.dumps(head).encode()
