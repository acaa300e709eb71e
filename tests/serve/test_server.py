"""Reliability of the HTTP server: real uvicorn on loopback, bounded loops and timeouts everywhere."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.serve.batcher import BatchingConfig  # noqa: E402
from torchnitro.serve.loadtest import HttpClient  # noqa: E402
from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig, make_pool  # noqa: E402
from torchnitro.serve.testing import POISON, RAISE  # noqa: E402


@contextlib.contextmanager
def serving(spec: str, name: str, batching: BatchingConfig | None = None, **kw):
    cfg = ServeConfig(port=0, **{"workers": 0, **kw})
    srv = InferenceServer([ModelEndpoint(name, make_pool(spec, name, cfg), batching)], cfg).start_in_thread()
    try:
        yield srv, f"http://127.0.0.1:{srv.port}"
    finally:
        srv.stop()


def row(i: float) -> list[float]:
    return [i, i + 0.5, i + 1, i + 2]


def req(i: float, **params) -> dict:
    b = {"id": str(i), "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": row(i)}]}
    if params:
        b["parameters"] = params
    return b


def expect(i: float) -> list[float]:
    return [2 * v + 1 for v in row(i)]


def metric(base: str, name: str, **labels) -> float:
    text = httpx.get(base + "/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metadata_health_and_errors():
    with serving("torchnitro.serve.testing:affine", "affine", BatchingConfig(max_batch_size=4)) as (_, base):
        c = httpx.Client(base_url=base, timeout=10)
        assert c.get("/v2").json()["name"] == "torchnitro"
        assert c.get("/v2/health/live").status_code == 200
        assert c.get("/v2/health/ready").json() == {"ready": True}
        assert c.get("/v2/models/affine/ready").status_code == 200
        meta = c.get("/v2/models/affine").json()
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]
        assert meta["outputs"][0]["name"] == "y"
        r = c.post("/v2/models/affine/infer", json=req(3))
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == expect(3) and r.json()["id"] == "3"
        # errors: protocol shape {"error": "..."} with the right status
        for path, status in [("/v2/models/nope", 404), ("/v2/models/nope/ready", 404), ("/v3/x", 404)]:
            r = c.get(path)
            assert r.status_code == status and "error" in r.json()
        r = c.post("/v2/models/nope/infer", json=req(1))
        assert r.status_code == 404 and "serves ['affine']" in r.json()["error"]
        r = c.post("/v2/models/affine/infer", content=b'{"inputs": [')
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
        bad = req(1)
        bad["inputs"][0]["shape"] = [1, 3]
        bad["inputs"][0]["data"] = [1, 2, 3]
        r = c.post("/v2/models/affine/infer", json=bad)
        assert r.status_code == 400 and "dimension 1 is 3, expected 4" in r.json()["error"]
        bad = req(1)
        bad["inputs"][0]["datatype"] = "INT64"
        assert c.post("/v2/models/affine/infer", json=bad).status_code == 400
        nan = '{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, NaN, 2, 3]}]}'
        r = c.post("/v2/models/affine/infer", content=nan)
        assert r.status_code == 400 and "NaN" in r.json()["error"]
        r = c.post("/v2/models/affine/infer", json={"inputs": [{"name": "x", "shape": [5, 4], "datatype": "FP32",
                                                                "data": [0.0] * 20}]})
        assert r.status_code == 400 and "max_batch_size=4" in r.json()["error"]
        assert metric(base, "torchnitro_requests_total", code="400") >= 5
        assert metric(base, "torchnitro_batch_size_count") >= 1


def test_oversized_body_and_bearer_token():
    with serving("torchnitro.serve.testing:affine", "affine", max_body_bytes=300, auth_token="s3cret") as (_, base):
        c = httpx.Client(base_url=base, timeout=10)
        auth = {"Authorization": "Bearer s3cret"}
        assert c.get("/v2/health/live").status_code == 200  # probes need no token
        r = c.post("/v2/models/affine/infer", json=req(1))
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert c.post("/v2/models/affine/infer", json=req(1), headers={"Authorization": "Bearer x"}).status_code == 401
        assert c.post("/v2/models/affine/infer", json=req(1), headers=auth).status_code == 200
        big = {"inputs": [{"name": "x", "shape": [20, 4], "datatype": "FP32", "data": [0.123456] * 80}]}
        r = c.post("/v2/models/affine/infer", json=big, headers=auth)
        assert r.status_code == 413 and "limit is 300" in r.json()["error"]

        def chunks():  # no Content-Length: the limit is enforced while streaming
            yield json.dumps(big).encode()

        r = c.post("/v2/models/affine/infer", content=chunks(), headers=auth)
        assert r.status_code == 413


def test_burst_1000_into_queue_of_100_exactly_one_answer_each(monkeypatch):
    monkeypatch.setenv("TORCHNITRO_TEST_DELAY_S", "0.02")
    cfg = BatchingConfig(max_batch_size=8, max_wait_ms=2, max_queue_size=100)

    async def burst(base):
        async def one(i):  # one connection per request: all 1,000 arrive at once
            c = HttpClient(base, timeout_s=60)
            try:
                return i, *(await c.request("POST", "/v2/models/slow/infer", json.dumps(req(i)).encode()))
            finally:
                await c.close()

        return await asyncio.gather(*(one(i) for i in range(1000)))

    with serving("torchnitro.serve.testing:slow_affine", "slow", cfg) as (_, base):
        results = asyncio.run(asyncio.wait_for(burst(base), 120))
        codes = [status for _, status, _ in results]
        assert len(results) == 1000
        assert set(codes) <= {200, 429}, set(codes)
        assert codes.count(429) > 0 and codes.count(200) >= 100
        ids = []
        for i, status, data in results:
            body = json.loads(data)
            if status == 200:
                assert body["id"] == str(i) and body["outputs"][0]["data"] == expect(i)  # its own result
                ids.append(body["id"])
            else:
                assert "queue is full" in body["error"]
        assert len(set(ids)) == len(ids)  # none duplicated
        assert metric(base, "torchnitro_requests_total", code="200") == codes.count(200)
        assert metric(base, "torchnitro_requests_total", code="429") == codes.count(429)
        r = httpx.post(base + "/v2/models/slow/infer", json=req(1), timeout=10)
        assert r.status_code == 200  # and it still serves afterwards


def _concurrent(base: str, bodies: list[dict], timeout: float = 30) -> list[tuple[float, httpx.Response]]:
    """Post bodies concurrently (in order of creation); returns (finish time, response) each."""

    async def main():
        async with httpx.AsyncClient(base_url=base, timeout=timeout) as c:
            async def one(b, delay):
                await asyncio.sleep(delay)
                r = await c.post(f"/v2/models/{b.pop('model')}/infer", json=b)
                return time.monotonic(), r

            return await asyncio.gather(*(one(b, k * 0.003) for k, b in enumerate(bodies)))

    return asyncio.run(asyncio.wait_for(main(), timeout + 10))


def test_deadline_priority_and_cancellation(monkeypatch, tmp_path):
    """The model is held by a gate (a file), so each step waits for the server's own state (what is
    computing, how many wait), never for a sleep to be long enough."""
    gate = tmp_path / "gate"
    monkeypatch.setenv("TORCHNITRO_TEST_GATE", str(gate))
    monkeypatch.setenv("TORCHNITRO_TEST_DELAY_S", "0.02")  # once open: answers 20 ms apart, in order
    cfg = BatchingConfig(max_batch_size=1, max_wait_ms=0, priority_levels=3, aging_ms=60_000)
    with serving("torchnitro.serve.testing:gated_affine", "g", cfg) as (srv, base):
        b = srv.models["g"].batcher

        async def until(cond, what):
            for _ in range(3000):
                if cond():
                    return
                await asyncio.sleep(0.01)
            pytest.fail(f"never happened: {what}")

        async def scenario():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                finished = []

                async def post(i, **params):
                    r = await c.post("/v2/models/g/infer", json=req(i, **params))
                    finished.append(i)
                    return r

                async def blocked():  # one request computing behind the closed gate
                    gate.unlink(missing_ok=True)
                    t = asyncio.create_task(post(-1))
                    await until(lambda: b.inflight == 1, "the first request reached the model")
                    finished.clear()
                    return t

                # priority (Triton's levels, 1 = most urgent of 3): 12 low-priority requests wait,
                # then one urgent request overtakes them
                blocker = await blocked()
                low = [asyncio.create_task(post(i, priority=3)) for i in range(12)]
                await until(lambda: b.depth == 12, "12 requests queued")
                urgent = asyncio.create_task(post(100, priority=1))
                await until(lambda: b.depth == 13, "the urgent request queued")
                gate.touch()
                assert all(r.status_code == 200 for r in await asyncio.gather(blocker, urgent, *low))
                assert finished[:2] == [-1, 100], finished

                # deadline: stuck in the queue, a 30 ms deadline answers 504 and is never computed
                before = metric(base, "torchnitro_batch_size_count")
                blocker = await blocked()
                queued = [asyncio.create_task(post(i)) for i in range(3)]
                late = await post(7, timeout=30_000)  # microseconds, as in Triton
                assert late.status_code == 504 and "deadline" in late.json()["error"]
                gate.touch()
                assert all(r.status_code == 200 for r in await asyncio.gather(blocker, *queued))
                assert metric(base, "torchnitro_batch_size_count") - before == 4  # not the expired one

                # cancellation: a client that gives up is dropped from the queue
                before = metric(base, "torchnitro_batch_size_count")
                blocker = await blocked()
                queued = [asyncio.create_task(post(i)) for i in range(2)]
                await until(lambda: b.depth == 2, "2 requests queued")
                with pytest.raises(httpx.TimeoutException):
                    await c.post("/v2/models/g/infer", json=req(9), timeout=0.2)
                await until(lambda: metric(base, "torchnitro_requests_total", code="499") == 1, "499 counted")
                assert b.depth == 2
                gate.touch()
                assert all(r.status_code == 200 for r in await asyncio.gather(blocker, *queued))
                assert metric(base, "torchnitro_batch_size_count") - before == 3  # the abandoned one never ran

        asyncio.run(asyncio.wait_for(scenario(), 120))


def test_ragged_requests_are_padded_and_unpadded():
    cfg = BatchingConfig(max_batch_size=16, max_wait_ms=500, bucket_boundaries=(4, 16))  # all arrive within it
    with serving("torchnitro.serve.testing:ragged_double", "rd", cfg) as (_, base):
        lengths = [1, 3, 9, 2, 15, 30, 5, 4]
        bodies = [{"model": "rd", "id": str(n), "inputs": [{"name": "tokens", "shape": [1, n], "datatype": "INT64",
                                                             "data": list(range(n, 2 * n))}]} for n in lengths]
        done = _concurrent(base, bodies)
        for n, (_, r) in zip(lengths, done):
            out = r.json()["outputs"][0]
            assert out["shape"] == [1, n] and out["data"] == [2.0 * v for v in range(n, 2 * n)]
        assert metric(base, "torchnitro_batch_size_count") < len(lengths)  # some were batched together


def test_worker_crash_fails_its_batch_and_is_restarted():
    cfg = BatchingConfig(max_batch_size=8192, max_wait_ms=0)
    with serving("torchnitro.serve.testing:affine", "affine", cfg, workers=2, threads=1) as (srv, base):
        c = httpx.Client(base_url=base, timeout=30)
        pids = set(srv.models["affine"].pool.pids)
        r = c.post("/v2/models/affine/infer", json=req(POISON))
        assert r.status_code == 500 and "died" in r.json()["error"]
        for i in range(10):  # the other worker keeps serving meanwhile
            r = c.post("/v2/models/affine/infer", json=req(i))
            assert r.status_code == 200 and r.json()["outputs"][0]["data"] == expect(i)
        end = time.monotonic() + 60
        while metric(base, "torchnitro_worker_restarts_total") < 1 and time.monotonic() < end:
            time.sleep(0.1)
        assert metric(base, "torchnitro_worker_restarts_total") == 1
        end = time.monotonic() + 60
        while srv.models["affine"].pool._free.qsize() < 2 and time.monotonic() < end:
            time.sleep(0.1)
        new_pids = set(srv.models["affine"].pool.pids)
        assert len(new_pids - pids) == 1 and len(new_pids) == 2
        results = _concurrent(base, [{"model": "affine", **req(i)} for i in range(6)])
        assert all(r.status_code == 200 for _, r in results)
        # a reply larger than the pipe buffer (5000 x 4 floats) arrives whole
        big = {"inputs": [{"name": "x", "shape": [5000, 4], "datatype": "FP32", "data": list(range(20000))}]}
        r = c.post("/v2/models/affine/infer", json=big)
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2.0 * v + 1 for v in range(20000)]


def test_expired_and_abandoned_requests_inside_the_window_do_not_wedge_the_server():
    cfg = BatchingConfig(max_batch_size=8, max_wait_ms=300)
    with serving("torchnitro.serve.testing:affine", "affine", cfg) as (srv, base):
        c = httpx.Client(base_url=base, timeout=10)
        r = c.post("/v2/models/affine/infer", json=req(1, timeout=30))  # expires in its batch's window
        assert r.status_code == 504
        with pytest.raises(httpx.TimeoutException):  # this client hangs up inside the window
            c.post("/v2/models/affine/infer", json=req(2), timeout=0.1)
        time.sleep(0.3)  # both 300 ms windows are over (a sleep only overshoots)
        for _ in range(300):  # and the batch loop has seen it, however slowly it runs here
            if metric(base, "torchnitro_queue_depth") == 0:
                break
            time.sleep(0.1)
        assert metric(base, "torchnitro_queue_depth") == 0
        r = c.post("/v2/models/affine/infer", json=req(3))  # alone: answered at its window's end
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == expect(3)
        assert metric(base, "torchnitro_queue_depth") == 0
        srv.stop(timeout_s=20)  # idle: nothing to drain (it waited 30 s on a depth of -1)
        assert not srv._thread.is_alive()


@pytest.mark.parametrize("workers", [0, 1])
def test_one_bad_request_fails_alone_and_its_batch_mates_are_answered(workers):
    cfg = BatchingConfig(max_batch_size=4, max_wait_ms=5_000)  # closes when full: the 4 share a batch
    with serving("torchnitro.serve.testing:picky_affine", "picky", cfg, workers=workers, threads=1) as (_, base):
        done = _concurrent(base, [{"model": "picky", **req(v)} for v in (1, 2, RAISE, 4)])
        codes = [r.status_code for _, r in done]
        assert codes == [200, 200, 500, 200], [r.text for _, r in done]
        for v, (_, r) in zip((1, 2, 4), [done[0], done[1], done[3]]):
            assert r.json()["outputs"][0]["data"] == expect(v)
        assert "not allowed by this model" in done[2][1].json()["error"]
        # all 4 in one batch, then its halves [1, 2] and [RAISE, 4], then [RAISE] and [4] alone
        assert metric(base, "torchnitro_batch_size_count") == 5
        assert metric(base, "torchnitro_batch_size_sum") == 4 + 2 + 2 + 1 + 1


def test_token_model_limits_are_400s_before_batching():
    cfg = BatchingConfig(max_batch_size=8, max_wait_ms=20)
    with serving("encoder", "encoder", cfg) as (_, base):
        def ids(data, shape=None):
            return {"model": "encoder", "inputs": [{"name": "tokens", "shape": shape or [1, len(data)],
                                                    "datatype": "INT64", "data": data}]}

        bad = [ids([1, 8192]), ids([-5, 3]), ids([1] * 513), ids([], [1, 0]), ids([1.5, 2])]
        done = _concurrent(base, [ids([1, 2, 3]), *bad, ids([4, 5])])
        assert [r.status_code for _, r in done] == [200, 400, 400, 400, 400, 400, 200]
        errors = [r.json()["error"] for _, r in done[1:6]]
        assert "received values in [1, 8192], this model takes [0, 8191]" in errors[0]
        assert "received values in [-5, 3]" in errors[1]
        assert "dimension 1 (length) is 513, this model takes at most 512" in errors[2]
        assert "received shape [1, 0] with an empty dimension" in errors[3]
        assert "received 1.5 for INT64, expected whole numbers" in errors[4]


def _raw(port: int, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=20)  # generous bound: the server closes first
    s.sendall(data)
    return s


def _read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


_HEAD = b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n"  # a request head that never finishes


def test_connection_limit_answers_503_beyond_it():
    with serving("torchnitro.serve.testing:affine", "affine", max_connections=4) as (srv, base):
        slow = [_raw(srv.port, _HEAD) for _ in range(2)]
        good = httpx.post(base + "/v2/models/affine/infer", json=req(1), timeout=10)
        assert good.status_code == 200  # 2 slow connections + this one: under the limit of 4
        slow += [_raw(srv.port, _HEAD) for _ in range(2)]
        over = httpx.post(base + "/v2/models/affine/infer", json=req(2), timeout=10)
        assert over.status_code == 503  # the limit counts every open connection, slow ones too
        for s in slow:
            s.close()
        end = time.monotonic() + 20
        while (r := httpx.post(base + "/v2/models/affine/infer", json=req(3), timeout=10)).status_code == 503:
            assert time.monotonic() < end, "closed connections were never released"
            time.sleep(0.05)
        assert r.status_code == 200


def test_slow_request_heads_are_closed_and_slow_bodies_get_408():
    with serving("torchnitro.serve.testing:affine", "affine", header_timeout_s=0.3, body_timeout_s=0.3) as (srv, base):
        slow = [_raw(srv.port, _HEAD) for _ in range(3)]
        for s in slow:
            assert _read_all(s) == b""  # closed by the server without an answer
            s.close()
        body = json.dumps(req(3)).encode()
        trickle = _raw(srv.port, b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
                       b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        answer = _read_all(trickle)
        trickle.close()
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.3 s" in answer
        with httpx.Client(base_url=base, timeout=10) as c:  # keep-alive: a second request on the same connection
            for i in (4, 5):
                good = c.post("/v2/models/affine/infer", json=req(i))
                assert good.status_code == 200 and good.json()["outputs"][0]["data"] == expect(i)


def test_empty_token_is_refused_loudly():
    with pytest.raises(ConfigError, match="empty token, which would let every client in"):
        ServeConfig(auth_token="")
    with pytest.raises(ConfigError, match="empty token"):
        ServeConfig(auth_token="  ")


def test_readiness_follows_the_pool():
    with serving("torchnitro.serve.testing:affine", "affine") as (srv, base):
        pool = srv.models["affine"].pool
        assert httpx.get(base + "/v2/health/ready", timeout=10).status_code == 200
        pool.ready = False  # what a ProcessPool reports while every worker is being replaced
        assert httpx.get(base + "/v2/health/ready", timeout=10).status_code == 503
        assert httpx.get(base + "/v2/models/affine/ready", timeout=10).json() == {"name": "affine", "ready": False}
        pool.ready = True
        assert httpx.get(base + "/v2/models/affine/ready", timeout=10).status_code == 200


def test_a_client_that_hangs_up_is_withdrawn_by_its_connection_without_a_watcher_task(monkeypatch, tmp_path):
    """On the server's own connections the protocol's ``connection_lost`` withdraws a waiting request
    at once: no task per request awaiting ``http.disconnect`` (that fallback, for the app under another
    server, is switched off here, so only the connection's callback can withdraw it)."""
    from torchnitro.serve import fastpath

    watchers: list[int] = []
    monkeypatch.setattr(fastpath._ClientWatch, "_start", lambda self, *a: watchers.append(1))
    gate = tmp_path / "gate"
    monkeypatch.setenv("TORCHNITRO_TEST_GATE", str(gate))
    with serving("torchnitro.serve.testing:gated_affine", "g", BatchingConfig(max_batch_size=1, max_wait_ms=0)) \
            as (srv, base):
        b = srv.models["g"].batcher

        async def until(cond, what):
            for _ in range(3000):
                if cond():
                    return
                await asyncio.sleep(0.01)
            pytest.fail(f"never happened: {what}")

        async def scenario():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                blocker = asyncio.create_task(c.post("/v2/models/g/infer", json=req(1)))
                await until(lambda: b.inflight == 1, "the first request reached the model")
                data = json.dumps(req(2)).encode()
                s = socket.create_connection(("127.0.0.1", srv.port), timeout=5)
                s.sendall(b"POST /v2/models/g/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
                await until(lambda: b.depth == 1, "the second request queued")
                s.close()  # hangs up while queued
                await until(lambda: b.depth == 0 and b.pending == 1, "the second request withdrawn")
                gate.touch()
                first = await blocker
            return first

        first = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert first.status_code == 200 and first.json()["outputs"][0]["data"] == expect(1)
        assert metric(base, "torchnitro_requests_total", code="499") == 1
        assert metric(base, "torchnitro_batch_size_count") == 1  # the withdrawn request never ran
        assert watchers == []


def test_a_busy_keep_alive_connection_stays_open_and_a_late_next_head_is_closed():
    """The head timer is armed once and re-armed lazily: a connection that keeps sending requests for
    several header timeouts, with short pauses, is never closed (the timer fires mostly during a pause
    and must measure from that pause's start), and one whose next head is late after a response is."""
    # 1 s, not less: a stall of the test process longer than the timeout (a loaded CI machine) would close
    # the busy connection for the wrong reason
    with serving("torchnitro.serve.testing:affine", "affine", header_timeout_s=1.0) as (srv, base):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        data = json.dumps(req(1)).encode()
        one = (b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        answers, end = 0, time.monotonic() + 3.5  # three and a half header timeouts of back-to-back requests
        buf = b""
        while time.monotonic() < end:
            s.sendall(one)
            while b"\r\n\r\n" not in buf or len(buf.split(b"\r\n\r\n", 1)[1]) < int(
                    buf.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):
                chunk = s.recv(65536)
                assert chunk, f"the server closed a busy connection after {answers} answers"
                buf += chunk
            head, rest = buf.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 200")
            buf = rest[int(head.split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0]):]
            answers += 1
            time.sleep(0.05)  # mostly idle between requests, each gap well within the header timeout
        s.sendall(b"POST /v2/models/affine/infer HTTP/1.1\r\nHost: x\r\n")  # a head that never ends
        assert _read_all(s) == b""  # closed without an answer
        s.close()
        assert answers > 0
