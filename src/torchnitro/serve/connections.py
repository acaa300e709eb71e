"""Connection limits for slow or idle clients, on top of uvicorn's HTTP protocol.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and answers 503 past
``limit_concurrency``, but a client that opens a connection and sends its request head slowly, or
never, holds a descriptor forever: a few hundred such clients starve good ones under a low
open-file limit. ``header_timeout_protocol`` closes a connection whose next request head has not
arrived within ``header_timeout_s`` of the connection opening or of the previous response ending.
Bodies have their own per-chunk timeout in the infer route (``fastpath``).

The same protocol tells the infer route when a client goes away: while a request waits for its
batch, the route sets ``CLIENT_GONE`` on uvicorn's request cycle (the object behind ``receive``) to a
callback, and ``connection_lost`` calls it. That withdraws the request at once, with no task per
request awaiting ``receive()`` for ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import resource
from typing import Any

__all__ = ["header_timeout_protocol", "default_max_connections", "CLIENT_GONE"]

_FD_RESERVE = 64  # descriptors kept for worker pipes, shared memory, logs and the listener
# attribute of uvicorn's request cycle: a callback for when its client goes away (fastpath sets it)
CLIENT_GONE = "_torchnitro_client_gone"


def default_max_connections() -> int:
    """Connections before 503s: the soft open-file limit less a reserve (never below 16)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, soft - _FD_RESERVE)


def header_timeout_protocol(header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools or h11, as ``http="auto"`` picks) with a timer that
    closes a connection whose request head is late."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    base: Any = import_from_string(HTTP_PROTOCOLS["auto"])

    class HeaderTimeoutProtocol(base):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None
        _head_wait: Any = None  # self.cycle when the wait for the next head began (a head replaces it)
        _head_since = 0.0  # when that wait began

        def _arm(self) -> None:
            # a timer per response (call_later + cancel) cost ~5 us of a ~120 us request (uvloop): one
            # timer stays armed and, when it fires early, re-arms for what is left of the latest wait
            self._head_wait, self._head_since = self.cycle, self.loop.time()
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_check)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_check(self) -> None:
            self._head_timer = None
            if self.cycle is not self._head_wait or self.transport.is_closing():
                return  # a head arrived: the end of its response starts the next wait
            left = self._head_since + header_timeout_s - self.loop.time()
            if left > 0:
                self._head_timer = self.loop.call_later(left, self._head_check)
            else:
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            self._arm()  # before super(): a pipelined request it starts replaces the cycle
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            cycle = self.cycle
            super().connection_lost(exc)
            gone = getattr(cycle, CLIENT_GONE, None)
            if gone is not None and cycle.disconnected:  # lost before its response was complete
                gone()

    return HeaderTimeoutProtocol
