"""``torchnitro profile``: a step profile of a model from the command line (registered in ``torchnitro.cli``).

``--model`` takes what ``torchnitro optimize`` takes (a built-in name, ``module:function``,
``file.py:function``, ``hf:/path``) or an artifact directory written by ``optimize``, whose saved
input signature sizes the example inputs (dynamic dims from ``--batch``/``--seq``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from torchnitro.errors import InputError

__all__ = ["register", "profile_command", "artifact_step", "trace_command"]

_MODEL_HELP = ("built-in name (encoder, lm, cnn, mlp, minilm), 'module:function', 'file.py:function', 'hf:/path' "
               "or an artifact directory from torchnitro optimize")


def _dtype(name: str) -> Any:
    import torch

    dt = getattr(torch, str(name).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise InputError(f"artifact input dtype {name!r} is not a torch dtype; expected e.g. 'float32' or 'int64'")
    return dt


def artifact_step(directory: Path, batch: int | None, seq: int | None) -> tuple[Callable[[], Any], str]:
    """A step calling a saved artifact on inputs built from its signature; returns (step, description)."""
    import torch

    from torchnitro.autotune.api import load

    opt = load(directory)
    inputs = []
    for spec in opt.signature.get("inputs", []):
        shape = [d if d != -1 else (batch or 1) if k == 0 else (seq or 128) for k, d in enumerate(spec["shape"])]
        dt = _dtype(spec["dtype"])
        # integer inputs are token ids, masks or indices: ones are valid for all three
        inputs.append(torch.randn(shape).to(dt) if dt.is_floating_point else torch.ones(shape, dtype=dt))
    if not inputs:
        raise InputError(f"artifact {directory}: its manifest lists no inputs; expected a signature with 'inputs'")
    return (lambda: opt(*inputs)), f"artifact {directory} ({opt.recipe})"


def profile_command(
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP + " (default: encoder)"),
    input: List[str] = typer.Option([], "--input", "-i", help="input spec per model input, e.g. 32x128:int64"),
    text: List[str] = typer.Option([], "--text", help="sentence(s) for hf:/path models"),
    batch: Optional[int] = typer.Option(None, "--batch", "-b", help="batch size of the example inputs"),
    seq: Optional[int] = typer.Option(None, "--seq", "-s", help="sequence length of the example inputs"),
    train: bool = typer.Option(False, "--train", help="profile forward + backward + an SGD update, not a forward"),
    warmup: int = typer.Option(3, "--warmup", help="steps recorded and thrown away before the measured ones"),
    steps: int = typer.Option(5, "--steps", help="recorded steps (numbers are per step)"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="write report.html, trace.json, profile.json, PNGs"),
    no_peak: bool = typer.Option(False, "--no-peak", help="do not time the GEMM peak around the steps (no MFU; "
                                 "saves about 1 s on CPU)"),
    as_json: bool = typer.Option(False, "--json", help="print profile.json instead of the summary"),
    trace: List[Path] = typer.Option([], "--trace", help="analyse existing Chrome trace(s) from torch.profiler "
                                     "(one per rank) instead of profiling a model"),
) -> None:
    """Where one step's time, FLOPs, memory and energy go: by category, top ops, MFU, findings."""
    from rich.console import Console

    from torchnitro.profile.profiler import ProfileConfig, profile

    if trace:
        if model is not None or out is not None:
            raise InputError(f"--trace with --model/--out: received both; expected either traces to analyse or "
                             "a model to profile")
        trace_command(list(trace), as_json)
        return
    if batch is not None and batch < 1 or seq is not None and seq < 1:
        raise InputError(f"--batch {batch} --seq {seq}: expected positive integers")
    cfg = ProfileConfig(warmup=warmup, steps=steps, measure_peak=not no_peak)
    if model is not None and Path(model).is_dir():  # an artifact (load() says so when it is not one)
        if train:
            raise InputError(f"--train with artifact {model!r}: an optimized artifact is inference-only; expected a "
                             "model spec (built-in, module:function, hf:/path) to profile a training step")
        step, what = artifact_step(Path(model), batch, seq)
        prof = profile(step, config=cfg)
    else:
        from torchnitro.autotune.inputs import model_and_inputs

        m, inputs, info = model_and_inputs(model, input, text=list(text) or None, batch=batch, seq=seq)
        what = info.name
        prof = profile(m.train() if train else m, inputs, cfg, train=train)
    con = Console(soft_wrap=True)
    if as_json:
        con.print_json(prof.to_json())
    else:
        con.print(f"[bold]{what}[/bold]{' (train step)' if train else ''}", highlight=False)
        con.print(prof.summary(), markup=False, highlight=False)
    if out is not None:
        path = prof.save(out)
        Console(stderr=as_json).print(f"report: {path} (trace: {out / 'trace.json'})", highlight=False)


def trace_command(paths: list[Path], as_json: bool) -> None:
    """Print the trace analysis of each file (``--trace``), or all of them as one JSON list."""
    import json

    from rich.console import Console

    from torchnitro.profile.trace import analyze_trace, trace_lines

    found = [(p, analyze_trace(p)) for p in paths]
    con = Console(soft_wrap=True)
    if as_json:
        con.print_json(json.dumps([{"trace": str(p), **a.to_dict()} for p, a in found], default=str))
        return
    for p, a in found:
        con.print(f"[bold]{p}[/bold]", highlight=False)
        con.print("\n".join(trace_lines(a)), markup=False, highlight=False)


def register(app: typer.Typer) -> None:
    app.command("profile")(profile_command)
