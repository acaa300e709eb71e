"""``torchnitro bench run``, ``bench compare`` and ``bench history`` (registered on the app in ``torchnitro.cli``).

``compare`` exits 1 when any case is slower, so CI can gate on it; bad or incomparable files exit 2
(``NitroError``), like every other verb. With ``--sequential`` it decides from as many runs as it is
given (``BASE NEW [BASE2 NEW2 ...]``, ``bench.sequential``) and exits 3 when a case is still
inconclusive: run both again and add the two files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from torchnitro.errors import InputError

__all__ = ["register", "bench_app", "run_command", "compare_command", "history_command", "load_history"]

bench_app = typer.Typer(help="Compare benchmark result files and find step changes over many runs.",
                        no_args_is_help=True)


@bench_app.command("compare")
def compare_command(
    base: Path = typer.Argument(..., help="result file of the baseline run"),
    new: Path = typer.Argument(..., help="result file of the run to check"),
    more: Optional[List[Path]] = typer.Argument(None, help="with --sequential: later runs of both, as further "
                                                "BASE NEW pairs (one look each)"),
    sequential: bool = typer.Option(False, "--sequential", help="decide or ask for more runs (exit 3), up to "
                                    "--looks runs of each"),
    looks: int = typer.Option(4, "--looks", help="with --sequential: the most runs of each that will be compared"),
    threshold: float = typer.Option(0.05, "--threshold", help="smallest relative change that counts (0.05 = 5%)"),
    alpha: float = typer.Option(0.01, "--alpha", help="significance level of the rank test"),
    force: bool = typer.Option(False, "--force", help="compare files from different machines/thread settings"),
    as_json: bool = typer.Option(False, "--json", help="print the verdicts as JSON"),
) -> None:
    """Per case: faster / slower / same, with the ratio of medians, its interval and the p-value."""
    from rich.console import Console
    from rich.table import Table

    from torchnitro.bench.regress import CompareConfig, compare_results
    from torchnitro.bench.results import check_comparable, read_results

    a, b = read_results(base), read_results(new)
    notes = check_comparable(a, b) if not force else ["--force: environments not checked"]
    if more and not sequential:
        raise InputError(f"received {len(more)} files after BASE NEW; expected them only with --sequential (pairs "
                         "of later runs)")
    if sequential:
        verdicts, only, notes = _sequential(a, b, more or [], looks, alpha, threshold, force, notes)
    else:
        verdicts, only = compare_results(a, b, CompareConfig(alpha=alpha, threshold=threshold))
    con = Console(soft_wrap=True)
    if as_json:
        con.print_json(json.dumps({"verdicts": [v.to_dict() for v in verdicts], "only_in_one": only, "notes": notes}))
    else:
        t = Table(title=f"{base} -> {new}")
        for c in ("case", "verdict", "ratio (new/base)", "95% interval", "p", "median base", "median new", "why"):
            t.add_column(c)
        color = {"slower": "red", "faster": "green", "same": "white", "inconclusive": "yellow"}
        for v in verdicts:
            t.add_row(v.case, f"[{color[v.verdict]}]{v.verdict}[/]", f"{v.ratio:.3f}", f"{v.ci_low:.3f}-{v.ci_high:.3f}",
                      f"{v.p_value:.2g}", f"{v.median_base_s * 1e3:.4f} ms", f"{v.median_new_s * 1e3:.4f} ms", v.reason)
        con.print(t)
        for line in notes + [f"not compared: {o}" for o in only]:
            con.print(f"note: {line}", highlight=False)
    slower = [v.case for v in verdicts if v.verdict == "slower"]
    if slower:
        Console(stderr=True).print(f"regression: {len(slower)} case(s) slower: {', '.join(slower)}", highlight=False)
        raise typer.Exit(code=1)
    open_cases = [v.case for v in verdicts if v.verdict == "inconclusive"]
    if open_cases:
        Console(stderr=True).print(f"inconclusive: {len(open_cases)} case(s) need more samples "
                                   f"({', '.join(open_cases)}): run both again and add the two result files "
                                   "(BASE NEW ... BASE2 NEW2)", highlight=False)
        raise typer.Exit(code=3)


def _sequential(a: Any, b: Any, more: List[Path], looks: int, alpha: float, threshold: float, force: bool,
                notes: list[str]) -> tuple[list[Any], list[str], list[str]]:
    """Verdicts of ``bench.sequential`` over the runs given; the ratio is of low quantiles (see its module doc)."""
    from torchnitro.bench.results import check_comparable, read_results
    from torchnitro.bench.sequential import SequentialConfig, compare_result_files

    if len(more) % 2:
        raise InputError(f"--sequential: received {len(more)} files after BASE NEW; expected pairs (BASE2 NEW2 ...)")
    runs = [(a, b)] + [(read_results(x), read_results(y)) for x, y in zip(more[::2], more[1::2])]
    for x, y in runs[1:]:
        notes = notes + (check_comparable(a, x) + check_comparable(a, y) if not force else [])
    verdicts, only = compare_result_files(runs, SequentialConfig(looks=looks, alpha=alpha, threshold=threshold))
    return verdicts, only, notes + [f"sequential: {len(runs)} of at most {looks} runs; ratio and interval are of the "
                                    "0.1 quantiles (the clean mode), alpha spent over the looks"]


@bench_app.command("run")
def run_command(
    suite: str = typer.Option("attention", "--suite", help="which suite: attention, fused, train, models"),
    tier: str = typer.Option("micro,small,realistic", "--tier", help="comma-separated tiers: micro, small, "
                             "realistic, large, xlarge"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="result file (default: results/bench-SUITE-TIME.json)"),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    quick: bool = typer.Option(False, "--quick", help="few samples: a smoke test, not a measurement"),
) -> None:
    """Time a suite over the size matrix and write a result file with every sample and the environment."""
    import dataclasses
    import time

    import torch
    from rich.console import Console

    from torchnitro.bench.environment import timing_environment
    from torchnitro.bench.provenance import provenance
    from torchnitro.bench.report import results_dir
    from torchnitro.bench.results import MIN_SAMPLES, write_results
    from torchnitro.bench.suites import run_suite
    from torchnitro.bench.timing import TimingConfig

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tiers = [t.strip() for t in tier.split(",") if t.strip()]
    # --quick still takes enough samples for the file to be comparable
    timing = dataclasses.replace(TimingConfig(device=dev).quick(), min_iters=MIN_SAMPLES) if quick else \
        TimingConfig(device=dev)
    res = run_suite(suite, tiers, device=dev, timing=timing)
    path = out or results_dir() / f"bench-{suite}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    env = {**provenance("torchnitro bench run", device=dev), **timing_environment(), "device": dev}
    write_results(path, res.timings, env, skipped=res.skipped)
    con = Console(soft_wrap=True)
    for name, t in res.timings.items():
        con.print(f"{name}: {t}", highlight=False)
    for name, why in res.skipped.items():
        con.print(f"{name}: skipped: {why}", highlight=False)
    con.print(f"results: {path}", highlight=False)


def load_history(directory: Path) -> tuple[list[str], dict[str, list[float | None]]]:
    """Result files of ``directory`` in name order -> (run labels, case -> per-run median or None)."""
    import statistics

    from torchnitro.bench.results import read_results

    if not directory.is_dir():
        raise InputError(f"{directory}: not a directory; expected a folder of torchnitro bench result files")
    files = sorted(directory.glob("*.json"))
    if len(files) < 2:
        raise InputError(f"{directory}: {len(files)} result file(s); expected at least 2 runs (*.json, named so "
                         "that they sort in time order, e.g. 2026-11-26T10-00_<commit>.json)")
    runs = [read_results(f) for f in files]
    names = sorted({c for r in runs for c in r.cases})
    series = {c: [statistics.median(r.cases[c]) if c in r.cases else None for r in runs] for c in names}
    return [f.stem for f in files], series


@bench_app.command("history")
def history_command(
    directory: Path = typer.Argument(..., help="folder of result files, one per run, names sorting in time order"),
    threshold: float = typer.Option(0.05, "--threshold", help="smallest relative step that counts (0.05 = 5%)"),
    alpha: float = typer.Option(0.01, "--alpha", help="significance of each step's permutation test"),
    plot: bool = typer.Option(False, "--plot", help="write history.png (medians per run, steps marked)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="where the plot goes (default: DIRECTORY)"),
) -> None:
    """Step changes in each case's median over a series of runs."""
    from rich.console import Console

    from torchnitro.bench.regress import detect_steps

    labels, series = load_history(directory)
    con = Console(soft_wrap=True)
    found = {}
    for case, vals in series.items():
        idx = [i for i, v in enumerate(vals) if v is not None]
        if len(idx) < 5:
            con.print(f"{case}: {len(idx)} runs, too few for step detection (need 5)", highlight=False)
            continue
        steps = detect_steps([vals[i] for i in idx], threshold=threshold, alpha=alpha)
        found[case] = [(idx[s.index], s) for s in steps]
        if not steps:
            con.print(f"{case}: no step over {len(idx)} runs", highlight=False)
        for i, s in found[case]:
            kind = "slower" if s.ratio > 1 else "faster"
            con.print(f"{case}: step at run {i} ({labels[i]}): {s.before * 1e3:.4f} -> {s.after * 1e3:.4f} ms "
                      f"({s.ratio - 1:+.1%}, {kind}, p={s.p_value:.3f})", highlight=False)
    if plot:
        path = _plot(labels, series, found, (out or directory) / "history.png")
        con.print(f"plot: {path}", highlight=False)


def _plot(labels: list[str], series: dict[str, list[float | None]], found: dict, path: Path) -> Path:
    from torchnitro.bench.report import save_plot

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for case, vals in series.items():
        xs = [i for i, v in enumerate(vals) if v is not None]
        line, = ax.plot(xs, [vals[i] * 1e3 for i in xs], marker="o", ms=3, label=case)  # type: ignore[operator]
        for i, _ in found.get(case, []):
            ax.axvline(i - 0.5, color=line.get_color(), ls="--", alpha=0.7)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("median ms per call")
    ax.set_title("benchmark history (dashed: detected steps)")
    ax.legend(fontsize=7)
    return save_plot(fig, path.stem, path.parent)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")
