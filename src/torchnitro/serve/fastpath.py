"""The inference route as a raw ASGI handler: the per-request hot path of the server.

``POST /v2/models/{name}/infer`` is answered here, in front of Starlette: no routing table, no
``Request``/``Response`` objects, no middleware stack. Each request costs one body read, one JSON
parse into numpy-backed tensors, one enqueue into the batcher, one wait and one JSON write (orjson
writes numpy arrays directly). Status codes and messages are the same as the Starlette routes':
400 bad input, 401 token, 404 unknown model, 408 body too slow, 413 body too large, 429 queue full
(``Retry-After``), 499 client gone, 500 model failure, 503 draining (or, behind Ray's proxy, a body
that never came), 504 deadline.

The body is read under one ``body_timeout_s`` timer. Where torchnitro owns the connection (uvicorn,
``torchnitro serve``) a body that misses it is a slow client's: 408. Behind Ray's proxy
(``behind_proxy``, the Ray replicas of ``serve.ray_app``) the body comes through Ray's receive
channel, and one that never comes is most likely a request Ray's router re-sent to this replica
after the replica it first went to died having already taken the body from the proxy's one queue
per request: nothing will ever arrive, so the answer is 503 with ``Retry-After``, which
``ray_app.should_retry`` tells the client to resend (a fresh request, with its body).

A client that disconnects while its request waits has the request withdrawn from the batcher (it
is never computed if still queued). On torchnitro's own connections (``InferenceServer`` runs
uvicorn with ``connections.header_timeout_protocol``: ``own_connections``) the protocol calls back
when the connection is lost, at no cost per request. Elsewhere (the app under another server,
Ray's proxy) a small task awaits the ASGI ``http.disconnect`` message, started once the request has
waited 10 ms, so the many fast answers under load need no task.

The binary tensor data extension (``Inference-Header-Content-Length``, ``serve.binary``) is read and
written here too: binary inputs become numpy arrays without a JSON number in between, and binary
outputs are the tensors' bytes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from torchnitro.errors import InputError, NitroError, ServeError
from torchnitro.serve.access import UNAUTHORIZED, Refusal, bearer, find_model, not_accepting, token_ok
from torchnitro.serve.binary import BinaryParser, encode_response
from torchnitro.serve.connections import CLIENT_GONE
from torchnitro.serve.protocol import parse_infer_request

if TYPE_CHECKING:  # pragma: no cover
    from torchnitro.serve.server import InferenceServer

__all__ = ["InferPath"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_PREFIX, _SUFFIX = "/v2/models/", "/infer"
_JSON = (b"content-type", b"application/json")
_BINARY = (b"content-type", b"application/octet-stream")
_HEADER_LENGTH = b"inference-header-content-length"  # binary tensor extension (serve.binary)
_WATCH_AFTER_S = 0.01  # how long a request waits before its client's disconnect is watched for


async def _within(seconds: float, coro: Awaitable[Any]) -> Any:
    """``await coro`` or raise ``asyncio.TimeoutError``; ``asyncio.timeout`` (3.11+) needs no task."""
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(seconds):
            return await coro
    return await asyncio.wait_for(coro, seconds)  # pragma: no cover - Python 3.10


def _err(msg: str, status: int, headers: list[tuple[bytes, bytes]] | None = None) -> tuple[int, bytes, list]:
    return status, json.dumps({"error": msg}).encode(), headers or []


class _ClientWatch:
    """Calls ``cancel`` (withdraws the waiting request) if the client goes away; ``gone`` says it did.

    ``hooked``: ``receive`` belongs to a connection of ``connections.header_timeout_protocol``, whose
    ``connection_lost`` calls back. Otherwise a task awaits ``receive()``'s ``http.disconnect``,
    started only if the request is still waiting after ``_WATCH_AFTER_S`` (uvicorn remembers a
    disconnect, so an earlier one is still seen).
    """

    __slots__ = ("gone", "_cancel", "_cycle", "_timer", "_task")

    def __init__(self, receive: Receive, cancel: Callable[[], None], hooked: bool) -> None:
        self.gone = False
        self._cancel: Callable[[], None] | None = cancel
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        cycle = getattr(receive, "__self__", None) if hooked else None
        self._cycle = cycle if hasattr(cycle, "disconnected") else None
        if self._cycle is not None:
            setattr(self._cycle, CLIENT_GONE, self._client_gone)
            if self._cycle.disconnected:  # it left before the callback was set
                self._client_gone()
        else:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(_WATCH_AFTER_S, self._start, receive, loop)

    def _client_gone(self) -> None:
        if self._cancel is not None:
            self.gone = True
            self._cancel()

    def _start(self, receive: Receive, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._task = loop.create_task(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            # an ASGI server's receive() waits for the disconnect once the body is in; one that
            # answers at once with something else (a test's, a proxy's) would otherwise spin here
            # without ever yielding, holding the event loop (and every request) forever
            await asyncio.sleep(_WATCH_AFTER_S)
        self._client_gone()

    def close(self) -> None:
        """The request is answered: stop watching (and let go of the callback's request)."""
        self._cancel = None
        if self._cycle is not None:
            setattr(self._cycle, CLIENT_GONE, None)
            self._cycle = None
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None:
            self._task.cancel()


class InferPath:
    """ASGI app: answers ``POST /v2/models/{name}/infer`` itself, passes everything else to ``app``."""

    def __init__(self, server: "InferenceServer", app: Any, *, behind_proxy: bool = False):
        self.server, self.app = server, app
        self.behind_proxy = behind_proxy  # the body comes through a proxy's channel, not a client's socket
        # connections are header_timeout_protocol's, which reports lost clients (set by InferenceServer)
        self.own_connections = False
        cfg = server.config
        self._token = bearer(cfg.auth_token)
        self._limit = cfg.max_body_bytes
        self._body_timeout = cfg.body_timeout_s
        self._retry = [(b"retry-after", str(cfg.retry_after_s).encode())]
        # per-request metrics as tallies (metrics.Tally: no lock per request), added on each render
        self._counters: dict[tuple[str, int], Any] = {}  # (model, status) -> requests_total tally
        self._latency: dict[str, Any] = {}  # model -> request_seconds tally
        self._binary = BinaryParser()  # binary-extension headers seen before: parsed and checked once

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path: str = scope["path"]
            if path.startswith(_PREFIX) and path.endswith(_SUFFIX):
                name = path[len(_PREFIX):-len(_SUFFIX)]
                if name and "/" not in name:
                    await self._infer(name, scope, receive, send)
                    return
        await self.app(scope, receive, send)

    def _count(self, model: str, status: int) -> None:
        c = self._counters.get((model, status))
        if c is None:
            m = self.server.metrics
            c = self._counters[(model, status)] = m.tally(m.requests.labels(model, str(status)), counter=True)
        c.total += 1

    async def _infer(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        t0 = time.monotonic()
        try:
            status, body, headers = await self._answer(name, scope, receive)
        except Exception as exc:  # noqa: BLE001 - a bug answers JSON and is counted, never a bare 500
            status, body, headers = _err(f"internal error while answering this request: "
                                         f"{type(exc).__name__}: {exc}", 500)
        model = name if name in self.server.models and status != 401 else ""
        self._count(model, status)
        if status == 200:
            h = self._latency.get(model)
            if h is None:
                h = self._latency[model] = self.server.metrics.tally(self.server.metrics.latency.labels(model))
            h.observe(time.monotonic() - t0)
        ctype = _BINARY if headers and headers[0][0] == _HEADER_LENGTH else _JSON
        await send({"type": "http.response.start", "status": status,
                    "headers": [ctype, (b"content-length", str(len(body)).encode()), *headers]})
        await send({"type": "http.response.body", "body": body})

    def _headers(self, scope: Scope) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(authorization, content-length, inference-header-content-length) as sent, or None."""
        auth = length = binary = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                auth = v
            elif k == b"content-length":
                length = v
            elif k == _HEADER_LENGTH:
                binary = v
        return auth, length, binary

    async def _read_body(self, receive: Receive, declared: bytes | None) -> bytes | tuple[int, bytes, list]:
        limit = self._limit
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return _err(f"request body is {declared.decode()} bytes, the limit is {limit}; split the batch "
                        "or raise --max-body-bytes", 413)
        if self.own_connections and getattr(getattr(receive, "__self__", None), "more_body", True) is False:
            # uvicorn already holds the whole body (the usual case: it came with the head), so
            # receive() answers without waiting and needs no timer (asyncio.timeout: ~15 us)
            return await self._read_chunks(receive, limit)
        try:  # one timer for the whole body: a client trickling bytes cannot hold the connection
            return await _within(self._body_timeout, self._read_chunks(receive, limit))
        except asyncio.TimeoutError:
            if self.behind_proxy:
                return _err(f"the request body did not reach this replica within {self._body_timeout:g} s "
                            "(ServeConfig.body_timeout_s): behind Ray's proxy this is a request re-routed "
                            "after the replica it first went to died with its body; resend it", 503,
                            self._retry)
            return _err(f"the request body did not arrive within {self._body_timeout:g} s; send it at once "
                        "(the limit is ServeConfig.body_timeout_s)", 408)

    async def _read_chunks(self, receive: Receive, limit: int) -> bytes | tuple[int, bytes, list]:
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return _err("client disconnected while sending the body", 499)
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > limit:
                return _err(f"request body exceeds the {limit}-byte limit; split the batch or raise "
                            "--max-body-bytes", 413)
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def _answer(self, name: str, scope: Scope, receive: Receive) -> tuple[int, bytes, list]:
        srv = self.server
        auth, declared, header_length = self._headers(scope)
        if not token_ok(self._token, auth):
            return _err(UNAUTHORIZED.message, 401, [(b"www-authenticate", b"Bearer")])
        ep = find_model(srv.models, name)
        refused = ep if isinstance(ep, Refusal) else not_accepting(srv.draining, ep)
        if refused is not None:
            return _err(refused.message, refused.status)
        batcher = ep.batcher
        body = await self._read_body(receive, declared)
        if isinstance(body, tuple):
            return body
        try:
            sig = ep.signature
            item = (parse_infer_request(body, sig) if header_length is None
                    else self._binary.parse(body, header_length, sig))
            req = ep.enqueue(item)
        except InputError as exc:
            return _err(str(exc), 400)
        except ServeError as exc:
            return _err(str(exc), exc.status_code, self._retry if exc.status_code == 429 else None)
        watch = _ClientWatch(receive, lambda: batcher.cancel(req), self.own_connections)
        try:
            outputs = await batcher.wait(req)
        except asyncio.CancelledError:
            if watch.gone:  # the client went away, not the server
                return _err("client disconnected", 499)
            raise
        except ServeError as exc:
            return _err(str(exc), exc.status_code)
        except NitroError as exc:
            return _err(str(exc), 400 if isinstance(exc, InputError) else 500)
        except Exception as exc:  # noqa: BLE001 - one failing batch answers its requests with 500
            return _err(f"the model failed on this batch: {type(exc).__name__}: {exc}", 500)
        finally:
            watch.close()
            req = None  # an error raised above keeps this frame (its traceback): it must not keep req's future
        data, json_length = encode_response(ep.signature, outputs, item)
        return 200, data, [] if json_length is None else [(_HEADER_LENGTH, str(json_length).encode())]
