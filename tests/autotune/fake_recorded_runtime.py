"""A quiet own-runtime recipe and a crashing loader for the fair-timing tests (importable: the timing child loads
them)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
from fake_recipes import tiny_model
from fake_standalone import LOADS, BusyRuntime
from torch import nn

__all__ = ["RecordedRuntime", "exits_on_third_call"]


class RecordedRuntime(BusyRuntime):
    """``BusyRuntime`` without the busy pool: its load only records the process it ran in (``LOADS``).

    A load in the search process shows in ``LOADS`` without a spinning thread, and no spinning sibling makes every
    other sample of the comparison wait at the gate (and eager here drift into a redo)."""

    name = "test-recorded-runtime"

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        LOADS.append(os.getpid())
        m = tiny_model()
        m.load_state_dict(torch.load(directory / "weights.pt", weights_only=True))
        return m.eval()


def exits_on_third_call() -> Callable[..., Any]:
    """A ``ChildTimer`` loader whose function ends its process on its third call (a runtime crashing mid-run)."""
    calls = [0]

    def fn(*x: Any) -> Any:
        calls[0] += 1
        if calls[0] >= 3:
            os._exit(7)
        return x

    return fn
