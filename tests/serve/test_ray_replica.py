"""A Ray replica's request body that never comes: 503 to resend, not the slow-client 408.

Ray's router re-sends a request to another replica when the replica it went to dies before Ray
sees it accepted; that replica may already have taken the body from the proxy's one queue per
request, so the new replica's ``receive`` waits forever (the 408 after 30 s seen in
``test_ray.py``'s kill test). Killing a replica inside that window cannot be timed from a test, so
this drives ``NitroReplica`` directly (no Ray needed) with a ``receive`` that never answers, as
Ray's receive channel does then.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

pytest.importorskip("starlette")
from starlette.requests import Request  # noqa: E402

from torchnitro.serve.batcher import BatchingConfig  # noqa: E402
from torchnitro.serve.ray_app import NitroReplica, should_retry  # noqa: E402
from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig, make_pool  # noqa: E402

_BODY = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                "data": [1.0, 1.5, 2.0, 3.0]}]}).encode()


def _scope() -> dict:
    return {"type": "http", "method": "POST", "path": "/v2/models/affine/infer", "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(_BODY)).encode())],
            "query_string": b""}


async def _stalled() -> dict:
    await asyncio.Event().wait()  # Ray's receive channel when the body went with a dead replica
    raise AssertionError("unreachable")


async def _body() -> dict:
    return {"type": "http.request", "body": _BODY, "more_body": False}


def test_a_replica_whose_body_never_comes_answers_503_to_resend():
    async def run():
        replica = NitroReplica("torchnitro.serve.testing:affine", "affine", BatchingConfig(max_wait_ms=1),
                               ServeConfig(threads=1, body_timeout_s=0.3))
        try:
            t0 = time.monotonic()
            stalled = await asyncio.wait_for(replica(Request(_scope(), _stalled)), 10)
            waited = time.monotonic() - t0
            good = await asyncio.wait_for(replica(Request(_scope(), _body)), 30)  # the resend, body and all
        finally:
            if replica._life is not None:
                await replica._life.__aexit__(None, None, None)
        return stalled, waited, good

    stalled, waited, good = asyncio.run(run())
    assert stalled.status_code == 503, (stalled.status_code, stalled.body)
    assert should_retry(stalled.status_code, stalled.body)  # the documented client contract resends it
    assert stalled.headers["retry-after"] == "1" and stalled.headers["x-torchnitro-replica"]
    assert b"did not reach this replica within 0.3 s" in stalled.body
    assert 0.25 < waited < 5
    assert good.status_code == 200 and json.loads(good.body)["outputs"][0]["shape"] == [1, 4]


def test_outside_ray_a_body_that_never_comes_is_still_the_slow_client_408():
    async def run():
        cfg = ServeConfig(workers=0, threads=1, body_timeout_s=0.3)
        srv = InferenceServer([ModelEndpoint("affine", make_pool("torchnitro.serve.testing:affine", "affine", cfg),
                                             BatchingConfig(max_wait_ms=1))], cfg)
        sent: list[dict] = []

        async def send(msg: dict) -> None:
            sent.append(msg)

        async with srv._lifespan(srv.starlette):
            await asyncio.wait_for(srv.app(_scope(), _stalled, send), 10)
        return sent

    sent = asyncio.run(run())
    assert sent[0]["status"] == 408 and b"did not arrive within 0.3 s" in sent[1]["body"]
    assert not should_retry(408, sent[1]["body"])
