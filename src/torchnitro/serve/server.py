"""HTTP server: KServe v2 / Open Inference Protocol (JSON) over starlette + uvicorn.

Routes: ``GET /v2``, ``/v2/health/live``, ``/v2/health/ready``, ``/v2/models/{name}``,
``/v2/models/{name}/ready``, ``POST /v2/models/{name}/infer``, ``GET /metrics``; and Triton's
``/v2/models/{name}/config``, ``/v2/models/stats``, ``/v2/models/{name}/stats`` (``serve.triton``).
Errors are ``{"error": "..."}`` with 400 (bad input), 401 (token), 404 (unknown model), 413 (body too
large), 429 (queue full, with ``Retry-After``), 500 (worker/model failure), 503 (draining, not ready)
and 504 (deadline). A client that disconnects while waiting has its request cancelled.

SIGTERM (or SIGINT) drains: readiness turns 503 and new requests are refused, everything already
accepted is computed and answered, then uvicorn shuts down and the workers stop. A second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from torchnitro.version import __version__
from torchnitro.errors import ConfigError, DrainingError, ServeError
from torchnitro.serve.access import UNAUTHORIZED, Refusal, bearer, find_model, token_ok
from torchnitro.serve.batcher import BatchingConfig, DynamicBatcher, Request
from torchnitro.serve.connections import default_max_connections, header_timeout_protocol
from torchnitro.serve.metrics import CONTENT_TYPE_LATEST, ServeMetrics
from torchnitro.serve.fastpath import InferPath
from torchnitro.serve.protocol import InferItem, priority_level
from torchnitro.serve.triton import model_config, model_stats

if TYPE_CHECKING:  # pragma: no cover - workers is imported when a pool is made
    from torchnitro.serve.workers import WorkerPool

__all__ = ["ServeConfig", "ModelEndpoint", "InferenceServer", "make_pool"]


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise: exposing a model is a decision
    port: int = 8000
    workers: int = 1  # model replicas (processes on CPU); 0 runs the model in the server process
    threads: int | None = None  # torch threads per worker; default: usable cores // workers
    device: str = "auto"  # "cuda": replicas on GPUs (streams per device); "cpu": processes; auto: cuda if seen
    streams: int = 2  # CUDA streams (replicas) per GPU: overlap one batch's copies with another's compute
    max_body_bytes: int = 8 * 2**20  # larger request bodies get 413 before they are read
    auth_token: str | None = None  # if set, every route but /v2/health/* needs "Bearer <token>"
    drain_timeout_s: float = 30.0  # SIGTERM: how long accepted requests may take to finish
    retry_after_s: int = 1  # Retry-After header on 429
    log_level: str = "warning"  # uvicorn's log level
    header_timeout_s: float = 10.0  # a request head must arrive within this, or the connection closes
    body_timeout_s: float = 30.0  # longest wait for the next chunk of a request body (then 408)
    keep_alive_s: float = 5.0  # idle keep-alive connections close after this
    max_connections: int | None = None  # beyond it, 503; None: the open-file limit less a reserve
    max_header_bytes: int = 16 * 2**10  # request line + headers larger than this are refused
    worker_timeout_s: float | None = 120.0  # a worker holding one batch longer is killed and replaced
    trust_code: bool = False  # artifact dirs may run code (.py factory, TorchScript): only from trusted sources
    grpc_port: int | None = None  # also serve KServe v2 gRPC (serve/grpc_server.py) here; 0 = any free port
    # workers=0: a batch predicted to take at most this long runs on the event loop, not a thread
    # (no hand-off, no GIL contention; InlinePool); None: always a thread
    inline_loop_ms: float | None = 5.0

    def __post_init__(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"ServeConfig.workers: received {self.workers}, expected >= 0")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"ServeConfig.device: received {self.device!r}, expected 'auto', 'cpu' or 'cuda'")
        if self.max_body_bytes < 1:
            raise ConfigError(f"ServeConfig.max_body_bytes: received {self.max_body_bytes}, expected >= 1")
        if self.grpc_port is not None and not 0 <= self.grpc_port <= 65535:
            raise ConfigError(f"ServeConfig.grpc_port: received {self.grpc_port}, expected a port in 0..65535 "
                              "(0 = any free port) or None for no gRPC")
        if self.auth_token is not None and not self.auth_token.strip():
            raise ConfigError("ServeConfig.auth_token: received an empty token, which would let every client "
                              "in; set a real token, or leave it unset (no --token, no TORCHNITRO_TOKEN) "
                              "to serve without authentication")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ServeConfig.{name}: received {getattr(self, name)}, expected seconds > 0")
        if self.max_connections is not None and self.max_connections < 1:
            raise ConfigError(f"ServeConfig.max_connections: received {self.max_connections}, expected >= 1")
        if self.inline_loop_ms is not None and self.inline_loop_ms < 0:
            raise ConfigError(f"ServeConfig.inline_loop_ms: received {self.inline_loop_ms}, expected "
                              "milliseconds >= 0, or None to run every in-process batch on a thread")
        if self.worker_timeout_s is not None and self.worker_timeout_s <= 0:
            raise ConfigError(f"ServeConfig.worker_timeout_s: received {self.worker_timeout_s}, expected "
                              "seconds > 0, or None for no watchdog")


def make_pool(spec: Any, name: str, config: ServeConfig,
              on_restart: Callable[[int], None] | None = None) -> WorkerPool:
    """A worker pool for ``spec``: CUDA streams on GPUs; else processes for string specs, in-process
    for objects or workers=0. Raises InputError for an artifact directory that needs the user's model object
    (``models.check_servable``) before any worker starts."""
    import torch

    from torchnitro.errors import BackendUnavailableError
    from torchnitro.serve.models import check_servable, resolve_model
    from torchnitro.serve.workers import DevicePool, InlinePool, ProcessPool

    check_servable(spec)  # an artifact serve cannot load alone: one clear error now, not at each worker's start-up
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        sm = resolve_model(spec, name, trust_code=config.trust_code)
        if sm.module is None:
            if config.device == "cuda":
                raise BackendUnavailableError(f"model {name!r} is not an nn.Module, so it cannot be copied to "
                                              "GPUs; serve it with --device cpu")
        else:
            return DevicePool(sm, sm.module, streams=config.streams)
    if config.workers == 0 or not isinstance(spec, str):
        if config.threads is not None:  # in-process: the server's own torch threads are the model's
            torch.set_num_threads(config.threads)
        return InlinePool(resolve_model(spec, name, trust_code=config.trust_code, threads=config.threads),
                          replicas=max(1, config.workers),
                          loop_max_ms=config.inline_loop_ms)
    return ProcessPool(spec, name, config.workers, threads=config.threads, on_restart=on_restart,
                       trust_code=config.trust_code, batch_timeout_s=config.worker_timeout_s)


class ModelEndpoint:
    """One served model: its worker pool and the batcher in front of it."""

    def __init__(self, name: str, pool: WorkerPool, batching: BatchingConfig | None = None):
        self.name, self.pool = name, pool
        self.batching = batching or BatchingConfig()
        self.batcher: DynamicBatcher | None = None
        self.ready = False

    async def start(self, metrics: ServeMetrics) -> None:
        await self.pool.start()
        cfg = dataclasses.replace(self.batching, concurrency=self.pool.size)
        sig = self.pool.signature
        exact = any(s.ragged for s in sig.inputs) and not sig.padding_safe
        observer = metrics.observer(self.name)
        self.batcher = await DynamicBatcher(self.pool.run, cfg, observer=observer, exact_lengths=exact).start()
        if hasattr(self.pool, "others"):  # InlinePool: a batch runs on the loop only with nothing else pending
            batcher = self.batcher
            self.pool.others = lambda n: batcher.pending - n
        observer.watch(self.batcher)
        self.ready = True

    @property
    def signature(self) -> Any:
        return self.pool.signature

    def enqueue(self, item: InferItem, timeout_ms: float | None = None) -> Request:
        """Queue a parsed request in this model's batcher, its Triton priority mapped to a level;
        ``timeout_ms`` (a transport's own deadline) overrides the item's when it is sooner."""
        if self.batcher is None:
            raise DrainingError(f"model {self.name!r} is not started; retry once it is ready")
        if timeout_ms is None or (item.timeout_ms is not None and item.timeout_ms < timeout_ms):
            timeout_ms = item.timeout_ms
        cfg = self.batcher.config
        level = priority_level(item.priority, cfg.priority_levels, cfg.default_priority)
        return self.batcher.enqueue(item, priority=level, timeout_ms=timeout_ms, rows=item.rows, length=item.length)

    @property
    def serving(self) -> bool:
        """Loaded, and at least one replica is up (not all being replaced after a crash or hang)."""
        return self.ready and self.pool.ready


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(obj), status_code=status, headers=headers, media_type="application/json")


def _error(msg: str, status: int, headers: dict[str, str] | None = None) -> Response:
    return _json({"error": msg}, status, headers)


class _Uvicorn(uvicorn.Server):
    """uvicorn whose first SIGTERM/SIGINT drains the batchers before shutting down."""

    def __init__(self, config: uvicorn.Config, owner: "InferenceServer"):
        super().__init__(config)
        self.owner = owner

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.owner.draining:
            self.should_exit = self.force_exit = True
            return
        self.owner.begin_drain(self)


class InferenceServer:
    def __init__(self, endpoints: Sequence[ModelEndpoint], config: ServeConfig | None = None, *,
                 behind_proxy: bool = False):
        """``behind_proxy``: requests come through another server's proxy (a Ray replica), not a
        socket of ours, so a body that never arrives is answered 503 (resend), not 408 (fastpath)."""
        self.config = config or ServeConfig()
        self.models = {e.name: e for e in endpoints}
        self.metrics = ServeMetrics()
        self.draining = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._uvicorn: _Uvicorn | None = None
        self._thread: threading.Thread | None = None
        self.grpc: Any = None  # the GRPCFrontend when config.grpc_port is set
        self.starlette = Starlette(routes=[
            Route("/v2", self.server_meta), Route("/v2/health/live", self.live),
            Route("/v2/health/ready", self.ready), Route("/v2/models/stats", self.stats),
            Route("/v2/models/{name}", self.model_meta),
            Route("/v2/models/{name}/ready", self.model_ready),
            Route("/v2/models/{name}/config", self.model_config), Route("/v2/models/{name}/stats", self.stats),
            Route("/v2/models/{name}/infer", self.infer, methods=["POST"]), Route("/metrics", self.prom),
        ], lifespan=self._lifespan, exception_handlers={HTTPException: self._http_error})
        # POST .../infer skips Starlette: the hot path
        self.app = InferPath(self, self.starlette, behind_proxy=behind_proxy)

    # ------------------------------------------------------------------ lifecycle
    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any) -> AsyncIterator[None]:
        self.loop = asyncio.get_running_loop()
        for e in self.models.values():
            e.pool.on_restart = lambda idx, n=e.name: self.metrics.restarts.labels(n).inc()
            await e.start(self.metrics)
        if self.config.grpc_port is not None:
            from torchnitro.serve.grpc_server import GRPCFrontend

            self.grpc = await GRPCFrontend(self).start()
        yield
        self.draining = True
        await self._drain()
        if self.grpc is not None:
            await self.grpc.stop()
        for e in self.models.values():
            await e.pool.close()

    async def _drain(self) -> None:
        await asyncio.gather(*(e.batcher.stop(drain=True, timeout_s=self.config.drain_timeout_s)
                               for e in self.models.values() if e.batcher is not None))

    def begin_drain(self, server: _Uvicorn) -> None:
        """Stop accepting, finish accepted requests, then let uvicorn exit."""
        self.draining = True

        async def drain_then_exit() -> None:
            await self._drain()
            server.should_exit = True

        if self.loop is not None:
            self.loop.call_soon_threadsafe(lambda: self.loop.create_task(drain_then_exit()))
        else:
            server.should_exit = True

    def _server(self) -> _Uvicorn:
        c = self.config
        cfg = uvicorn.Config(self.app, host=c.host, port=c.port, log_level=c.log_level, lifespan="on",
                             access_log=False, proxy_headers=False, server_header=False,
                             timeout_graceful_shutdown=c.drain_timeout_s,
                             http=header_timeout_protocol(c.header_timeout_s),
                             timeout_keep_alive=c.keep_alive_s, h11_max_incomplete_event_size=c.max_header_bytes,
                             limit_concurrency=c.max_connections or default_max_connections())
        self.app.own_connections = True  # header_timeout_protocol reports lost clients to the infer route
        self._uvicorn = _Uvicorn(cfg, self)
        return self._uvicorn

    def run(self) -> None:
        """Serve in the foreground until SIGTERM/SIGINT (then drain and return)."""
        self._server().run()

    def start_in_thread(self, timeout_s: float = 180.0) -> "InferenceServer":
        """Serve from a background thread (tests, notebooks); returns once it accepts connections."""
        server = self._server()
        self._thread = threading.Thread(target=server.run, name="torchnitro-serve", daemon=True)
        self._thread.start()
        end = time.monotonic() + timeout_s
        while not server.started:
            if not self._thread.is_alive():
                raise ServeError("the server thread exited during startup; see the log above for why")
            if time.monotonic() > end:
                raise ServeError(f"the server did not start within {timeout_s:.0f} s")
            time.sleep(0.02)
        return self

    @property
    def port(self) -> int:
        if self._uvicorn is not None and self._uvicorn.servers:
            return self._uvicorn.servers[0].sockets[0].getsockname()[1]
        return self.config.port

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain and stop a server started with ``start_in_thread``."""
        if self._uvicorn is not None and self._thread is not None and self._thread.is_alive():
            self.begin_drain(self._uvicorn)
            self._thread.join(timeout_s)

    # ------------------------------------------------------------------ routes
    def _auth(self, request: Request) -> Response | None:
        if request.url.path.startswith("/v2/health") or token_ok(bearer(self.config.auth_token),
                                                                 request.headers.get("authorization")):
            return None
        return _error(UNAUTHORIZED.message, 401, {"WWW-Authenticate": "Bearer"})

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        return _error(f"{request.method} {request.url.path}: {exc.detail}", exc.status_code)

    async def server_meta(self, request: Request) -> Response:
        return self._auth(request) or _json({"name": "torchnitro", "version": __version__,
                                             "extensions": ["binary_tensor_data"]})

    async def live(self, request: Request) -> Response:
        return _json({"live": True})

    async def ready(self, request: Request) -> Response:
        ok = not self.draining and all(e.serving for e in self.models.values())
        return _json({"ready": ok}, 200 if ok else 503)

    def _endpoint(self, request: Request) -> ModelEndpoint | Response:
        ep = find_model(self.models, request.path_params["name"])
        return _error(ep.message, ep.status) if isinstance(ep, Refusal) else ep

    def _loaded(self, request: Request) -> ModelEndpoint | Response:
        """The request's model once authorised and loaded, else the error answer."""
        ep = self._auth(request) or self._endpoint(request)
        if isinstance(ep, ModelEndpoint) and not ep.ready:
            return _error(f"model {ep.name!r} is still loading", 503)
        return ep

    async def model_meta(self, request: Request) -> Response:
        ep = self._loaded(request)
        return ep if isinstance(ep, Response) else _json(ep.signature.metadata())

    async def model_ready(self, request: Request) -> Response:
        ep = self._auth(request) or self._endpoint(request)
        if isinstance(ep, Response):
            return ep
        ok = ep.serving and not self.draining
        return _json({"name": ep.name, "ready": ok}, 200 if ok else 503)

    async def model_config(self, request: Request) -> Response:
        """Triton's ``GET /v2/models/{name}/config`` (``serve.triton``)."""
        ep = self._loaded(request)
        return ep if isinstance(ep, Response) else _json(model_config(ep))

    async def stats(self, request: Request) -> Response:
        """Triton's ``GET /v2/models/stats`` (every model) and ``/v2/models/{name}/stats``."""
        denied = self._auth(request)
        if denied is not None:
            return denied
        eps: list[ModelEndpoint] = list(self.models.values())
        if "name" in request.path_params:
            ep = self._endpoint(request)
            if isinstance(ep, Response):
                return ep
            eps = [ep]
        return _json(model_stats(self.metrics, [e for e in eps if e.ready]))

    async def prom(self, request: Request) -> Response:
        return self._auth(request) or Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def infer(self, request: Request) -> Response:
        # POST is answered by the raw ASGI path (InferPath) before Starlette sees it; this route
        # exists so other methods on the infer URL get Starlette's 405
        return _error("use POST for inference", 405)  # pragma: no cover - unreachable for POST
