"""Throw-away recipes for the isolation tests (importable: an isolated child imports a recipe's module).

Importing this module sleeps ``$TORCHNITRO_TEST_SLOW_IMPORT_S`` seconds when that is set: the test of
the start-up budget sets it after the parent imported the module, so only the child's start-up is slow.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext, Built, NumericClass, Recipe

__all__ = ["DirtyRaise", "DiesUnderProgressBar", "SlowStart", "DIRTY_TENSOR"]

time.sleep(float(os.environ.get("TORCHNITRO_TEST_SLOW_IMPORT_S", "0")))

DIRTY_TENSOR = torch.arange(12.0).reshape(3, 4)


class _Fake(Recipe):
    numeric_class = NumericClass.EXACT
    default = False

    def load(self, directory: Path, meta: dict[str, Any], model: nn.Module | None) -> Callable[..., Any]:
        raise NotImplementedError


class DirtyRaise(_Fake):
    """Raises the way a library does: colour codes, a tensor repr and a progress bar in the message."""

    name = "test-dirty-raise"

    def build(self, ctx: BuildContext) -> Built:
        raise ValueError(f"\x1b[1;31mcache output is not a tensor\x1b[0m: got {DIRTY_TENSOR!r} of type "
                         "DynamicCache\nLoading weights:  50%|#####     | 1/2 [00:01<00:01, 1.00it/s]")


class DiesUnderProgressBar(_Fake):
    """Writes its cause, then a progress bar, to stderr and exits without writing a result."""

    name = "test-dies-under-bar"
    isolate = True

    def build(self, ctx: BuildContext) -> Built:
        sys.stderr.write("RuntimeError: the real cause\n")
        sys.stderr.write("Loading weights:  40%|####      | 2/5 [00:01<00:02, 1.90it/s]\r"
                         "Loading weights: 100%|##########| 5/5 [00:02<00:00, 2.00it/s]\n")
        sys.stderr.flush()
        os._exit(1)


class SlowStart(_Fake):
    """Isolated; its child's start-up (importing this module) is as slow as the environment says."""

    name = "test-slow-start"
    isolate = True
    order = 1  # first after eager, so the recipe after it finds the budget spent

    def build(self, ctx: BuildContext) -> Built:
        return Built(fn=ctx.model)
