"""``torchnitro xla plan``: compile-time memory per device of the JAX LM's train step, as a table.

Every (batch, remat) cell is one AOT compile for the target (host devices, or a TPU topology via
libtpu on this CPU) plus the analytic estimate beside it; ``--no-compile`` shows the estimate only
(milliseconds instead of seconds per cell). jax is imported only when the command runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from torchnitro.errors import ConfigError

__all__ = ["register", "MODEL_PRESETS"]

# --model name -> LMConfig fields; --vocab/--dim/--layers/--heads override them
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(vocab_size=512, dim=128, n_layers=2, n_heads=4),
    "lm": dict(vocab_size=8192, dim=512, n_layers=4, n_heads=8),
    "lm-1b": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16),
}

xla_app = typer.Typer(help="The TPU path on JAX/XLA: compile-time planning without a TPU.", no_args_is_help=True)


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"--{what} {text!r}: expected comma-separated integers such as 8,16,32") from None
    if not vals or min(vals) < 1:
        raise ConfigError(f"--{what} {text!r}: expected positive integers such as 8,16,32")
    return vals


def _start_jax(host_devices: int) -> None:
    """Host devices and libtpu settings must be in the environment before the first JAX backend starts."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # a TPU target is compiled AOT; no TPU runtime is wanted
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from torchnitro.xla.options import XlaOptions

    xb = sys.modules.get("jax._src.xla_bridge")
    if xb is None or not xb.backends_are_initialized():
        XlaOptions(host_device_count=host_devices).apply()


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


@xla_app.command("plan")
def plan(model: str = typer.Option("lm", help=f"model preset: {', '.join(MODEL_PRESETS)}"),
         target: str = typer.Option("host", help="'host' or a TPU target such as v5e:2x2, v5p:2x2x2"),
         batch: str = typer.Option("8,16,32", help="global batch sizes, comma-separated"),
         remat: str = typer.Option("none,dots_saveable,full", help="remat policies, comma-separated"),
         seq: int = typer.Option(512, help="tokens per sequence"),
         mesh: str = typer.Option("1x-1x1", help="data x fsdp x tensor sizes; -1 infers one"),
         rules: str = typer.Option("fsdp", help="data_parallel, fsdp, tensor_parallel or fsdp_tp"),
         attention: str = typer.Option("plain", help="plain, blockwise or flash"),
         vocab: Optional[int] = typer.Option(None, help="override the preset's vocabulary"),
         dim: Optional[int] = typer.Option(None, help="override the preset's width"),
         layers: Optional[int] = typer.Option(None, help="override the preset's layer count"),
         heads: Optional[int] = typer.Option(None, help="override the preset's head count"),
         compile: bool = typer.Option(True, "--compile/--no-compile", help="AOT-compile each cell (else estimate)"),
         host_devices: int = typer.Option(8, help="host CPU devices for target=host"),
         json_out: Optional[str] = typer.Option(None, "--json", help="also write the rows to this JSON file")) -> None:
    """Memory per device of the LM train step for each batch x remat policy, compiled and estimated."""
    if model not in MODEL_PRESETS:
        raise ConfigError(f"--model {model!r} is not a preset; known: {', '.join(MODEL_PRESETS)}")
    batches = _ints(batch, "batch")
    policies = [r.strip() for r in remat.split(",") if r.strip()]
    _start_jax(host_devices)
    from torchnitro.xla.memory import plan_lm_cell
    from torchnitro.xla.model import LMConfig

    sizes = {**MODEL_PRESETS[model], **{k: v for k, v in dict(vocab_size=vocab, dim=dim, n_layers=layers,
                                                               n_heads=heads).items() if v is not None}}
    cfg = LMConfig(max_seq_len=seq, attention=attention, **sizes)
    t = Table(title=f"{model} ({cfg.n_layers}x{cfg.dim}, vocab {cfg.vocab_size}) on {target}, mesh {mesh} {rules}, "
                    f"seq {seq}: MiB per device")
    for col in ("remat", "batch", "args", "temp", "peak", "estimate", "error", "HBM", "fits"):
        t.add_column(col, justify="left" if col == "remat" else "right")
    rows: list[dict[str, Any]] = []
    con = Console()
    with con.status("compiling") as status:
        for pol in policies:
            for b in batches:
                status.update(f"{'compiling' if compile else 'estimating'} remat={pol} batch={b}")
                row = plan_lm_cell(cfg, b, seq, mesh=mesh, rules=rules, remat=pol, target=target, compile=compile)
                rows.append(row)
                err = row.get("error")
                fits = row.get("fits")
                t.add_row(pol, str(b), _mib(row.get("argument")), _mib(row.get("temp")), _mib(row.get("peak")),
                          _mib(row["est_peak"]), "-" if err is None else f"{100 * err:+.0f}%", _mib(row["hbm"]),
                          "-" if fits is None else ("yes" if fits else "[red]no[/red]"))
    con.print(t)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(dict(model=dataclasses.asdict(cfg), target=target, mesh=mesh, rules=rules, rows=rows), f,
                      indent=1)


def register(app: typer.Typer) -> None:
    app.add_typer(xla_app, name="xla")
