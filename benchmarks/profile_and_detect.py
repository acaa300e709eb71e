"""How good are the profiler and the regression detector themselves (issue 19's goals)?

Profiler (one workload, all in one run):

- overhead: the mean profiled step (``torchnitro.profile``) over the median unprofiled step
  (``bench.measure``, timed just before), goal <= 1.10x;
- accounting: the categories' sum over the unprofiled step (they add up to the profiled step by
  construction; this shows how far the profiled step is from the real one);
- MFU of a plain GEMM against ``analyze.machine_roofline``'s measured peak: the peak *is* a GEMM, so
  the goal is MFU within 5% of 1.0.

Detector on real runs: ``trials`` A/A comparisons (the same function timed twice, interleaved with
``bench.compare``) and ``trials`` with an injected slowdown (the same GEMM plus 10% or 3% more rows of
it), each decided by ``regress.compare_samples`` and, using the rounds' pairing, ``compare_paired``. Goals: A/A false alarms <= 2%,
10% detected >= 95%.

The same statistics on 200 seeded synthetic cases and series come first (exact, no timing).

Run (one benchmark at a time on a shared machine)::

    flock /tmp/torchnitro-bench.lock python benchmarks/profile_and_detect.py              # a few minutes
    python benchmarks/profile_and_detect.py --quick                                       # ~1 min smoke test

Each detector row also counts, on the same samples, what pyperf's ``compare_to`` (pip install pyperf,
the ``bench`` extra) and pytest-benchmark's ``--benchmark-compare-fail=mean:5%`` rule would call slower.

Writes results/profile_and_detect.{json,md} (``--quick``: profile_and_detect_quick.*).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable, Sequence

import torch
from torch import nn

from torchnitro.autotune.analyze import machine_roofline
from torchnitro.bench import ResultTable, TimingConfig, compare, measure
from torchnitro.bench.provenance import provenance
from torchnitro.bench.regress import compare_paired, compare_samples
from torchnitro.profile import ProfileConfig, profile


def _peers_slower(base: Sequence[float], new: Sequence[float], paired: bool = False) -> dict[str, bool]:
    """Would each tool call ``new`` a regression, on the same samples?

    - ours: ``regress.compare_samples`` (rank test + interval + 5% threshold); with ``paired`` (samples
      from interleaved rounds) also ``regress.compare_paired`` (signed rank on per-round ratios);
    - pyperf: what ``pyperf compare_to`` prints "slower" for: its two-sample t-test at 95%
      (``pyperf._compare.is_significant_benchs``) and a larger mean, with no minimum effect;
    - pytest-benchmark: its ``--benchmark-compare-fail=mean:5%`` rule (the mean grew by more than 5%),
      re-implemented from its documentation (it has no significance test).
    """
    out = {"ours": compare_samples(base, new).verdict == "slower"}
    if paired:
        out["ours paired"] = compare_paired(base, new).verdict == "slower"
    try:
        import pyperf
        from pyperf._compare import is_significant_benchs
    except ImportError:
        out["pyperf"] = None  # type: ignore[assignment]
    else:
        b1 = pyperf.Benchmark([pyperf.Run(list(base), metadata={"name": "case"}, collect_metadata=False)])
        b2 = pyperf.Benchmark([pyperf.Run(list(new), metadata={"name": "case"}, collect_metadata=False)])
        significant, _ = is_significant_benchs(b1, b2)
        out["pyperf"] = bool(significant) and statistics.fmean(new) > statistics.fmean(base)
    out["pytest-benchmark"] = statistics.fmean(new) > 1.05 * statistics.fmean(base)
    return out


def _tally(counts: dict[str, int], base: Sequence[float], new: Sequence[float], paired: bool = False) -> None:
    for tool, slower in _peers_slower(base, new, paired).items():
        counts[tool] = counts.get(tool, 0) + bool(slower) if slower is not None else counts.get(tool, -1)


def _peer_detail(counts: dict[str, int], trials: int) -> str:
    return ", ".join(f"{k} {v}/{trials}" if v >= 0 else f"{k} not installed" for k, v in counts.items())


def profiler_rows(table: ResultTable, quick: bool) -> None:
    torch.manual_seed(0)
    d = 256 if quick else 1024
    model = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.LayerNorm(d))
    x = torch.randn(32, d)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        model(x).float().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = 5 if quick else 20
    plain = measure(step, TimingConfig(min_iters=steps, min_time_s=0.5))
    prof = profile(step, config=ProfileConfig(warmup=3, steps=steps, monitor=False, measure_peak=False))
    ratio = prof.step_time_s / plain.median
    table.add(check="profiler overhead (train step, mlp d=%d)" % d, value=f"{ratio:.3f}x", goal="<= 1.10x",
              met=ratio <= 1.10, detail=f"profiled {prof.step_time_s * 1e3:.3f} ms, plain {plain.median * 1e3:.3f} ms")
    acc = sum(prof.categories.values()) / plain.median
    table.add(check="categories sum / unprofiled step", value=f"{acc:.3f}", goal="within 5% of 1",
              met=abs(acc - 1) <= 0.05, detail=", ".join(f"{k} {v:.1%}" for k, v in prof.shares.items()))
    n = 512 if quick else 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    gemm = profile(lambda: torch.mm(a, b), config=ProfileConfig(warmup=3, steps=steps, monitor=False,
                                                                 peak_flops=machine_roofline("cpu").peak_flops["float32"]))
    mfu = gemm.mfu or 0.0
    table.add(check=f"MFU of a {n}^2 GEMM vs the measured GEMM peak", value=f"{mfu:.3f}", goal="within 5% of 1.0",
              met=abs(mfu - 1) <= 0.05, detail=f"achieved {(gemm.achieved_flops or 0) / 1e9:.1f} GFLOP/s")


def detector_rows(table: ResultTable, trials: int, quick: bool) -> None:
    torch.manual_seed(0)
    n = 128 if quick else 256
    a = torch.randn(n, n)
    one = a[:1]
    # every variant calls a second GEMM, so the injected slowdown adds rows, not a call's fixed overhead
    fn: Callable[[], Any] = lambda: (torch.mm(a, a), torch.mm(one, a))  # noqa: E731
    cfg = TimingConfig(warmup=2, warmup_s=0.0, min_iters=20, max_iters=20, min_time_s=0.0, min_sample_s=2e-3)
    for label, extra in (("A/A", 0.0), ("10% slower", 0.10), ("3% slower", 0.03)):
        # the slowdown is extra work (a slice of the same GEMM), so it scales with the machine's load
        part = a[: 1 + round(n * extra)]
        slow = (lambda: (torch.mm(a, a), torch.mm(part, a))) if extra else fn
        counts: dict[str, int] = {}
        for _ in range(trials):
            res = compare({"a": fn, "b": slow}, cfg)
            _tally(counts, res["a"].samples, res["b"].samples, paired=True)
        slower = counts["ours"]
        goal = {"A/A": ("<= 2%", slower <= 0.02 * trials), "10% slower": (">= 95%", slower >= 0.95 * trials),
                "3% slower": ("rarely (threshold 5%)", None)}[label]
        table.add(check=f"detector on real runs: {label} ({n}^2 mm, 20 samples each)",
                  value=f"{slower}/{trials} called slower", goal=goal[0], met=goal[1],
                  detail="same samples: " + _peer_detail(counts, trials))


def synthetic_rows(table: ResultTable, trials: int) -> None:
    """The same statistics on seeded synthetic samples and series (no timing: exact, reproducible)."""
    import numpy as np

    from torchnitro.bench.regress import detect_steps

    counts = {"step": 0, "flat": 0}
    peers: dict[str, dict[str, int]] = {"aa": {}, "ten": {}, "three": {}}
    for s in range(trials):
        r = np.random.default_rng(10_000 + s)
        _tally(peers["aa"], r.normal(1, 0.03, 20), r.normal(1, 0.03, 20))
        _tally(peers["ten"], r.normal(1, 0.03, 20), r.normal(1.1, 0.033, 20))
        _tally(peers["three"], r.normal(1, 0.03, 20), r.normal(1.03, 0.0309, 20))
        q = np.random.default_rng(s)
        series = np.r_[q.normal(1, 0.02, 10), q.normal(1.1, 0.022, 10)]
        counts["step"] += [z.index for z in detect_steps(series, seed=s)] == [10]
        counts["flat"] += bool(detect_steps(q.normal(1, 0.03, 20), seed=s))
    for check, key, goal, ok in (("synthetic A/A, 20 samples at 3% noise", "aa", "<= 2%", lambda n: n <= 0.02 * trials),
                                 ("synthetic 10% slowdown, 3% noise", "ten", ">= 95%", lambda n: n >= 0.95 * trials),
                                 ("synthetic 3% slowdown called slower", "three", "rarely (threshold 5%)", None)):
        n = peers[key]["ours"]
        table.add(check=check, value=f"{n}/{trials}", goal=goal, met=ok(n) if ok else None,
                  detail="seeded numpy samples; same samples: " + _peer_detail(peers[key], trials))
    table.add(check="synthetic 10% step at 2% noise, 20 runs: found at the exact run", value=f"{counts['step']}/{trials}",
              goal=">= 90%", met=counts["step"] >= 0.9 * trials, detail="seeded numpy series")
    table.add(check="synthetic flat series at 3% noise, 20 runs: false steps", value=f"{counts['flat']}/{trials}",
              goal="<= 1%", met=counts["flat"] <= 0.01 * trials, detail="seeded numpy series")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and 10 trials: a smoke test")
    ap.add_argument("--trials", type=int, default=None, help="comparisons per detector row (default 200, quick 10)")
    args = ap.parse_args()
    trials = args.trials or (10 if args.quick else 200)
    table = ResultTable("profiler and regression detector", ["check", "value", "goal", "met", "detail"],
                        meta=provenance("benchmarks/profile_and_detect.py"))
    synthetic_rows(table, 200)
    profiler_rows(table, args.quick)
    detector_rows(table, trials, args.quick)
    table.print()
    table.save("profile_and_detect_quick" if args.quick else "profile_and_detect")


if __name__ == "__main__":
    main()
