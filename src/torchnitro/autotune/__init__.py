"""torchnitro.autotune: the engine behind ``torchnitro.optimize`` (recipes, gate, search, artifacts).

The package is not named ``optimize`` so that ``torchnitro.optimize`` stays the function. Modules:
``config`` (OptimizeConfig), ``recipe`` (interface + registry), ``recipes/`` (built-in recipes),
``inputs`` (model/input specs), ``verify`` (the gate), ``evaluate`` (one candidate, isolated or
not), ``workload`` + ``search`` (the loop), ``final`` + ``fair*`` (the final comparison and its knobs),
``report``, ``artifact``, ``cache``, ``pipelines`` (transformers pipelines), ``api``, ``cli``.
"""

from __future__ import annotations

__all__ = ["optimize", "load", "OptimizedModel", "OptimizeConfig"]


def __getattr__(name: str):
    if name in ("optimize", "load", "OptimizedModel"):
        from torchnitro.autotune import api

        return getattr(api, name)
    if name == "OptimizeConfig":
        from torchnitro.autotune.config import OptimizeConfig

        return OptimizeConfig
    raise AttributeError(f"module 'torchnitro.autotune' has no attribute {name!r}")
