"""The checks every front end makes before it answers for a model: bearer token, model lookup, and
whether the model takes new requests. The Starlette routes (``server``), the raw infer path
(``fastpath``) and gRPC (``grpc_server``) share them, so each refuses with the same status and message.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

__all__ = ["Refusal", "bearer", "token_ok", "UNAUTHORIZED", "find_model", "not_accepting"]

E = TypeVar("E")


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused before it reaches a model: the HTTP status and the message."""

    status: int
    message: str


UNAUTHORIZED = Refusal(401, "missing or wrong bearer token; send 'Authorization: Bearer <token>'")


def bearer(token: str | None) -> bytes | None:
    """The exact ``authorization`` value a configured token requires (None: no token, anyone may call)."""
    return f"Bearer {token}".encode() if token else None


def token_ok(expected: bytes | None, got: bytes | str | None) -> bool:
    """True when no token is required or ``got`` is ``expected`` (constant-time comparison)."""
    if expected is None:
        return True
    raw = got.encode() if isinstance(got, str) else (got or b"")
    return hmac.compare_digest(raw, expected)


def find_model(models: Mapping[str, E], name: str) -> E | Refusal:
    """The endpoint serving ``name``, or the 404 that lists the names served."""
    ep = models.get(name)
    if ep is None:
        return Refusal(404, f"unknown model {name!r}; this server serves {sorted(models)}")
    return ep


def not_accepting(draining: bool, ep: Any) -> Refusal | None:
    """The 503 for a server that drains or an endpoint that is not loaded (no batcher yet), else None."""
    if draining or not ep.ready or ep.batcher is None:
        return Refusal(503, "the server is draining or not ready; retry on another replica")
    return None
