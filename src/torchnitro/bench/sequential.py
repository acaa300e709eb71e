"""Sequential comparison: decide with the samples there are, or ask for more (up to a cap).

``compare_samples`` decides once, on a fixed number of samples; when the noise is large it says
``same`` for a real 10% slowdown because it could not show it. Here the comparison looks at the
samples after each batch and returns one of four answers: ``slower`` / ``faster`` (shown), ``same``
(shown: the whole interval lies within the threshold), or ``inconclusive`` (collect another batch of
both and look again). At the last planned look (``looks``) inconclusive becomes ``same``.

**The statistic.** Timing noise on a shared machine is one-sided: preemption, a descheduled thread
of a parallel op or a cache flush only ever *add* time, so a run is a clean mode plus a heavy right
tail (results/profile_and_detect.md). The comparison therefore uses a low quantile (``quantile``,
0.1 by default) of each run: it estimates the clean mode, which moves with the code, while the
median moves with the load. The ratio is Q_q(new) / Q_q(base).

**The test.** A permutation test of |log Q_q(new) - log Q_q(base)|: exact under the null that both
runs are draws from one distribution, whatever that distribution is. Unpaired runs permute the
pooled samples; paired samples (``bench.compare`` rounds) swap base and new within each round, so
the null keeps every round's load on both sides (exact when the order inside a round does not matter,
as with drift that moves between rounds). The interval is a bootstrap of the ratio (over
samples, or over rounds when paired).

**Repeated looks.** Looking after every batch and stopping at the first significant result would
raise the false-alarm rate with each look. The false-alarm budget ``alpha`` is spent over the
planned looks (``alpha_spending``; by default growing with the look, k / (1 + ... + looks) of alpha
at look k, so an early look needs strong evidence and a batch that ran under odd conditions is
rarely decided on alone): by the union bound the chance of any false ``slower``/``faster`` over all looks is at most ``alpha``,
whatever the dependence between looks. Stopping early for ``same`` only removes chances to reject,
so it costs nothing.

**The threshold is tested, not compared.** A case is ``slower`` only when, at the look's share of
alpha, the test rejects "no change" (with the interval excluding 1) *and* a second, one-sided
permutation test rejects "the change is at most ``threshold``": the new samples are divided by
``1 + threshold`` and the test asks whether their quantile still lies above the base's. Requiring only
that the *estimate* moved by the threshold would call a real change just under it (a true 4% under a
5% threshold) slower about as often as its estimate lands above: half the time for a change at the
threshold, whatever alpha is. With the one-sided test the chance of calling a change of at most the
threshold ``slower`` is at most alpha over all looks (union bound again; exact when the change scales
the clean mode, as more of the same work does), and at least alpha smaller for a change further
below it. ``faster`` is the mirror image (a speed-up by more than ``1 / (1 + threshold)``). A real
change that is significant but not shown beyond the threshold collects more samples, and at the last
look is ``same`` with the reason saying so.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from torchnitro.errors import InputError

__all__ = ["SequentialConfig", "Look", "SequentialVerdict", "look", "compare_sequential", "quantile_ratio_test",
           "beyond_threshold_p", "compare_interleaved_sequential", "decide_batches", "compare_result_files"]


@dataclass(frozen=True)
class SequentialConfig:
    looks: int = 4  # the cap: at most this many decisions (one per batch); the last one is final
    alpha: float = 0.01  # false-alarm budget over all looks together (spent per look, module doc)
    alpha_spending: tuple[float, ...] | None = None  # share of alpha per look (sums to 1); None: k / sum(1..looks)
    threshold: float = 0.05  # smallest relative change of the low quantile that counts as a change
    quantile: float = 0.1  # which quantile of each run is compared (low: the clean mode, module doc)
    confidence: float = 0.95  # of the bootstrap interval of the ratio (and of the early "same")
    n_perm: int = 1999  # permutations per look: p resolves down to 1 / (n_perm + 1)
    n_boot: int = 2000  # bootstrap resamples per look
    seed: int = 0  # permutation / bootstrap generator: the same samples give the same verdict

    def __post_init__(self) -> None:
        if not isinstance(self.looks, int) or self.looks < 1:
            raise InputError(f"SequentialConfig.looks: received {self.looks!r}; expected an integer >= 1")
        if not 0 < self.alpha < 1 or not 0 < self.confidence < 1 or not 0 < self.quantile < 1:
            raise InputError(f"SequentialConfig: alpha {self.alpha}, confidence {self.confidence}, quantile "
                             f"{self.quantile}; expected each in (0, 1)")
        if not self.threshold >= 0:
            raise InputError(f"SequentialConfig.threshold: received {self.threshold}; expected a relative change "
                             ">= 0, e.g. 0.05 for 5%")
        s = self.alpha_spending
        if s is not None and (len(s) != self.looks or any(not x >= 0 for x in s) or abs(sum(s) - 1) > 1e-9):
            raise InputError(f"SequentialConfig.alpha_spending: received {s!r}; expected {self.looks} non-negative "
                             "shares that sum to 1 (one per look)")
        smallest = min(self.alpha_at(k) for k in range(1, self.looks + 1) if self.alpha_at(k) > 0)
        if self.n_perm < 1 / smallest or self.n_boot < 100:
            raise InputError(f"SequentialConfig: n_perm {self.n_perm} / n_boot {self.n_boot}; expected n_perm >= "
                             f"{math.ceil(1 / smallest)} (1 / the smallest alpha of a look, so every look can reject) "
                             "and n_boot >= 100")

    def alpha_at(self, k: int) -> float:
        """The share of the false-alarm budget look ``k`` (1-based) may spend."""
        if not 1 <= k <= self.looks:
            raise InputError(f"look {k}: expected 1..{self.looks} (SequentialConfig.looks)")
        share = self.alpha_spending[k - 1] if self.alpha_spending is not None else \
            k / (self.looks * (self.looks + 1) / 2)
        return self.alpha * share


@dataclass
class Look:
    """One decision on the samples collected so far."""

    k: int  # 1-based
    n_base: int
    n_new: int
    verdict: str  # slower | faster | same | inconclusive
    ratio: float  # Q_q(new) / Q_q(base); > 1 is slower
    ci_low: float
    ci_high: float
    p_value: float
    alpha: float  # the share of the budget this look spent
    reason: str
    p_threshold: float = math.nan  # one-sided p of "the change is at most the threshold", in the ratio's direction


@dataclass
class SequentialVerdict:
    case: str
    verdict: str  # slower | faster | same (never inconclusive: the last look decides)
    ratio: float
    ci_low: float
    ci_high: float
    p_value: float
    n_base: int
    n_new: int
    looks_used: int
    reason: str
    p_threshold: float = math.nan  # the deciding look's one-sided p of "at most the threshold" (module doc)
    history: list[Look] = field(default_factory=list)
    base: list[float] = field(default_factory=list, repr=False)  # every sample collected, in order
    new: list[float] = field(default_factory=list, repr=False)

    @property
    def median_base_s(self) -> float:
        return float(np.median(self.base)) if self.base else math.nan

    @property
    def median_new_s(self) -> float:
        return float(np.median(self.new)) if self.new else math.nan

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("base"), d.pop("new")
        return {**d, "median_base_s": self.median_base_s, "median_new_s": self.median_new_s}


def _check(case: str, base: Sequence[float], new: Sequence[float], paired: bool) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(base, float), np.asarray(new, float)
    for label, s in (("base", a), ("new", b)):
        if s.ndim != 1 or len(s) < 3 or not np.all(s > 0):
            raise InputError(f"case {case!r}: {label} has {s.size} samples ({s.ravel()[:3].tolist()}...); expected at "
                             "least 3 positive seconds-per-call values")
    if paired and len(a) != len(b):
        raise InputError(f"case {case!r}: {len(a)} base and {len(b)} new samples; paired samples come in equal "
                         "numbers (one of each per round); pass paired=False for separate runs")
    return a, b


def _stat(x: np.ndarray, y: np.ndarray, quantile: float) -> np.ndarray:
    """log Q_q(y) - log Q_q(x) along the last axis (x, y already in logs)."""
    return np.quantile(y, quantile, axis=-1) - np.quantile(x, quantile, axis=-1)


def _permuted(la: np.ndarray, lb: np.ndarray, paired: bool, rng: np.random.Generator, n_perm: int
              ) -> Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Draws the permutations once; the returned function applies them to (la, lb) or to a shifted lb."""
    if paired:  # swap base/new inside each round
        swap = rng.random((n_perm, len(la))) < 0.5  # (n_perm, rounds)
        return lambda x, y: (np.where(swap, y, x), np.where(swap, x, y))
    order = np.argsort(rng.random((n_perm, len(la) + len(lb))), axis=1)  # (n_perm, n1 + n2)

    def apply(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        perm = np.concatenate([x, y])[order]
        return perm[:, :len(x)], perm[:, len(x):]
    return apply


def _tests(a: np.ndarray, b: np.ndarray, quantile: float, paired: bool, confidence: float, n_perm: int, n_boot: int,
           seed: int, threshold: float | None) -> tuple[float, float, float, float, float]:
    """(ratio, ci_low, ci_high, p of "no change", p of "at most the threshold" in the ratio's direction)."""
    la, lb = np.log(a), np.log(b)
    rng = np.random.default_rng(seed)
    obs = float(_stat(la, lb, quantile))
    permute = _permuted(la, lb, paired, rng, n_perm)
    if paired:
        idx = rng.integers(0, len(la), (n_boot, len(la)))  # whole rounds
        boot = _stat(la[idx], lb[idx], quantile)
    else:
        boot = _stat(la[rng.integers(0, len(la), (n_boot, len(la)))], lb[rng.integers(0, len(lb), (n_boot, len(lb)))],
                     quantile)
    t = np.abs(_stat(*permute(la, lb), quantile))
    p = (1 + int(np.sum(t >= abs(obs) * (1 - 1e-12) - 1e-15))) / (n_perm + 1)
    p_thr = math.nan
    if threshold is not None:  # shift new back by the threshold, toward base; one-sided in the ratio's direction
        sign = 1.0 if obs >= 0 else -1.0
        shifted = lb - sign * math.log1p(threshold)
        obs_s = sign * float(_stat(la, shifted, quantile))
        t_s = sign * _stat(*permute(la, shifted), quantile)
        p_thr = (1 + int(np.sum(t_s >= obs_s - 1e-12 * abs(obs_s) - 1e-15))) / (n_perm + 1)
    q = (1 - confidence) / 2
    return math.exp(obs), float(np.exp(np.quantile(boot, q))), float(np.exp(np.quantile(boot, 1 - q))), p, p_thr


def quantile_ratio_test(base: Sequence[float], new: Sequence[float], *, quantile: float = 0.1, paired: bool = False,
                        confidence: float = 0.95, n_perm: int = 1999, n_boot: int = 2000, seed: int = 0
                        ) -> tuple[float, float, float, float]:
    """(ratio, ci_low, ci_high, p): the ratio of the ``quantile`` of ``new`` over that of ``base``, its
    bootstrap interval and the permutation p-value of "both come from one distribution" (module doc)."""
    a, b = _check("", base, new, paired)
    return _tests(a, b, quantile, paired, confidence, n_perm, n_boot, seed, None)[:4]


def beyond_threshold_p(base: Sequence[float], new: Sequence[float], threshold: float, *, quantile: float = 0.1,
                       paired: bool = False, n_perm: int = 1999, seed: int = 0) -> float:
    """One-sided permutation p of "``new`` is at most ``threshold`` slower than ``base``" when its quantile is
    higher (of "at most ``1 / (1 + threshold)`` faster" when lower): small only when the change is shown to
    exceed the threshold, not merely estimated to (module doc)."""
    a, b = _check("", base, new, paired)
    if not threshold >= 0:
        raise InputError(f"beyond_threshold_p: threshold {threshold}; expected a relative change >= 0")
    return _tests(a, b, quantile, paired, 0.95, n_perm, 100, seed, threshold)[4]


def look(base: Sequence[float], new: Sequence[float], k: int, config: SequentialConfig | None = None, *,
         paired: bool = False, case: str = "") -> Look:
    """The decision at look ``k`` (1-based) of ``config.looks`` on all samples collected so far."""
    cfg = config or SequentialConfig()
    a, b = _check(case, base, new, paired)
    alpha_k = cfg.alpha_at(k)
    ratio, lo, hi, p, p_thr = _tests(a, b, cfg.quantile, paired, cfg.confidence, cfg.n_perm, cfg.n_boot,
                                     cfg.seed + k, cfg.threshold)
    significant = p < alpha_k and (lo > 1 or hi < 1)
    beyond = p_thr < alpha_k  # shown to exceed the threshold, in the direction the ratio moved
    inside = 1 / (1 + cfg.threshold) < lo and hi < 1 + cfg.threshold
    what = f"q{cfg.quantile:g} ratio {ratio:.3f} ({lo:.3f}-{hi:.3f}), p={p:.2g}"
    beyond_what = f"p={p_thr:.2g} that it is at most {cfg.threshold:.0%}"
    if significant and beyond:
        verdict = "slower" if ratio > 1 else "faster"
        reason = f"{what}, {beyond_what}: both < {alpha_k:.2g} (look {k}/{cfg.looks}); moved {ratio - 1:+.1%}"
    elif inside:
        verdict, reason = "same", f"{what}: the interval lies within the {cfg.threshold:.0%} threshold"
    elif k >= cfg.looks:
        verdict = "same"
        reason = f"{what}: " + (f"a real change, not shown beyond {cfg.threshold:.0%} at the last look "
                                f"({beyond_what}, alpha {alpha_k:.2g})" if significant else
                                f"not shown at the last look ({k}/{cfg.looks}, alpha {alpha_k:.2g})")
    else:
        verdict, reason = "inconclusive", (f"{what}, {beyond_what}: neither shown beyond the threshold nor ruled "
                                           f"out at look {k}/{cfg.looks}; more samples")
    return Look(k, len(a), len(b), verdict, ratio, lo, hi, p, alpha_k, reason, p_thr)


def _looks(batches: Iterator[tuple[Sequence[float], Sequence[float]]], cfg: SequentialConfig, paired: bool,
           case: str) -> SequentialVerdict:
    """Look after each batch until a decision or the batches end (the last planned look always decides)."""
    base: list[float] = []
    new: list[float] = []
    history: list[Look] = []
    for k, (a, b) in enumerate(batches, 1):
        base += [float(x) for x in a]
        new += [float(x) for x in b]
        history.append(look(base, new, k, cfg, paired=paired, case=case))
        if history[-1].verdict != "inconclusive" or k == cfg.looks:
            break
    last = history[-1]
    return SequentialVerdict(case, last.verdict, last.ratio, last.ci_low, last.ci_high, last.p_value, len(base),
                             len(new), len(history), last.reason, last.p_threshold, history, base, new)


def compare_sequential(collect: Callable[[], tuple[Sequence[float], Sequence[float]]],
                       config: SequentialConfig | None = None, *, paired: bool = False,
                       case: str = "") -> SequentialVerdict:
    """Call ``collect()`` for a batch of (base, new) samples, look, and repeat while inconclusive (at most
    ``config.looks`` batches). Each batch should be one more run of both: interleaved rounds (``paired``)
    or two back-to-back runs."""
    cfg = config or SequentialConfig()
    return _looks((collect() for _ in range(cfg.looks)), cfg, paired, case)


def decide_batches(batches: Sequence[tuple[Sequence[float], Sequence[float]]], config: SequentialConfig | None = None,
                   *, paired: bool = False, case: str = "") -> SequentialVerdict:
    """The sequential decision on batches collected already (e.g. one pair of result files per run). It may be
    ``inconclusive``: the batches ran out before a decision and before the cap; add a batch and decide again."""
    cfg = config or SequentialConfig()
    if not 1 <= len(batches) <= cfg.looks:
        raise InputError(f"case {case!r}: {len(batches)} batches; expected 1 to {cfg.looks} (SequentialConfig.looks: "
                         "the number of looks is planned before the first one; raise it to allow more)")
    return _looks(iter(batches), cfg, paired, case)


def compare_result_files(runs: Sequence[tuple[Any, Any]], config: SequentialConfig | None = None
                         ) -> tuple[list[SequentialVerdict], list[str]]:
    """Per case shared by every (base, new) pair of ``BenchResult`` s, one run per look: the verdicts, and the
    cases left out (not in every file)."""
    files = [r for pair in runs for r in pair]
    shared = [c for c in files[0].cases if all(c in r.cases for r in files)]
    only = sorted({c for r in files for c in r.cases} - set(shared))
    if not shared:
        raise InputError(f"{', '.join(str(r.path) for r in files)} share no case names; expected the same benchmark "
                         "run each time")
    return [decide_batches([(b.cases[c], n.cases[c]) for b, n in runs], config, case=c) for c in shared], \
        [f"{c} (not in every file)" for c in only]


def compare_interleaved_sequential(fns: Mapping[str, Callable[[], Any]], baseline: str, timing: Any = None,
                                   config: SequentialConfig | None = None) -> list[SequentialVerdict]:
    """``bench.compare`` batches of interleaved rounds until every case is decided (or the cap): the
    sequential counterpart of ``regress.compare_interleaved``, one verdict per non-baseline entry."""
    from torchnitro.bench.timing import compare

    if baseline not in fns or len(fns) < 2:
        raise InputError(f"baseline {baseline!r} of {sorted(fns)}: expected one of at least two named functions")
    cfg = config or SequentialConfig()
    got: dict[str, list[float]] = {n: [] for n in fns}
    history: dict[str, list[Look]] = {n: [] for n in fns if n != baseline}
    open_cases = list(history)
    out: dict[str, SequentialVerdict] = {}
    for k in range(1, cfg.looks + 1):
        res = compare({n: fns[n] for n in [baseline] + open_cases}, timing)
        for n, t in res.items():
            got[n] += list(t.samples)
        for n in list(open_cases):  # every open case has every round so far, paired with the baseline's
            lk = look(got[baseline], got[n], k, cfg, paired=True, case=n)
            history[n].append(lk)
            if lk.verdict != "inconclusive":
                out[n] = SequentialVerdict(n, lk.verdict, lk.ratio, lk.ci_low, lk.ci_high, lk.p_value,
                                           len(got[baseline]), len(got[n]), k, lk.reason, lk.p_threshold, history[n],
                                           list(got[baseline]), list(got[n]))
                open_cases.remove(n)
        if not open_cases:
            break
    return [out[n] for n in history]
