"""``torchnitro optimize``, ``analyze`` and ``inspect`` (registered on the app in ``torchnitro.cli``)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

from torchnitro.errors import ConfigError, InputError

__all__ = ["register", "optimize_command", "analyze_command", "inspect_command"]

_MODEL_HELP = "built-in name (encoder, lm, cnn, mlp, minilm), 'module:function', 'file.py:function' or 'hf:/path'"


def _config(path: Optional[Path], overrides: dict[str, Any]):
    from torchnitro.autotune.config import OptimizeConfig
    from torchnitro.config import load_section

    cfg = load_section(path, "optimize", OptimizeConfig) if path is not None else OptimizeConfig()
    changes = {k: v for k, v in overrides.items() if v is not None and v != []}
    try:
        return dataclasses.replace(cfg, **changes)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"options {sorted(changes)}: {exc}") from exc


def _parse_shape(text: str) -> list[int]:
    try:
        dims = [int(d) for d in text.lower().split("x")]
    except ValueError:
        dims = []
    if not dims or len(dims) > 2 or any(d < 1 for d in dims):
        raise InputError(f"--shape {text!r}: expected BATCH or BATCHxSEQ with positive integers, e.g. '1x16' or '32'")
    return dims


def optimize_command(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP + " (default: encoder)"),
    input: List[str] = typer.Option([], "--input", "-i", help="input spec per model input, e.g. 32x128:int64"),
    text: List[str] = typer.Option([], "--text", help="sentence(s) for hf:/path models"),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help="batch size of the example inputs"),
    seq: Optional[int] = typer.Option(None, "--seq", "-s", help="sequence length of the example inputs"),
    out: Path = typer.Option(Path("torchnitro-opt"), "--out", "-o", help="artifact directory to write"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="versioned YAML with an 'optimize:' section"),
    budget: Optional[float] = typer.Option(None, "--budget", help="total search budget in seconds"),
    recipe: List[str] = typer.Option([], "--recipe", "-r", help="only these recipes (repeatable)"),
    exclude: List[str] = typer.Option([], "--exclude", "-x", help="never these recipes (repeatable)"),
    objective: Optional[str] = typer.Option(None, "--objective", help="latency or throughput"),
    percentile: Optional[str] = typer.Option(None, "--percentile", help="p50 or p99 (latency objective)"),
    shape: List[str] = typer.Option([], "--shape", help="extra dynamic size to verify and time, BATCH or BATCHxSEQ "
                                    "(repeatable), e.g. --shape 1x16 --shape 32x128"),
    no_cache: bool = typer.Option(False, "--no-cache", help="ignore and do not write the on-disk cache"),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON instead of a table"),
) -> None:
    """Find the fastest verified variant of a model on this machine, print the report, save the artifact."""
    from rich.console import Console

    from torchnitro.autotune.api import optimize
    from torchnitro.autotune.inputs import model_and_inputs

    if batch is not None and batch < 1 or seq is not None and seq < 1:
        raise InputError(f"--batch {batch} --seq {seq}: expected positive integers")
    cfg = _config(config, {"budget_s": budget, "recipes": list(recipe) or None, "exclude": list(exclude),
                           "objective": objective, "percentile": percentile, "cache": False if no_cache else None,
                           "shapes": [_parse_shape(s) for s in shape]})
    from torchnitro.autotune.workload import select_recipes

    select_recipes(cfg)  # unknown recipe names fail before any work
    m, inputs, info = model_and_inputs(model, input, text=list(text) or None, batch=batch, seq=seq)
    opt = optimize(m, inputs, cfg, info=info)
    path = opt.save(out)
    con = Console(width=None if sys.stdout.isatty() else 200)
    if as_json:
        con.print_json(opt.report.to_json())
    else:
        con.print(opt.report.rich())
        con.print(f"chosen: [bold]{opt.recipe}[/bold]; artifact written to {path} (load with torchnitro.load)")


def analyze_command(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP + " (default: encoder)"),
    input: List[str] = typer.Option([], "--input", "-i", help="input spec per model input, e.g. 32x128:int64"),
    text: List[str] = typer.Option([], "--text", help="sentence(s) for hf:/path models"),
    batch: Optional[int] = typer.Option(None, "--batch", "-b"),
    seq: Optional[int] = typer.Option(None, "--seq", "-s"),
    markdown: bool = typer.Option(False, "--markdown", help="print Markdown instead of a table"),
    as_json: bool = typer.Option(False, "--json", help="print JSON instead of a table"),
) -> None:
    """Parameters, FLOPs, this machine's roofline and findings (alignment, attention, fusable pairs)."""
    import json

    from rich.console import Console

    from torchnitro.autotune.inputs import model_and_inputs

    if importlib.util.find_spec("torchnitro.autotune.analyze") is None:
        raise InputError("torchnitro analyze is not available in this installation (torchnitro.autotune.analyze is "
                         "missing); expected it in the package, reinstall torchnitro")
    from torchnitro.autotune.analyze import analyze

    m, inputs, _ = model_and_inputs(model, input, text=list(text) or None, batch=batch, seq=seq)
    result = analyze(m, inputs)
    con = Console()
    if as_json:
        con.print_json(json.dumps(result.to_dict(), default=str))
    elif markdown:
        con.print(result.to_markdown(), markup=False, highlight=False)
    else:
        con.print(result.rich())


def inspect_command(
    directory: Path = typer.Argument(..., help="artifact directory written by torchnitro optimize"),
) -> None:
    """Check an artifact's checksums and print its recipe, signature and report (loads nothing)."""
    import json

    from rich.console import Console

    from torchnitro.autotune.artifact import read_manifest
    from torchnitro.autotune.report import Report

    manifest = read_manifest(directory)
    con = Console()
    con.print(f"[bold]{directory}[/bold]: recipe {manifest['recipe']} ({manifest['numeric_class']}), "
              f"{'standalone' if manifest['standalone'] else 'state dict + ' + str(manifest['model'].get('spec'))}, "
              f"{len(manifest['files'])} files verified")
    con.print_json(json.dumps(manifest["signature"]))
    con.print(Report.from_dict(json.loads((Path(directory) / "report.json").read_text())).rich())


def register(app: typer.Typer) -> None:
    app.command("optimize")(optimize_command)
    app.command("analyze")(analyze_command)
    app.command("inspect")(inspect_command)
