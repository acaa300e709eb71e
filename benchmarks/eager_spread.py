"""How much does eager's p50 differ between fresh processes, and how much of that is glibc's allocator?

Each built-in model's eager is timed in several fresh processes, one at a time (nothing else timed beside it),
half of them with glibc's default malloc thresholds and half under ``bench.environment.ALLOCATOR_SETTING``
(``MALLOC_MMAP_THRESHOLD_=268435456 MALLOC_TRIM_THRESHOLD_=536870912``), alternating (default, setting, default,
...) so drift of the machine hits both. Every process reports its p50 and the minor page faults per call it took
while timed (``bench.isolated.ChildTimer.faults``).

Why it matters: the optimizer compares fresh processes with each other (eager in one, each finalist in its own);
if two fresh processes of the same eager differ by more than the comparison's 5% band, no comparison can
agree with a later measurement. With glibc's defaults a process returns some of each call's freed
activations to the kernel and faults them in again on the next call, and how much depends on which of torch's
threads freed what first. This table is why every timing process runs under the setting
(``bench.environment.timing_process_env``).

Run (one benchmark at a time on a shared machine)::

    flock /tmp/torchnitro-bench.lock python benchmarks/eager_spread.py        # a few minutes
    python benchmarks/eager_spread.py --quick                                 # smoke test, seconds

Writes results/eager_spread.{json,md,png} (``--quick``: eager_spread_quick.*) with the command, machine, versions.
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

from torchnitro.bench.environment import ALLOCATOR_SETTING, GLIBC_DEFAULTS, allocator_untunable, describe_environment
from torchnitro.bench.isolated import ChildTimer, save_inputs
from torchnitro.bench.provenance import git_commit
from torchnitro.bench.report import ResultTable, results_dir, save_plot
from torchnitro.hardware import hardware_info

SETTINGS: dict[str, dict[str, str | None]] = {"glibc defaults": dict(GLIBC_DEFAULTS),
                                                "allocator setting": dict(ALLOCATOR_SETTING)}
WORKLOADS = ("encoder", "cnn", "lm", "mlp")
PROCESS_COLUMNS = ("workload", "setting", "process", "p50 ms", "p10 ms", "p90 ms", "page faults per call")
SUMMARY_COLUMNS = ("workload", "setting", "processes", "p50 min ms", "p50 median ms", "p50 max ms", "spread",
                   "faults per call (min-max)", "median vs glibc defaults")


def build_eager(spec: str) -> Callable[..., Any]:
    """Child side (``ChildTimer`` loader): the built-in model's eager, as ``torchnitro.load`` rebuilds it."""
    from torchnitro.nn.zoo import get_builtin

    return get_builtin(spec).build()


def _one(spec: str, inputs: Path, threads: int, env: dict[str, str | None], samples: int,
         min_sample_s: float) -> dict[str, float]:
    """One fresh process: ``samples`` samples, each after one untimed call (as the optimizer samples)."""
    with ChildTimer(f"{Path(__file__).stem}:build_eager", {"spec": spec}, inputs, threads=threads, env=env,
                    timeout_s=300.0, name=f"eager {spec}") as timer:
        first = timer.sample(1, warm=1)
        k = max(1, int(min_sample_s / max(first, 1e-6)))
        timer.faults.clear()
        times = sorted(timer.sample(k, warm=1) * 1e3 for _ in range(samples))
    n = len(times)  # nearest-rank percentiles of the samples (sorted)
    return {"p50 ms": statistics.median(times), "p10 ms": times[round(0.1 * (n - 1))],
            "p90 ms": times[round(0.9 * (n - 1))],
            "page faults per call": statistics.median(timer.faults)}


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        out["torchnitro"] = importlib.metadata.version("torchnitro")
    except importlib.metadata.PackageNotFoundError:
        pass
    return out


def _load() -> str:
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)"
    except OSError:
        return "unknown"


def _plot(per: ResultTable, workloads: list[str], name: str, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(workloads), figsize=(3.2 * len(workloads), 3.4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for x, (setting, colour) in enumerate(zip(SETTINGS, ("tab:red", "tab:blue"))):
            ys = [r["p50 ms"] for r in per.rows if r["workload"] == w and r["setting"] == setting]
            ax.scatter([x + 0.06 * (i - (len(ys) - 1) / 2) for i in range(len(ys))], ys, color=colour, s=22)
        ax.set_xticks([0, 1], ["glibc\ndefaults", "allocator\nsetting"])
        ax.set_xlim(-0.6, 1.6)
        ax.set_title(f"{w}: eager p50 per process", fontsize=9)
        ax.set_ylabel("ms")
        lo = min(r["p50 ms"] for r in per.rows if r["workload"] == w)
        ax.set_ylim(bottom=lo * 0.8)
    fig.suptitle("eager in fresh processes, one at a time: glibc's defaults vs the allocator setting", fontsize=10)
    fig.tight_layout()
    return save_plot(fig, name, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="mlp only, one process per setting: a smoke test")
    ap.add_argument("--models", nargs="+", default=list(WORKLOADS), help=f"built-ins (default {' '.join(WORKLOADS)})")
    ap.add_argument("--processes", type=int, default=5, help="fresh processes per setting (default 5)")
    ap.add_argument("--samples", type=int, default=15, help="samples per process (default 15)")
    ap.add_argument("--out", default=None, help="output folder (default: results/)")
    args = ap.parse_args(argv)
    why = allocator_untunable()
    if why is not None:
        print(f"cannot compare glibc's allocator settings here: {why}", file=sys.stderr)
        return 2
    from torchnitro.nn.zoo import get_builtin

    workloads = ["mlp"] if args.quick else list(args.models)
    processes, samples, min_s = (1, 3, 0.02) if args.quick else (args.processes, args.samples, 0.2)
    threads = torch.get_num_threads()
    hw = hardware_info()
    meta = {"command": "python " + " ".join([f"benchmarks/{Path(__file__).name}"] + (argv if argv is not None
                                                                                      else sys.argv[1:])),
            "machine": f"{hw.cpu_name}, {hw.cpu_cores} cores", "versions": _versions(), "commit": git_commit(),
            "timing environment": describe_environment(), "torch threads": threads,
            "load average at start": _load(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "settings": {k: " ".join(f"{a}={b}" for a, b in v.items() if b is not None) or "glibc's default thresholds"
                         for k, v in SETTINGS.items()}}
    per = ResultTable("eager p50 in each fresh process (one process at a time)", PROCESS_COLUMNS, meta=meta)
    summary = ResultTable("per workload and setting: how far fresh processes differ", SUMMARY_COLUMNS)
    from rich.progress import Progress

    with tempfile.TemporaryDirectory(prefix="eager-spread-") as tmp, Progress(transient=True) as bar:
        task = bar.add_task("fresh processes", total=len(workloads) * processes * len(SETTINGS))
        for w in workloads:
            b = get_builtin(w)
            inputs = Path(tmp) / f"{w}.pt"
            save_inputs([b.inputs(b.default_batch, b.default_seq, 0)], inputs)
            for i in range(processes):
                for setting, env in SETTINGS.items():  # alternating: drift hits both settings
                    bar.update(task, description=f"{w}: {setting}, process {i + 1}/{processes}")
                    per.add(workload=w, setting=setting, process=i + 1, **_one(w, inputs, threads, env, samples, min_s))
                    bar.advance(task)
    for w in workloads:
        base = None
        for setting in SETTINGS:
            rows = [r for r in per.rows if r["workload"] == w and r["setting"] == setting]
            p50 = [r["p50 ms"] for r in rows]
            faults = [r["page faults per call"] for r in rows]
            med = statistics.median(p50)
            base = med if base is None else base
            summary.add(workload=w, setting=setting, processes=len(rows), **{
                "p50 min ms": min(p50), "p50 median ms": med, "p50 max ms": max(p50),
                "spread": f"{max(p50) / min(p50) - 1:+.1%}",
                "faults per call (min-max)": f"{min(faults):,.0f}-{max(faults):,.0f}",
                "median vs glibc defaults": base / med})
    meta["load average at end"] = _load()
    name = "eager_spread_quick" if args.quick else "eager_spread"
    out = Path(args.out) if args.out else results_dir()
    per.print()
    summary.print()
    jp, md = per.save(name, out)
    md.write_text(md.read_text() + "\n" + summary.to_markdown())
    jp.write_text(json.dumps({"processes": per.to_json(), "summary": summary.to_json()}, indent=2, default=str))
    png = _plot(per, workloads, name, out)
    print(f"wrote {md} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
