from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.serve.cli import build_configs  # noqa: E402
from torchnitro.serve.loadtest import HttpClient  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_flags_override_yaml(tmp_path):
    p = tmp_path / "serve.yaml"
    p.write_text("version: 1\nbatching:\n  max_batch_size: 16\n  max_wait_ms: 3\nserve:\n  workers: 3\n")
    b, s = build_configs(str(p), max_wait_ms=9.0, port=1234, workers=None)
    assert (b.max_batch_size, b.max_wait_ms, s.workers, s.port, s.host) == (16, 9.0, 3, 1234, "127.0.0.1")
    p.write_text("version: 1\nbatching:\n  max_batchsize: 16\n")
    with pytest.raises(ConfigError, match="max_batchsize"):
        build_configs(str(p))


def _workers(pid: int) -> set[int]:
    """Live worker processes of server ``pid`` (multiprocessing spawns them with ``spawn_main``)."""
    out = set()
    for child in psutil.Process(pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                out.add(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("workers,sig", [(0, signal.SIGINT), (2, signal.SIGTERM)])
def test_signal_to_the_process_group_drains_accepted_requests_then_exits(tmp_path, workers, sig):
    """Ctrl-C (SIGINT) / docker stop / systemd / Kubernetes (SIGTERM) signal the whole group."""
    gate, port = tmp_path / "gate", free_port()
    env = {**os.environ, "TORCHNITRO_TEST_GATE": str(gate)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchnitro", "serve", "torchnitro.serve.testing:gated_affine", "--name", "g",
         "--workers", str(workers), "--threads", "1", "--port", str(port), "--max-batch-size", "2",
         "--max-wait-ms", "0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 90
        while True:
            try:
                if httpx.get(base + "/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > end:
                pytest.fail(f"server did not start: {proc.stdout.read().decode()[-2000:]}")
            time.sleep(0.2)

        def body(i):
            return json.dumps({"id": str(i), "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                                         "data": [i, i, i, i]}]}).encode()

        async def until(what, check):  # bounded polling of the server's own view, not a sleep race
            c = HttpClient(base, 5)
            try:
                for _ in range(600):
                    if check(*(await c.request("GET", what))):
                        return
                    await asyncio.sleep(0.05)
                pytest.fail(f"{what} never reached the expected state")
            finally:
                await c.close()

        async def scenario():
            async def one(i):
                c = HttpClient(base, 60)
                try:
                    return await c.request("POST", "/v2/models/g/infer", body(i))
                finally:
                    await c.close()

            accepted = [asyncio.create_task(one(i)) for i in range(8)]  # held by the gate: in flight
            await until("/metrics", lambda s, t: _metric(t.decode(), "torchnitro_requests_pending") == 8)
            workers_before = _workers(proc.pid)
            os.killpg(proc.pid, sig)  # the whole group: server and its workers
            await until("/v2/health/ready", lambda s, t: s == 503)
            # the same workers hold the in-flight batches (a killed one would be restarted and its
            # batch retried: answered, but only after a reload)
            assert _workers(proc.pid) == workers_before and len(workers_before) == workers
            try:
                late = await one(99)
            except (OSError, asyncio.IncompleteReadError):
                late = (None, b"")  # listener already closed: also a refusal
            gate.touch()
            return await asyncio.gather(*accepted), late

        done, late = asyncio.run(asyncio.wait_for(scenario(), 120))
        assert [s for s, _ in done] == [200] * 8, done
        for i, (_, data) in enumerate(done):
            assert json.loads(data)["outputs"][0]["data"] == [2.0 * i + 1] * 4
        assert late[0] in (503, None)
        assert proc.wait(timeout=60) == 0  # generous bound; it used to take > 15 s with workers
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_serve_rejects_bad_flags():
    from torchnitro.cli import main

    assert main(["serve", "torchnitro.serve.testing:affine", "--buckets", "a,b"]) == 2
    assert main(["serve", "no_such_module_xyz:f", "--workers", "0"]) == 2
    assert main(["serve", "torchnitro.serve.testing:affine", "--workers", "0", "--token", ""]) == 2  # no open door


def test_loadtest_command_writes_results(tmp_results):
    from torchnitro.cli import main
    from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig, make_pool

    cfg = ServeConfig(port=0, workers=0)
    srv = InferenceServer([ModelEndpoint("affine", make_pool("torchnitro.serve.testing:affine", "affine", cfg))],
                          cfg).start_in_thread()
    try:
        code = main(["loadtest", f"http://127.0.0.1:{srv.port}", "--model", "affine", "--concurrency", "2",
                     "--rate", "50", "--duration", "0.3", "--out", "lt_cli"])
    finally:
        srv.stop()
    assert code == 0
    rows = json.loads((tmp_results / "lt_cli.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == ["closed", "open"] and all(r["ok"] > 0 for r in rows)
    assert (tmp_results / "lt_cli.png").stat().st_size > 0
    assert main(["loadtest", f"http://127.0.0.1:{free_port()}", "--model", "affine"]) == 2  # nothing listening
