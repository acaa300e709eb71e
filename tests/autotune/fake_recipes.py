"""Throw-away recipes for the search tests (registered by fixtures, unregistered afterwards).

They live in an importable module because isolated candidates are rebuilt in a child process from
``module:qualname``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe
from torchnitro.autotune.report import CandidateResult, Report, Status

__all__ = ["Raises", "Hangs", "HangsIsolated", "ExitsIsolated", "SegfaultIsolated", "BadCheck", "Hog", "Wrong", "ReusesBuffer",
           "Faster", "Slower", "SlowModel", "NoisyStart", "DecoyA", "DecoyB", "NOISY", "tiny_model", "tiny_inputs",
           "fast_config", "eager_and_cand_report"]


def fast_config(tmp_path, **kw) -> OptimizeConfig:
    """Cheap timing so a search over tiny models takes seconds on 2 cores: eager and in-process candidates are
    timed in the test's process (``final_alone=False``; tests/autotune/test_fair_timing.py turns it on)."""
    base = dict(timing_min_iters=2, timing_min_time_s=0.01, final_min_iters=3, final_min_time_s=0.02,
                progress=False, cache_dir=str(tmp_path / "cache"), candidate_timeout_s=60.0, held_out=2, threads=1,
                final_alone=False, tune_allocator=False)
    base.update(kw)
    return OptimizeConfig(**base)


def eager_and_cand_report() -> Report:
    """A report with two verified rows, ``eager`` and ``cand``, for ``final.pick_winner`` tests."""
    rep = Report(model="m", inputs="f32[2x4]", objective="latency p50", hardware="cpu")
    rep.candidates = [CandidateResult("eager", "exact", Status.VERIFIED),
                      CandidateResult("cand", "exact", Status.VERIFIED)]
    return rep


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()


def tiny_inputs(batch: int = 4) -> tuple[torch.Tensor]:
    return (torch.randn(batch, 16, generator=torch.Generator().manual_seed(0)),)


class _Fake(Recipe):
    numeric_class = NumericClass.EXACT
    default = False

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        return self.build(BuildContext(model, (), None, torch.device("cpu"), directory)).fn  # type: ignore[arg-type]


class Raises(_Fake):
    name = "test-raises"

    def build(self, ctx: BuildContext) -> Built:
        raise RuntimeError("boom from test-raises")


class Hangs(_Fake):
    name = "test-hangs"

    def build(self, ctx: BuildContext) -> Built:
        time.sleep(60)
        raise AssertionError("unreachable")


class HangsIsolated(Hangs):
    name = "test-hangs-isolated"
    isolate = True


class ExitsIsolated(_Fake):
    name = "test-exits"
    isolate = True

    def build(self, ctx: BuildContext) -> Built:
        os._exit(3)


class SegfaultIsolated(_Fake):
    name = "test-segfault"
    isolate = True

    def build(self, ctx: BuildContext) -> Built:
        os.kill(os.getpid(), signal.SIGSEGV)
        time.sleep(5)
        raise AssertionError("unreachable")


class BadCheck(_Fake):
    """Its applicability check itself raises."""

    name = "test-bad-check"

    def inapplicable_reason(self, model: nn.Module, example_inputs: tuple[Any, ...]) -> str | None:
        raise KeyError("config.hidden_size")

    def build(self, ctx: BuildContext) -> Built:
        raise AssertionError("unreachable")


class Hog(_Fake):
    """Touches 256 MB while building, then frees it: the peak-memory column must see it."""

    name = "test-hog"

    def build(self, ctx: BuildContext) -> Built:
        big = torch.ones(64 * 2**20)  # 256 MB, written so the pages are resident
        time.sleep(0.05)
        del big
        return Built(fn=ctx.model)


class Wrong(_Fake):
    """Claims to be exact but perturbs the output by 1%: the gate must reject it."""

    name = "test-wrong"

    def build(self, ctx: BuildContext) -> Built:
        m = ctx.model
        return Built(fn=lambda *x: m(*x) * 1.01)


class ReusesBuffer(_Fake):
    """Returns the same output tensor every call (what raw CUDA graphs do)."""

    name = "test-reuses-buffer"

    def build(self, ctx: BuildContext) -> Built:
        m, buf = ctx.model, {}

        def fn(*x: Any) -> torch.Tensor:
            out = m(*x)
            if "t" not in buf or buf["t"].shape != out.shape:
                buf["t"] = torch.empty_like(out)
            return buf["t"].copy_(out)

        return Built(fn=fn)


class SlowModel(nn.Module):
    """The tiny model plus a sleep (30 ms unless given): a recipe that drops the sleep is exactly 'faster'."""

    def __init__(self, sleep_s: float = 0.03) -> None:
        super().__init__()
        self.inner = tiny_model()
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return self.inner(x)


class Faster(_Fake):
    name = "test-faster"

    def build(self, ctx: BuildContext) -> Built:
        return Built(fn=ctx.model.inner)


class Slower(_Fake):
    name = "test-slower"

    def build(self, ctx: BuildContext) -> Built:
        m = ctx.model

        def fn(*x: Any) -> Any:
            time.sleep(0.01)
            return m(*x)

        return Built(fn=fn)


NOISY = {"slow": True}  # cleared by the test when the finalist stage starts


class NoisyStart(_Fake):
    """Truly the fastest (1 ms), but load hit its search-time sample (60 ms while NOISY['slow']): slower than the
    decoys' 40 ms by more than a loaded test machine's sleep overshoot, yet inside the 2x noise band with as much
    room (20 ms; at 34 against 20 ms a loaded CI machine's 44.7 ms sample fell outside it)."""

    name = "test-noisy-start"

    def build(self, ctx: BuildContext) -> Built:
        m = ctx.model.inner

        def fn(*x: Any) -> Any:
            time.sleep(0.060 if NOISY["slow"] else 0.001)
            return m(*x)

        return Built(fn=fn)


class DecoyA(_Fake):
    """A steady 40 ms: looks better than NoisyStart in the search, is slower in truth (eager: SlowModel(0.06))."""

    name = "test-decoy-a"

    def build(self, ctx: BuildContext) -> Built:
        m = ctx.model.inner

        def fn(*x: Any) -> Any:
            time.sleep(0.040)
            return m(*x)

        return Built(fn=fn)


class DecoyB(DecoyA):
    name = "test-decoy-b"
