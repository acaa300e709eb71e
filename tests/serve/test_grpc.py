"""KServe v2 gRPC front-end: a real grpc channel to a real server on loopback, next to its HTTP side."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest
import torch

grpc = pytest.importorskip("grpc")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")  # the HTTP side the gRPC front-end runs beside
pytest.importorskip("uvicorn")

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.serve.batcher import BatchingConfig  # noqa: E402
from torchnitro.serve.grpc_server import SERVICE  # noqa: E402
from torchnitro.serve.proto import grpc_predict_v2_pb2 as pb  # noqa: E402
from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig, make_pool  # noqa: E402

RPCS = {"ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse),
        "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse),
        "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse),
        "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse),
        "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse),
        "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse)}


class Client:
    """A plain v2 gRPC client on a real channel (no generated stubs needed: the method paths are the spec's)."""

    def __init__(self, port: int, metadata: tuple = ()):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.metadata = metadata

    def __getattr__(self, rpc: str):
        req_t, resp_t = RPCS[rpc]
        call = self.channel.unary_unary(f"/{SERVICE}/{rpc}", request_serializer=req_t.SerializeToString,
                                        response_deserializer=resp_t.FromString)
        return lambda req=None, **kw: call(req if req is not None else req_t(**kw), timeout=30,
                                           metadata=self.metadata)


@contextlib.contextmanager
def serving(spec: str = "mlp", name: str = "mlp", **kw):
    cfg = ServeConfig(port=0, grpc_port=0, **{"workers": 0, **kw})
    srv = InferenceServer([ModelEndpoint(name, make_pool(spec, name, cfg), BatchingConfig(max_batch_size=8))],
                          cfg).start_in_thread()
    try:
        yield srv, Client(srv.grpc.port), f"http://127.0.0.1:{srv.port}"
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def mlp():
    with serving() as s:
        yield s


def _raw_request(x: np.ndarray, **kw) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="mlp", **kw)
    req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.astype("<f4").tobytes())
    return req


def _http(base: str, x: np.ndarray) -> np.ndarray:
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}]}
    r = httpx.post(f"{base}/v2/models/mlp/infer", json=body, timeout=30)
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_health_and_metadata(mlp):
    srv, c, _ = mlp
    assert c.ServerLive().live and c.ServerReady().ready and c.ModelReady(name="mlp").ready
    meta = c.ServerMetadata()
    assert meta.name == "torchnitro" and meta.version
    m = c.ModelMetadata(name="mlp")
    assert m.name == "mlp" and list(m.versions) == ["1"]
    assert [(t.name, t.datatype, list(t.shape)) for t in m.inputs] == [("x", "FP32", [-1, 512])]
    assert [(t.datatype, list(t.shape)) for t in m.outputs] == [("FP32", [-1, 512])]
    with pytest.raises(grpc.RpcError) as e:
        c.ModelReady(name="nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in e.value.details()
    index = c.channel.unary_unary(f"/{SERVICE}/RepositoryIndex", request_serializer=bytes,
                                  response_deserializer=bytes)
    with pytest.raises(grpc.RpcError) as e:
        index(b"", timeout=30)  # a Triton-only RPC this server does not answer
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("rows", [1, 5])
def test_raw_both_ways_equals_http_and_the_model(mlp, rows):
    srv, c, base = mlp
    x = np.random.default_rng(rows).standard_normal((rows, 512)).astype(np.float32)
    resp = c.ModelInfer(_raw_request(x, id=f"r{rows}"))
    assert resp.id == f"r{rows}" and resp.model_name == "mlp" and len(resp.raw_output_contents) == 1
    out = resp.outputs[0]
    assert (out.datatype, list(out.shape)) == ("FP32", [rows, 512]) and not out.contents.fp32_contents
    got = np.frombuffer(resp.raw_output_contents[0], dtype="<f4").reshape(rows, 512)
    np.testing.assert_array_equal(got, _http(base, x))  # same batcher, same model: bit-identical
    from torchnitro.nn.zoo import get_builtin

    want = get_builtin("mlp").build().eval()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_typed_contents_both_ways(mlp):
    srv, c, base = mlp
    x = np.linspace(-1, 1, 2 * 512, dtype=np.float32).reshape(2, 512)
    req = pb.ModelInferRequest(model_name="mlp", outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(
        name="output")])
    req.inputs.add(name="x", datatype="FP32", shape=[2, 512]).contents.fp32_contents.extend(x.reshape(-1).tolist())
    resp = c.ModelInfer(req)
    assert not resp.raw_output_contents
    got = np.asarray(resp.outputs[0].contents.fp32_contents, dtype=np.float32).reshape(2, 512)
    np.testing.assert_array_equal(got, _http(base, x))


@pytest.mark.parametrize("case, match", [
    ("short-raw", r"holds 2044 bytes, shape \[1, 512\] of FP32 needs 2048"),
    ("wrong-dtype", r"datatype 'INT64' received, expected 'FP32'"),
    ("wrong-shape", r"dimension 1 is 511, expected 512"),
    ("nan", "NaN"),
    ("wrong-field", r"contents.fp32_contents, received int64_contents"),
    ("raw-count", r"raw_input_contents has 2 entries for 1 inputs"),
    ("unknown-output", r"requested outputs \['nope'\] are unknown"),
    ("unknown-input", r"inputs received \['y'\], expected \['x'\]"),
])
def test_bad_request_is_invalid_argument(mlp, case, match):
    srv, c, _ = mlp
    x = np.zeros((1, 512), np.float32)
    req = _raw_request(x)
    if case == "short-raw":
        req.raw_input_contents[0] = req.raw_input_contents[0][:-4]
    elif case == "wrong-dtype":
        req.inputs[0].datatype = "INT64"
        req.raw_input_contents[0] = np.zeros((1, 512), "<i8").tobytes()
    elif case == "wrong-shape":
        req = _raw_request(np.zeros((1, 511), np.float32))
    elif case == "nan":
        x[0, 3] = np.nan
        req = _raw_request(x)
    elif case == "wrong-field":
        req = pb.ModelInferRequest(model_name="mlp")
        req.inputs.add(name="x", datatype="FP32", shape=[1, 512]).contents.int64_contents.extend([0] * 512)
    elif case == "raw-count":
        req.raw_input_contents.append(b"")
    elif case == "unknown-output":
        req.outputs.add(name="nope")
    else:
        req.inputs[0].name = "y"
    with pytest.raises(grpc.RpcError) as e:
        c.ModelInfer(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(match, e.value.details()), e.value.details()
    assert c.ModelInfer(_raw_request(np.zeros((1, 512), np.float32))).outputs[0].shape == [1, 512]  # it answers on


def test_unknown_model_and_metrics_shared_with_http(mlp):
    srv, c, base = mlp
    with pytest.raises(grpc.RpcError) as e:
        c.ModelInfer(pb.ModelInferRequest(model_name="other"))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "serves ['mlp']" in e.value.details()
    c.ModelInfer(_raw_request(np.ones((1, 512), np.float32)))
    text = httpx.get(base + "/metrics", timeout=10).text
    assert 'torchnitro_requests_total{code="200",model="mlp"}' in text


def test_token_required_except_health():
    with serving(auth_token="s3cret") as (srv, c, _):
        assert c.ServerLive().live and c.ServerReady().ready
        with pytest.raises(grpc.RpcError) as e:
            c.ModelInfer(_raw_request(np.zeros((1, 512), np.float32)))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in e.value.details()
        ok = Client(srv.grpc.port, metadata=(("authorization", "Bearer s3cret"),))
        assert ok.ModelInfer(_raw_request(np.zeros((1, 512), np.float32))).outputs[0].name == "output"


def test_bad_grpc_port_is_a_config_error():
    with pytest.raises(ConfigError, match="grpc_port: received 70000"):
        ServeConfig(grpc_port=70000)


def test_tritonclient_grpc_defaults(mlp):
    """Triton's client as users call it: raw inputs, all outputs, its own copy of the v2 messages."""
    tc = pytest.importorskip("tritonclient.grpc")
    srv, _, base = mlp
    client = tc.InferenceServerClient(f"127.0.0.1:{srv.grpc.port}")
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("mlp")
    meta = client.get_model_metadata("mlp")
    assert meta.inputs[0].name == "x" and list(meta.inputs[0].shape) == [-1, 512]
    x = np.random.default_rng(7).standard_normal((3, 512)).astype(np.float32)
    inp = tc.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("mlp", [inp])
    np.testing.assert_array_equal(result.as_numpy("output"), _http(base, x))
    bad = tc.InferInput("x", [1, 4], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(Exception, match="dimension 1 is 4, expected 512"):
        client.infer("mlp", [bad])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_grpc_port_with_a_worker_process_then_sigterm(tmp_path):
    """`torchnitro serve mlp --grpc-port N`: gRPC next to HTTP on a worker process; SIGTERM stops both."""
    import os
    import signal
    import subprocess
    import sys
    import time

    port, gport = _free_port(), _free_port()
    env = {**os.environ, "TORCHNITRO_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "torchnitro", "serve", "mlp", "--workers", "1", "--threads", "1",
                             "--port", str(port), "--grpc-port", str(gport)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        c, end = Client(gport), time.monotonic() + 90
        while True:
            try:
                if c.ServerReady().ready:
                    break
            except grpc.RpcError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"server did not start: {proc.stdout.read().decode()[-2000:]}")
            time.sleep(0.2)
        x = np.full((2, 512), 0.25, np.float32)
        got = np.frombuffer(c.ModelInfer(_raw_request(x)).raw_output_contents[0], "<f4").reshape(2, 512)
        np.testing.assert_array_equal(got, _http(f"http://127.0.0.1:{port}", x))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_readiness_follows_the_pool_as_over_http():
    """While every worker of a model is being replaced, gRPC readiness is false, as HTTP's is 503."""
    with serving() as (srv, c, base):
        pool = srv.models["mlp"].pool
        assert c.ServerReady().ready and c.ModelReady(name="mlp").ready
        pool.ready = False  # what a ProcessPool reports while every worker is being replaced
        try:
            assert httpx.get(base + "/v2/health/ready", timeout=10).status_code == 503
            assert not c.ServerReady().ready and not c.ModelReady(name="mlp").ready
        finally:
            pool.ready = True
        assert c.ServerReady().ready and c.ModelReady(name="mlp").ready


def test_raw_inputs_reach_validation_as_arrays_not_lists():
    """gRPC raw contents become one typed numpy array per input (no Python list per element)."""
    from torchnitro.serve.grpc_server import request_to_body

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = request_to_body(_raw_request(x))["inputs"][0]["data"]
    assert isinstance(data, np.ndarray) and data.dtype == np.float32 and data.flags.writeable
    np.testing.assert_array_equal(data, x.reshape(-1))


def test_failed_requests_are_freed_without_the_cycle_collector():
    """A request the model raised on is answered INTERNAL; then nothing may hold it except a reference
    cycle (error -> traceback -> the RPC's frame -> request -> future -> error) that only the cyclic
    GC would free. The server runs in this process, so switching the collector off holds any cycle."""
    import gc
    import time

    from torchnitro.serve.queue import Request
    from torchnitro.serve.testing import RAISE

    with serving("torchnitro.serve.testing:picky_affine", "picky") as (srv, client, _):
        def infer(v: float) -> pb.ModelInferRequest:
            req = pb.ModelInferRequest(model_name="picky")
            req.inputs.add(name="x", datatype="FP32", shape=[1, 4])
            req.raw_input_contents.append(np.full((1, 4), v, "<f4").tobytes())
            return req

        gc.collect()
        gc.disable()
        try:
            for v in (1.0, RAISE, 2.0, RAISE):
                if v == RAISE:
                    with pytest.raises(grpc.RpcError) as err:
                        client.ModelInfer(infer(v))
                    assert err.value.code() == grpc.StatusCode.INTERNAL
                else:
                    client.ModelInfer(infer(v))
            for _ in range(500):  # the RPC's coroutine may finish just after its answer went out
                live = sum(type(o) is Request for o in gc.get_objects())
                if live == 0:
                    break
                time.sleep(0.01)
        finally:
            gc.enable()
    assert live == 0


def test_repeated_raw_layout_is_validated_once_and_every_request_still_checked(mlp, monkeypatch):
    """tritonclient.grpc repeats one layout: the second request of a layout skips the full parse
    (RawParser keeps its decisions), a changed shape or parameter takes the full path again, and a
    bad request inside a cached stream gets its own INVALID_ARGUMENT without spoiling the layout."""
    import torchnitro.serve.grpc_server as gs

    srv, c, base = mlp
    full = []
    real = gs.request_to_body
    monkeypatch.setattr(gs, "request_to_body", lambda req: full.append(1) or real(req))
    parser, rng = srv.grpc.parser, np.random.default_rng(7)
    hits0 = parser.hits
    xs = [rng.standard_normal((2, 512)).astype(np.float32) for _ in range(3)]
    outs = [np.frombuffer(c.ModelInfer(_raw_request(x)).raw_output_contents[0], "<f4").reshape(2, 512) for x in xs]
    assert len(full) == 1 and parser.hits == hits0 + 2  # one full parse, two reuses of its decisions
    for x, got in zip(xs, outs):
        np.testing.assert_array_equal(got, _http(base, x))  # each answer is its own request's
    bad = xs[0].copy()
    bad[1, 7] = np.nan
    for broken, match in [(_raw_request(bad), "NaN"), (_raw_request(xs[0]), "holds 4092 bytes")]:
        if match.startswith("holds"):
            broken.raw_input_contents[0] = broken.raw_input_contents[0][:-4]
        with pytest.raises(grpc.RpcError) as e:
            c.ModelInfer(broken)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and match in e.value.details()
    assert len(full) == 1  # both refused on the kept layout, by their own bytes
    again = np.frombuffer(c.ModelInfer(_raw_request(xs[1])).raw_output_contents[0], "<f4").reshape(2, 512)
    np.testing.assert_array_equal(again, outs[1])  # the layout still answers correctly after the refusals
    one = rng.standard_normal((6, 512)).astype(np.float32)  # a changed shape: a new layout, parsed in full
    got = np.frombuffer(c.ModelInfer(_raw_request(one)).raw_output_contents[0], "<f4").reshape(6, 512)
    np.testing.assert_array_equal(got, _http(base, one))
    req = _raw_request(one)
    req.parameters["timeout"].int64_param = 10_000_000  # a changed parameter: parsed in full as well
    c.ModelInfer(req)
    c.ModelInfer(_raw_request(one, id="with-id"))  # an id is never kept
    c.ModelInfer(_raw_request(one, id="with-id"))
    assert len(full) == 5
    with pytest.raises(grpc.RpcError) as e:  # a layout the full path refuses is never kept
        c.ModelInfer(_raw_request(np.zeros((1, 511), np.float32)))
    with pytest.raises(grpc.RpcError):
        c.ModelInfer(_raw_request(np.zeros((1, 511), np.float32)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(full) == 7
