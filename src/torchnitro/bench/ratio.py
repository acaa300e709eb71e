"""How sure a speedup is: the ratio of two interleaved timings with its noise.

``compare`` takes one sample of every function per round, next to each other in time, so load that
changes between rounds hits the baseline and the candidate of one round alike. The noise of the
ratio is therefore measured on rounds, not on each timing's own spread: a paired bootstrap draws
whole rounds with replacement (``resamples`` times, fixed seed), recomputes
``stat(baseline) / stat(candidate)`` on each draw, and takes the central ``confidence`` interval.
``noise`` is how far the lower end of that interval lies below the estimate: a candidate is faster
than the baseline by more than the noise exactly when the interval's lower end is above 1.

A machine whose speed drifts by 20% over the run gives each timing a large coefficient of variation
but a steady ratio (small noise); a candidate whose own latency jumps around gives a wide interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchnitro.bench.timing import Timing, percentile
from torchnitro.errors import InputError

__all__ = ["RatioEstimate", "paired_ratio"]

_MAX_CELLS = 8_000_000  # resamples x rounds drawn at once (torch.quantile takes at most 2**24 elements)


@dataclass(frozen=True)
class RatioEstimate:
    """``baseline / candidate`` of one statistic (>1: the candidate is faster), with its bootstrap interval."""

    ratio: float  # stat(baseline samples) / stat(candidate samples)
    low: float  # lower end of the central confidence interval of the ratio
    high: float  # upper end
    rounds: int  # paired rounds the interval was drawn from

    @property
    def noise(self) -> float:
        """How far the interval reaches below the estimate (>= 0; inf with fewer than 2 rounds)."""
        return max(0.0, self.ratio - self.low)

    @property
    def beats_noise(self) -> bool:
        """The whole interval is above 1: faster than the baseline by more than the noise."""
        return self.low > 1.0

    def text(self) -> str:
        return f"{self.ratio:.2f}x ±{self.noise:.2f}"


def paired_ratio(baseline: Timing, candidate: Timing, q: float = 50.0, *, confidence: float = 0.95,
                 resamples: int = 1000, seed: int = 0) -> RatioEstimate:
    """The ratio of the ``q``-th percentiles of two timings from one ``compare`` run, with its noise.

    Sample ``i`` of each timing must come from the same round (``compare`` guarantees it)."""
    if baseline.n != candidate.n:
        raise InputError(f"paired_ratio needs samples from the same interleaved rounds; received {baseline.n} baseline "
                         f"and {candidate.n} candidate samples (expected equal counts, one per round)")
    if not 0.0 < confidence < 1.0 or not 0.0 <= q <= 100.0:
        raise InputError(f"confidence must lie in (0, 1) and q in [0, 100]; received confidence={confidence}, q={q}")
    n = baseline.n
    ratio = percentile(baseline.samples, q) / percentile(candidate.samples, q)
    if n < 2:
        return RatioEstimate(ratio, -math.inf, math.inf, n)
    b = torch.tensor(baseline.samples, dtype=torch.float64)  # (n,) seconds per call, one per round
    c = torch.tensor(candidate.samples, dtype=torch.float64)
    draws = max(50, min(resamples, _MAX_CELLS // n))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(n, (draws, n), generator=gen)  # (draws, n): whole rounds, drawn with replacement
    qq = q / 100.0
    boot = torch.quantile(b[idx], qq, dim=1) / torch.quantile(c[idx], qq, dim=1)  # (draws,)
    tail = (1.0 - confidence) / 2.0
    low, high = torch.quantile(boot, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
    return RatioEstimate(ratio, low, high, n)
