"""Does the optimizer's final comparison time each variant as it runs alone?

For each workload, one ``torchnitro.optimize`` search builds one recipe per runtime family (compile, TorchScript,
ONNX Runtime, OpenVINO when installed) into the candidate cache, and each variant's artifact is saved. Then the
rule, fixed before any number is seen: ``R`` rounds (``--rounds``; per workload ``BLOCKS``: encoder 3 at 2 s per
variant, ``mlp`` 7 at 0.5 s; 1 with ``--quick``) run as one chain of blocks, alone set 0, comparison 1, alone set 1,
comparison 2, ..., comparison R, alone set R. Round ``i`` is comparison ``i`` against the alone sets right before and
after it: each variant's p50 alone in that round is the mean of the two sets' p50s, so a drift of the machine's
speed that is linear across the round cancels, and a step inside it counts half. Why: on this shared VM the speed
moves 12-20% in phases minutes long (the probe below; 7ce9ea3:results/timing_fairness.md), and with one comparison
and one alone set per round, each ~2.5 min on ``mlp`` (2 s a variant), every ``mlp`` variant ran 1.4-14% faster
inside the comparison than alone in two rounds of the 27 Nov 08:45 run and within 2.4% in the third, while the
two sides' loaders timed in one rotation differed by at most 2% (docs/optimize.md, "Inside against alone").
Shorter blocks keep the two sides of a round closer in time. A round's comparison is ``optimize`` again on the
same candidate cache with the whole-search cache entry removed: nothing is built again (a row's note says
otherwise), the final comparison is timed anew. An alone set times every variant (eager
included) in its own fresh process (all started together, timed in rotation with the comparison's warm-up, samples
and time per variant; the parent only waits). Two checks per workload (issue 14), each on the median over rounds of
the per-round difference, the per-round values beside it:

- each variant's p50 inside the optimizer's comparison is within 5% of its p50 alone;
- the optimizer's reported speedup agrees with the isolated ratio (eager alone / variant alone) within 10%.

A machine-speed probe (a fixed fp32 matmul, ``speed_probe``, timed ~0.3 s in one process started with the run, gated
like every sample) is read before every block and after the last; the rounds table shows the readings before a
round's first alone set and after its second, so a round that straddled a phase change shows. It is a diagnostic:
no number is normalised by it. Each alone set's note also gives every process's p50 over the second half of its
samples against the first half (``_halves``): a fresh process that speeds up as it ages shows the same sign in every
set, a change of the machine's speed shows in every process of one set.

The optimizer's comparison times eager and every finalist alone, each in its own fresh process that loads the
variant as its artifact would (``autotune.fair``), eager in ``OptimizeConfig.eager_processes`` (default 1) fresh
processes whose median p50 is the baseline of every speedup (``autotune.fair_eager``; the rounds table lists each
process's p50). The alone side here times each variant's saved artifact as ``torchnitro.load`` runs it, in its own
fresh process (eager: the built-in rebuilt from its factory, as ``load`` rebuilds it), so the two differ only in
when they ran. The artifact of a variant the search did not choose comes from a one-recipe search on the same
candidate cache (the same files, never rebuilt). The rounds' searches skip the allocator and thread trials that
follow the comparison (``tune_allocator``/``tune_threads`` off: they time nothing the checks read).

Every timing process, the optimizer's and this benchmark's alone side alike, runs under glibc's
``ALLOCATOR_SETTING`` (``bench.environment.timing_process_env``): with glibc's defaults, fresh processes of
the same eager differed by 10-20% (results/eager_spread.md). A third table times eager alone in fresh
processes under glibc allocator settings, glibc's defaults first (the issue measured eager MobileNetV3 at
138 ms with glibc's defaults and 66.5 ms with ``MALLOC_MMAP_THRESHOLD_``), with the minor page faults per
call: the setting a number was measured under is part of the number (``--no-allocator`` skips it). Its last row
applies the setting with ``mallopt`` after the process started, as ``torchnitro.load`` does
(``bench.environment.apply_allocator``), against the variables read at start.

A fourth table times eager alone in fresh processes under OpenMP wait settings, first on the quiet machine,
then beside one busy process (a Python loop: one more runnable thread than cores, as any other job on a
2-core machine makes it). Timing processes add no wait setting of their own (``bench.environment.THREAD_SETTING``
is empty: libgomp's default, as deployed); a bounded spin for every timing process (``GOMP_SPINCOUNT=10000``,
a row here) made small models' eager slower than deployed. ``--no-threads`` skips it.

Both sides sample the same way: every sample, in the optimizer's comparison and on the alone side here, goes
through the timing gate (``bench.quiet``): it starts once the other timing processes are idle and is retaken
when foreign CPU ran beside it; the notes give each side's counts (samples retaken, kept under foreign load)
and which of our processes burnt CPU during another's samples. The busy process of the fourth table is a
deliberate competitor: left out of "ours" and of the machine check there.

Run (one benchmark at a time on a shared machine)::

    flock /tmp/torchnitro-bench.lock python benchmarks/timing_fairness.py   # ~25-30 min on 2 idle cores
    python benchmarks/timing_fairness.py --only mlp --rounds 2               # one workload
    python benchmarks/timing_fairness.py --quick                            # smoke test, 1-2 min

Writes results/timing_fairness.{json,md} (``--quick``: timing_fairness_quick.*) with the command,
the machine, the library versions and the allocator/thread settings.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torchnitro.autotune.api import optimize
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.fair import Steady
from torchnitro.autotune.inputs import model_and_inputs
from torchnitro.autotune.recipe import BuildContext, get_recipe
from torchnitro.autotune.report import Report
from torchnitro.bench import ResultTable, TimingConfig, compare, results_dir
from torchnitro.bench import quiet
from torchnitro.bench.environment import (ALLOCATOR_SETTING, GLIBC_DEFAULTS, apply_allocator, describe_environment,
                                          timing_process_env)
from torchnitro.bench.isolated import ChildTimer, save_inputs
from torchnitro.bench.provenance import git_commit
from torchnitro.hardware import hardware_info

# family -> the recipe that stands for it
FAMILIES = {"compile": "compile", "torchscript": "torchscript", "onnxruntime": "onnxruntime", "openvino": "openvino"}
WORKLOADS = {"encoder": ("encoder", 8, 128), "mlp": ("mlp", 64, 0)}  # name -> (builtin, batch, seq)
QUICK_WORKLOADS = {"mlp": ("mlp", 8, 0)}
QUICK_SKIP = ("compile",)  # inductor's C++ build takes minutes on 2 cores: not for a smoke test
P50_GOAL, SPEEDUP_GOAL = 0.05, 0.10
ROUNDS = 3  # comparisons per workload (each between two alone sets): the goals are checked on the rounds' median
FINAL_S, QUICK_FINAL_S = 2.0, 0.3  # measured seconds per variant in each comparison and each alone set
# workload -> (FINAL_S, ROUNDS) of its own: mlp's blocks were ~2.5 min at 2 s a variant, long enough for the VM to
# change speed between a comparison and its alone set (results/timing_fairness.md, 27 Nov 08:45); at 0.5 s (~250
# samples a variant) a block is ~1 min and 7 rounds take ~13 min
BLOCKS = {"encoder": (FINAL_S, ROUNDS), "mlp": (0.5, 7)}
SETUP_FINAL_S = 0.05  # the building search's own comparison: not read by any check (every round compares anew)
PROBE_S, QUICK_PROBE_S = 0.3, 0.1  # measured seconds of one machine-speed probe reading (read 2R + 2 times)
PROBE_N = 384  # the probe's fp32 matmul is (PROBE_N x PROBE_N) @ (PROBE_N x PROBE_N): ~0.8 ms on this 2-core VM
VARIANT_COLUMNS = ("workload", "variant", "family", "p50 in comparison ms", "p50 alone ms", "diff", "within 5%",
                   "in comparison per round ms", "alone per round ms", "diff per round", "alone sets per round ms",
                   "timed in comparison", "alone")
P50_COLUMNS = ("p50 in comparison ms: the optimizer's own number (for eager the median of the p50s of its fresh "
               "processes, which every reported speedup divides), the median over rounds; p50 alone ms: each round's "
               "is the mean of the p50s of the alone sets right before and after its comparison (one fresh process "
               "per variant in each set), the median over rounds; diff: the median over rounds of each round's "
               "inside/alone - 1 (the goals are checked on it; of an even count of rounds, the mean of the middle "
               "two); the per-round columns list every round in order, 'alone sets per round ms' each round's "
               "before|after")
SPEEDUP_COLUMNS = ("workload", "variant", "reported speedup", "isolated ratio", "diff", "within 10%",
                   "reported per round", "isolated per round", "diff per round", "chosen in rounds")
ROUND_COLUMNS = ("workload", "round", "blocks", "started", "probe at start ms", "probe at end ms", "probe change",
                 "comparison s", "alone s", "chosen", "eager per process ms", "redone")
ALLOCATOR_COLUMNS = ("workload", "setting", "env", "eager p50 alone ms", "vs glibc defaults", "page faults per call")
THREAD_COLUMNS = ("workload", "setting", "env", "beside", "eager p50 alone ms", "eager p90 ms",
                  "vs libgomp default, same load")
THREAD_SETTINGS = {  # name -> (environment of a fresh process (libgomp reads it once, at start-up), no mallopt)
    "libgomp default (~3 ms spin)": ({"GOMP_SPINCOUNT": "300000"}, {}),  # libgomp's value when nothing is set
    "GOMP_SPINCOUNT=10000 (~0.1 ms spin)": ({"GOMP_SPINCOUNT": "10000"}, {}),  # the earlier timing processes'

    "GOMP_SPINCOUNT=1000 (~10 us spin)": ({"GOMP_SPINCOUNT": "1000"}, {}),
    "OMP_WAIT_POLICY=PASSIVE (no spin)": ({"OMP_WAIT_POLICY": "PASSIVE"}, {}),
}
BUSY = "while True: pass"  # the competitor: one runnable thread that never blocks
# name -> (environment of a fresh process (glibc reads it once, at start-up; None: removed), mallopt setting); the
# timing processes' own setting is ALLOCATOR_SETTING (bench.environment.timing_process_env), so each row says its own
MALLOC_SETTINGS: dict[str, tuple[dict[str, str | None], dict[str, str]]] = {
    "glibc defaults": (dict(GLIBC_DEFAULTS), {}),
    "mmap threshold 256 MiB": ({"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": None}, {}),
    "mmap + trim threshold 256/512 MiB": (dict(ALLOCATOR_SETTING), {}),
    "same via mallopt after start (torchnitro.load)": (dict(GLIBC_DEFAULTS), dict(ALLOCATOR_SETTING)),
}
REPORT_NOTES = ("eager in the final comparison", "eager p50 alone", "final comparison redone", "timing gate")


def build_variant(spec: str, batch: int, seq: int, recipe: str, workdir: str, threads: int,
                  mallopt: dict[str, str] | None = None) -> Callable[..., Any]:
    """Child side (``ChildTimer`` loader): the built-in model, built into ``recipe``'s variant in this process
    (after applying ``mallopt``, as ``torchnitro.load`` applies an artifact's allocator setting)."""
    if mallopt:
        apply_allocator(mallopt)
    model, inputs, info = model_and_inputs(spec, batch=batch or None, seq=seq or None)
    if recipe == "eager":
        return model
    ctx = BuildContext(model, inputs, hardware_info(), torch.device("cpu"), Path(workdir), dict(info.dynamic_dims),
                       OptimizeConfig(threads=threads))
    return get_recipe(recipe).build(ctx).fn


def load_artifact(directory: str) -> Callable[..., Any]:
    """Child side (``ChildTimer`` loader): the variant as ``torchnitro.load`` runs it (allocator setting included)."""
    from torchnitro.autotune.api import load

    return load(directory, trust_code=True)  # written by this benchmark's own search


def speed_probe(n: int = PROBE_N) -> Callable[..., Any]:
    """Child side (``ChildTimer`` loader): the machine-speed probe, one fixed fp32 matmul into a fixed buffer per
    call (the same work in every reading; its inputs are ignored)."""
    g = torch.Generator().manual_seed(0)
    a, b, out = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g), torch.empty(n, n)
    return lambda *_: torch.mm(a, b, out=out)


class Probe:
    """The machine-speed probe timed in one process started once (a process per reading would add the spread
    between fresh processes to what should show only the machine); ``read()`` -> p50 ms of ~``seconds`` of
    gated samples, NaN once the process failed (``failed`` says why): a diagnostic never stops the benchmark."""

    def __init__(self, work: Path, threads: int, seconds: float):
        work.mkdir(parents=True, exist_ok=True)
        save_inputs([(torch.zeros(1),)], work / "probe_inputs.pt")
        self.tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=5, min_time_s=seconds, max_time_s=3 * seconds)
        self.failed = ""
        self.timer: ChildTimer | None = None
        try:
            self.timer = ChildTimer(f"{Path(__file__).stem}:speed_probe", {}, work / "probe_inputs.pt",
                                    threads=threads, timeout_s=60.0, name="speed probe")
        except OSError as exc:
            self.failed = f"the probe's process did not start ({exc})"

    def read(self) -> float:
        if self.timer is None:
            return math.nan
        try:
            return compare({"probe": Steady(self.timer)}, self.tc)["probe"].median * 1e3
        except Exception as exc:  # noqa: BLE001 - a failed diagnostic leaves NaN in its column, nothing else
            self.failed = f"the probe failed ({type(exc).__name__}: {exc})"[:300]
            self.close()
            return math.nan

    def close(self) -> None:
        if self.timer is not None:
            self.timer.close()
            self.timer = None


@dataclasses.dataclass
class Round:
    """One round of a workload: the optimizer's comparison between the alone sets before and after it (``_chain``)."""

    number: int  # 1-based; a round that failed is left out of the tables (the notes say why)
    order: str
    started: str  # when its comparison started
    probe_ms: tuple[float, float]  # the machine-speed probe before the alone set before and after the one after
    inside: dict[str, float]  # variant -> p50 ms in the comparison (NaN: not in it this round)
    speedup: dict[str, float]  # variant -> the optimizer's reported speedup
    alone: dict[str, float]  # variant -> p50 ms alone: the mean of the two alone sets' p50s
    how: dict[str, str]  # variant -> how the comparison timed it
    chosen: str
    eager_processes_ms: list[float]
    redone: bool
    comparison_s: float
    alone_s: tuple[float, float]  # the alone sets' wall times, before and after
    # variant -> p50 ms in the alone set before and in the one after (a failed set: empty)
    alone_sets: tuple[dict[str, float], dict[str, float]] = dataclasses.field(default_factory=lambda: ({}, {}))


def diffs(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per round ``num / den - 1`` (NaN where either is missing)."""
    return [a / b - 1 if _ok(a) and _ok(b) and b > 0 else math.nan for a, b in zip(num, den)]


def median(xs: Sequence[float]) -> float:
    """The median of the finite values (NaN when none)."""
    good = [x for x in xs if _ok(x)]
    return statistics.median(good) if good else math.nan


def within(diff: float, goal: float) -> bool:
    """The goal check: ``|diff| <= goal``; a missing difference does not meet it."""
    return _ok(diff) and abs(diff) <= goal


def _ok(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _per_round(xs: Sequence[float], fmt: str = "{:.4g}") -> str:
    """Every round's value in order, "/"-separated ("-": none that round)."""
    return "/".join("-" if not _ok(x) else fmt.format(x) for x in xs)


def save_artifacts(opt: Any, model: Any, inputs: tuple[Any, ...], info: Any, cfg: OptimizeConfig, names: list[str],
                   work: Path, notes: list[str], label: str) -> dict[str, Path]:
    """The artifact of each variant in ``names``: the chosen one as the search saved it, each other from a
    one-recipe search on the same candidate cache (its files as the first search built them)."""
    out = {}
    for n in names:
        d = work / f"artifact-{n}"
        if n == opt.recipe:
            opt.save(d)
            out[n] = d
            continue
        one = dataclasses.replace(cfg, recipes=[n], min_speedup=0.0, finalists=1, final_min_iters=2,
                                  final_min_time_s=0.01, tune_allocator=False, progress=False, final_alone=False)
        try:
            got = optimize(model, inputs, one, info=info)
        except Exception as exc:  # noqa: BLE001 - the row says it was rebuilt instead
            notes.append(f"{label}: {n} artifact not saved ({type(exc).__name__}: {exc}); rebuilt in its child")
            continue
        if got.recipe != n or not got.report.get(n).cached:
            notes.append(f"{label}: {n} artifact not from the search's files (chosen {got.recipe}, cached "
                         f"{got.report.get(n).cached}); rebuilt in its child")
            continue
        got.save(d)
        out[n] = d
    return out


def _families(quick: bool) -> dict[str, str]:
    out = {}
    for fam, name in FAMILIES.items():
        if quick and fam in QUICK_SKIP:
            continue
        why = get_recipe(name).unavailable_reason(hardware_info())
        if why is None:
            out[fam] = name
        else:
            print(f"skipping {fam}: {why}")
    return out


def _alone(spec: str, batch: int, seq: int, names: list[str], inputs: tuple[Any, ...], threads: int,
           tc: TimingConfig, work: Path, envs: dict[str, tuple[dict[str, str | None], dict[str, str]]] | None = None,
           artifacts: dict[str, Path] | None = None, gate: quiet.GateConfig = quiet.GateConfig(),
           notes: list[str] | None = None, label: str = "") -> dict[str, Any]:
    """p50 ms of each variant alone in its own fresh process (all started together, timed in rotation, every
    sample gated as the optimizer's: ``bench.quiet``): its artifact loaded with ``torchnitro.load`` where
    ``artifacts`` has one, else built in the child. ``notes`` gets the gate's counts.

    ``envs``: one process per entry instead, each running eager under that (environment, mallopt setting); then
    the full ``Timing`` of each is returned instead of its p50, with its median minor page faults per call."""
    work.mkdir(parents=True, exist_ok=True)
    save_inputs([inputs], work / "inputs.pt")
    jobs = {n: ("eager", *env) for n, env in envs.items()} if envs is not None else {n: (n, {}, {}) for n in names}
    artifacts = artifacts or {}
    timers = {}
    try:
        for n, (recipe, env, mallopt) in jobs.items():
            d = Path(tempfile.mkdtemp(dir=work))
            if recipe in artifacts and envs is None:
                timers[n] = ChildTimer(f"{Path(__file__).stem}:load_artifact", {"directory": str(artifacts[recipe])},
                                       work / "inputs.pt", threads=threads, timeout_s=600.0, gate=gate, name=n)
                continue
            timers[n] = ChildTimer(f"{Path(__file__).stem}:build_variant",
                                   {"spec": spec, "batch": batch, "seq": seq, "recipe": recipe, "workdir": str(d),
                                    "threads": threads, "mallopt": mallopt}, work / "inputs.pt", threads=threads,
                                   timeout_s=600.0, env=env, gate=gate, name=n)
        for t in timers.values():
            t.wait_ready()
        with quiet.recording() as rec:
            res = compare({n: Steady(t) for n, t in timers.items()}, tc)  # sampled as the optimizer's comparison
        if notes is not None:
            notes.append(f"{label}: {rec.text()}; {_halves(res)}")
        faults = {n: statistics.median(t.faults) if t.faults else float("nan") for n, t in timers.items()}
    finally:
        for t in timers.values():
            t.close()
    return {n: (t, faults[n]) for n, t in res.items()} if envs is not None else {n: t.median * 1e3 for n, t in res.items()}


def _halves(res: dict[str, Any]) -> str:
    """Each process's p50 over the second half of its samples against the first half: a young process that speeds
    up shows the same sign in every set, a machine that changes speed shows it in every process of one set."""
    parts = []
    for n, t in res.items():
        half = len(t.samples) // 2
        if half >= 3:
            a, b = statistics.median(t.samples[:half]), statistics.median(t.samples[half:])
            parts.append(f"{n} {b / a - 1:+.1%}")
    return "second half of each process's samples against its first half (p50): " + (", ".join(parts) or "-")


@dataclasses.dataclass
class Workload:
    """What every round of one workload shares: the model, the comparison's config, the variants and their files."""

    name: str
    spec: str
    batch: int
    seq: int
    model: Any
    inputs: tuple[Any, ...]
    info: Any
    cfg: OptimizeConfig  # the rounds' search: the candidate cache of the first search, the final comparison's timing
    tc: TimingConfig  # the alone side's timing (the comparison's iterations and time)
    timed: list[str]  # eager first, then every variant in the first search's comparison
    artifacts: dict[str, Path]  # variant -> its saved artifact (absent: built in its alone child)
    work: Path


def _comparison(w: Workload, notes: list[str], label: str) -> tuple[Report, str]:
    """The optimizer's final comparison again: ``optimize`` on the first search's candidate cache, without the
    whole-search entry (which would return the first report untimed); the candidates load from the cache."""
    shutil.rmtree(w.cfg.resolved_cache_dir() / "searches", ignore_errors=True)
    opt = optimize(w.model, w.inputs, w.cfg, info=w.info)
    rep = opt.report
    if rep.cached:
        raise RuntimeError(f"{label}: optimize returned the cached search; expected a new final comparison")
    rebuilt = [c.recipe for c in rep.candidates if c.recipe in w.timed and c.recipe != "eager" and not c.cached]
    notes.append(f"{label}: chosen {opt.recipe}" + (f"; built again, not loaded from the candidate cache: "
                                                    f"{', '.join(rebuilt)}" if rebuilt else "")
                 + "".join(f"; {n}" for n in rep.notes if n.startswith(REPORT_NOTES)))
    return rep, opt.recipe


@dataclasses.dataclass
class _Comparison:
    """One comparison block of a workload's chain (``_chain``)."""

    rep: Report
    chosen: str
    started: str
    seconds: float


def _chain(w: Workload, rounds: int, probe: Probe, notes: list[str]) -> list[Round]:
    """The blocks A0 C1 A1 C2 ... CR AR (A: an alone set, C: the optimizer's comparison), the probe read before every
    block and after the last; round ``i`` is (A[i-1], C[i], A[i]). A failed block is noted; a round whose comparison
    failed is left out, one whose alone sets both failed too, one with a single alone set uses it alone."""
    reads, sets, set_s, comps = [probe.read()], [], [], []

    def alone_set(j: int) -> None:
        t0 = time.perf_counter()
        try:
            got = _alone(w.spec, w.batch, w.seq, w.timed, w.inputs, w.cfg.resolved_threads(), w.tc,
                         w.work / f"alone{j}", artifacts=w.artifacts, notes=notes, label=f"{w.name} alone set {j}")
        except Exception as exc:  # noqa: BLE001 - a failed alone set costs its rounds one side, not the run
            notes.append(f"{w.name} alone set {j} failed: {type(exc).__name__}: {exc}"[:400])
            got = {}
        sets.append(got)
        set_s.append(time.perf_counter() - t0)
        reads.append(probe.read())

    alone_set(0)
    for i in range(1, rounds + 1):
        label, started = f"{w.name} round {i} of {rounds} comparison", time.strftime("%H:%M:%S")
        t0 = time.perf_counter()
        try:
            comps.append(_Comparison(*_comparison(w, notes, label), started, time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - a failed comparison costs its own round, not the others'
            notes.append(f"{w.name} round {i} of {rounds} failed, left out: {type(exc).__name__}: {exc}"[:400])
            comps.append(None)
        reads.append(probe.read())
        alone_set(i)
    return [_bracketed(i, c, w.timed, (sets[i - 1], sets[i]), (set_s[i - 1], set_s[i]),
                       (reads[2 * i - 2], reads[2 * i + 1])) for i, c in enumerate(comps, 1)
            if c is not None and (sets[i - 1] or sets[i])]


def _bracketed(i: int, c: _Comparison, timed: list[str], sets: tuple[dict[str, float], dict[str, float]],
               set_s: tuple[float, float], probe_ms: tuple[float, float]) -> Round:
    """Round ``i`` from its comparison and the alone sets before and after it: each variant's p50 alone is the mean
    of the two sets' p50s (a drift linear in time across the bracket cancels), one set's where the other has none."""
    inside, speedup, how = {}, {}, {}
    for n in timed:
        cand = next((x for x in c.rep.candidates if x.recipe == n and x.interleaved and x.p50_ms), None)
        if cand is None:
            inside[n], speedup[n], how[n] = math.nan, math.nan, "not in this round's comparison"
            continue
        inside[n], speedup[n] = cand.p50_ms, cand.speedup if cand.speedup is not None else math.nan
        k = len(cand.process_p50_ms) if n == "eager" and cand.process_p50_ms else 1
        how[n] = ("own process" if k == 1 else f"{k} own processes, median") if cand.alone else \
            "this process: " + _why_here(cand.notes)
    alone = {n: _mean([s.get(n, math.nan) for s in sets]) for n in timed}
    eager = c.rep.get("eager")
    return Round(number=i, order=f"alone set {i - 1}, comparison, alone set {i}", started=c.started,
                 probe_ms=probe_ms, inside=inside, speedup=speedup, alone=alone, how=how, chosen=c.chosen,
                 eager_processes_ms=list(eager.process_p50_ms) or [eager.p50_ms or math.nan],
                 redone=any(x.redone for x in c.rep.candidates), comparison_s=c.seconds, alone_s=set_s,
                 alone_sets=sets)


def _mean(xs: Sequence[float]) -> float:
    """The mean of the finite values (NaN when none)."""
    good = [x for x in xs if _ok(x)]
    return statistics.fmean(good) if good else math.nan


def run(name: str, spec: str, batch: int, seq: int, families: dict[str, str], quick: bool,
        tables: dict[str, ResultTable], notes: list[str], probe: Probe, rounds: int | None = None,
        eager_processes: int | None = None) -> None:
    """One workload: the search that builds every family's candidate once and saves each variant's artifact, then
    ``rounds`` comparisons, each between two alone sets (``_chain``; default: the workload's ``BLOCKS``); the tables
    get one row per variant with every round's numbers and the goals checked on the median over rounds."""
    model, inputs, info = model_and_inputs(spec, batch=batch or None, seq=seq or None)
    final_s, default_rounds = (QUICK_FINAL_S, 1) if quick else BLOCKS.get(name, (FINAL_S, ROUNDS))
    rounds = rounds or default_rounds
    with tempfile.TemporaryDirectory(prefix="timing-fairness-") as tmp:
        cfg = OptimizeConfig(recipes=list(families.values()), finalists=len(families), min_speedup=1.0,
                             final_min_time_s=final_s, final_min_iters=5 if quick else 15, budget_s=1800.0,
                             **({"timing_min_time_s": QUICK_FINAL_S} if quick else {}),  # search-time estimates
                             candidate_timeout_s=600.0, cache_dir=str(Path(tmp) / "cache"), progress=not quick,
                             # the artifacts' alone side must run at the comparison's thread count (the knob that
                             # would record fewer is tested on its own: tests/autotune/test_fair_threads.py)
                             tune_threads=False, tune_allocator=False,
                             **({} if eager_processes is None else {"eager_processes": eager_processes}))
        t0 = time.perf_counter()
        # builds every candidate into the cache; its own comparison is short and in this process (no check reads
        # it: no timing process to start) and accepts a slower winner, whose artifact is saved from it directly
        setup = optimize(model, inputs, dataclasses.replace(cfg, final_min_time_s=SETUP_FINAL_S, final_min_iters=2,
                                                            min_speedup=0.0, final_alone=False), info=info)
        timed = ["eager"] + [c.recipe for c in setup.report.candidates if c.interleaved and c.recipe != "eager"]
        for c in setup.report.candidates:
            if c.recipe != "eager" and not c.interleaved:
                notes.append(f"{name}: {c.recipe} not in the comparison ({c.status}: {c.reason[:120]})")
        # the comparison's own timing (final_check.DriftCheck.comparison): the same warm-up, samples and time per variant
        tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=cfg.final_min_iters, min_time_s=final_s,
                          max_time_s=max(5.0, 3 * final_s))
        arts = save_artifacts(setup, model, inputs, info, cfg, timed[1:], Path(tmp), notes, name)
        del setup  # its timing processes are closed; its files stay in the cache
        notes.append(f"{name}: candidates built and artifacts saved in {time.perf_counter() - t0:.0f} s")
        w = Workload(name, spec, batch, seq, model, inputs, info, cfg, tc, timed, arts, Path(tmp))
        done = _chain(w, rounds, probe, notes)
        if not done:
            raise RuntimeError(f"{name}: every round failed: {[n for n in notes if 'failed' in n][-rounds:]}")
        if "allocator" in tables:
            _allocator_table(w, tables["allocator"], notes)
        if "threads" in tables:
            _thread_table(w, tables["threads"])
    loaded = {n: ("artifact (torchnitro.load)" if n in arts else "built in its child") for n in timed}
    loaded["eager"] = "built-in rebuilt from its factory"
    _add_rows(name, timed, families, done, loaded, tables)


def _add_rows(name: str, timed: list[str], families: dict[str, str], done: list[Round], loaded: dict[str, str],
              tables: dict[str, ResultTable]) -> None:
    """The variants, speedups and rounds tables' rows of one workload from its rounds."""
    fam_of = {v: k for k, v in families.items()} | {"eager": "eager"}
    for r in done:
        a, b = r.probe_ms
        tables["rounds"].add(workload=name, round=r.number, blocks=r.order, started=r.started, chosen=r.chosen, **{
            "probe at start ms": a, "probe at end ms": b, "probe change": f"{b / a - 1:+.1%}" if _ok(a / b) else "-",
            "comparison s": r.comparison_s, "alone s": _per_round(r.alone_s, "{:.0f}"), "redone": r.redone,
            "eager per process ms": _per_round(r.eager_processes_ms)})
    for n in timed:
        inside, alone = [r.inside[n] for r in done], [r.alone.get(n, math.nan) for r in done]
        d = diffs(inside, alone)
        hows = list(dict.fromkeys(r.how[n] for r in done))
        redone = [str(r.number) for r in done if r.redone]
        tables["variants"].add(workload=name, variant=n, family=fam_of.get(n, n), **{
            "p50 in comparison ms": median(inside), "p50 alone ms": median(alone), "diff": f"{median(d):+.1%}",
            "within 5%": within(median(d), P50_GOAL), "in comparison per round ms": _per_round(inside),
            "alone per round ms": _per_round(alone), "diff per round": _per_round(d, "{:+.1%}"),
            "alone sets per round ms": " / ".join(
                _per_round([s.get(n, math.nan) for s in r.alone_sets]).replace("/", "|") for r in done),
            "timed in comparison": "; ".join(hows) + (f", redone in round {'/'.join(redone)}" if redone else ""),
            "alone": loaded[n]})
        if n == "eager":
            continue
        reported = [r.speedup[n] for r in done]
        iso = [r.alone.get("eager", math.nan) / r.alone.get(n, math.nan) for r in done]
        ds = diffs(reported, iso)
        tables["speedups"].add(workload=name, variant=n, **{
            "reported speedup": median(reported), "isolated ratio": median(iso), "diff": f"{median(ds):+.1%}",
            "within 10%": within(median(ds), SPEEDUP_GOAL), "reported per round": _per_round(reported),
            "isolated per round": _per_round(iso), "diff per round": _per_round(ds, "{:+.1%}"),
            "chosen in rounds": "/".join(str(r.number) for r in done if r.chosen == n) or "none"})


def _allocator_table(w: Workload, table: ResultTable, notes: list[str]) -> None:
    """Eager alone in fresh processes under each of ``MALLOC_SETTINGS``, against glibc's defaults."""
    by_env = _alone(w.spec, w.batch, w.seq, [], w.inputs, w.cfg.resolved_threads(), w.tc, w.work / "malloc",
                    MALLOC_SETTINGS, notes=notes, label=f"{w.name} allocator table")
    base = by_env["glibc defaults"][0].median * 1e3
    for setting, (t, faults) in by_env.items():
        env_vars, mallopt = MALLOC_SETTINGS[setting]
        env = " ".join(f"{k}={v}" for k, v in env_vars.items() if v is not None) or (
            "mallopt " + " ".join(f"{k}={v}" for k, v in mallopt.items()) if mallopt else "-")
        table.add(workload=w.name, setting=setting, env=env, **{
            "eager p50 alone ms": t.median * 1e3, "vs glibc defaults": base / (t.median * 1e3),
            "page faults per call": faults})


def _thread_table(w: Workload, table: ResultTable) -> None:
    """Eager alone under each of ``THREAD_SETTINGS``, quiet and beside one busy process (``BUSY``)."""
    for beside in ("nothing", "one busy process"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY]) if beside != "nothing" else None
        # the busy process is the condition measured, not a disturbance: not ours, and no machine retakes beside it
        gate = quiet.GateConfig(machine=busy is None)
        try:
            with quiet.ignore(busy.pid) if busy is not None else contextlib.nullcontext():
                res = _alone(w.spec, w.batch, w.seq, [], w.inputs, w.cfg.resolved_threads(), w.tc,
                             w.work / beside.replace(" ", "-"), THREAD_SETTINGS, gate=gate)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        base = res["libgomp default (~3 ms spin)"][0].median
        for setting, (t, _) in res.items():
            env = " ".join(f"{k}={v}" for k, v in THREAD_SETTINGS[setting][0].items())
            table.add(workload=w.name, setting=setting, env=env, beside=beside, **{
                "eager p50 alone ms": t.median * 1e3, "eager p90 ms": t.p90 * 1e3,
                "vs libgomp default, same load": base / t.median})


def _why_here(notes: str) -> str:
    """The report row's reason for timing a variant in the search's process."""
    _, _, why = notes.partition("final comparison: timed in this process")
    return why.split(";")[0].strip(" :()")[:120] or "see the report"


def _load() -> str:
    """The machine's 1/5/15-minute load averages (runnable processes; this machine has ``os.cpu_count()`` cores)."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"
    except OSError:
        return "unknown"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for pkg in ("torchnitro", "onnxruntime", "onnx", "openvino"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def _rounds_text(rounds: int | None, quick: bool, names: Sequence[str]) -> str:
    """The rounds and measured seconds per variant of each workload in ``names`` (``--rounds`` overrides the count)."""
    if quick:
        return f"{rounds or 1} per workload, {QUICK_FINAL_S:g} s a variant"
    return ", ".join(f"{k}: {rounds or r} rounds, {sec:g} s a variant"
                     for k, (sec, r) in ((k, BLOCKS.get(k, (FINAL_S, ROUNDS))) for k in names))


def _tables(meta: dict[str, Any], allocator: bool, threads: bool) -> dict[str, ResultTable]:
    tables = {"variants": ResultTable("p50 inside the optimizer's comparison vs alone in a fresh process, per round",
                                      VARIANT_COLUMNS, meta=dict(meta)),
              "speedups": ResultTable("reported speedup vs isolated ratio, per round", SPEEDUP_COLUMNS),
              "rounds": ResultTable("rounds: order, machine-speed probe at start and end (a diagnostic: no number "
                                    "is normalised by it), durations", ROUND_COLUMNS)}
    if allocator:
        tables["allocator"] = ResultTable("eager alone in fresh processes under glibc allocator settings",
                                          ALLOCATOR_COLUMNS)
    if threads:
        tables["threads"] = ResultTable("eager alone in fresh processes under OpenMP wait settings", THREAD_COLUMNS)
    return tables


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one small workload, no torch.compile: a smoke test")
    ap.add_argument("--only", choices=sorted(WORKLOADS), help="one workload")
    ap.add_argument("--out", default=None, help="output folder (default: results/)")
    ap.add_argument("--no-allocator", action="store_true", help="skip eager under glibc allocator settings")
    ap.add_argument("--no-threads", action="store_true", help="skip eager under OpenMP wait settings")
    ap.add_argument("--eager-processes", type=int, default=None,
                    help="eager's fresh processes in the optimizer's comparison "
                         f"(default {OptimizeConfig().eager_processes})")
    ap.add_argument("--rounds", type=int, default=None,
                    help="comparisons per workload, each between two alone sets (default per workload: "
                         + ", ".join(f"{k} {r}" for k, (_, r) in BLOCKS.items()) + "; 1 with --quick)")
    args = ap.parse_args(argv)
    rounds = args.rounds
    if rounds is not None and rounds < 1:
        ap.error(f"--rounds: received {rounds}, expected >= 1")
    if args.eager_processes is not None and args.eager_processes < 1:
        ap.error(f"--eager-processes: received {args.eager_processes}, expected >= 1")
    eager_processes = args.eager_processes or OptimizeConfig().eager_processes
    workloads = QUICK_WORKLOADS if args.quick else {k: v for k, v in WORKLOADS.items() if args.only in (None, k)}
    families = _families(args.quick)
    hw = hardware_info()
    meta = {"command": "python " + " ".join([f"benchmarks/{Path(__file__).name}"] + (argv if argv is not None
                                                                                      else sys.argv[1:])),
            "machine": f"{hw.cpu_name}, {hw.cpu_cores} cores", "versions": _versions(), "commit": git_commit(),
            "timing environment": describe_environment(), "families": families, "load average at start": _load(),
            "rounds": _rounds_text(rounds, args.quick, list(workloads)) + "; per workload one chain alone set 0, "
                      "comparison 1, alone set 1, comparison 2, ...: each comparison against the mean of the p50s of "
                      "the alone sets before and after it",
            "eager in the comparison": f"{eager_processes} fresh processes, median p50", "p50 columns": P50_COLUMNS,
            "timing processes' environment": timing_process_env() or "nothing added: libgomp's default OpenMP wait, "
                                                                     "or the user's OMP_WAIT_POLICY/GOMP_SPINCOUNT"}
    tables = _tables(meta, not args.no_allocator, not args.no_threads)
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="timing-fairness-probe-") as tmp:
        probe = Probe(Path(tmp), OptimizeConfig().resolved_threads(), QUICK_PROBE_S if args.quick else PROBE_S)
        try:
            for name, (spec, batch, seq) in workloads.items():
                run(name, spec, batch, seq, families, args.quick, tables, notes, probe, rounds, eager_processes)
        finally:
            probe.close()
    if probe.failed:
        notes.append(f"machine-speed probe: {probe.failed}")
    variants = tables["variants"]
    variants.meta["notes"] = notes
    for t in tables.values():
        t.print()
    for n in notes:
        print(n)
    out = Path(args.out) if args.out else results_dir()
    out.mkdir(parents=True, exist_ok=True)
    stem = "timing_fairness_quick" if args.quick else "timing_fairness"
    variants.meta["load average at end"] = _load()  # other work on the machine moves every number here
    variants.meta["written"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / f"{stem}.json").write_text(json.dumps({k: t.to_json() for k, t in tables.items()}, indent=2, default=str))
    (out / f"{stem}.md").write_text("\n".join(t.to_markdown() for t in tables.values()))
    print(f"wrote {out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
