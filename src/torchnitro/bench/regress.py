"""Regression statistics: is B slower than A (``compare_samples``), and where did a series step (``detect_steps``).

**Two runs** (two result files, or two variants timed interleaved in one process by
``bench.compare``: ``compare_interleaved``). For each case the raw samples of both runs are compared with a two-sided
Mann-Whitney U test (normal approximation, tie and continuity corrected) and a bootstrap confidence
interval of the ratio of medians (new / base, seeded). A case is ``slower`` or ``faster`` only when
*both* hold: the test rejects at ``alpha`` with the interval excluding 1, and the median moved by at
least ``threshold`` (5% by default). Noise alone fails the first; a real but tiny change fails the
second, so it is reported as ``same`` with its ratio and interval.

**A series of runs.** ``detect_steps`` fits step changes to the log of per-run medians by binary
segmentation in its circular form (Olshen et al. 2004, so a bump that goes up and comes back is
found too): in a segment, the single split, or else the sub-segment, that differs most from the
rest by a two-sample t statistic is taken when a permutation test of that maximum (the maximum
over all splits or sub-segments of shuffled data, so trying every split is paid for) gives
p < ``alpha / 2`` (two tests, so ``alpha`` in all); each of its one or two
boundaries is a step when the level changes there by at least ``threshold``; the pieces are then
searched again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from torchnitro.errors import InputError

__all__ = ["CompareConfig", "CaseVerdict", "Step", "mann_whitney_u", "ratio_ci", "compare_samples",
           "wilcoxon_signed_rank", "compare_paired",
           "compare_results", "compare_interleaved", "detect_steps"]


@dataclass(frozen=True)
class CompareConfig:
    alpha: float = 0.01  # significance of the rank test (and of each step's permutation test)
    threshold: float = 0.05  # smallest relative change of the median that counts as a change
    confidence: float = 0.95  # of the bootstrap interval of the ratio of medians
    n_boot: int = 2000  # bootstrap resamples
    seed: int = 0  # bootstrap / permutation generator: the same files give the same verdicts

    def __post_init__(self) -> None:
        if not (0 < self.alpha < 1 and 0 < self.confidence < 1):
            raise InputError(f"alpha {self.alpha} / confidence {self.confidence}: expected both in (0, 1)")
        if not self.threshold >= 0:
            raise InputError(f"threshold {self.threshold}: expected a relative change >= 0, e.g. 0.05 for 5%")


@dataclass
class CaseVerdict:
    case: str
    verdict: str  # slower | faster | same
    ratio: float  # median(new) / median(base); > 1 is slower
    ci_low: float
    ci_high: float
    p_value: float
    n_base: int
    n_new: int
    median_base_s: float
    median_new_s: float
    reason: str  # why this verdict, in words

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mann_whitney_u(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """U statistic of ``a`` and the two-sided p-value (normal approximation with tie correction)."""
    x, y = np.asarray(a, float), np.asarray(b, float)
    n1, n2 = len(x), len(y)
    if n1 < 1 or n2 < 1:
        raise InputError(f"mann_whitney_u: received samples of sizes {n1} and {n2}; expected both non-empty")
    allv = np.concatenate([x, y])
    order = np.argsort(allv, kind="mergesort")
    ranks = np.empty(len(allv))
    sv = allv[order]
    _, start, counts = np.unique(sv, return_index=True, return_counts=True)
    mid = start + (counts + 1) / 2.0  # average rank of each tie group (1-based)
    ranks[order] = np.repeat(mid, counts)
    u1 = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0
    n = n1 + n2
    tie = (counts ** 3 - counts).sum()
    var = n1 * n2 / 12.0 * ((n + 1) - tie / (n * (n - 1))) if n > 1 else 0.0
    if var <= 0:
        return float(u1), 1.0
    z = (abs(u1 - n1 * n2 / 2.0) - 0.5) / math.sqrt(var)
    return float(u1), float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0))))


def ratio_ci(base: Sequence[float], new: Sequence[float], *, confidence: float = 0.95, n_boot: int = 2000,
             seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of median(new) / median(base), each run resampled on its own."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(base, float), np.asarray(new, float)
    ma = np.median(a[rng.integers(0, len(a), (n_boot, len(a)))], axis=1)
    mb = np.median(b[rng.integers(0, len(b), (n_boot, len(b)))], axis=1)
    r = mb / ma
    q = (1 - confidence) / 2
    return float(np.quantile(r, q)), float(np.quantile(r, 1 - q))


def _check(case: str, **samples: Sequence[float]) -> None:
    for label, s in samples.items():
        if len(s) < 3 or any(not (v > 0) for v in s):
            raise InputError(f"case {case!r}: {label} has {len(s)} samples ({list(s)[:3]}...); expected at least 3 "
                             "positive seconds-per-call values")


def _verdict(case: str, base: Sequence[float], new: Sequence[float], ratio: float, lo: float, hi: float, p: float,
             cfg: CompareConfig) -> CaseVerdict:
    """Both must hold for slower/faster: significant (p and interval) and at least the threshold."""
    significant = p < cfg.alpha and (lo > 1 or hi < 1)
    big = abs(ratio - 1) >= cfg.threshold
    if significant and big:
        verdict = "slower" if ratio > 1 else "faster"
        reason = f"p={p:.2g} < {cfg.alpha} and the median moved {ratio - 1:+.1%} (threshold {cfg.threshold:.0%})"
    elif significant:
        verdict, reason = "same", f"a real but small change ({ratio - 1:+.1%} < threshold {cfg.threshold:.0%})"
    else:
        verdict = "same"
        reason = f"not significant (p={p:.2g}, interval {lo:.3f}-{hi:.3f} includes 1)" if big or p >= cfg.alpha else \
            f"interval {lo:.3f}-{hi:.3f} includes 1"
    return CaseVerdict(case, verdict, ratio, lo, hi, p, len(base), len(new), float(np.median(base)),
                       float(np.median(new)), reason)


def compare_samples(base: Sequence[float], new: Sequence[float], config: CompareConfig | None = None, *,
                    case: str = "") -> CaseVerdict:
    """The verdict for one case from the raw samples of two runs (see the module doc)."""
    cfg = config or CompareConfig()
    _check(case, base=base, new=new)
    _, p = mann_whitney_u(base, new)
    lo, hi = ratio_ci(base, new, confidence=cfg.confidence, n_boot=cfg.n_boot, seed=cfg.seed)
    return _verdict(case, base, new, float(np.median(new) / np.median(base)), lo, hi, p, cfg)


def wilcoxon_signed_rank(d: Sequence[float]) -> float:
    """Two-sided p-value that the differences ``d`` are centred on 0 (zeros dropped, normal approximation)."""
    x = np.asarray(d, float)
    x = x[x != 0]
    n = len(x)
    if n == 0:
        return 1.0
    a = np.abs(x)
    order = np.argsort(a, kind="mergesort")
    _, start, counts = np.unique(a[order], return_index=True, return_counts=True)
    ranks = np.empty(n)
    ranks[order] = np.repeat(start + (counts + 1) / 2.0, counts)
    w = ranks[x > 0].sum()
    var = n * (n + 1) * (2 * n + 1) / 24.0 - (counts ** 3 - counts).sum() / 48.0
    if var <= 0:
        return 1.0
    z = (abs(w - n * (n + 1) / 4.0) - 0.5) / math.sqrt(var)
    return float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0))))


def compare_paired(base: Sequence[float], new: Sequence[float], config: CompareConfig | None = None, *,
                   case: str = "") -> CaseVerdict:
    """The verdict for samples taken in pairs (interleaved rounds): drift common to a round cancels.

    The ratio is exp(median of the per-round log ratios), its interval a bootstrap over rounds, the
    test Wilcoxon's signed rank on the log ratios.
    """
    cfg = config or CompareConfig()
    _check(case, base=base, new=new)
    if len(base) != len(new):
        raise InputError(f"case {case!r}: {len(base)} base and {len(new)} new samples; paired samples come in "
                         "equal numbers (one of each per round); use compare_samples for unpaired runs")
    d = np.log(np.asarray(new, float)) - np.log(np.asarray(base, float))
    rng = np.random.default_rng(cfg.seed)
    boot = np.median(d[rng.integers(0, len(d), (cfg.n_boot, len(d)))], axis=1)
    q = (1 - cfg.confidence) / 2
    lo, hi = float(np.exp(np.quantile(boot, q))), float(np.exp(np.quantile(boot, 1 - q)))
    return _verdict(case, base, new, float(np.exp(np.median(d))), lo, hi, wilcoxon_signed_rank(d), cfg)


def compare_results(base: Any, new: Any, config: CompareConfig | None = None) -> tuple[list[CaseVerdict], list[str]]:
    """Every case both ``BenchResult`` s share; returns (verdicts, names found in only one of them)."""
    shared = [c for c in base.cases if c in new.cases]
    only = [f"{c} (only in {base.path or 'base'})" for c in base.cases if c not in new.cases]
    only += [f"{c} (only in {new.path or 'new'})" for c in new.cases if c not in base.cases]
    if not shared:
        raise InputError(f"{base.path} and {new.path} share no case names (base has {sorted(base.cases)[:5]}, new "
                         f"has {sorted(new.cases)[:5]}); expected the same benchmark run twice")
    return [compare_samples(base.cases[c], new.cases[c], config, case=c) for c in shared], only


def compare_interleaved(timings: Mapping[str, Any], baseline: str,
                        config: CompareConfig | None = None) -> list[CaseVerdict]:
    """Verdicts for every entry of a ``bench.compare`` result against ``baseline``: its rounds pair the samples."""
    if baseline not in timings:
        raise InputError(f"baseline {baseline!r} is not one of {sorted(timings)}; expected a name passed to compare()")
    base = timings[baseline].samples
    return [compare_paired(base, t.samples, config, case=name) for name, t in timings.items() if name != baseline]


# ---- step detection over a series of runs ------------------------------------------------------

@dataclass
class Step:
    index: int  # first run at the new level
    before: float  # median of the level before (same unit as the series)
    after: float  # median of the level after
    p_value: float

    @property
    def ratio(self) -> float:
        return self.after / self.before


def _pairs(n: int, min_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (i, j) with a segment y[i:j] and a rest of at least ``min_size`` points each."""
    i, j = np.triu_indices(n + 1, k=min_size)
    keep = (n - (j - i)) >= min_size
    return i[keep], j[keep]


def _max_t(y: np.ndarray, i: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows of ``y`` (R, n): the largest t of "y[i:j] differs from the rest" over the pairs, and which pair."""
    n = y.shape[1]
    zero = np.zeros((len(y), 1))
    c1, c2 = np.hstack([zero, np.cumsum(y, axis=1)]), np.hstack([zero, np.cumsum(y * y, axis=1)])
    nin, nout = (j - i).astype(float), (n - (j - i)).astype(float)
    s_in, s2_in = c1[:, j] - c1[:, i], c2[:, j] - c2[:, i]
    s_out, s2_out = c1[:, -1:] - s_in, c2[:, -1:] - s2_in
    m_in, m_out = s_in / nin, s_out / nout
    ssw = (s2_in - nin * m_in * m_in) + (s2_out - nout * m_out * m_out)
    var = np.maximum(ssw / max(n - 2, 1), 1e-24)
    t = np.abs(m_in - m_out) / np.sqrt(var * (1 / nin + 1 / nout))
    best = np.argmax(t, axis=1)
    return t[np.arange(len(y)), best], best


def detect_steps(values: Sequence[float], *, threshold: float = 0.05, alpha: float = 0.01, min_size: int = 2,
                 n_perm: int = 999, seed: int = 0) -> list[Step]:
    """Step changes in a series of positive values (per-run medians), in order of index."""
    v = np.asarray(values, float)
    if v.ndim != 1 or len(v) and not np.all(v > 0):
        raise InputError(f"detect_steps: received {v.shape} values (min {v.min() if v.size else None}); expected a "
                         "1-D series of positive timings")
    if min_size < 1:
        raise InputError(f"detect_steps: min_size {min_size}; expected >= 1 runs on each side of a step")
    rng = np.random.default_rng(seed)
    steps: list[Step] = []

    def search(lo: int, hi: int) -> None:
        if hi - lo < 2 * min_size:
            return
        seg = np.log(v[lo:hi])
        perms = seg[np.argsort(rng.random((n_perm, len(seg))), axis=1)]
        i_all, j_all = _pairs(len(seg), min_size)
        one = (i_all == 0) | (j_all == len(seg))  # a single split: segment touches an end
        # one step first (most power on short series), then a bump (a sub-segment): alpha/2 each
        for i, j in ((i_all[one], j_all[one]), (i_all, j_all)):
            t_obs, best = _max_t(seg[None, :], i, j)
            t_perm, _ = _max_t(perms, i, j)
            p = (1 + int(np.sum(t_perm >= t_obs[0] * (1 - 1e-12)))) / (n_perm + 1)
            if p < alpha / 2:
                break
        else:
            return
        cuts = [lo] + [lo + int(c) for c in (i[best[0]], j[best[0]]) if 0 < c < len(seg)] + [hi]
        found = False
        for a, b, c in zip(cuts, cuts[1:], cuts[2:]):  # each boundary between two levels
            before, after = float(np.median(v[a:b])), float(np.median(v[b:c]))
            if abs(after / before - 1) >= threshold:
                steps.append(Step(b, before, after, p))
                found = True
        if found:
            for a, b in zip(cuts, cuts[1:]):
                search(a, b)

    search(0, len(v))
    return sorted(steps, key=lambda s: s.index)
