"""Eager's baseline from several fresh processes in the final comparison (``OptimizeConfig.eager_processes``).

One fresh process is one draw of eager's per-process speed: the same model in four fresh processes of one
quiet run took 41.6-51.3 ms (git show bcfd875:results/timing_fairness.md, docs/optimize.md; the cause, glibc's
allocator, was found later: results/eager_spread.md), so a speedup over one eager
process hangs on which draw it got. On the CPU, when eager is timed alone, the comparison therefore starts
``K`` eager timing processes (``process_names``: ``eager``, ``eager-2``, ...) loaded the same way, and
eager's statistic for every speedup is the **median of the per-process statistics** (p50, or p99 for a p99
objective): ``EagerBaseline``.
The default is ``K`` = 1: a quiet run with ``K`` = 3 (docs/optimize.md, "Measured, and why the default is
1") made the searches 1.5-2x longer and slowed every timing process on a 2-core machine without closing the
gap between sets of fresh processes.

**Every eager process in every round.** ``bench.compare`` takes one sample of every entry per round, so the
``K`` processes are ``K`` entries: a round holds one sample of each eager process and of each finalist. The
comparison grows by ``K - 1`` samples per round (3 finalists, ``K`` = 3: 6 samples a round instead of 4).
Cycling one eager process per round would keep the length but leave each process a ``1/K`` share of the
rounds, so each per-process p50 would carry ~sqrt(K) more sampling noise, and that noise is what has to be
small for the median over processes to separate a process's mode from a slow round; it would also leave
the rounds unequal (a round's eager sample from a different process each time). Every process in every
round keeps each process's p50 as precise as the single process's was and the pairing exact.

**The pairing of the bootstrap** (``EagerBaseline.ratio``, the ``±`` of each speedup): a draw takes whole
rounds with replacement, each round carrying the finalist's sample and the ``K`` eager samples taken beside
it; on the drawn rounds it recomputes each eager process's statistic, their median, and the finalist's
statistic, and divides. The ``K`` processes themselves are kept fixed, not resampled: the ``±`` is the
noise of the rounds given these processes (with 3 processes a resample of processes would only pick among
three values), and the spread between processes is reported beside it (``text``: the per-process p50s).
With ``K`` = 1 it is ``bench.ratio.paired_ratio`` exactly (the old single-process result).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from torchnitro.autotune.recipe import EAGER
from torchnitro.bench.ratio import RatioEstimate, paired_ratio
from torchnitro.bench.timing import Timing, percentile
from torchnitro.errors import InputError

if TYPE_CHECKING:
    from torchnitro.autotune.report import CandidateResult

__all__ = ["process_names", "is_eager", "is_copy", "EagerBaseline"]

_MAX_CELLS = 8_000_000  # resamples x rounds drawn at once (torch.quantile takes at most 2**24 elements)


def process_names(k: int) -> list[str]:
    """The comparison's names of eager's ``k`` timing processes: ``eager`` (the report's row), ``eager-2``, ..."""
    if k < 1:
        raise InputError(f"eager needs at least one timing process; received {k}")
    return [EAGER] + [f"{EAGER}-{i}" for i in range(2, k + 1)]


def is_copy(name: str) -> bool:
    """``eager-2``, ``eager-3``, ...: a further eager timing process (no report row of its own)."""
    head, _, tail = name.rpartition("-")
    return head == EAGER and tail.isdigit()


def is_eager(name: str) -> bool:
    """One of eager's timing processes (the report's ``eager`` row or a further copy)."""
    return name == EAGER or is_copy(name)


@dataclass(frozen=True)
class EagerBaseline:
    """Eager's timings from its processes in one interleaved run: sample ``i`` of each comes from round ``i``."""

    timings: tuple[Timing, ...]  # one per eager process, in the comparison's order

    @classmethod
    def of(cls, res: Mapping[str, Timing]) -> "EagerBaseline":
        """The eager entries of one ``compare`` result (``is_eager``), in its order."""
        got = tuple(t for n, t in res.items() if is_eager(n))
        if not got:
            raise InputError(f"the comparison has no eager entry; received {sorted(res)}, expected {EAGER!r} "
                             "among them")
        return cls(got)

    @property
    def k(self) -> int:
        return len(self.timings)

    def stat(self, q: float = 50.0) -> float:
        """Seconds: the median over processes of each process's ``q``-th percentile."""
        return statistics.median(percentile(t.samples, q) for t in self.timings)

    @property
    def median(self) -> float:
        """Seconds: the median of the per-process p50s (``fair.check_eager`` reads this)."""
        return statistics.median(t.median for t in self.timings)

    @property
    def cv(self) -> float:
        """The median of the per-process coefficients of variation (each process's own spread)."""
        return statistics.median(t.cv for t in self.timings)

    def p50s_ms(self) -> list[float]:
        return [t.median * 1e3 for t in self.timings]

    def ratio(self, candidate: Timing, q: float = 50.0, *, confidence: float = 0.95, resamples: int = 1000,
              seed: int = 0) -> RatioEstimate:
        """``stat(q) / candidate's q-th percentile`` with its paired bootstrap interval (module docstring)."""
        if self.k == 1:
            return paired_ratio(self.timings[0], candidate, q, confidence=confidence, resamples=resamples, seed=seed)
        n = candidate.n
        if any(t.n != n for t in self.timings):
            raise InputError(f"the eager processes and the candidate must come from the same rounds; received "
                             f"{[t.n for t in self.timings]} eager and {n} candidate samples (expected equal counts)")
        if not 0.0 < confidence < 1.0 or not 0.0 <= q <= 100.0:
            raise InputError(f"confidence must lie in (0, 1) and q in [0, 100]; received confidence={confidence}, "
                             f"q={q}")
        ratio = self.stat(q) / percentile(candidate.samples, q)
        if n < 2:
            return RatioEstimate(ratio, -math.inf, math.inf, n)
        e = torch.tensor([t.samples for t in self.timings], dtype=torch.float64)  # (K, n): process x round
        c = torch.tensor(candidate.samples, dtype=torch.float64)  # (n,)
        draws = max(50, min(resamples, _MAX_CELLS // n))
        idx = torch.randint(n, (draws, n), generator=torch.Generator().manual_seed(seed))  # whole rounds
        qq = q / 100.0
        per = torch.stack([torch.quantile(row[idx], qq, dim=1) for row in e])  # (K, draws): each process, drawn rounds
        base = torch.quantile(per, 0.5, dim=0)  # (draws,): their median (the middle two's mean for even K)
        boot = base / torch.quantile(c[idx], qq, dim=1)
        tail = (1.0 - confidence) / 2.0
        low, high = torch.quantile(boot, torch.tensor([tail, 1.0 - tail], dtype=torch.float64)).tolist()
        return RatioEstimate(ratio, low, high, n)

    def fill(self, c: CandidateResult) -> None:
        """Eager's report row: p50 and p99 the medians over processes, cv the median process's, speedup 1."""
        t0 = self.timings[0]
        if self.k == 1:
            c.p50_ms, c.p99_ms, c.cv, c.throughput = t0.median * 1e3, t0.p99 * 1e3, t0.cv, t0.throughput
        else:
            med = self.median
            c.p50_ms, c.p99_ms, c.cv = med * 1e3, self.stat(99.0) * 1e3, self.cv
            c.throughput = t0.items_per_call / med if med > 0 else math.inf
        c.process_p50_ms = self.p50s_ms()
        c.speedup, c.interleaved = 1.0, True

    def per_process_text(self) -> str:
        return " / ".join(f"{ms:.3f}" for ms in self.p50s_ms()) + " ms"

    def text(self) -> str:
        """The report's line: every process's p50 and the median every speedup divides."""
        return (f"eager in the final comparison: {self.k} fresh processes, p50 {self.per_process_text()}; every "
                f"speedup uses their median, {self.median * 1e3:.3f} ms (± of a speedup: whole rounds drawn, each "
                "with every eager process's sample and the finalist's; the processes kept fixed)")
