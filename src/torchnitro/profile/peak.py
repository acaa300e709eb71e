"""The GEMM peak MFU is taken against, measured in the same run as the profiled steps.

A peak measured once per process (``analyze.machine_roofline``) and a step measured minutes later see
different load, clocks and thread contention; on a shared machine that put a plain GEMM's MFU at
1.11, which cannot be. Here a ``PeakProbe`` times a plain square GEMM of the profile's dtype, on its
device, with the threads the step runs with, a few times just before and just after the recorded
steps (``ProfileConfig.peak_timings``). The peak is the *best* of those timings, and at least the
best per-step FLOP rate the profiled step itself reached: no step can then read above 100% MFU, and
a GEMM-only step reads close to 100%. The spread of the timings (best, median, worst) travels with
the peak, so MFU is shown with the range the peak's own noise allows.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from torchnitro.errors import InputError
from torchnitro.hardware import roofline_gemm_n

if TYPE_CHECKING:
    from torchnitro.profile.profiler import ProfileConfig

__all__ = ["GemmPeak", "PeakProbe", "probe_for", "peak_of"]


@dataclass
class GemmPeak:
    """FLOP/s of the plain-GEMM timings around one profile (in the order they were taken)."""

    device: str
    dtype: str
    n: int  # the GEMM is (n, n) @ (n, n): 2 n^3 FLOPs
    threads: int  # torch intra-op threads while timing (the step's)
    flops_samples: list[float] = field(default_factory=list)  # FLOP/s of each timing
    raised_to_step: float | None = None  # the step's best rate, when it beat every timing (the peak is then that)

    @property
    def best(self) -> float:
        return max([*self.flops_samples, self.raised_to_step or 0.0])

    @property
    def median(self) -> float:
        return statistics.median(self.flops_samples) if self.flops_samples else 0.0

    @property
    def spread(self) -> float:
        """(best - worst) / best of the timings: how much the peak itself moved during the profile."""
        s = self.flops_samples
        return (max(s) - min(s)) / max(s) if s and max(s) > 0 else 0.0

    def describe(self) -> str:
        s = self.flops_samples
        text = (f"best of {len(s)} {self.n}^3 {self.dtype} GEMM timings around the recorded steps ({self.threads} "
                f"threads; {min(s) / 1e9:.1f}-{max(s) / 1e9:.1f} GFLOP/s, spread {self.spread:.1%})") if s else \
            "no GEMM timings"
        if self.raised_to_step is not None and self.raised_to_step >= max(s, default=0.0):
            text += f"; raised to the step's own best rate {self.raised_to_step / 1e9:.1f} GFLOP/s"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "best": self.best, "median": self.median, "spread": self.spread}


class PeakProbe:
    """Times ``torch.mm`` of two (n, n) tensors on ``device`` in ``dtype``; ``sample(k)`` adds k timings."""

    def __init__(self, device: str, dtype: str, n: int | None = None):
        dt = getattr(torch, dtype, None)
        if not isinstance(dt, torch.dtype) or not dt.is_floating_point:
            raise InputError(f"PeakProbe: dtype {dtype!r} is not a floating-point torch dtype; expected e.g. "
                             "'float32' or 'bfloat16'")
        self.device = device
        self.n = n or roofline_gemm_n(device)  # the size analyze.machine_roofline times
        self.peak = GemmPeak(device, dtype, self.n, torch.get_num_threads())
        self._a = torch.randn(self.n, self.n, device=device).to(dt)
        self._b = torch.randn(self.n, self.n, device=device).to(dt)
        self._timing: Any = None

    def sample(self, k: int = 1) -> None:
        """k more timings; each is the fastest of a few back-to-back calls (warm, synchronised)."""
        from torchnitro.bench.timing import TimingConfig, measure

        if self._timing is None:  # a short warm-up on the first call only: the GEMM is warm after that
            self._timing = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, max_iters=3, min_time_s=0.0,
                                        min_sample_s=2e-3, device="cuda" if self.device.startswith("cuda") else "cpu")
        for _ in range(k):
            t = measure(lambda: torch.mm(self._a, self._b), self._timing)
            self.peak.flops_samples.append(2 * self.n ** 3 / min(t.samples))

    def finish(self, step_flops: int | None, step_times_s: list[float]) -> GemmPeak:
        """The peak, raised to the profiled step's best per-step rate where that beat every timing."""
        if step_flops and step_times_s:
            rate = step_flops / min(step_times_s)
            if rate > max(self.peak.flops_samples, default=0.0):
                self.peak.raised_to_step = rate
        del self._a, self._b
        return self.peak


def probe_for(cfg: ProfileConfig, device: str) -> PeakProbe | None:
    """A ``PeakProbe`` when the peak is to be measured here; a failure to time it is a warning, not a lost profile."""
    if cfg.peak_flops is not None or not cfg.measure_peak or not cfg.count_flops:
        return None
    import warnings

    try:
        probe = PeakProbe(device, cfg.dtype, cfg.peak_gemm)
        probe.sample((cfg.peak_timings + 1) // 2)
        return probe
    except Exception as exc:  # e.g. a dtype this device has no GEMM for
        warnings.warn(f"timing a {cfg.dtype} GEMM on {device} for the MFU peak failed ({type(exc).__name__}: "
                      f"{exc}); MFU is unavailable", stacklevel=4)
        return None


def peak_of(cfg: ProfileConfig, probe: PeakProbe | None, flops: int | None, times: list[float]
            ) -> tuple[float | None, str, dict[str, Any]]:
    """(peak FLOP/s, where it came from, its timings) for MFU: given, measured around the steps, or none."""
    if cfg.peak_flops is not None:
        return cfg.peak_flops, "given", {}
    if probe is None:
        return None, ("no peak given and measure_peak=False" if not cfg.measure_peak else
                      f"no {cfg.dtype} GEMM peak measured on this device"), {}
    peak = probe.finish(flops, times)
    return peak.best, peak.describe(), peak.to_dict()
