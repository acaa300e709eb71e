"""KServe v2 gRPC front-end: ``inference.GRPCInferenceService`` beside the HTTP server.

It answers ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and ModelInfer
(``proto/grpc_predict_v2.proto``), and Triton's ModelConfig and ModelStatistics (``serve.triton``) with the same ``ModelEndpoint`` objects as HTTP: one batcher per
model, so gRPC and HTTP requests share batches, the queue bound, deadlines and drain. It runs as a
``grpc.aio`` server on the HTTP server's event loop, started with ``ServeConfig.grpc_port``
(``torchnitro serve --grpc-port N``) and stopped after the drain on SIGTERM.

Inputs come either typed (``contents.fp32_contents`` ...) or as ``raw_input_contents`` (little-endian
bytes per input, as ``tritonclient.grpc`` sends by default); both go through the HTTP path's
validation (``protocol.parse_infer_request``), so a request is accepted or refused the same way on
either transport. A raw request whose layout (input names, datatypes, shapes, parameters, outputs;
no id) was seen before reuses that validation and only checks its own bytes (``RawParser``). Outputs are raw (``raw_output_contents``) when the request sent raw inputs or an
output has no typed field (FP16, BF16), else typed. Errors map HTTP status -> gRPC code: 400
INVALID_ARGUMENT, 401 UNAUTHENTICATED, 404 NOT_FOUND, 429 RESOURCE_EXHAUSTED, 500 INTERNAL, 503
UNAVAILABLE, 504 DEADLINE_EXCEEDED. A client deadline becomes the request's deadline in the batcher;
a client that cancels has its request withdrawn. The bearer token, if set, is read from the
``authorization`` metadata (health RPCs are open, as on HTTP).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import grpc
import numpy as np
from google.protobuf import json_format
import torch
from torch import Tensor

from torchnitro.version import __version__
from torchnitro.errors import InputError, NitroError, ServeError
from torchnitro.serve.access import Refusal, bearer, find_model, not_accepting, token_ok
from torchnitro.serve.binary import _LE, _Plan, fast_input
from torchnitro.serve.protocol import (_NP, DATATYPES, InferItem, ModelSignature, array_from_bytes,
                                      parse_infer_request)
from torchnitro.serve.proto import grpc_predict_v2_pb2 as pb
from torchnitro.serve.triton import model_config, model_stats

if TYPE_CHECKING:  # pragma: no cover
    from torchnitro.serve.server import InferenceServer, ModelEndpoint

__all__ = ["SERVICE", "GRPCFrontend", "RawParser", "request_to_body", "encode_response"]

SERVICE = "inference.GRPCInferenceService"
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}
# v2 datatype -> the InferTensorContents field that carries it (FP16/BF16 have none: raw only)
_FIELDS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
           "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
           "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
           "FP64": "fp64_contents", "BYTES": "bytes_contents"}


class _Abort(Exception):
    """An RPC answered with a status (the HTTP code it stands for) and a message."""

    def __init__(self, http_status: int, message: str):
        super().__init__(message)
        self.http_status = http_status


def _raw_array(name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray:
    """Little-endian bytes of one input -> its flat array for the shared validation (no Python list)."""
    if datatype not in DATATYPES:
        raise InputError(f"input {name!r}: datatype {datatype!r} cannot be sent raw here; expected one of "
                         f"{sorted(DATATYPES)}")
    if any(d < 0 for d in shape):
        raise InputError(f"input {name!r}: shape {shape} has a negative dimension; expected sizes >= 0")
    item = DATATYPES[datatype].itemsize
    want = math.prod(shape) * item
    if len(raw) != want:
        raise InputError(f"input {name!r}: raw_input_contents holds {len(raw)} bytes, shape {shape} of {datatype} "
                         f"needs {want} ({item} per element, little-endian)")
    return array_from_bytes(name, datatype, raw)


def _typed_list(t: Any) -> list[Any]:
    """The typed contents of one input, from the one field its datatype uses."""
    used = [f.name for f, _ in t.contents.ListFields()]
    field = _FIELDS.get(t.datatype)
    if field is None or t.datatype == "BYTES":
        raise InputError(f"input {t.name!r}: datatype {t.datatype!r} has no typed contents field this server reads; "
                         "send FP16/BF16 in raw_input_contents, and numbers for numeric inputs")
    stray = [u for u in used if u != field]
    if stray:
        raise InputError(f"input {t.name!r}: datatype {t.datatype} is carried in contents.{field}, received "
                         f"{', '.join(stray)}; put the values in {field}")
    return list(getattr(t.contents, field))


def _param(p: Any) -> Any:
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def request_to_body(req: Any) -> dict[str, Any]:
    """A ``ModelInferRequest`` as the v2 JSON body ``parse_infer_request`` reads (one validation path)."""
    raw = list(req.raw_input_contents)
    if raw and len(raw) != len(req.inputs):
        raise InputError(f"raw_input_contents has {len(raw)} entries for {len(req.inputs)} inputs; expected one "
                         "per input, in the order of 'inputs' (or none, with typed contents)")
    inputs = []
    for i, t in enumerate(req.inputs):
        if raw and t.contents.ListFields():
            raise InputError(f"input {t.name!r}: has typed contents while the request also sends "
                             "raw_input_contents; use one or the other for every input")
        shape = list(t.shape)
        data = _raw_array(t.name, t.datatype, shape, raw[i]) if raw else _typed_list(t)
        inputs.append({"name": t.name, "datatype": t.datatype, "shape": shape, "data": data})
    body: dict[str, Any] = {"inputs": inputs, "parameters": {k: _param(v) for k, v in req.parameters.items()}}
    if req.id:
        body["id"] = req.id
    return body


_MAX_CACHED = 256  # distinct request layouts kept per front-end; beyond it the cache starts afresh


class RawParser:
    """``parse(request, sig)`` -> ``InferItem``, reusing what an earlier request of the same layout
    decided, as ``binary.BinaryParser`` does for HTTP: ``tritonclient.grpc`` repeats the same
    inputs (names, datatypes, shapes), parameters and outputs with only the raw bytes changing.

    Only id-less requests whose every input comes in ``raw_input_contents`` are kept, keyed by that
    layout; a repeat checks its own bytes (byte count, NaN, the model's value limits) and skips the
    rest. Anything else, or a changed layout, takes the full path (``request_to_body`` +
    ``parse_infer_request``); a request refused there is never kept.
    """

    def __init__(self, max_entries: int = _MAX_CACHED):
        self.max_entries = max_entries
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self.hits = 0  # requests answered from a kept layout (tests read it)

    def parse(self, req: Any, sig: ModelSignature) -> InferItem:
        raw = req.raw_input_contents
        key = None
        if not req.id and raw and len(raw) == len(req.inputs):
            key = (sig.name, tuple((t.name, t.datatype, tuple(t.shape), t.HasField("contents")) for t in req.inputs),
                   tuple(sorted((k, _param(v)) for k, v in req.parameters.items())),
                   tuple(o.name for o in req.outputs))
            plan = self._plans.get(key)
            if plan is not None and plan.sig is sig:
                tensors = []
                for spec, (idx, nbytes), shape, count in zip(sig.inputs, plan.slices, plan.shapes, plan.counts):
                    data = raw[idx]
                    if len(data) != nbytes:
                        raise InputError(f"input {spec.name!r}: raw_input_contents holds {len(data)} bytes, shape "
                                         f"{shape} of {spec.datatype} needs {nbytes} (little-endian)")
                    tensors.append(fast_input(spec, data, 0, shape, count, sig.allow_nan))
                self.hits += 1
                return InferItem(tensors, plan.rows, plan.length, None, plan.priority, plan.timeout_ms,
                                 plan.outputs, plan.binary_outputs)
        item = parse_infer_request(request_to_body(req), sig)
        if (_LE and key is not None and not any(k[3] for k in key[1])
                and all(s.datatype in _NP for s in sig.inputs)):
            order = {t.name: i for i, t in enumerate(req.inputs)}
            if len(self._plans) >= self.max_entries:
                self._plans.clear()
            self._plans[key] = _Plan(sig, 0, tuple((order[s.name], len(raw[order[s.name]])) for s in sig.inputs),
                                     tuple(list(t.shape) for t in item.tensors),
                                     tuple(t.numel() for t in item.tensors), item.rows, item.length, item.priority,
                                     item.timeout_ms, item.outputs, item.binary_outputs)
        return item


def _bytes(t: Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    arr = t.numpy()
    return arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()


def encode_response(sig: ModelSignature, outputs: list[Tensor], rid: str, wanted: list[str], raw: bool) -> Any:
    """The ``ModelInferResponse``: the outputs ``wanted`` (all when empty), raw or typed."""
    pairs = [(s, t.to(s.dtype)) for s, t in zip(sig.outputs, outputs) if not wanted or s.name in wanted]
    raw = raw or any(_FIELDS.get(s.datatype) is None for s, _ in pairs)
    resp = pb.ModelInferResponse(model_name=sig.name, model_version=sig.versions[0], id=rid)
    for spec, t in pairs:
        out = resp.outputs.add(name=spec.name, datatype=spec.datatype, shape=list(t.shape))
        if raw:
            resp.raw_output_contents.append(_bytes(t))
        else:
            getattr(out.contents, _FIELDS[spec.datatype]).extend(t.reshape(-1).tolist())
    return resp


class GRPCFrontend:
    """The gRPC service of one ``InferenceServer`` (its models, batchers, metrics and token)."""

    def __init__(self, server: "InferenceServer"):
        self.server = server
        self.port: int | None = None
        self._grpc: Any = None
        self._token = bearer(server.config.auth_token)
        self.parser = RawParser()  # request layouts seen before: validated once (RawParser)

    async def start(self, port: int | None = None, host: str | None = None) -> "GRPCFrontend":
        """Listen on ``host:port`` (default: ``ServeConfig.host`` and ``grpc_port``; 0 = any free port)."""
        cfg = self.server.config
        port = cfg.grpc_port if port is None else port
        limit = cfg.max_body_bytes
        self._grpc = grpc.aio.server(options=[("grpc.max_receive_message_length", limit),
                                              ("grpc.max_send_message_length", -1)])
        self._grpc.add_generic_rpc_handlers((self._handler(),))
        address = f"{host or cfg.host}:{0 if port is None else port}"
        self.port = self._grpc.add_insecure_port(address)
        if not self.port:
            raise ServeError(f"gRPC: could not listen on {address!r}; pick a free --grpc-port")
        await self._grpc.start()
        return self

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._grpc is not None:
            await self._grpc.stop(grace_s)

    def _handler(self) -> Any:
        rpcs: dict[str, tuple[Callable[..., Awaitable[Any]], Any, bool]] = {
            "ServerLive": (self.server_live, pb.ServerLiveRequest, False),
            "ServerReady": (self.server_ready, pb.ServerReadyRequest, False),
            "ModelReady": (self.model_ready, pb.ModelReadyRequest, True),
            "ServerMetadata": (self.server_metadata, pb.ServerMetadataRequest, True),
            "ModelMetadata": (self.model_metadata, pb.ModelMetadataRequest, True),
            "ModelInfer": (self.model_infer, pb.ModelInferRequest, True),
            "ModelConfig": (self.model_config, pb.ModelConfigRequest, True),
            "ModelStatistics": (self.model_statistics, pb.ModelStatisticsRequest, True),
        }
        return grpc.method_handlers_generic_handler(SERVICE, {
            name: grpc.unary_unary_rpc_method_handler(self._guard(fn, auth), request_deserializer=req.FromString,
                                                      response_serializer=lambda m: m.SerializeToString())
            for name, (fn, req, auth) in rpcs.items()})

    def _guard(self, fn: Callable[..., Awaitable[Any]], auth: bool) -> Callable[..., Awaitable[Any]]:
        """Token check, then ``fn``; an ``_Abort`` becomes the gRPC status it stands for."""
        async def call(request: Any, context: Any) -> Any:
            try:
                if auth:
                    self._check_token(context)
                return await fn(request, context)
            except _Abort as exc:
                await context.abort(_CODES.get(exc.http_status, grpc.StatusCode.INTERNAL), str(exc))
            except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL with a message, not a bare UNKNOWN
                if isinstance(exc, grpc.aio.AbortError):
                    raise
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error while answering this request: "
                                                              f"{type(exc).__name__}: {exc}")
        return call

    def _check_token(self, context: Any) -> None:
        if self._token is None:
            return
        got = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not token_ok(self._token, got):
            raise _Abort(401, "missing or wrong bearer token; send metadata 'authorization: Bearer <token>'")

    def _endpoint(self, name: str) -> "ModelEndpoint":
        ep = find_model(self.server.models, name)
        if isinstance(ep, Refusal):
            raise _Abort(ep.status, ep.message)
        return ep

    # ------------------------------------------------------------------ RPCs
    async def server_live(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: Any, context: Any) -> Any:
        srv = self.server
        return pb.ServerReadyResponse(ready=not srv.draining and all(e.serving for e in srv.models.values()))

    async def model_ready(self, request: Any, context: Any) -> Any:
        ep = self._endpoint(request.name)
        return pb.ModelReadyResponse(ready=ep.serving and not self.server.draining)

    async def server_metadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(name="torchnitro", version=__version__, extensions=[])

    async def model_metadata(self, request: Any, context: Any) -> Any:
        ep = self._endpoint(request.name)
        if not ep.ready:
            raise _Abort(503, f"model {ep.name!r} is still loading")
        m = ep.signature.metadata()
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(name=m["name"], versions=m["versions"], platform=m["platform"],
                                        inputs=[tensor(**t) for t in m["inputs"]],
                                        outputs=[tensor(**t) for t in m["outputs"]])

    async def model_config(self, request: Any, context: Any) -> Any:
        """Triton's ModelConfig RPC: the same configuration as ``GET /v2/models/{name}/config``."""
        ep = self._endpoint(request.name)
        if not ep.ready:
            raise _Abort(503, f"model {ep.name!r} is still loading")
        return pb.ModelConfigResponse(config=json_format.ParseDict(model_config(ep), pb.ModelConfig()))

    async def model_statistics(self, request: Any, context: Any) -> Any:
        """Triton's ModelStatistics RPC: one model (``name``) or every model, as over HTTP."""
        eps = [self._endpoint(request.name)] if request.name else list(self.server.models.values())
        stats = model_stats(self.server.metrics, [e for e in eps if e.ready])
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def model_infer(self, request: Any, context: Any) -> Any:
        name = request.model_name
        try:
            resp = await self._infer(request, context)
        except _Abort as exc:
            self._count(name, exc.http_status)
            raise
        self._count(name, 200)
        return resp

    def _count(self, name: str, status: int) -> None:
        model = name if name in self.server.models and status != 401 else ""
        self.server.metrics.requests.labels(model, str(status)).inc()

    async def _infer(self, request: Any, context: Any) -> Any:
        ep = self._endpoint(request.model_name)
        refused = not_accepting(self.server.draining, ep)
        if refused is not None:
            raise _Abort(refused.status, refused.message)
        batcher = ep.batcher
        sig = ep.signature
        wanted = [o.name for o in request.outputs]
        try:
            unknown = sorted(set(wanted) - {s.name for s in sig.outputs})
            if unknown:
                raise InputError(f"requested outputs {unknown} are unknown; model {ep.name!r} returns "
                                 f"{[s.name for s in sig.outputs]}")
            item = self.parser.parse(request, sig)
            left = context.time_remaining()  # the client's gRPC deadline (client_timeout), if it set one
            req = ep.enqueue(item, left * 1e3 if left is not None and left > 0 else None)
        except InputError as exc:
            raise _Abort(400, str(exc)) from None
        except ServeError as exc:
            raise _Abort(exc.status_code, str(exc)) from None
        try:
            outputs = await batcher.wait(req)  # a client cancel cancels this await: the request is withdrawn
        except ServeError as exc:
            raise _Abort(exc.status_code, str(exc)) from None
        except NitroError as exc:
            raise _Abort(400 if isinstance(exc, InputError) else 500, str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - one failing batch answers its requests, the server lives on
            raise _Abort(500, f"the model failed on this batch: {type(exc).__name__}: {exc}") from None
        finally:
            req = None  # an error's traceback keeps this frame: it must not keep req's future (batcher.wait)
        return encode_response(sig, list(outputs), request.id, wanted, raw=bool(request.raw_input_contents))
