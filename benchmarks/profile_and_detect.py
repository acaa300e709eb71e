"""How good are the profiler and the regression detector themselves (issue 19's goals)?

Profiler (one workload, all in one run, plain and profiled blocks alternating so drift hits both):

- overhead: per round (the plain block first in even rounds, the profiled one first in odd rounds), the
  median profiled step (``torchnitro.profile``, its ProfilerStep ranges)
  over the median unprofiled step (the same step called just before, after two warm-up calls); the
  median over rounds, goal <= 1.10x. The same ratio in process CPU time (``time.process_time``
  around each step, both runs) is shown beside it: on a shared machine it is what other processes
  distort least;
- accounting: the categories (``unattributed`` holds the time outside every op) add up to each
  profiled step (``Profile.accounted``, shown), so what the goal measures is how far the profiled
  step is from the unprofiled one: per round, the median step's category sum over the median
  unprofiled step (medians: one preempted step on a shared machine moves a mean of 10 by 10%);
  median over rounds, goal within 5%. The ratio of means is shown beside it;
- MFU of a plain GEMM against the profile's own peak (``profile.peak``: the best of plain-GEMM
  timings of the same size, dtype and threads just before and just after the recorded steps), goal
  within 5% of 1.0; the MFU against the median timing and the timings' spread are shown beside it.

Detector on real runs: ``trials`` A/A comparisons (the same function twice) and ``trials`` with an
injected slowdown (100 small GEMMs against 110 or 103 of them), 20 samples each, in two modes:

- *interleaved*: both timed in one process by ``bench.compare`` (rounds pair the samples), decided by
  ``regress.compare_paired`` (what ``compare_interleaved`` uses); ``compare_samples`` beside it;
- *back to back*: one ``bench.measure`` run after the other, as two result files would be, decided by
  ``regress.compare_samples`` (what ``bench compare`` uses on two files).

Goals: A/A false alarms <= 2%, 10% found >= 95%, and a 3% slowdown called slower no more often than
the 5% threshold implies. For the sequential detector (``ours sequential``, the rows' verdict), which
*tests* "the change is at most 5%" at its alpha over all looks, that is alpha (1%) plus two binomial
standard errors: the most it may call any change at or below the threshold. For a rule that compares
the *estimate* with the threshold (``compare_samples``, the synthetic ``ours`` rows) it is the share
of A/A ratio estimates that, times 1.03, reach 1.05 (the noise that would push a 3% change over the
threshold), plus two standard errors; that rate is shown beside the sequential rows too.

Each detector row also counts, on the same samples, what pyperf's ``compare_to`` calls slower (its
t-test, ``pyperf._compare.is_significant_benchs``, and a larger mean) and what pytest-benchmark's
``--benchmark-compare-fail=mean:5%`` fails (its own ``Stats`` and ``PercentageRegressionCheck``).

The same statistics on 200 seeded synthetic cases and series come first (exact, no timing).

Run (one benchmark at a time on a shared machine)::

    flock /tmp/torchnitro-bench.lock python benchmarks/profile_and_detect.py              # see below
    flock /tmp/torchnitro-bench.lock python benchmarks/profile_and_detect.py --shared-base  # a third less timing
    python benchmarks/profile_and_detect.py --quick                                       # smoke test
    python benchmarks/profile_and_detect.py --from-samples results/profile_and_detect_samples.json
    python benchmarks/profile_and_detect.py --from-samples OLD_samples.json --borrow-later-trials  # see --help

Run time: the real runs dominate, 200 trials x 3 rows x 2 modes of 1 to 4 batches (40 samples of
about 2 ms each, quiet) each; the 14:15 run (one batch a trial) took 13 min at load average 3-4, and
the sequential detector asks for about 1.6 batches a trial (replayed samples). Quiet, roughly 6-12
min; at load 3-4 about 20; at load 10-15 one trial took about 30 s. ``--shared-base`` times 4 runs
a trial instead of 6 (``_record_shared``). Progress goes to stderr after each part.

Writes results/profile_and_detect.{json,md} and the detector's raw samples to
results/profile_and_detect_samples.json (``--quick``: *_quick.*; ``--trials N`` other than 200:
*_Ntrials.*); ``--from-samples`` re-decides
recorded samples without timing anything (results/profile_and_detect_recorded.*).

This file times (the profiler rows and the detector's real runs); how samples become rows is in
``_profile_detect_stats.py`` beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from torchnitro.autotune.analyze import machine_roofline
from torchnitro.bench import ResultTable, TimingConfig, compare, measure
from torchnitro.bench.provenance import provenance
from torchnitro.bench.report import results_dir
from torchnitro.bench.sequential import SequentialConfig, compare_sequential, look
from torchnitro.profile import ProfileConfig, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _profile_detect_stats import SLOWDOWNS, decide_real, synthetic_rows  # noqa: E402


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

    steps, rounds = (5, 2) if quick else (10, 9)
    pcfg = ProfileConfig(warmup=2, steps=steps, monitor=False, measure_peak=False, count_flops=False,
                         track_memory=False, unprofiled_steps=0)  # those run outside the recorded steps anyway
    wall: list[float] = []
    cpu: list[float] = []

    def timed() -> None:  # the same wrapper in both runs: wall and process CPU time of each step
        w, c = time.perf_counter(), time.process_time()
        step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)

    over, over_cpu, acc, acc_mean, closure, detail = [], [], [], [], [], []

    def plain_block() -> tuple[list[float], list[float]]:
        wall.clear()
        cpu.clear()
        for _ in range(2 + steps):
            timed()
        return wall[-steps:], cpu[-steps:]

    def profiled_block() -> tuple[Any, list[float]]:
        cpu.clear()
        return profile(timed, config=pcfg), cpu[-steps:]

    for r in range(rounds):  # which block runs first alternates, so an order effect hits both alike
        if r % 2 == 0:
            (pw, pc), (prof, qc) = plain_block(), profiled_block()
        else:
            (prof, qc), (pw, pc) = profiled_block(), plain_block()
        plain, plain_cpu, plain_mean = statistics.median(pw), statistics.median(pc), statistics.fmean(pw)
        med = statistics.median(prof.step_times_s)
        over.append(med / plain)
        over_cpu.append(statistics.median(qc) / plain_cpu)
        closure.append(prof.accounted)  # categories / profiled step: 1 unless some time is in no category
        acc.append(med * prof.accounted / plain)
        acc_mean.append(sum(prof.categories.values()) / plain_mean)
        detail.append(f"{med * 1e3:.2f}/{plain * 1e3:.2f}")
    ratio = statistics.median(over)
    table.add(check=f"profiler overhead (train step, mlp d={d}, shapes+memory recorded)", value=f"{ratio:.3f}x",
              goal="<= 1.10x", met=ratio <= 1.10,
              detail=f"median over {rounds} alternating rounds of profiled/plain median step ms: {', '.join(detail)}")
    rc = statistics.median(over_cpu)
    table.add(check="profiler overhead in process CPU time (same steps)", value=f"{rc:.3f}x", goal="<= 1.10x",
              met=rc <= 1.10, detail="time.process_time around each step: what other processes' load distorts "
                                     "least; per round " + ", ".join(f"{r:.3f}" for r in over_cpu))
    a = statistics.median(acc)
    table.add(check="categories sum / unprofiled step (median steps)", value=f"{a:.3f}", goal="within 5% of 1",
              met=abs(a - 1) <= 0.05,
              detail=f"categories / profiled step {min(closure):.3f}-{max(closure):.3f}; ratio of means "
                     f"{statistics.median(acc_mean):.3f}; per round " + ", ".join(f"{r:.3f}" for r in acc) +
                     "; shares " + ", ".join(f"{k} {v:.1%}" for k, v in prof.shares.items()))
    gemm_mfu_row(table, 512 if quick else 1024, steps)


def gemm_mfu_row(table: ResultTable, n: int, steps: int) -> None:
    """MFU of an n^2 float32 GEMM against the peak the profiler times around its recorded steps."""
    a_, b_ = torch.randn(n, n), torch.randn(n, n)
    roofline = machine_roofline("cpu").peak_flops["float32"]  # measured once per process, for reference
    gemm = profile(lambda: torch.mm(a_, b_), config=ProfileConfig(warmup=3, steps=2 * steps, monitor=False,
                                                                   track_memory=False, peak_timings=6, peak_gemm=n))
    mfu = gemm.mfu or 0.0
    rng = gemm.mfu_range or (0.0, 0.0)
    # the value is the profiler's own MFU (mean step over the best timing: load lowers it); the best step over
    # the best timing is like against like, so a gap between the two is noise, not FLOP or time accounting
    best_step = (gemm.flops or 0) / min(gemm.step_times_s) / gemm.peak_flops if gemm.peak_flops else 0.0
    table.add(check=f"MFU of a {n}^2 GEMM vs the GEMM peak timed around it", value=f"{mfu:.3f}",
              goal="within 5% of 1.0", met=abs(mfu - 1) <= 0.05,
              detail=f"achieved {(gemm.achieved_flops or 0) / 1e9:.1f} GFLOP/s (mean step); {rng[1]:.3f} against the "
                     f"median timing; best step {best_step:.3f}; peak: {gemm.peak_source}; analyze.machine_roofline "
                     f"(earlier, median) {roofline / 1e9:.1f} GFLOP/s")


def record_real(trials: int, quick: bool, seq: SequentialConfig, shared_base: bool = False,
                checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Raw samples of the real detector runs: {label: {"interleaved"/"back to back": [trial, ...]}}, a trial
    being the batches [[base, new], ...] the sequential detector asked for (the first is the 20-sample run
    every tool decides on). ``shared_base``: see ``_record_shared``. ``checkpoint`` gets what is recorded so
    far after each label (every 50 trials with ``shared_base``), so a stopped run keeps its samples."""
    save = checkpoint or (lambda part: None)
    torch.manual_seed(0)
    n, reps = (32, 100) if quick else (64, 100)
    a = torch.randn(n, n)

    def work(k: int) -> Callable[[], Any]:
        def run() -> None:
            for _ in range(k):
                torch.mm(a, a)
        return run

    # the slowdown is more repetitions of the same unit of work: its true size is exactly the nominal one
    # (an earlier version added rows to a GEMM and injected 20% / 9% for "10%" / "3%", see docs/profile.md)
    fn = work(reps)
    cfg = TimingConfig(warmup=2, warmup_s=0.0, min_iters=20, max_iters=20, min_time_s=0.0, min_sample_s=2e-3)
    out: dict[str, Any] = {"gemm": n, "work": f"{reps} x {n}^2 mm, slower: more of them", "samples_per_run": 20,
                           "unit": "us per call", "sequential": dataclasses.asdict(seq), "shared base": shared_base,
                           "load average at start": _load()}
    if shared_base:
        news = {label: work(round(reps * (1 + extra))) if extra else fn for label, extra in SLOWDOWNS.items()}
        out.update(_record_shared(trials, fn, news, cfg, seq, lambda part: save({**out, **part})))
        out["load average at end"] = _load()
        return out

    for label, extra in SLOWDOWNS.items():
        slow = work(round(reps * (1 + extra))) if extra else fn
        runs: dict[str, list[list[list[list[float]]]]] = {"interleaved": [], "back to back": []}
        for _ in range(trials):
            for mode in runs:
                batches: list[list[list[float]]] = []

                def more(mode: str = mode, batches: list = batches) -> list[list[float]]:
                    if mode == "interleaved":
                        res = compare({"a": fn, "b": slow}, cfg)
                        batches.append([_us(res["a"].samples), _us(res["b"].samples)])
                    else:
                        batches.append([_us(measure(fn, cfg).samples), _us(measure(slow, cfg).samples)])
                    return batches[-1]

                compare_sequential(more, seq, paired=mode == "interleaved")  # decided again from the file
                runs[mode].append(batches)
        out[label] = runs
        save(out)
        sys.stderr.write(f"profile_and_detect: real runs, {label}: {trials} trials of both modes timed "
                         f"(load average {_load()})\n")
    out["load average at end"] = _load()
    return out


def _us(samples: Sequence[float]) -> list[float]:  # ns resolution, about half the characters of full floats
    return [round(x * 1e6, 3) for x in samples]


def _record_shared(trials: int, fn: Callable[[], Any], news: dict[str, Callable[[], Any]], cfg: TimingConfig,
                   seq: SequentialConfig, checkpoint: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """The trials of every label at once, one base run shared by the labels still open (``--shared-base``).

    Per trial and mode, each batch times the base once and the new side of every label whose sequential
    decision is still open: interleaved, all of them in one ``bench.compare`` (rounds of up to four samples;
    each label's samples pair with the base's of the same round); back to back, the base run and then one
    run per open label, the labels' order rotating from trial to trial so each sits at each distance from
    the base equally often. A label's trial is its own batches ([[base, new], ...], the file format of the
    unshared runs), decided by the same looks. Every row still has ``trials`` trials, each on samples no
    other trial of that row uses; the three rows of one trial share the base samples, so their counts are
    correlated (one unlucky base run can cost an A/A and a 3% trial together), not their rates. It times 4
    runs where the unshared runs time 6: about a third less.
    """
    labels = list(news)
    out: dict[str, Any] = {label: {"interleaved": [], "back to back": []} for label in labels}
    for t in range(trials):
        for mode in ("interleaved", "back to back"):
            open_labels = labels[t % len(labels):] + labels[:t % len(labels)]
            batches: dict[str, list[list[list[float]]]] = {label: [] for label in labels}
            for k in range(1, seq.looks + 1):
                if mode == "interleaved":
                    res = compare({"base": fn, **{label: news[label] for label in open_labels}}, cfg)
                    base, new = _us(res["base"].samples), {label: _us(res[label].samples) for label in open_labels}
                else:
                    base = _us(measure(fn, cfg).samples)
                    new = {label: _us(measure(news[label], cfg).samples) for label in open_labels}
                for label in list(open_labels):
                    batches[label].append([base, new[label]])
                    a = [x for b in batches[label] for x in b[0]]
                    b_ = [x for b in batches[label] for x in b[1]]
                    if look(a, b_, k, seq, paired=mode == "interleaved").verdict != "inconclusive":
                        open_labels.remove(label)
                if not open_labels:
                    break
            for label in labels:
                out[label][mode].append(batches[label])
        if (t + 1) % 50 == 0 or t + 1 == trials:
            checkpoint(out)
            sys.stderr.write(f"profile_and_detect: real runs, shared base: {t + 1}/{trials} trials timed "
                             f"(load average {_load()})\n")
    return out


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes and 10 trials: a smoke test")
    ap.add_argument("--trials", type=int, default=None, help="comparisons per detector row (default 200, quick 10)")
    ap.add_argument("--from-samples", type=Path, default=None,
                    help="re-decide recorded detector samples (no timing): a *_samples.json this script wrote")
    ap.add_argument("--shared-base", action="store_true",
                    help="time one base run per trial for all three rows (A/A, 10%%, 3%%) instead of one per row: "
                         "4 runs a trial instead of 6, every row still 200 trials on samples of its own; the rows of "
                         "one trial share the base (see _record_shared)")
    ap.add_argument("--borrow-later-trials", action="store_true",
                    help="with --from-samples on a file from before the sequential detector: its later batches are "
                         "the next trials' samples (an approximation); without it such a file gets one look")
    args = ap.parse_args()
    trials = args.trials or (10 if args.quick else 200)
    # only the full default run writes the goal files; a smaller one is labelled by what it is
    name = "profile_and_detect" + ("_quick" if args.quick else f"_{trials}trials" if trials != 200 else "")
    table = ResultTable("profiler and regression detector", ["check", "value", "goal", "met", "detail"],
                        meta=provenance("benchmarks/profile_and_detect.py"))
    took: dict[str, float] = {}
    t0 = time.perf_counter()

    def lap(what: str) -> None:  # wall seconds per part, into the table's header
        took[what] = time.perf_counter() - t0 - sum(took.values())
        sys.stderr.write(f"profile_and_detect: {what} done after {time.perf_counter() - t0:.0f} s\n")

    synthetic_rows(table, 200)
    lap("synthetic")
    if args.from_samples is not None:
        rec = json.loads(args.from_samples.read_text())
        table.meta["samples"] = f"{args.from_samples} (recorded {rec.get('written', '?')}, load average "\
                                f"{rec.get('load average at start')} -> {rec.get('load average at end')})"\
                                + (f"; PARTIAL: {rec['partial']}" if rec.get("partial") else "")
        decide_real(table, rec, borrow=args.borrow_later_trials)
        name = "profile_and_detect_recorded" + ("_borrowed" if args.borrow_later_trials else "")
        lap("deciding")
    else:
        profiler_rows(table, args.quick)
        lap("profiler")
        table.meta["partial"] = "synthetic and profiler rows only: the real detector runs had not finished"
        table.save(name)  # kept if the long real runs are stopped; replaced when they finish
        del table.meta["partial"], table.meta["written"]
        path = results_dir() / f"{name}_samples.json"

        def checkpoint(part: dict[str, Any]) -> None:  # a stopped run keeps the samples taken so far
            path.write_text(json.dumps({**part, "written": table.meta.get("started", ""),
                                        "partial": "the real runs had not finished"}))

        rec = record_real(trials, args.quick, SequentialConfig(), shared_base=args.shared_base, checkpoint=checkpoint)
        lap("real-run timing")
        rec["written"] = table.meta.get("started", "")
        path.write_text(json.dumps(rec))
        table.meta["samples"] = f"{path.name} (load average {rec['load average at start']} -> " \
                                f"{rec['load average at end']})"
        decide_real(table, rec)
        lap("deciding")
    table.meta["duration"] = f"{sum(took.values()):.0f} s (" + ", ".join(f"{k} {v:.0f} s" for k, v in took.items()) + ")"
    table.print()
    table.save(name)


if __name__ == "__main__":
    main()
