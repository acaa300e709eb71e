"""Fake recipes with standalone artifacts for the fair-timing tests (importable: the timing child loads them)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable

import torch
from fake_recipes import SlowModel, tiny_model
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe

__all__ = ["BusyRuntime", "DiesWhileTimed", "LOADS", "busy_threads", "identity_loader", "failing_loader", "env_loader",
           "env_scale_loader", "CountingSlowModel", "FORWARD_PIDS", "ShiftsWhenUnpickled", "FailsWhenUnpickled",
           "FakeChild"]

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


def env_scale_loader(name: str) -> Callable[..., Any]:
    """A ChildTimer loader whose function returns x * float(os.environ[name]) (0 when unset): its outputs
    tell which environment its process started with."""
    scale = float(os.environ.get(name, "0"))
    return lambda x: x * scale


FORWARD_PIDS: list[int] = []  # the pid of each CountingSlowModel.forward call made in this process


class CountingSlowModel(SlowModel):
    """SlowModel that records each forward call made in this process (a timing child keeps its own list)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARD_PIDS.append(os.getpid())
        return super().forward(x)


class _Copies(nn.Module):
    """A tiny model whose deepcopy is plain; what happens when it is unpickled is up to the subclass."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = tiny_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_Copies":
        new = type(self)()
        new.load_state_dict(self.state_dict())
        return new.train(self.training)


class ShiftsWhenUnpickled(_Copies):
    """Unpickled (in a timing child), its first bias moves by 1: the child's eager differs from the search's."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        with torch.no_grad():
            self.inner[0].bias.add_(1.0)


class FailsWhenUnpickled(_Copies):
    """Cannot be unpickled: the child that should time eager fails to load it."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        raise RuntimeError("this model cannot be re-created from a pickle")


class FakeChild:
    """Stands for a ChildTimer in fair.tune_allocator: every sample takes ``seconds`` per call (no timing).
    ``again(env)`` returns the process started with ``env``: ``tuned_seconds`` per call."""

    times_itself = True

    def __init__(self, seconds: float, tuned_seconds: float, env: dict[str, str] | None = None):
        self.seconds, self.tuned_seconds, self.env, self.failed = seconds, tuned_seconds, env, None
        self.closed = False
        self.spawned: list[FakeChild] = []

    def again(self, env: dict[str, str]) -> "FakeChild":
        child = FakeChild(self.tuned_seconds, self.tuned_seconds, env)
        self.spawned.append(child)
        return child

    def wait_ready(self) -> None:
        pass

    def __call__(self, k: int) -> float:
        return self.seconds

    def close(self) -> None:
        self.closed = True
