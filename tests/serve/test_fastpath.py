"""The raw ASGI infer route, driven directly (no sockets): routing, answers, metrics, disconnects."""

from __future__ import annotations

import asyncio
import gc
import json
import threading

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from torchnitro.serve.batcher import BatchingConfig  # noqa: E402
from torchnitro.serve.models import ServedModel  # noqa: E402
from torchnitro.serve.protocol import InferItem, ModelSignature, TensorSpec  # noqa: E402
from torchnitro.serve.queue import Request  # noqa: E402
from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig  # noqa: E402
from torchnitro.serve.workers import InlinePool  # noqa: E402


class Gated:
    """``y = 2x + 1``; blocks while the gate is closed; records every row it computes."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.seen: list[float] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.gate.wait(10)
        self.seen += x[:, 0].tolist()
        return x * 2 + 1


def scope(path: str, method: str = "POST", headers: list | None = None) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": headers or []}


def body(v: float) -> bytes:
    return json.dumps({"id": str(v), "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                                 "data": [v, v, v, v]}]}).encode()


async def call(app, sc: dict, data: bytes, disconnect_after: float | None = None) -> tuple[int, dict, bytes]:
    msgs = [{"type": "http.request", "body": data, "more_body": False}]
    sent: list[dict] = []

    async def receive() -> dict:
        if msgs:
            return msgs.pop(0)
        if disconnect_after is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    async def send(msg: dict) -> None:
        sent.append(msg)

    await app(sc, receive, send)
    start, payload = sent
    return start["status"], dict(start["headers"]), payload["body"]


@pytest.fixture
def served():
    model = Gated()
    sig = ModelSignature("g", [TensorSpec("x", "FP32", (-1, 4))], [TensorSpec("y", "FP32", (-1, 4))])
    ep = ModelEndpoint("g", InlinePool(ServedModel(model, sig)), BatchingConfig(max_batch_size=1, max_wait_ms=0))
    srv = InferenceServer([ep], ServeConfig(port=0, workers=0, auth_token="tok"))
    return srv, ep, model


def test_infer_is_answered_without_starlette_and_other_routes_pass_through(served):
    srv, ep, model = served
    inner: list[str] = []

    async def starlette_stub(sc, receive, send):
        inner.append(f"{sc['method']} {sc['path']}")

    srv.app.app = starlette_stub
    auth = [(b"authorization", b"Bearer tok")]

    async def main():
        await ep.start(srv.metrics)
        model.gate.set()
        ok = await call(srv.app, scope("/v2/models/g/infer", headers=auth), body(3.0))
        await srv.app(scope("/v2/models/g/infer", "GET"), None, None)  # 405 is Starlette's job
        await srv.app(scope("/v2/models/a/b/infer"), None, None)  # not a model name: Starlette's 404
        await srv.app(scope("/v2/health/ready", "GET"), None, None)
        missing = await call(srv.app, scope("/v2/models/nope/infer", headers=auth), body(1.0))
        noauth = await call(srv.app, scope("/v2/models/g/infer"), body(1.0))
        await ep.batcher.stop()
        return ok, missing, noauth

    ok, missing, noauth = asyncio.run(asyncio.wait_for(main(), 20))
    status, headers, data = ok
    assert status == 200 and int(headers[b"content-length"]) == len(data)
    out = json.loads(data)
    assert out["id"] == "3.0" and out["outputs"][0]["data"] == [7.0] * 4
    assert inner == ["GET /v2/models/g/infer", "POST /v2/models/a/b/infer", "GET /v2/health/ready"]
    assert missing[0] == 404 and "unknown model 'nope'" in json.loads(missing[2])["error"]
    assert noauth[0] == 401 and noauth[1][b"www-authenticate"] == b"Bearer"
    text = srv.metrics.render().decode()
    assert 'torchnitro_requests_total{code="200",model="g"} 1.0' in text
    assert 'torchnitro_requests_total{code="404",model=""} 1.0' in text


def test_client_gone_while_queued_gets_499_and_is_never_computed(served):
    srv, ep, model = served
    auth = [(b"authorization", b"Bearer tok")]

    async def main():
        await ep.start(srv.metrics)
        running = asyncio.create_task(call(srv.app, scope("/v2/models/g/infer", headers=auth), body(1.0)))
        while ep.batcher.inflight < 1:  # until the first request holds the only slot (gate closed)
            await asyncio.sleep(0.001)
        # the second waits in the queue; its client leaves after 30 ms (after the 10 ms watch delay)
        gone = await call(srv.app, scope("/v2/models/g/infer", headers=auth), body(2.0), disconnect_after=0.03)
        model.gate.set()
        first = await running
        await ep.batcher.stop()
        return gone, first

    gone, first = asyncio.run(asyncio.wait_for(main(), 20))
    assert gone[0] == 499 and first[0] == 200
    assert model.seen == [1.0]  # the abandoned request never reached the model


def test_deep_json_is_a_400_and_an_unexpected_failure_is_a_json_500(served, monkeypatch):
    srv, ep, model = served
    auth = [(b"authorization", b"Bearer tok")]
    deep = b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": ' + b"[" * 10_000 \
        + b"]" * 10_000 + b"}]}"

    async def main():
        await ep.start(srv.metrics)
        model.gate.set()
        nested = await call(srv.app, scope("/v2/models/g/infer", headers=auth), deep)

        def broken(body, sig):
            raise KeyError("a bug")

        monkeypatch.setattr("torchnitro.serve.fastpath.parse_infer_request", broken)
        bug = await call(srv.app, scope("/v2/models/g/infer", headers=auth), body(1.0))
        await ep.batcher.stop()
        return nested, bug

    nested, bug = asyncio.run(asyncio.wait_for(main(), 20))
    assert nested[0] == 400 and "nests JSON too deeply" in json.loads(nested[2])["error"]
    assert bug[0] == 500 and bug[1][b"content-type"] == b"application/json"
    assert "KeyError" in json.loads(bug[2])["error"]
    assert 'torchnitro_requests_total{code="500",model="g"} 1.0' in srv.metrics.render().decode()


def test_failed_requests_are_freed_without_the_cycle_collector():
    """A request whose model call raised is answered 500; once answered, nothing may hold it or its
    input tensors except a reference cycle (error -> traceback -> the route's frame -> request ->
    future -> error), which only the cyclic GC would free (see test_batcher's test of the same)."""

    def model(x: torch.Tensor) -> torch.Tensor:
        if bool((x[:, 0] < 0).any()):
            raise ValueError("negative rows are refused")
        return x * 2 + 1

    sig = ModelSignature("g", [TensorSpec("x", "FP32", (-1, 4))], [TensorSpec("y", "FP32", (-1, 4))])
    ep = ModelEndpoint("g", InlinePool(ServedModel(model, sig)), BatchingConfig(max_batch_size=4, max_wait_ms=1))
    srv = InferenceServer([ep], ServeConfig(port=0, workers=0))

    async def main():
        await ep.start(srv.metrics)
        answers = await asyncio.gather(*(call(srv.app, scope("/v2/models/g/infer"), body(-v if v % 3 == 0 else v))
                                         for v in range(1, 13)))
        live = [sum(type(o) is t for o in gc.get_objects()) for t in (Request, InferItem)]
        await ep.batcher.stop()
        return [a[0] for a in answers], live

    gc.collect()
    gc.disable()  # what a cycle holds now stays held, so the count is deterministic
    try:
        statuses, live = asyncio.run(asyncio.wait_for(main(), 20))
    finally:
        gc.enable()
    assert statuses == [500 if v % 3 == 0 else 200 for v in range(1, 13)]
    assert live == [0, 0]


def test_a_receive_that_never_waits_does_not_hold_the_loop():
    """Outside torchnitro's own connections a waiting request's client is watched by awaiting
    ``receive()``; one that answers at once with a body message again and again (not a disconnect)
    must not spin the event loop: the request still gets its answer. Run in a thread, so a loop
    that spins fails the test (join times out) instead of hanging it."""
    model = Gated()
    sig = ModelSignature("g", [TensorSpec("x", "FP32", (-1, 4))], [TensorSpec("y", "FP32", (-1, 4))])
    ep = ModelEndpoint("g", InlinePool(ServedModel(model, sig)), BatchingConfig(max_batch_size=1, max_wait_ms=0))
    srv = InferenceServer([ep], ServeConfig(port=0, workers=0))
    assert not srv.app.own_connections  # the task-based watch, as under another server or Ray's proxy
    result: list = []

    async def main():
        await ep.start(srv.metrics)
        sent: list[dict] = []

        async def receive() -> dict:  # never waits, never reports a disconnect
            return {"type": "http.request", "body": body(4.0), "more_body": False}

        async def send(msg: dict) -> None:
            sent.append(msg)

        task = asyncio.create_task(srv.app(scope("/v2/models/g/infer"), receive, send))
        await asyncio.sleep(0.05)  # past the 10 ms after which the watch starts; the gate holds the batch
        model.gate.set()
        await task
        await ep.batcher.stop()
        return sent

    def runner():
        result.append(asyncio.run(main()))

    t = threading.Thread(target=runner, daemon=True)
    t.start()
    t.join(15)
    assert not t.is_alive(), "the event loop is held by the disconnect watch"
    sent = result[0]
    assert sent[0]["status"] == 200 and json.loads(sent[1]["body"])["outputs"][0]["data"] == [9.0] * 4
