"""How ``benchmarks/profile_and_detect.py`` decides its detector rows from samples (no timing here).

A trial's samples go to our detectors (``regress.compare_samples``, ``compare_paired`` and the
sequential ``bench.sequential``) and to the peers' rules (pyperf's ``compare_to`` t-test and
pytest-benchmark's ``mean:5%``), each through its own code; ``Tally`` counts what each called slower.
The rows' goals and the 3% limit are explained in the benchmark's docstring and ``_rows``. Recorded
samples (``decide_real``) and seeded synthetic ones (``synthetic_rows``) are decided the same way.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

import numpy as np

from torchnitro.bench import ResultTable
from torchnitro.bench.regress import compare_paired, compare_samples, detect_steps
from torchnitro.bench.sequential import SequentialConfig, compare_sequential
from torchnitro.errors import InputError

__all__ = ["SLOWDOWNS", "Tally", "allowed_rate", "decide_real", "implied_rate", "synthetic_rows"]

# the injected slowdowns, one detector row each; the real runs time exactly these
SLOWDOWNS = {"A/A": 0.0, "10% slower": 0.10, "3% slower": 0.03}


def _pytest_benchmark_fails(base: Sequence[float], new: Sequence[float]) -> bool | None:
    """pytest-benchmark's ``--benchmark-compare-fail=mean:5%`` on these samples, through its own code."""
    try:
        from pytest_benchmark.stats import Stats
        from pytest_benchmark.utils import parse_compare_fail
    except ImportError:
        return None
    stats = []
    for samples in (base, new):
        s = Stats()
        for x in samples:
            s.update(x)
        stats.append(s.as_dict())
    return bool(parse_compare_fail("mean:5%").fails(stats[1], stats[0]))


def _pyperf_slower(base: Sequence[float], new: Sequence[float]) -> bool | None:
    """What ``pyperf compare_to`` prints "slower" for: its t-test at 95% and a larger mean (no minimum effect)."""
    try:
        import pyperf
        from pyperf._compare import is_significant_benchs
    except ImportError:
        return None
    b1 = pyperf.Benchmark([pyperf.Run(list(base), metadata={"name": "case"}, collect_metadata=False)])
    b2 = pyperf.Benchmark([pyperf.Run(list(new), metadata={"name": "case"}, collect_metadata=False)])
    significant, _ = is_significant_benchs(b1, b2)
    return bool(significant) and statistics.fmean(new) > statistics.fmean(base)


class Tally:
    """Per tool: how many trials it called slower; and our ratio estimates (for the 3% calibration).

    The fixed-sample tools decide on the first batch (20 samples each, as before); ``ours sequential``
    (``bench.sequential``) on the batches it asked for, which pyperf and pytest-benchmark then also get
    (their ``... on the same N`` counts).
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.ratios: dict[str, list[float]] = {"ours": [], "ours paired": [], "ours sequential": []}
        self.trials = 0
        self.samples_used = 0

    def add(self, base: Sequence[float], new: Sequence[float], paired: bool,
            batches: Sequence[Sequence[Sequence[float]]] | None = None, seq: SequentialConfig | None = None) -> None:
        self.trials += 1
        verdicts: dict[str, Any] = {"ours": compare_samples(base, new)}
        if paired:
            verdicts["ours paired"] = compare_paired(base, new)
        if batches is not None:
            it = iter(batches)
            v = compare_sequential(lambda: next(it), seq or SequentialConfig(), paired=paired)
            verdicts["ours sequential"] = v
            self.samples_used += v.n_base
        calls: dict[str, bool | None] = {k: v.verdict == "slower" for k, v in verdicts.items()}
        for k, v in verdicts.items():
            self.ratios[k].append(v.ratio)
        calls["pyperf compare_to"] = _pyperf_slower(base, new)
        calls["pytest-benchmark mean:5%"] = _pytest_benchmark_fails(base, new)
        if batches is not None:  # the peers on the samples our sequential run collected
            pb, pn = verdicts["ours sequential"].base, verdicts["ours sequential"].new
            calls["pyperf on the same samples"] = _pyperf_slower(pb, pn)
            calls["pytest-benchmark on the same samples"] = _pytest_benchmark_fails(pb, pn)
        for tool, slower in calls.items():
            self.counts[tool] = self.counts.get(tool, 0) + bool(slower) if slower is not None else -1

    def detail(self) -> str:
        out = ", ".join(f"{k} {v}/{self.trials}" if v >= 0 else f"{k} not installed" for k, v in self.counts.items())
        if self.samples_used:
            out += f"; ours sequential used {self.samples_used / self.trials:.1f} samples a side on average"
        return out


def implied_rate(aa_ratios: Sequence[float], shift: float = 0.03, threshold: float = 0.05) -> float:
    """Share of A/A ratio estimates that, moved by ``shift``, reach the threshold: what a ``shift`` change
    is called slower at most, given this noise (an upper bound: the significance test is not applied)."""
    return sum(r * (1 + shift) >= 1 + threshold for r in aa_ratios) / max(len(aa_ratios), 1)


def allowed_rate(rate: float, n: int) -> float:
    """``rate`` plus two binomial standard errors of a count over ``n`` trials (at least that of 1 / n)."""
    return rate + 2 * math.sqrt(max(rate, 1 / n) * (1 - rate) / n)


def _rows(table: ResultTable, what: str, tallies: dict[str, Tally], key: str, also: str | None = None,
          tested_alpha: float | None = None) -> None:
    """Three rows (A/A, 10%, 3%) for one mode, judged on our verdict ``key`` (``also``: shown beside it).

    The 3% limit: for a detector that compares its *estimate* with the threshold (``compare_samples``),
    the noise-implied rate (``implied_rate``); for one that *tests* "the change is at most the threshold"
    at ``tested_alpha`` over all its looks (``bench.sequential``), that alpha: what its threshold implies
    for any change at or below it. Both plus two binomial standard errors; the other is shown beside it.
    """
    n = tallies["A/A"].trials
    aa, ten, three = (tallies[k].counts[key] for k in SLOWDOWNS)
    implied = implied_rate(tallies["A/A"].ratios[key])
    if tested_alpha is None:
        allowed = allowed_rate(implied, n)
        why, beside = f"implied {implied:.1%} + 2 SE", ""
    else:
        allowed = allowed_rate(tested_alpha, n)
        why = f"alpha {tested_alpha:.0%} + 2 SE: the threshold is tested"
        beside = f"; noise-implied rate for an estimate-vs-threshold rule {implied:.1%}"
    for label, count, goal, met in (("A/A", aa, "<= 2%", aa <= 0.02 * n), ("10% slower", ten, ">= 95%", ten >= 0.95 * n),
                                    ("3% slower", three, f"<= {allowed:.1%} ({why})", three <= allowed * n)):
        extra = f"; {tallies[label].counts[also]}/{n} ({also})" if also else ""
        table.add(check=f"{what}: {label}", value=f"{count}/{n} called slower ({key}){extra}", goal=goal, met=met,
                  detail="same samples: " + tallies[label].detail() + (beside if label == "3% slower" else ""))



def decide_real(table: ResultTable, rec: dict[str, Any], borrow: bool = False) -> None:
    """The detector rows from recorded samples. ``borrow``: a file from before the sequential detector (one
    batch a trial) is decided as if each trial's later batches were the next trials of the same label and
    mode (taken minutes later under the same conditions: an approximation of asking for more)."""
    modes = ("interleaved", "back to back")
    missing = [f"{label}/{m}" for label in SLOWDOWNS for m in modes
               if not isinstance(rec.get(label), dict) or not rec[label].get(m)]
    if missing or "gemm" not in rec:
        raise InputError(f"recorded samples: {missing or ['gemm']} missing or empty; expected the samples file "
                         "this script writes (results/profile_and_detect_samples.json)")
    # a file recorded before the sequential detector has one batch a trial: it gets one look, at the full alpha
    old = "sequential" not in rec
    seq = SequentialConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in rec["sequential"].items()}) \
        if not old else SequentialConfig() if borrow else SequentialConfig(looks=1)
    for mode in modes:
        tallies = {label: Tally() for label in SLOWDOWNS}
        for label in SLOWDOWNS:
            trials = rec[label][mode]
            for i, trial in enumerate(trials):
                # a trial is [base, new] (files before the sequential detector) or its batches [[base, new], ...]
                batches = trial if not old else [trials[(i + j) % len(trials)] for j in range(seq.looks)]
                tallies[label].add(*batches[0], paired=mode == "interleaved", batches=batches, seq=seq)
        what = rec.get("work", f"{rec['gemm']}^2 mm plus 1 row, slower: more rows") + \
            (", one base run shared by the three rows" if rec.get("shared base") else "")
        first = "ours paired" if mode == "interleaved" else "ours"
        _rows(table, f"real runs, {mode} ({what}, {rec['samples_per_run']} samples a batch, sequential up to "
                     f"{seq.looks} batches)", tallies, "ours sequential", also=first, tested_alpha=seq.alpha)


def synthetic_rows(table: ResultTable, trials: int) -> None:
    """The same statistics on seeded synthetic samples and series (no timing: exact, reproducible)."""
    counts = {"step": 0, "flat": 0}
    tallies = {label: Tally() for label in SLOWDOWNS}
    seq = SequentialConfig()
    for s in range(trials):
        r = np.random.default_rng(10_000 + s)
        later = np.random.default_rng(20_000 + s)  # the sequential detector's later batches, should it ask
        for label, extra in SLOWDOWNS.items():
            first = (r.normal(1, 0.03, 20), r.normal(1 + extra, 0.03 * (1 + extra), 20))
            batches = [first] + [(later.normal(1, 0.03, 20), later.normal(1 + extra, 0.03 * (1 + extra), 20))
                                 for _ in range(seq.looks - 1)]
            tallies[label].add(*first, paired=False, batches=batches, seq=seq)
        q = np.random.default_rng(s)
        series = np.r_[q.normal(1, 0.02, 10), q.normal(1.1, 0.022, 10)]
        counts["step"] += [z.index for z in detect_steps(series, seed=s)] == [10]
        counts["flat"] += bool(detect_steps(q.normal(1, 0.03, 20), seed=s))
    _rows(table, "synthetic, 20 samples at 3% noise", tallies, "ours")
    _rows(table, f"synthetic, 20 samples a batch at 3% noise, sequential up to {seq.looks} batches", tallies,
          "ours sequential", tested_alpha=seq.alpha)
    table.add(check="synthetic 10% step at 2% noise, 20 runs: found at the exact run", value=f"{counts['step']}/{trials}",
              goal=">= 90%", met=counts["step"] >= 0.9 * trials, detail="seeded numpy series")
    table.add(check="synthetic flat series at 3% noise, 20 runs: false steps", value=f"{counts['flat']}/{trials}",
              goal="<= 1%", met=counts["flat"] <= 0.01 * trials, detail="seeded numpy series")
