from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

pytest.importorskip("uvicorn")

from torchnitro.errors import InputError  # noqa: E402
from torchnitro.serve.batcher import BatchingConfig  # noqa: E402
from torchnitro.serve.loadtest import (  # noqa: E402
    HttpClient,
    LoadTarget,
    closed_loop,
    interleaved,
    open_loop,
    save_results,
    v2_target,
)
from torchnitro.serve.metrics import parse_batch_size  # noqa: E402
from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig, make_pool  # noqa: E402


def test_closed_and_open_loop_against_a_real_server(tmp_results):
    cfg = ServeConfig(port=0, workers=0)
    ep = ModelEndpoint("affine", make_pool("torchnitro.serve.testing:affine", "affine", cfg),
                       BatchingConfig(max_batch_size=8, max_wait_ms=2))
    srv = InferenceServer([ep], cfg).start_in_thread()
    base = f"http://127.0.0.1:{srv.port}"
    try:
        async def main():
            target = await v2_target(base, "affine", variants=8)
            bodies = [json.loads(target.body(i))["inputs"][0]["data"] for i in range(8)]
            target.check = lambda i, data: json.loads(data)["outputs"][0]["data"] == \
                pytest.approx([2 * v + 1 for v in bodies[i % 8]], rel=1e-6)
            closed = await closed_loop(target, concurrency=4, duration_s=5.0, max_requests=120)
            opened = await open_loop(target, rate=200, duration_s=0.25)
            binary = await v2_target(base, "affine", variants=8, binary=True)
            n = int(binary.headers["Inference-Header-Content-Length"])

            def same_answer(i, data):  # binary in, binary out: one row of 4 FP32 after the JSON header
                return np.frombuffer(data[-16:], "<f4").tolist() == pytest.approx(
                    [2 * v + 1 for v in np.frombuffer(binary.body(i)[n:], "<f4").tolist()], rel=1e-6)

            binary.check = same_answer
            raw = await closed_loop(binary, concurrency=4, duration_s=5.0, max_requests=40)
            return closed, opened, raw

        closed, opened, raw = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        srv.stop()
    assert closed.sent == 120 and closed.ok == 120 and closed.errors == {}
    assert closed.throughput > 0 and closed.p50_ms <= closed.p90_ms <= closed.p99_ms
    assert closed.mean_batch is not None and 1.0 <= closed.mean_batch <= 4.0
    assert opened.sent == 50 and opened.ok == 50
    assert raw.sent == 40 and raw.ok == 40 and raw.errors == {}  # every binary answer was checked
    paths = save_results([closed, opened], "lt_test")
    assert {p.suffix for p in paths} == {".json", ".md", ".png"} and all(p.exists() for p in paths)
    data = json.loads((tmp_results / "lt_test.json").read_text())
    assert data["rows"][0]["mode"] == "closed"


def test_errors_are_counted_by_status():
    async def main():
        server = await asyncio.start_server(_teapot, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        from torchnitro.serve.loadtest import LoadTarget

        t = LoadTarget(f"http://127.0.0.1:{port}", "/x", lambda i: b"{}", metrics_path=None)
        res = await closed_loop(t, concurrency=2, duration_s=5, max_requests=10)
        server.close()
        return res

    res = asyncio.run(asyncio.wait_for(main(), 20))
    assert res.errors == {"418": 10} and res.ok == 0 and res.p50_ms is None


async def _teapot(reader, writer):
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0].split(b":")[1])
            await reader.readexactly(n)
            writer.write(b"HTTP/1.1 418 I'm a teapot\r\nContent-Length: 2\r\n\r\nno")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


def test_bad_url_and_metrics_parsing():
    with pytest.raises(InputError, match="http://host:port"):
        HttpClient("https://example.com")
    text = ('torchnitro_batch_size_sum{model="a"} 30.0\ntorchnitro_batch_size_count{model="a"} 10.0\n'
            'torchnitro_batch_size_sum{model="b"} 5.0\ntorchnitro_batch_size_count{model="b"} 5.0\n')
    assert parse_batch_size(text, "a") == (30.0, 10.0)
    assert parse_batch_size(text) == (35.0, 15.0)


def test_interleaved_loads_each_server_in_turn():
    async def main():
        hits: list[str] = []

        def handler(tag):
            async def serve(reader, writer):
                try:
                    while True:
                        head = await reader.readuntil(b"\r\n\r\n")
                        n = int([ln for ln in head.split(b"\r\n")
                                 if ln.lower().startswith(b"content-length")][0].split(b":")[1])
                        await reader.readexactly(n)
                        hits.append(tag)
                        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                        await writer.drain()
                except (asyncio.IncompleteReadError, ConnectionError):
                    writer.close()
            return serve

        servers = {tag: await asyncio.start_server(handler(tag), "127.0.0.1", 0) for tag in ("a", "b")}
        targets = {tag: LoadTarget(f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}", "/x", lambda i: b"{}",
                                   metrics_path=None) for tag, s in servers.items()}
        t0 = time.perf_counter()
        res = await interleaved(targets, concurrency=2, rounds=3, burst_s=0.05, focus=focused.append)
        run_s = time.perf_counter() - t0
        for s in servers.values():
            s.close()
        return res, hits, run_s

    focused: list[str | None] = []
    res, hits, run_s = asyncio.run(asyncio.wait_for(main(), 30))
    assert focused == [None, "a", "b", "b", "a", "a", "b", None]  # each burst's server, all of them around
    assert set(res) == {"a", "b"}
    for tag, r in res.items():
        assert r.ok == hits.count(tag) > 0 and r.errors == {} and r.throughput > 0
        assert r.duration_s >= 3 * 0.05  # three bursts, each runs until its 50 ms are over
    # each server's time is its own bursts only: together they fit inside the run (no wall-clock limit,
    # so a loaded machine cannot fail this; counting the whole run for each server would exceed it)
    assert res["a"].duration_s + res["b"].duration_s <= run_s
    # one server at a time, order rotating per round: a b | b a | a b -> runs a, b, a, b
    runs = [x for k, x in enumerate(hits) if k == 0 or hits[k - 1] != x]
    assert runs == ["a", "b", "a", "b"], runs
    with pytest.raises(InputError, match="rounds"):
        asyncio.run(interleaved({}, 1, 0, 1.0))
