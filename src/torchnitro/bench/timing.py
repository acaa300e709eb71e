"""The one timing method every number in torchnitro goes through.

``measure(fn)``:
  1. warm-up calls (at least ``warmup`` calls and ``warmup_s`` seconds) so lazy init, autotuning and
     allocator growth are not timed;
  2. calibration: a call shorter than ``min_sample_s`` is repeated inside one sample, so timer
     resolution and launch jitter do not dominate;
  3. samples until both ``min_iters`` samples and ``min_time_s`` measured seconds are reached
     (or ``max_iters`` / ``max_time_s``);
  4. device synchronisation: CUDA events bracket each sample on GPU, ``perf_counter_ns`` on CPU;
  5. statistics: median, p90, p99, mean, min, coefficient of variation, throughput.

``compare({"a": fa, "b": fb})`` interleaves the candidates sample by sample (rotating the order
each round) so drift (thermal, other load) hits all of them alike, and reports ratios.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

import torch

__all__ = ["Timing", "TimingConfig", "measure", "compare", "synchronize", "percentile"]


@dataclass(frozen=True)
class TimingConfig:
    warmup: int = 3  # minimum warm-up calls: first calls pay lazy init and autotuning
    warmup_s: float = 0.05  # and at least this long warming up
    min_iters: int = 10  # enough samples for a median and a rough p90
    max_iters: int = 10_000  # hard cap on samples for very fast functions
    min_time_s: float = 0.5  # measured time to accumulate, so short functions get many samples
    max_time_s: float = 30.0  # stop even if min_iters is not reached (slow functions)
    min_sample_s: float = 1e-3  # calls shorter than this are repeated inside one sample
    device: str | None = None  # "cuda" / "cpu"; None: infer from torch.cuda.is_available()

    def quick(self) -> "TimingConfig":
        """A cheaper variant for tests and smoke runs."""
        return TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, max_iters=50, min_time_s=0.02,
                            max_time_s=2.0, min_sample_s=1e-4, device=self.device)


@dataclass
class Timing:
    """Per-call latency statistics, in seconds."""

    samples: list[float] = field(repr=False)  # seconds per call, one entry per sample
    calls_per_sample: int = 1
    items_per_call: int = 1  # e.g. batch size, for throughput
    warmup_calls: int = 0

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def p90(self) -> float:
        return percentile(self.samples, 90)

    @property
    def p99(self) -> float:
        return percentile(self.samples, 99)

    @property
    def std(self) -> float:
        return statistics.pstdev(self.samples) if self.n > 1 else 0.0

    @property
    def cv(self) -> float:
        """Coefficient of variation (std / mean); above ~0.1 the machine was noisy."""
        m = self.mean
        return self.std / m if m > 0 else math.inf

    @property
    def throughput(self) -> float:
        """Items per second at the median latency."""
        return self.items_per_call / self.median if self.median > 0 else math.inf

    @property
    def stable(self) -> bool:
        return self.cv < 0.10

    def to_dict(self) -> dict[str, Any]:
        return {
            "n": self.n, "calls_per_sample": self.calls_per_sample, "items_per_call": self.items_per_call,
            "median_s": self.median, "mean_s": self.mean, "min_s": self.min, "p90_s": self.p90,
            "p99_s": self.p99, "cv": self.cv, "throughput_per_s": self.throughput,
            "stable": self.stable,
        }

    def __str__(self) -> str:
        return (f"median {self.median * 1e3:.3f} ms, p90 {self.p90 * 1e3:.3f} ms, p99 {self.p99 * 1e3:.3f} ms, "
                f"cv {self.cv:.1%}, n={self.n}x{self.calls_per_sample}")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), without numpy."""
    if not values:
        raise ValueError("percentile of an empty list")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _use_cuda(cfg: TimingConfig) -> bool:
    if cfg.device is not None:
        return cfg.device.startswith("cuda")
    return torch.cuda.is_available()


def synchronize(device: str | None = None) -> None:
    """Wait for queued device work; a no-op on CPU."""
    if (device is None or device.startswith("cuda")) and torch.cuda.is_available():
        torch.cuda.synchronize()


class _Sampler:
    """Times one sample of ``k`` calls of ``fn`` on the right clock."""

    def __init__(self, fn: Callable[[], Any], cuda: bool):
        self.fn, self.cuda = fn, cuda
        if cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)

    def __call__(self, k: int) -> float:
        fn = self.fn
        if self.cuda:
            self.start.record()
            for _ in range(k):
                fn()
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3 / k
        t0 = time.perf_counter_ns()
        for _ in range(k):
            fn()
        return (time.perf_counter_ns() - t0) / 1e9 / k


def _warmup(sampler: _Sampler, cfg: TimingConfig) -> tuple[int, float]:
    """Run warm-up calls; returns (calls made, estimated seconds per call)."""
    calls, spent, last = 0, 0.0, math.inf
    while calls < max(1, cfg.warmup) or spent < cfg.warmup_s:
        last = sampler(1)
        spent += last
        calls += 1
        if spent > cfg.max_time_s:
            break
    return calls, last


def _calls_per_sample(per_call_s: float, cfg: TimingConfig) -> int:
    if per_call_s <= 0:
        return 100
    return max(1, min(1000, math.ceil(cfg.min_sample_s / per_call_s)))


def measure(fn: Callable[[], Any], config: TimingConfig | None = None, *, items_per_call: int = 1) -> Timing:
    """Time ``fn()`` (no arguments: close over inputs) with warm-up, sync and enough samples."""
    cfg = config or TimingConfig()
    sampler = _Sampler(fn, _use_cuda(cfg))
    warm_calls, per_call = _warmup(sampler, cfg)
    k = _calls_per_sample(per_call, cfg)
    samples: list[float] = []
    total = 0.0
    while len(samples) < cfg.max_iters:
        s = sampler(k)
        samples.append(s)
        total += s * k
        if len(samples) >= cfg.min_iters and total >= cfg.min_time_s:
            break
        if total >= cfg.max_time_s and len(samples) >= 1:
            break
    return Timing(samples, calls_per_sample=k, items_per_call=items_per_call, warmup_calls=warm_calls)


def compare(
    fns: Mapping[str, Callable[[], Any]],
    config: TimingConfig | None = None,
    *,
    items_per_call: int = 1,
    baseline: str | None = None,
) -> dict[str, Timing]:
    """Time several functions interleaved: every round takes one sample of each, in rotating order.

    Returns name -> Timing. With ``baseline``, ``speedups(result, baseline)`` gives the ratios.
    """
    if not fns:
        raise ValueError("compare() needs at least one function")
    if baseline is not None and baseline not in fns:
        raise KeyError(f"baseline {baseline!r} is not one of {sorted(fns)}")
    cfg = config or TimingConfig()
    cuda = _use_cuda(cfg)
    names = list(fns)
    # an entry with ``times_itself`` (e.g. bench.isolated.ChildTimer) takes k and returns seconds per call
    samplers = {n: fns[n] if getattr(fns[n], "times_itself", False) else _Sampler(fns[n], cuda) for n in names}
    ks, warm = {}, {}
    for n in names:
        warm[n], per = _warmup(samplers[n], cfg)
        ks[n] = _calls_per_sample(per, cfg)
    samples: dict[str, list[float]] = {n: [] for n in names}
    total = 0.0
    rnd = 0
    while rnd < cfg.max_iters:
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for n in order:
            s = samplers[n](ks[n])
            samples[n].append(s)
            total += s * ks[n]
        rnd += 1
        if rnd >= cfg.min_iters and total >= cfg.min_time_s * len(names):
            break
        if total >= cfg.max_time_s * len(names):
            break
    return {n: Timing(samples[n], ks[n], items_per_call, warm[n]) for n in names}


def speedups(result: Mapping[str, Timing], baseline: str) -> dict[str, float]:
    """Median-latency speedup of each entry over ``baseline`` (>1 is faster)."""
    base = result[baseline].median
    return {n: base / t.median for n, t in result.items()}


__all__.append("speedups")
