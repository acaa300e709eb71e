"""Does the optimizer's final comparison time each variant as it runs alone?

For each workload, one ``torchnitro.optimize`` search over one recipe per runtime family (compile,
TorchScript, ONNX Runtime, OpenVINO when installed) with every candidate in the final comparison,
then every variant (eager included) built and timed alone, each in its own fresh process (rounds
alternate between the processes; the parent only waits). Two checks per workload (issue 14):

- each variant's p50 inside the optimizer's comparison is within 5% of its p50 alone;
- the optimizer's reported speedup agrees with the isolated ratio (eager alone / variant alone) within 10%.

The optimizer's comparison times eager and every finalist alone, each in its own fresh process that loads
the variant as its artifact would (``autotune.fair``), eager in ``OptimizeConfig.eager_processes`` (default 1) fresh
processes whose median p50 is the baseline of every speedup (``autotune.fair_eager``); so like is compared
with like, eager's "p50 in comparison" is that median (the processes' p50s beside it) and its "p50 alone"
the median over ``--repeat`` sets of fresh processes (theirs beside it). The "alone" side here times each
variant's saved artifact as ``torchnitro.load`` runs it, in its own fresh process (eager: the built-in
rebuilt from its factory, as ``load`` rebuilds it), so the two differ only in when they ran. The artifact
of a variant the search did not choose comes from a one-recipe search on the same candidate cache (the same files, never
rebuilt). An earlier version rebuilt every variant in the alone child: a rebuilt ONNX Runtime session
measured its own spinning choice while its sibling processes were building, chose differently from the
search's build, and ran 7-18% slower than the artifact the optimizer had timed.

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

    flock /tmp/torchnitro-bench.lock python benchmarks/timing_fairness.py           # a few minutes
    python benchmarks/timing_fairness.py --quick                                    # smoke test, ~1 min

Writes results/timing_fairness.{json,md} (``--quick``: timing_fairness_quick.*) with the command,
the machine, the library versions and the allocator/thread settings.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from torchnitro.autotune.api import optimize
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.fair import Steady
from torchnitro.autotune.inputs import model_and_inputs
from torchnitro.autotune.recipe import BuildContext, get_recipe
from torchnitro.bench import ResultTable, TimingConfig, compare, results_dir
from torchnitro.bench import quiet
from torchnitro.bench.environment import (ALLOCATOR_SETTING, GLIBC_DEFAULTS, apply_allocator, describe_environment,
                                          timing_process_env)
from torchnitro.bench.isolated import ChildTimer, save_inputs
from torchnitro.hardware import hardware_info

# family -> the recipe that stands for it
FAMILIES = {"compile": "compile", "torchscript": "torchscript", "onnxruntime": "onnxruntime", "openvino": "openvino"}
WORKLOADS = {"encoder": ("encoder", 8, 128), "mlp": ("mlp", 64, 0)}  # name -> (builtin, batch, seq)
QUICK_WORKLOADS = {"mlp": ("mlp", 8, 0)}
QUICK_SKIP = ("compile",)  # inductor's C++ build takes minutes on 2 cores: not for a smoke test
P50_GOAL, SPEEDUP_GOAL = 0.05, 0.10
REPEAT = 3  # independent sets of fresh processes on the alone side: one fresh process is one draw of
# eager's per-process mode (encoder eager 41.6-51.3 ms across four processes of the 00:06 run)
VARIANT_COLUMNS = ("workload", "variant", "family", "p50 in comparison ms", "comparison per process ms", "p50 alone ms",
                   "alone per process ms", "diff", "within 5%", "timed in comparison", "alone")
P50_COLUMNS = ("p50 in comparison ms: the optimizer's own number; for eager the median of the p50s of its fresh "
               "processes in the comparison (eager_processes; listed in 'comparison per process ms'), which every "
               "reported speedup divides; other variants run in one process there. p50 alone ms: the median over "
               "--repeat independent sets of fresh processes (listed in 'alone per process ms')")
SPEEDUP_COLUMNS = ("workload", "variant", "reported speedup", "isolated ratio", "diff", "within 10%", "chosen")
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


def save_artifacts(opt: Any, model: Any, inputs: tuple[Any, ...], info: Any, cfg: OptimizeConfig, names: list[str],
                   work: Path, notes: list[str], label: str) -> dict[str, Path]:
    """The artifact of each variant in ``names``: the chosen one as the search saved it, each other from a
    one-recipe search on the same candidate cache (its files as the first search built them)."""
    import dataclasses

    out = {}
    for n in names:
        d = work / f"artifact-{n}"
        if n == opt.recipe:
            opt.save(d)
            out[n] = d
            continue
        one = dataclasses.replace(cfg, recipes=[n], min_speedup=0.0, finalists=1, final_min_iters=2,
                                  final_min_time_s=0.01, tune_allocator=False, progress=False)
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
            notes.append(f"{label}: {rec.text()}")
        faults = {n: statistics.median(t.faults) if t.faults else float("nan") for n, t in timers.items()}
    finally:
        for t in timers.values():
            t.close()
    return {n: (t, faults[n]) for n, t in res.items()} if envs is not None else {n: t.median * 1e3 for n, t in res.items()}


def run(name: str, spec: str, batch: int, seq: int, families: dict[str, str], quick: bool,
        tables: dict[str, ResultTable], notes: list[str], repeat: int = REPEAT,
        eager_processes: int | None = None) -> None:
    """One workload: the optimizer's comparison (eager in ``eager_processes`` fresh processes; None: the config's
    default), then every timed variant alone in ``repeat`` independent sets of fresh processes (``p50 alone ms``:
    the median of the per-process p50s; the column beside it lists them)."""
    variants, speedups, allocator = tables["variants"], tables["speedups"], tables.get("allocator")
    model, inputs, info = model_and_inputs(spec, batch=batch or None, seq=seq or None)
    final_s = 0.3 if quick else 2.0
    with tempfile.TemporaryDirectory(prefix="timing-fairness-") as tmp:
        cfg = OptimizeConfig(recipes=list(families.values()), finalists=len(families), min_speedup=1.0,
                             final_min_time_s=final_s, final_min_iters=5 if quick else 15, budget_s=1800.0,
                             candidate_timeout_s=600.0, cache_dir=str(Path(tmp) / "cache"), progress=not quick,
                             # the artifacts' alone side must run at the comparison's thread count (the knob that
                             # would record fewer is tested on its own: tests/autotune/test_fair_threads.py)
                             tune_threads=False,
                             **({} if eager_processes is None else {"eager_processes": eager_processes}))
        t0 = time.perf_counter()
        opt = optimize(model, inputs, cfg, info=info)
        rep = opt.report
        notes.append(f"{name}: search {time.perf_counter() - t0:.0f} s, chosen {opt.recipe}; " + "; ".join(
            n for n in rep.notes if n.startswith(("eager in the final comparison", "eager p50 alone",
                                                  "final comparison redone", "allocator setting", "timing gate"))))
        timed = [c.recipe for c in rep.candidates if c.interleaved]
        for c in rep.candidates:
            if c.recipe != "eager" and not c.interleaved:
                notes.append(f"{name}: {c.recipe} not in the comparison ({c.status}: {c.reason[:120]})")
        tc = TimingConfig(warmup=2, warmup_s=0.0, min_iters=5 if quick else 15, min_time_s=final_s,
                          max_time_s=max(5.0, 3 * final_s))
        arts = save_artifacts(opt, model, inputs, info, cfg, [n for n in timed if n != "eager"], Path(tmp), notes, name)
        runs = [_alone(spec, batch, seq, timed, inputs, cfg.resolved_threads(), tc, Path(tmp) / f"alone{i}",
                       artifacts=arts, notes=notes, label=f"{name} alone side, set {i + 1} of {repeat}")
                for i in range(repeat)]
        alone = {n: statistics.median(r[n] for r in runs) for n in timed}  # median of the per-process p50s
        spread = {n: "/".join(f"{r[n]:.2f}" for r in runs) for n in timed}
        loaded = {n: ("artifact (torchnitro.load)" if n in arts else "built in its child") for n in timed}
        loaded["eager"] = "built-in rebuilt from its factory"
        if allocator is not None:
            by_env = _alone(spec, batch, seq, [], inputs, cfg.resolved_threads(), tc, Path(tmp) / "malloc",
                            MALLOC_SETTINGS, notes=notes, label=f"{name} allocator table")
            base = by_env["glibc defaults"][0].median * 1e3
            for setting, (t, faults) in by_env.items():
                env_vars, mallopt = MALLOC_SETTINGS[setting]
                env = " ".join(f"{k}={v}" for k, v in env_vars.items() if v is not None) or (
                    "mallopt " + " ".join(f"{k}={v}" for k, v in mallopt.items()) if mallopt else "-")
                allocator.add(workload=name, setting=setting, env=env, **{
                    "eager p50 alone ms": t.median * 1e3, "vs glibc defaults": base / (t.median * 1e3),
                    "page faults per call": faults})
        if "threads" in tables:
            _thread_table(name, spec, batch, seq, inputs, cfg.resolved_threads(), tc, Path(tmp) / "threads",
                          tables["threads"])
    fam_of = {v: k for k, v in families.items()} | {"eager": "eager"}
    for n in timed:
        c = rep.get(n)
        diff = c.p50_ms / alone[n] - 1
        inside = c.process_p50_ms if n == "eager" and c.process_p50_ms else [c.p50_ms]
        how = ("own process" if len(inside) == 1 else f"{len(inside)} own processes, median") if c.alone else \
            "this process: " + _why_here(c.notes)
        variants.add(workload=name, variant=n, family=fam_of.get(n, n), **{
            "p50 in comparison ms": c.p50_ms, "comparison per process ms": "/".join(f"{ms:.2f}" for ms in inside),
            "p50 alone ms": alone[n], "alone per process ms": spread[n], "diff": f"{diff:+.1%}",
            "within 5%": abs(diff) <= P50_GOAL, "timed in comparison": how + (", redone" if c.redone else ""),
            "alone": loaded[n]})
        if n != "eager":
            iso = alone["eager"] / alone[n]
            d = c.speedup / iso - 1
            speedups.add(workload=name, variant=n, **{"reported speedup": c.speedup, "isolated ratio": iso,
                         "diff": f"{d:+.1%}", "within 10%": abs(d) <= SPEEDUP_GOAL, "chosen": n == opt.recipe})


def _thread_table(name: str, spec: str, batch: int, seq: int, inputs: tuple[Any, ...], threads: int,
                  tc: TimingConfig, work: Path, table: ResultTable) -> None:
    """Eager alone under each of ``THREAD_SETTINGS``, quiet and beside one busy process (``BUSY``)."""
    import contextlib
    import subprocess

    for beside in ("nothing", "one busy process"):
        busy = subprocess.Popen([sys.executable, "-c", BUSY]) if beside != "nothing" else None
        # the busy process is the condition measured, not a disturbance: not ours, and no machine retakes beside it
        gate = quiet.GateConfig(machine=busy is None)
        try:
            with quiet.ignore(busy.pid) if busy is not None else contextlib.nullcontext():
                res = _alone(spec, batch, seq, [], inputs, threads, tc, work / beside.replace(" ", "-"),
                             THREAD_SETTINGS, gate=gate)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
        base = res["libgomp default (~3 ms spin)"][0].median
        for setting, (t, _) in res.items():
            env = " ".join(f"{k}={v}" for k, v in THREAD_SETTINGS[setting][0].items())
            table.add(workload=name, setting=setting, env=env, beside=beside, **{
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
    ap.add_argument("--repeat", type=int, default=None,
                    help=f"independent sets of fresh processes on the alone side (default {REPEAT}, 1 with --quick)")
    args = ap.parse_args(argv)
    repeat = args.repeat if args.repeat is not None else (1 if args.quick else REPEAT)
    if repeat < 1:
        ap.error(f"--repeat: received {repeat}, expected >= 1")
    if args.eager_processes is not None and args.eager_processes < 1:
        ap.error(f"--eager-processes: received {args.eager_processes}, expected >= 1")
    eager_processes = args.eager_processes or OptimizeConfig().eager_processes
    workloads = QUICK_WORKLOADS if args.quick else {k: v for k, v in WORKLOADS.items() if args.only in (None, k)}
    families = _families(args.quick)
    hw = hardware_info()
    meta = {"command": "python " + " ".join([f"benchmarks/{Path(__file__).name}"] + (argv if argv is not None
                                                                                      else sys.argv[1:])),
            "machine": f"{hw.cpu_name}, {hw.cpu_cores} cores", "versions": _versions(),
            "timing environment": describe_environment(), "families": families, "load average at start": _load(),
            "eager in the comparison": f"{eager_processes} fresh processes, median p50", "p50 columns": P50_COLUMNS,
            "timing processes' environment": timing_process_env() or "nothing added: libgomp's default OpenMP wait, "
                                                                     "or the user's OMP_WAIT_POLICY/GOMP_SPINCOUNT"}
    variants = ResultTable("p50 inside the optimizer's comparison vs alone in a fresh process", VARIANT_COLUMNS,
                           meta=dict(meta))
    tables = {"variants": variants, "speedups": ResultTable("reported speedup vs isolated ratio", SPEEDUP_COLUMNS)}
    if not args.no_allocator:
        tables["allocator"] = ResultTable("eager alone in fresh processes under glibc allocator settings",
                                          ALLOCATOR_COLUMNS)
    if not args.no_threads:
        tables["threads"] = ResultTable("eager alone in fresh processes under OpenMP wait settings", THREAD_COLUMNS)
    notes: list[str] = []
    for name, (spec, batch, seq) in workloads.items():
        run(name, spec, batch, seq, families, args.quick, tables, notes, repeat, eager_processes)
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
