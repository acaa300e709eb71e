"""Fake recipes with standalone artifacts for the fair-timing tests (importable: the timing child loads them)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch
from fake_recipes import tiny_model
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe

__all__ = ["BusyRuntime", "DiesWhileTimed", "LOADS", "busy_threads", "identity_loader", "failing_loader", "env_loader"]

LOADS: list[int] = []  # pids of the processes in which BusyRuntime.load ran (only this process is visible)
_BUSY = "test-busy-runtime-pool"


def _spin() -> None:
    x = 0
    while True:  # a runtime pool that never goes quiet: holds the GIL and a core
        x += 1


def busy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == _BUSY]


class BusyRuntime(Recipe):
    """Stands for a foreign runtime: a standalone artifact whose load() starts a pool that keeps a core busy.

    Loaded in the search process (the old comparison), its pool slows eager timed after it."""

    name = "test-busy-runtime"
    numeric_class = NumericClass.EXACT
    isolate = True
    default = False

    def build(self, ctx: BuildContext) -> Built:
        torch.save(ctx.model.state_dict(), ctx.workdir / "weights.pt")
        return Built(fn=ctx.model, files=["weights.pt"], meta={"kind": "tiny"}, standalone=True)

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        LOADS.append(os.getpid())
        threading.Thread(target=_spin, name=_BUSY, daemon=True).start()
        m = tiny_model()
        m.load_state_dict(torch.load(directory / "weights.pt", weights_only=True))
        return m.eval()


class DiesWhileTimed(BusyRuntime):
    """Builds and verifies like BusyRuntime; its loaded artifact kills its process on the third call."""

    name = "test-dies-while-timed"

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        m, calls = tiny_model().eval(), [0]

        def fn(*x: Any) -> Any:
            calls[0] += 1
            if calls[0] >= 3:
                os._exit(7)
            return m(*x)

        return fn


def identity_loader(scale: float) -> Callable[..., Any]:
    """A ChildTimer loader: returns x * scale."""
    return lambda x: x * scale


def env_loader(name: str, value: str) -> Callable[..., Any]:
    """A ChildTimer loader that only loads when its process started with ``name=value`` in the environment."""
    if os.environ.get(name) != value:
        raise RuntimeError(f"{name}={os.environ.get(name)!r}, expected {value!r}")
    return lambda x: x


def failing_loader() -> Callable[..., Any]:
    raise RuntimeError("artifact is missing its weights")
