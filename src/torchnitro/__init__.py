"""torchnitro: make PyTorch workloads fast, and prove it.

Public names are listed in ``__all__`` and resolved on first use (PEP 562), so ``import torchnitro``
stays cheap and optional extras (ONNX Runtime, HTTP serving) are imported only when used.
"""

from __future__ import annotations

from torchnitro._lazy import lazy_names
from torchnitro.version import __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # the main job
    "optimize": "torchnitro.autotune.api",
    "load": "torchnitro.autotune.api",
    "analyze": "torchnitro.autotune.analyze",
    "OptimizeConfig": "torchnitro.autotune.config",
    "OptimizedModel": "torchnitro.autotune.api",
    "OptimizedPipeline": "torchnitro.autotune.pipelines",
    "load_pipeline": "torchnitro.autotune.api",
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

__all__, __getattr__, __dir__ = lazy_names(globals(), _EXPORTS, _SUBMODULES, eager=["__version__"])
