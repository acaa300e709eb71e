"""torchnitro.bench: the one timing method, and result tables/plots for benchmark scripts."""

from __future__ import annotations

from torchnitro.bench.report import ResultTable, results_dir, save_plot
from torchnitro.bench.timing import Timing, TimingConfig, compare, measure, percentile, speedups, synchronize

__all__ = [
    "Timing", "TimingConfig", "measure", "compare", "speedups", "synchronize", "percentile",
    "ResultTable", "results_dir", "save_plot",
]
