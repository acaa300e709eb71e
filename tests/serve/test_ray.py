"""Ray Serve scale-out: two replicas on a local Ray cluster, correctness, then one replica killed under load."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (pip install 'torchnitro[ray]')")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed (pip install 'torchnitro[ray]')")
httpx = pytest.importorskip("httpx")

from torchnitro.errors import ConfigError  # noqa: E402
from torchnitro.nn.zoo import get_builtin  # noqa: E402
from torchnitro.serve.batcher import BatchingConfig  # noqa: E402
from torchnitro.serve.ray_app import ray_app, should_retry  # noqa: E402
from torchnitro.serve.server import ServeConfig  # noqa: E402

N, CONCURRENCY = 160, 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # body_timeout_s=5: a request Ray's router re-sends after the kill may find its body gone with the
    # dead replica; the replica then answers 503 (resent below) after 5 s instead of the default 30
    app = ray_app("mlp", replicas=2, num_cpus=0.5, batching=BatchingConfig(max_batch_size=8, max_wait_ms=2),
                  serve_config=ServeConfig(threads=1, body_timeout_s=5))
    serve.run(app, route_prefix="/")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _body(x: np.ndarray) -> dict:
    return {"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32", "data": x.reshape(-1).tolist()}]}


def _want(x: np.ndarray) -> np.ndarray:
    torch.manual_seed(0)
    return get_builtin("mlp").build().eval()(torch.from_numpy(x)).detach().numpy()


def test_should_retry_tells_a_dead_replica_from_a_model_error():
    assert should_retry(500, b"Internal Server Error") and should_retry(503, b'{"error": "draining"}')
    assert not should_retry(500, b'{"error": "the model failed on this batch: ..."}')
    assert not should_retry(400, b'{"error": "bad"}') and not should_retry(200, b"{}")


def test_bad_arguments_are_config_errors():
    with pytest.raises(ConfigError, match="replicas received 0"):
        ray_app("mlp", replicas=0)
    with pytest.raises(ConfigError, match="autoscaling received list"):
        ray_app("mlp", autoscaling=[1, 2])


def test_two_replicas_answer_like_the_model_and_survive_a_kill(cluster):
    base = cluster
    xs = np.random.default_rng(0).standard_normal((N, 1, 512)).astype(np.float32)
    want = _want(xs.reshape(N, 512))
    meta = httpx.get(base + "/v2/models/mlp", timeout=30).json()
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 512]}]

    async def run() -> tuple[dict[int, np.ndarray], Counter, Counter, list[str]]:
        answers: dict[int, np.ndarray] = {}
        replicas: Counter = Counter()
        retried: Counter = Counter()
        killed: list[str] = []
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(N):
            queue.put_nowait(i)

        async def client(c: httpx.AsyncClient) -> None:
            while not queue.empty():
                i = queue.get_nowait()
                for _ in range(20):  # the documented client contract: resend what should_retry says
                    r = await c.post("/v2/models/mlp/infer", json=_body(xs[i]))
                    if not should_retry(r.status_code, r.content):
                        break
                    retried[r.status_code] += 1
                    await asyncio.sleep(0.2)
                assert r.status_code == 200, (i, r.status_code, r.text[:300])
                out = r.json()["outputs"][0]
                answers[i] = np.asarray(out["data"], np.float32).reshape(out["shape"])
                replicas[r.headers["x-torchnitro-replica"]] += 1
                if len(answers) == N // 4 and not killed:  # a quarter in: kill one replica under load
                    killed.append(_kill_one_replica())

        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            await asyncio.gather(*(client(c) for _ in range(CONCURRENCY)))
        return answers, replicas, retried, killed

    answers, replicas, retried, killed = asyncio.run(run())
    assert sorted(answers) == list(range(N))  # no request lost
    got = np.concatenate([answers[i] for i in range(N)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(replicas) >= 2, replicas  # both replicas answered (before the kill at least)
    assert killed and killed[0]
    print(f"answers per replica {dict(replicas)}, retried {dict(retried)}")


def _kill_one_replica() -> str:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::") and "torchnitro-mlp" in a["name"]]
    assert len(names) == 2, names
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)
    return names[0]


def test_cli_ray_flags_reach_the_deployment(monkeypatch):
    import torchnitro.serve.ray_app as ray_app_mod
    from torchnitro.cli import main

    seen = {}
    monkeypatch.setattr(ray_app_mod, "run_ray", lambda model, **kw: seen.update(model=model, **kw))
    assert main(["serve", "mlp", "--ray", "--replicas", "3", "--port", "9123", "--max-batch-size", "4",
                 "--threads", "2"]) in (0, None)
    assert seen["model"] == "mlp" and seen["name"] == "mlp" and seen["replicas"] == 3
    assert seen["batching"].max_batch_size == 4
    assert (seen["serve_config"].port, seen["serve_config"].threads) == (9123, 2)
