"""torchnitro: make PyTorch workloads fast, and prove it.

Public names are listed in ``__all__`` and resolved on first use (PEP 562), so ``import torchnitro``
stays cheap and optional extras (ONNX Runtime, HTTP serving) are imported only when used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # the main job
    "optimize": "torchnitro.autotune.api",
    "load": "torchnitro.autotune.api",
    "analyze": "torchnitro.autotune.analyze",
    "OptimizeConfig": "torchnitro.autotune.config",
    "OptimizedModel": "torchnitro.autotune.api",
    # serving
    "DynamicBatcher": "torchnitro.serve.batcher",
    "BatchingConfig": "torchnitro.serve.batcher",
    "ServeConfig": "torchnitro.serve.server",
    "InferenceServer": "torchnitro.serve.server",
    # kernels
    "patch_": "torchnitro.kernels.patch",
    # memory and precision
    "checkpoint_": "torchnitro.memory.checkpointing",
    "find_batch_size": "torchnitro.memory.finder",
    "TrainStep": "torchnitro.precision.train_step",
    "to_float8_": "torchnitro.precision.float8_linear",
    # timing
    "measure": "torchnitro.bench.timing",
    "compare": "torchnitro.bench.timing",
    "TimingConfig": "torchnitro.bench.timing",
    # hardware
    "hardware_info": "torchnitro.hardware",
}
# "profile" is both the subpackage and its function: the package module is callable (profile/__init__.py)
_SUBMODULES = ("bench", "errors", "config", "hardware", "nn", "kernels", "autotune", "serve", "hrr",
               "memory", "precision", "profile", "distributed", "xla")

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        mod = importlib.import_module(f"torchnitro.{name}")
        globals()[name] = mod
        return mod
    raise AttributeError(f"module 'torchnitro' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
