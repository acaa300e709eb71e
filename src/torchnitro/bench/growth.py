"""Does a repeated operation grow host memory? A least-squares slope per repetition with its confidence interval.

``memory_sample()`` reads, once per repetition at the same point of the cycle, the process's RSS, USS and PSS
(``psutil.memory_full_info``; USS/PSS are None where the platform has no smaps) and the bytes glibc's malloc
holds in use (``mallinfo2``: heap in use plus mmapped blocks; None off glibc). ``fit_growth`` fits a line to one
series after a warm-up and gives the slope's confidence interval from Student's t. "No growth" is a claim with
power only when the interval's upper end is far below the leak one looks for: ``Growth.rules_out(leak)``.

The interval assumes independent residuals; allocator retention makes neighbouring RSS samples correlated, so
the malloc in-use series (no page-level retention) is the sharper one, and RSS is reported beside it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import statistics
from dataclasses import dataclass
from statistics import NormalDist

import psutil

from torchnitro.errors import InputError

__all__ = ["Growth", "fit_growth", "memory_sample", "t_quantile", "trim_heap"]


@dataclass(frozen=True)
class Growth:
    """A fitted growth per repetition, in the units of the series (bytes)."""

    slope: float  # least-squares change per repetition
    low: float  # lower end of the two-sided confidence interval of the slope
    high: float  # upper end
    n: int  # samples fitted (after the warm-up)
    confidence: float  # e.g. 0.95

    @property
    def grows(self) -> bool:
        """The interval excludes zero from above: memory grows per repetition."""
        return self.low > 0

    def rules_out(self, leak: float) -> bool:
        """A leak of ``leak`` per repetition (or more) lies above the interval: the data exclude it."""
        return self.high < leak


def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile from the normal one (Cornish-Fisher, 3 terms): within 0.2% of the exact value for
    dof >= 5 at p = 0.975 (2.5678 vs 2.5706 at 5, 2.0211 vs 2.0211 at 40); too small below 5, which
    ``fit_growth`` therefore refuses."""
    if dof < 1 or not 0 < p < 1:
        raise InputError(f"t_quantile: received p={p}, dof={dof}; expected 0 < p < 1 and dof >= 1.")
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    return z + g1 / dof + g2 / dof**2 + g3 / dof**3


def fit_growth(series: list[float], warmup: int = 0, confidence: float = 0.95) -> Growth:
    """Least-squares slope of ``series[warmup:]`` over its index, with a ``confidence`` interval."""
    ys = [float(y) for y in series[warmup:]]
    if len(ys) < 7:
        raise InputError(f"fit_growth: received {len(series)} samples with warmup={warmup}; expected at least 7 "
                         "after the warm-up (more saves, or a shorter warm-up).")
    xs = list(range(len(ys)))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = [y - (my + slope * (x - mx)) for x, y in zip(xs, ys)]
    se = math.sqrt(sum(r * r for r in resid) / (len(ys) - 2) / sxx)
    half = t_quantile(0.5 + confidence / 2, len(ys) - 2) * se
    return Growth(slope=slope, low=slope - half, high=slope + half, n=len(ys), confidence=confidence)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    fn = getattr(ctypes.CDLL(name), "mallinfo2", None)  # glibc >= 2.33
    if fn is None:
        return None
    fn.restype = _Mallinfo2
    return fn


_MALLINFO2 = None
_MALLINFO2_LOOKED = False


def memory_sample(proc: psutil.Process | None = None) -> dict[str, int | None]:
    """{"rss", "uss", "pss", "malloc_in_use"} in bytes for this process (None where not available)."""
    global _MALLINFO2, _MALLINFO2_LOOKED
    proc = proc or psutil.Process()
    try:
        full = proc.memory_full_info()
        rss, uss, pss = full.rss, getattr(full, "uss", None), getattr(full, "pss", None)
    except psutil.AccessDenied:
        rss, uss, pss = proc.memory_info().rss, None, None
    if not _MALLINFO2_LOOKED:
        _MALLINFO2, _MALLINFO2_LOOKED = _mallinfo2(), True
    in_use = None
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        in_use = int(info.uordblks + info.hblkhd)  # all arenas' chunks in use + mmapped blocks
    return {"rss": rss, "uss": uss, "pss": pss, "malloc_in_use": in_use}


def trim_heap() -> bool:
    """Return glibc malloc's free heap pages to the system (``malloc_trim(0)``); False where there is no glibc.

    RSS minus what this gives back is the allocator's retention, not live memory: a series sampled after a
    trim separates a leak (still grows) from pages malloc keeps for reuse (stops growing).
    """
    name = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if fn is None:
        return False
    fn(0)
    return True
