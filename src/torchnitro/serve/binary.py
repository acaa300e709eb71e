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
"""

from __future__ import annotations

import json
import sys
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from torchnitro.errors import InputError
from torchnitro.serve.protocol import (InferItem, ModelSignature, _loads, array_from_bytes, encode_infer_response,
                                      orjson)

__all__ = ["read_request", "encode_response"]

_LE = sys.byteorder == "little"


def _header_length(declared: bytes | str, body_len: int) -> int:
    text = declared.decode() if isinstance(declared, bytes) else declared
    if not text.isdigit() or int(text) > body_len:
        raise InputError(f"Inference-Header-Content-Length: received {text!r} for a {body_len}-byte body, "
                         "expected the byte length of the JSON header at the start of the body")
    return int(text)


def read_request(body: bytes, declared: bytes | str) -> dict[str, Any]:
    """The JSON header of a binary request with each binary input's bytes as an ndarray ``data``."""
    n = _header_length(declared, len(body))
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
        off += size
    if off != len(body):
        raise InputError(f"the body has {len(body) - off} bytes after the last binary input; expected "
                         "Inference-Header-Content-Length plus the binary_data_size of every binary input")
    return req


def _raw(t: Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    arr = t.numpy()
    return (arr if _LE else arr.astype(arr.dtype.newbyteorder("<"))).tobytes()


def encode_response(sig: ModelSignature, outputs: Sequence[Tensor], item: InferItem) -> tuple[bytes, int | None]:
    """(body, JSON header length or None): plain JSON unless outputs were chosen or asked binary."""
    if item.outputs is None and not item.binary_outputs:
        return encode_infer_response(sig, outputs, item.id), None
    by_name = {spec.name: (spec, t) for spec, t in zip(sig.outputs, outputs)}
    order = item.outputs if item.outputs is not None else [s.name for s in sig.outputs]
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
    head: dict[str, Any] = {"model_name": sig.name, "model_version": sig.versions[0], "outputs": outs}
    if item.id is not None:
        head["id"] = item.id
    header = orjson.dumps(head) if orjson is not None else json.dumps(head).encode()
    if not blobs:
        return header, None
    return header + b"".join(blobs), len(header)
