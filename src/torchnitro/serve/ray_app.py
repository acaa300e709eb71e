"""Scale-out on Ray Serve: the same model, batcher and HTTP protocol in every replica of a deployment.

``ray_app(model, replicas=N)`` returns a Ray Serve ``Application``; ``serve.run(app)`` (or
``torchnitro serve MODEL --ray --replicas N``) starts it on the connected Ray cluster. Each replica
is one Ray actor holding an ``InferenceServer`` of its own: the model (in the actor's process, with
``threads`` torch threads), a ``DynamicBatcher`` with the given ``BatchingConfig`` and its own
Prometheus metrics. Ray's HTTP proxy is the ingress; each request it routes is handed to the
replica's own ASGI app, so the KServe v2 routes, the binary extension, validation, status codes and
``/metrics`` are the single-server ones (``/metrics`` answers for the replica that took the call,
named in the ``x-torchnitro-replica`` header).

Ray routes at most ``max_ongoing_requests`` requests to one replica at a time (default: twice
``max_batch_size``, one batch computing and one filling); the rest wait in Ray's proxy. With
``autoscaling`` (Ray's ``autoscaling_config`` dict: ``min_replicas``, ``max_replicas``,
``target_ongoing_requests`` ...) Ray sizes the deployment instead of ``replicas``.

A replica that dies (process killed, node lost) fails the requests it held: Ray's proxy answers
them with a plain-text 500, and Ray replaces the replica. Ray's router may also re-send a request
whose replica died before Ray saw it accepted to another replica, but the dead replica may already
have taken the body from the proxy: the new replica then waits ``ServeConfig.body_timeout_s`` for a
body that never comes and answers 503 (a slow-client 408 only where torchnitro owns the socket).
Those requests are safe to resend (inference has no side effects): ``should_retry(status, body)``
says which answers to resend.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from torchnitro.errors import ConfigError
from torchnitro.serve.batcher import BatchingConfig
from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig, make_pool

__all__ = ["ray_app", "run_ray", "NitroReplica", "should_retry"]


def should_retry(status: int, body: bytes) -> bool:
    """Whether a client should resend a request that got ``status``/``body`` from the deployment.

    502/503 (Ray's proxy without a replica, a replica draining, or one whose request body never came
    through Ray's proxy, see the module doc) and a 500 that is not this
    server's JSON error: Ray's proxy answers a request whose replica died with a plain-text
    ``Internal Server Error``, while a model failure is ``{"error": ...}`` and would fail again.
    """
    if status in (502, 503):
        return True
    return status == 500 and not body.lstrip().startswith(b'{"error"')


class NitroReplica:
    """One Ray Serve replica: an ``InferenceServer`` whose ASGI app answers what the proxy routes."""

    def __init__(self, model: Any, name: str, batching: BatchingConfig, serve_config: ServeConfig):
        import torch

        if serve_config.threads:
            torch.set_num_threads(serve_config.threads)
        # the replica is the process: the model runs in it (workers=0), on the batcher's one thread
        cfg = dataclasses.replace(serve_config, workers=0, grpc_port=None)
        # behind_proxy: the body comes through Ray's receive channel; one that never arrives (Ray re-sent
        # the request here after its first replica died holding the body) is answered 503, to resend
        self.server = InferenceServer([ModelEndpoint(name, make_pool(model, name, cfg), batching)], cfg,
                                      behind_proxy=True)
        self.replica_id = f"{os.uname().nodename}:{os.getpid()}"
        self._life: Any = None
        self._lock = asyncio.Lock()

    async def _started(self) -> None:
        """Load the model and start the batcher on the replica's event loop (once)."""
        async with self._lock:
            if self._life is None:
                life = self.server._lifespan(self.server.starlette)
                await life.__aenter__()
                self._life = life

    async def check_health(self) -> None:
        """Ray's health check: a replica whose model is gone (every worker down) is replaced."""
        await self._started()
        if not all(e.serving for e in self.server.models.values()):
            raise RuntimeError(f"replica {self.replica_id}: model not serving")

    async def __call__(self, request: Request) -> Response:
        await self._started()
        sent: dict[str, Any] = {"headers": [], "body": []}

        async def send(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                sent["status"], sent["headers"] = msg["status"], list(msg.get("headers", []))
            elif msg["type"] == "http.response.body":
                sent["body"].append(msg.get("body", b""))

        scope = dict(request.scope)
        scope["path"] = scope.get("path", "")[len(scope.get("root_path", "")):] or "/"
        scope["root_path"] = ""
        await self.server.app(scope, request.receive, send)
        headers = {k.decode(): v.decode() for k, v in sent["headers"] if k.lower() != b"content-length"}
        headers["x-torchnitro-replica"] = self.replica_id
        return Response(b"".join(sent["body"]), status_code=sent.get("status", 500), headers=headers)


def ray_app(model: Any, *, name: str | None = None, replicas: int = 1, autoscaling: dict[str, Any] | None = None,
            batching: BatchingConfig | None = None, serve_config: ServeConfig | None = None,
            num_cpus: float = 1.0, max_ongoing_requests: int | None = None) -> Any:
    """A Ray Serve application serving ``model`` (built-in name, artifact dir, ``module:factory``).

    ``replicas`` fixed replicas, or ``autoscaling`` (Ray's ``autoscaling_config``); ``num_cpus`` per
    replica actor; ``serve_config`` supplies ``threads``, ``auth_token``, ``max_body_bytes`` and
    ``trust_code`` (host, port and workers are Ray's business here).
    """
    from ray import serve

    if replicas < 1:
        raise ConfigError(f"ray_app: replicas received {replicas}, expected >= 1")
    if autoscaling is not None and not isinstance(autoscaling, dict):
        raise ConfigError(f"ray_app: autoscaling received {type(autoscaling).__name__}, expected Ray's "
                          "autoscaling_config dict, e.g. {'min_replicas': 1, 'max_replicas': 4}")
    batching = batching or BatchingConfig()
    if name is None:
        name = os.path.basename(os.path.normpath(model)) if isinstance(model, str) and os.path.isdir(model) \
            else str(model).rpartition(":")[2]
    opts: dict[str, Any] = {"name": f"torchnitro-{name}", "ray_actor_options": {"num_cpus": num_cpus},
                            "max_ongoing_requests": max_ongoing_requests or 2 * batching.max_batch_size}
    if autoscaling is not None:
        opts["autoscaling_config"] = autoscaling
    else:
        opts["num_replicas"] = replicas
    deployment = serve.deployment(NitroReplica, **opts)
    return deployment.bind(model, name, batching, serve_config or ServeConfig(threads=1))


def run_ray(model: Any, *, name: str | None, replicas: int, batching: BatchingConfig,
            serve_config: ServeConfig) -> None:
    """``torchnitro serve MODEL --ray``: join the Ray cluster (``RAY_ADDRESS``, else a local one),
    put Ray's HTTP proxy on ``serve_config.host:port`` and serve until interrupted."""
    import ray
    from ray import serve

    ray.init(address=os.environ.get("RAY_ADDRESS"))
    serve.start(http_options={"host": serve_config.host, "port": serve_config.port})
    app = ray_app(model, name=name, replicas=replicas, batching=batching, serve_config=serve_config,
                  num_cpus=float(serve_config.threads or 1))
    serve.run(app, route_prefix="/", blocking=True)
