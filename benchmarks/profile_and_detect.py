"""How good are the profiler and the regression detector themselves (issue 19's goals)?

Profiler (one workload, all in one run):

- overhead: the mean profiled step (``torchnitro.profile``) over the median unprofiled step
  (``bench.measure``, timed just before), goal <= 1.10x;
- accounting: the categories' sum over the unprofiled step (they add up to the profiled step by
  construction; this shows how far the profiled step is from the real one);
- MFU of a plain GEMM against ``analyze.machine_roofline``'s measured peak: the peak *is* a GEMM, so
  the goal is MFU within 5% of 1.0.

Detector on real runs: ``trials`` A/A comparisons (the same function timed twice, interleaved with
``bench.compare``) and ``trials`` with an injected slowdown (the same function plus a busy loop of
10% or 3% of its median), each decided by ``regress.compare_samples``. Goals: A/A false alarms <= 2%,
10% detected >= 95%.

The same statistics on 200 seeded synthetic cases and series come first (exact, no timing).

Run (one benchmark at a time on a shared machine)::

    flock /tmp/torchnitro-bench.lock python benchmarks/profile_and_detect.py              # a few minutes
    python benchmarks/profile_and_detect.py --quick                                       # ~1 min smoke test

Writes results/profile_and_detect.{json,md} (``--quick``: profile_and_detect_quick.*).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.analyze import machine_roofline
from torchnitro.bench import ResultTable, TimingConfig, compare, measure
from torchnitro.bench.provenance import provenance
from torchnitro.bench.regress import compare_samples
from torchnitro.profile import ProfileConfig, profile


def _spin(seconds: float) -> Callable[[], None]:
    def spin() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    return spin


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
    fn: Callable[[], Any] = lambda: torch.mm(a, a)  # noqa: E731
    cfg = TimingConfig(warmup=2, warmup_s=0.0, min_iters=20, max_iters=20, min_time_s=0.0, min_sample_s=2e-3)
    base = measure(fn, cfg).median
    for label, extra in (("A/A", 0.0), ("10% slower", 0.10), ("3% slower", 0.03)):
        spin = _spin(base * extra)
        slow = (lambda: (fn(), spin())) if extra else fn
        slower = 0
        for _ in range(trials):
            res = compare({"a": fn, "b": slow}, cfg)
            slower += compare_samples(res["a"].samples, res["b"].samples).verdict == "slower"
        goal = {"A/A": ("<= 2%", slower <= 0.02 * trials), "10% slower": (">= 95%", slower >= 0.95 * trials),
                "3% slower": ("rarely (threshold 5%)", None)}[label]
        table.add(check=f"detector on real runs: {label} ({n}^2 mm, 20 samples each)",
                  value=f"{slower}/{trials} called slower", goal=goal[0], met=goal[1], detail="")


def synthetic_rows(table: ResultTable, trials: int) -> None:
    """The same statistics on seeded synthetic samples and series (no timing: exact, reproducible)."""
    import numpy as np

    from torchnitro.bench.regress import detect_steps

    counts = {"aa": 0, "ten": 0, "three": 0, "step": 0, "flat": 0}
    for s in range(trials):
        r = np.random.default_rng(10_000 + s)
        counts["aa"] += compare_samples(r.normal(1, 0.03, 20), r.normal(1, 0.03, 20)).verdict != "same"
        counts["ten"] += compare_samples(r.normal(1, 0.03, 20), r.normal(1.1, 0.033, 20)).verdict == "slower"
        counts["three"] += compare_samples(r.normal(1, 0.03, 20), r.normal(1.03, 0.0309, 20)).verdict == "slower"
        q = np.random.default_rng(s)
        series = np.r_[q.normal(1, 0.02, 10), q.normal(1.1, 0.022, 10)]
        counts["step"] += [z.index for z in detect_steps(series, seed=s)] == [10]
        counts["flat"] += bool(detect_steps(q.normal(1, 0.03, 20), seed=s))
    rows = [("synthetic A/A, 20 samples at 3% noise", "aa", "<= 2%", counts["aa"] <= 0.02 * trials),
            ("synthetic 10% slowdown, 3% noise", "ten", ">= 95%", counts["ten"] >= 0.95 * trials),
            ("synthetic 3% slowdown called slower", "three", "rarely (threshold 5%)", None),
            ("synthetic 10% step at 2% noise, 20 runs: found at the exact run", "step", ">= 90%",
             counts["step"] >= 0.9 * trials),
            ("synthetic flat series at 3% noise, 20 runs: false steps", "flat", "<= 1%", counts["flat"] <= 0.01 * trials)]
    for check, key, goal, met in rows:
        table.add(check=check, value=f"{counts[key]}/{trials}", goal=goal, met=met, detail="seeded numpy samples")


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
