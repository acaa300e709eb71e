"""A profiler hook for the sharded train step: step times, a ``jax.profiler`` trace, MFU from XLA's cost analysis.

``profile_step`` runs a few steps of a ``TrainStep`` (after untimed warm-up steps that compile it),
times each to completion, optionally inside ``jax.profiler.trace`` (an XPlane / Perfetto trace that
TensorBoard's profile plugin or Perfetto opens, each step marked with ``StepTraceAnnotation``), and
reads the per-device FLOPs of one step from the compiled executable's cost analysis. MFU is those
FLOPs over the median step time and the device's peak FLOP/s, which the caller supplies (a TPU
datasheet number); on host CPU devices the number is only a smoke test.
"""

from __future__ import annotations

import glob
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import jax

from torchnitro.errors import ConfigError
from torchnitro.xla.train import TrainStep

__all__ = ["StepProfile", "profile_step", "step_flops"]


@dataclass(frozen=True)
class StepProfile:
    """What one ``profile_step`` call measured."""

    step_s: list[float]  # wall time of each timed step, to completion (block_until_ready)
    flops: float | None  # per-device FLOPs of one step, from the compiled cost analysis (None if unreported)
    peak_flops: float | None  # per-device peak FLOP/s the caller gave (None: MFU not computed)
    trace_dir: str | None  # directory jax.profiler wrote to (None: not traced)
    trace_files: list[str] = field(default_factory=list)  # the trace files written there

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation: FLOPs per step / (median step time x peak FLOP/s), per device."""
        if not self.flops or not self.peak_flops:
            return None
        return self.flops / (self.median_s * self.peak_flops)


def step_flops(step: TrainStep, params: Any, opt_state: Any, batch: Any) -> float | None:
    """Per-device FLOPs of one step from XLA's cost analysis of the compiled executable."""
    cost = step.lower(params, opt_state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per program
    flops = (cost or {}).get("flops")
    return float(flops) if flops else None


def profile_step(step: TrainStep, params: Any, opt_state: Any, batch: Mapping[str, Any], *, steps: int = 3,
                 warmup: int = 1, trace_dir: str | None = None,
                 peak_flops: float | None = None) -> tuple[StepProfile, Any, Any]:
    """Run ``warmup`` untimed then ``steps`` timed steps; returns (profile, params, opt_state).

    The step donates its parameters and optimizer state, so the updated ones are handed back for
    the caller to continue with. With ``trace_dir`` the timed steps run inside ``jax.profiler.trace``.
    """
    if steps < 1 or warmup < 0:
        raise ConfigError(f"profile_step: steps={steps}, warmup={warmup}; expected steps >= 1 and warmup >= 0")
    if peak_flops is not None and peak_flops <= 0:
        raise ConfigError(f"profile_step: peak_flops={peak_flops}; expected a positive FLOP/s per device or None")
    flops = step_flops(step, params, opt_state, batch)
    for _ in range(warmup):
        params, opt_state, loss = step(params, opt_state, batch)
        jax.block_until_ready(loss)
    times: list[float] = []

    def run() -> None:
        nonlocal params, opt_state
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train_step", step_num=i):
                t0 = time.perf_counter()
                params, opt_state, loss = step(params, opt_state, batch)
                jax.block_until_ready((params, opt_state, loss))
                times.append(time.perf_counter() - t0)

    files: list[str] = []
    if trace_dir is not None:
        before = set(glob.glob(os.path.join(trace_dir, "**", "*"), recursive=True))
        with jax.profiler.trace(trace_dir):
            run()
        files = sorted(f for f in set(glob.glob(os.path.join(trace_dir, "**", "*"), recursive=True)) - before
                       if os.path.isfile(f))
    else:
        run()
    return StepProfile(times, flops, peak_flops, trace_dir, files), params, opt_state
