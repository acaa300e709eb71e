"""torchnitro.memory: measure, plan and cut the memory of a training step.

- ``track(model, opt)``: exact live-tensor bytes per phase and category (dispatch mode; CPU or GPU);
- ``plan(config, batch=, seq=, ...)``: analytic estimate for ``TransformerLM`` with a table of terms;
- ``find_batch_size(step_fn, FinderConfig(...))``: largest (or fastest) batch that fits, confirmed by trials;
- ``checkpoint_(model, policy)``: activation checkpointing by blocks, every n, selective or budget;
- ``load_weights(path, mmap=True)``: zero-copy weight loading; ``PinnedBufferPool``/``Prefetcher``.
"""

from __future__ import annotations

from torchnitro.memory.checkpointing import checkpoint_, find_blocks, selective_policy
from torchnitro.memory.finder import FinderConfig, FinderResult, Trial, find_batch_size
from torchnitro.memory.pools import PinnedBufferPool, Prefetcher
from torchnitro.memory.planner import Budget, MemoryPlan, PlanTerm, plan
from torchnitro.memory.tracker import MemoryReport, MemoryTracker, PeakInfo, track
from torchnitro.memory.zerocopy import load_into_, load_weights, prepare_inference_, resident_bytes

__all__ = [
    "track", "MemoryTracker", "MemoryReport", "PeakInfo",
    "plan", "MemoryPlan", "PlanTerm", "Budget",
    "checkpoint_", "find_blocks", "selective_policy",
    "find_batch_size", "FinderConfig", "FinderResult", "Trial",
    "load_weights", "load_into_", "prepare_inference_", "resident_bytes", "PinnedBufferPool", "Prefetcher",
]
