"""Tiny deterministic models for exercising a server (smoke tests, the reliability suite), and an
event loop on virtual time for testing the batcher without wall-clock waits.

Each model is a zero-argument factory, so it can be served by spec: ``torchnitro serve
torchnitro.serve.testing:affine --workers 2``. Results are a known function of the input, so a
client can check that every answer belongs to its own request.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import time
from typing import Any, Awaitable, Callable, TypeVar

from torch import Tensor

from torchnitro.serve.models import ServedModel
from torchnitro.serve.protocol import ModelSignature, TensorSpec

__all__ = ["POISON", "RAISE", "affine", "slow_affine", "gated_affine", "ragged_double", "picky_affine",
           "VirtualTimeLoop", "run_virtual"]

POISON = -999.0  # an input row starting with this value kills the worker process (crash tests)
RAISE = -777.0  # an input row starting with this value makes ``picky_affine`` raise (isolation tests)
T = TypeVar("T")


class _JumpingSelector:
    """Polls the real selector without blocking; when nothing is ready and the loop would sleep
    until its next timer, moves the virtual clock to that timer instead of sleeping."""

    def __init__(self, real: selectors.BaseSelector, loop: "VirtualTimeLoop"):
        self._real, self._loop = real, loop

    def select(self, timeout: float | None = None) -> list[Any]:
        events = self._real.select(0)
        if events or timeout == 0:
            return events
        if timeout is None:  # no timer pending: only I/O (e.g. an executor thread) can wake us
            return self._real.select(None)
        self._loop.now += timeout
        return events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose ``time()`` is virtual: ``sleep(5)`` returns at once with ``time()`` 5 s
    later, in the same order as on a real clock. Tests of timing *logic* (windows, deadlines,
    aging) then assert exact orders and virtual durations, immune to a loaded machine."""

    def __init__(self) -> None:
        super().__init__(selectors.DefaultSelector())
        self.now = 0.0
        self._selector = _JumpingSelector(self._selector, self)

    def time(self) -> float:
        return self.now


def run_virtual(main: Callable[[], Awaitable[T]]) -> T:
    """Run the coroutine ``main()`` to completion on a fresh ``VirtualTimeLoop``."""
    loop = VirtualTimeLoop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _affine_fn(delay_s: float):
    def fn(x: Tensor) -> Tensor:  # (B, 4) -> (B, 4)
        if bool((x[:, 0] == POISON).any()):
            os._exit(3)  # simulate a segfaulting extension: no exception, no goodbye
        if delay_s:
            time.sleep(delay_s)
        return x * 2 + 1

    return fn


def _affine_sig(name: str) -> ModelSignature:
    return ModelSignature(name, [TensorSpec("x", "FP32", (-1, 4))], [TensorSpec("y", "FP32", (-1, 4))])


def affine() -> ServedModel:
    """``y = 2x + 1`` on ``(B, 4)`` float32; a row starting with ``POISON`` kills the process."""
    return ServedModel(_affine_fn(0.0), _affine_sig("affine"))


def slow_affine() -> ServedModel:
    """``affine`` that takes 50 ms per batch (queues build up: priorities, drain, deadlines)."""
    return ServedModel(_affine_fn(float(os.environ.get("TORCHNITRO_TEST_DELAY_S", "0.05"))),
                       _affine_sig("slow_affine"))


def gated_affine() -> ServedModel:
    """``affine`` that holds every batch until the file named by ``$TORCHNITRO_TEST_GATE`` exists
    (up to 120 s; removing the file closes it again), then takes ``$TORCHNITRO_TEST_DELAY_S``
    (default 0): a test decides when in-flight work may finish instead of racing a sleep."""
    gate = os.environ.get("TORCHNITRO_TEST_GATE", "")
    base = _affine_fn(float(os.environ.get("TORCHNITRO_TEST_DELAY_S", "0")))

    def fn(x: Tensor) -> Tensor:
        end = time.monotonic() + 120
        while gate and not os.path.exists(gate) and time.monotonic() < end:
            time.sleep(0.01)
        return base(x)

    return ServedModel(fn, _affine_sig("gated_affine"))


def picky_affine() -> ServedModel:
    """``affine`` that raises ``ValueError`` on a batch holding a row that starts with ``RAISE``
    (a model that fails on one request's input and would fail every request batched with it)."""
    base = _affine_fn(0.0)

    def fn(x: Tensor) -> Tensor:
        if bool((x[:, 0] == RAISE).any()):
            raise ValueError(f"row value {RAISE} is not allowed by this model")
        return base(x)

    return ServedModel(fn, _affine_sig("picky_affine"))


def ragged_double() -> ServedModel:
    """``(B, T)`` int64 tokens -> ``(B, T)`` float32 ``2 * tokens``: padding must be cut back off."""

    def fn(tokens: Tensor) -> Tensor:
        return tokens.float() * 2

    sig = ModelSignature("ragged_double", [TensorSpec("tokens", "INT64", (-1, -1))],
                         [TensorSpec("doubled", "FP32", (-1, -1))], padding_safe=True)
    return ServedModel(fn, sig)
