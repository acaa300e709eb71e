"""``OptimizeConfig``: every knob of ``torchnitro.optimize`` as one typed dataclass.

On disk it is the ``optimize:`` section of a versioned YAML file (``torchnitro optimize --config
file.yaml``), loaded with ``torchnitro.config.load_section`` which rejects unknown keys by name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from torchnitro.errors import ConfigError

__all__ = ["OptimizeConfig", "DEFAULT_TOLERANCES", "default_cache_dir"]

# numeric class -> default gate. exact: norm-relative error (||a-b|| / ||a||) so fp32 reassociation
# passes but a wrong kernel does not; reduced/int8: cosine similarity of each flattened output.
# top1: share of rows of a class-logits output whose top-1 class must not change (verify.class_logits).
DEFAULT_TOLERANCES: dict[str, dict[str, float]] = {
    "exact": {"rel": 1e-4},
    "reduced": {"cosine": 0.999, "top1": 1.0},
    "int8": {"cosine": 0.99, "top1": 1.0},
    # pruning changes what the model computes: a dense model pruned without fine-tuning fails this
    # (random-init lm: cosine 0.55); a model trained 2:4-sparse passes; a broken kernel fails
    "pruned": {"cosine": 0.9, "top1": 0.9},
}

_OBJECTIVES = ("latency", "throughput")
_PERCENTILES = ("p50", "p99")


def _function_id(fn: Any) -> str | None:
    from torchnitro.autotune.cache import function_id

    return function_id(fn)


def default_cache_dir() -> Path:
    """$TORCHNITRO_CACHE_DIR, else ~/.cache/torchnitro."""
    env = os.environ.get("TORCHNITRO_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "torchnitro"


@dataclass
class OptimizeConfig:
    """How ``torchnitro.optimize`` searches. Every field has a default that works on a laptop CPU."""

    budget_s: float = 300.0  # total wall-clock budget for the search; candidates left are 'skipped'
    candidate_timeout_s: float = 120.0  # per-candidate limit for build + verify + timing
    recipes: Optional[list[str]] = None  # only these recipes (None: every default recipe that applies)
    exclude: list[str] = field(default_factory=list)  # never these recipes
    objective: str = "latency"  # 'latency' (at the given batch) or 'throughput' (items/s)
    percentile: str = "p50"  # latency statistic to minimise: 'p50' or 'p99'
    tolerances: dict[str, dict[str, float]] = field(default_factory=dict)  # per class overrides, e.g. {'int8': {'cosine': 0.995}}
    metric_fn: Optional[Callable[..., float]] = None  # metric_fn(ref_outputs, cand_outputs) -> float, higher is better
    metric_threshold: Optional[float] = None  # a candidate passes when metric_fn(...) >= this
    held_out: int = 2  # held-out input sets for verification (seeds differ from the timing inputs)
    dynamic_dims: Optional[dict[int, list[int]]] = None  # input index -> dims that vary (None: the model's default)
    shapes: list[list[int]] = field(default_factory=list)  # extra sizes of the dynamic dims to verify and time, e.g. [[1, 16], [32, 128]]
    cache: bool = True  # reuse results and artifacts from earlier searches
    cache_dir: Optional[str] = None  # None: $TORCHNITRO_CACHE_DIR or ~/.cache/torchnitro
    threads: int = 0  # torch / ONNX Runtime intra-op threads (0: the usable cores)
    device: str = "auto"  # 'auto' (cuda when visible), 'cpu' or 'cuda'
    isolate_all: bool = False  # build every candidate in a subprocess, not only the risky ones
    finalists: int = 3  # verified candidates re-timed side by side (interleaved) with eager
    min_speedup: float = 1.03  # a candidate must beat eager by this factor and by eager's noise (< 1: accept slower, to force a recipe)
    timing_min_iters: int = 5  # samples per candidate during the search
    timing_min_time_s: float = 0.5  # measured seconds per candidate during the search
    final_min_iters: int = 10  # samples per finalist in the interleaved comparison
    final_min_time_s: float = 1.0  # measured seconds per finalist in the interleaved comparison
    final_alone: bool = True  # CPU: time eager and each finalist alone in its own fresh process, as deployed
    # CPU: eager's p50 = median over this many fresh timing processes (one = one draw). Default 1: three doubled
    # the search's timing and slowed every timing process on a 2-core machine (git show 75ac45d:results/timing_fairness.md, 02:29)
    eager_processes: int = 1
    tune_allocator: bool = True  # CPU: time the chosen variant and eager with glibc's defaults too (timing processes run
    # under bench.environment.ALLOCATOR_SETTING); the artifact keeps the setting unless the defaults were faster
    tune_threads: bool = True  # CPU: time the chosen variant with fewer intra-op threads; record them when faster
    progress: bool = True  # rich progress display while searching (on a terminal)
    seed: int = 1234  # base seed of the held-out inputs
    padding_mask: Optional[Union[int, str]] = None  # the attention-mask input (index or forward arg name); None: detect
    compare_padding: bool = False  # True: the gate compares outputs at masked (padded) positions too
    classifier: Optional[bool] = None  # top-1 gate: None detects class logits, True: every output, False: never

    def __post_init__(self) -> None:
        if self.objective not in _OBJECTIVES:
            raise ConfigError(f"objective: received {self.objective!r}, expected one of {list(_OBJECTIVES)}")
        if self.percentile not in _PERCENTILES:
            raise ConfigError(f"percentile: received {self.percentile!r}, expected one of {list(_PERCENTILES)}")
        if self.budget_s <= 0 or self.candidate_timeout_s <= 0:
            raise ConfigError(
                f"budget_s={self.budget_s}, candidate_timeout_s={self.candidate_timeout_s}: expected positive "
                "seconds; raise them or remove the keys for the defaults")
        if isinstance(self.eager_processes, bool) or not isinstance(self.eager_processes, int) \
                or self.eager_processes < 1:
            raise ConfigError(f"eager_processes: received {self.eager_processes!r}, expected an integer >= 1 "
                              "(1: eager timed in one process, as before)")
        if self.held_out < 1:
            raise ConfigError(f"held_out: received {self.held_out}, expected >= 1 (verification needs inputs)")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device: received {self.device!r}, expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.metric_fn is not None and self.metric_threshold is None:
            raise ConfigError("metric_fn is set but metric_threshold is None; pass the minimum acceptable score")
        for cls, tol in self.tolerances.items():
            if cls not in DEFAULT_TOLERANCES:
                raise ConfigError(f"tolerances: unknown class {cls!r}; expected one of {sorted(DEFAULT_TOLERANCES)}")
            bad = sorted(set(tol) - {"rel", "cosine", "abs", "top1"})
            if bad:
                raise ConfigError(f"tolerances[{cls!r}]: unknown key(s) {bad}; expected 'rel', 'abs', 'cosine' or 'top1'")
        if self.padding_mask is not None and not isinstance(self.padding_mask, (int, str)):
            raise ConfigError(f"padding_mask: received {type(self.padding_mask).__name__}; expected an input index, "
                              "a forward argument name, or None to detect the attention mask")

    def tolerance(self, numeric_class: str) -> dict[str, float]:
        """The gate for one numeric class: the default, updated by the user's override."""
        tol = dict(DEFAULT_TOLERANCES[numeric_class])
        tol.update(self.tolerances.get(numeric_class, {}))
        return tol

    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    def resolved_threads(self) -> int:
        from torchnitro.hardware import hardware_info

        return self.threads if self.threads > 0 else hardware_info().cpu_cores

    def cache_key_fields(self) -> dict[str, Any]:
        """Fields that change what a search returns (used in the whole-search cache key)."""
        return {
            "recipes": self.recipes, "exclude": sorted(self.exclude), "objective": self.objective,
            "percentile": self.percentile, "tolerances": self.tolerances, "held_out": self.held_out,
            "dynamic_dims": self.dynamic_dims, "shapes": self.shapes, "device": self.device,
            "metric": _function_id(self.metric_fn), "metric_threshold": self.metric_threshold,
            "min_speedup": self.min_speedup, "threads": self.threads, "finalists": self.finalists,
            "padding_mask": self.padding_mask, "compare_padding": self.compare_padding, "classifier": self.classifier,
            "final_alone": self.final_alone, "tune_allocator": self.tune_allocator, "tune_threads": self.tune_threads,
            "eager_processes": self.eager_processes,
        }
