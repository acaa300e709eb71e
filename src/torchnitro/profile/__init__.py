"""torchnitro.profile: where a step's time, FLOPs, memory and energy go.

``torchnitro.profile(step_fn, warmup=5, steps=10)`` or ``torchnitro.profile(model, example_inputs)``
returns a ``Profile``: ``summary()`` prints it, ``save(dir)`` writes the Chrome/Perfetto trace,
profile.json, PNG plots and a self-contained report.html. See docs/profile.md.

This package is also the ``profile`` function: ``torchnitro.profile`` names the package once any of
its modules is imported (Python binds a subpackage to its parent's attribute), so the package module
is made callable and ``torchnitro.profile(...)`` works whatever was imported first.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from torchnitro.profile.categories import CATEGORIES, category_of
from torchnitro.profile.profiler import ProfileConfig, make_step, profile
from torchnitro.profile.result import OpStat, Profile
from torchnitro.profile.trace import TraceAnalysis, TraceConfig, analyze_trace

__all__ = ["profile", "Profile", "ProfileConfig", "OpStat", "CATEGORIES", "category_of", "make_step",
           "analyze_trace", "TraceAnalysis", "TraceConfig"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Profile:
        return profile(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
