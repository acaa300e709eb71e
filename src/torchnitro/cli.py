"""``torchnitro <verb>``: the command line.

Each subsystem adds its verbs through a ``register(app)`` function in its own ``cli`` module
(``torchnitro.autotune.cli``: optimize, analyze; ``torchnitro.serve.cli``: serve, loadtest;
``torchnitro.memory.cli``: memory ...). This module owns the app, ``doctor``, and error handling:
a ``NitroError`` prints as one paragraph and exits 2, with no traceback unless ``--debug``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from torchnitro.errors import NitroError

__all__ = ["app", "main"]

app = typer.Typer(
    name="torchnitro",
    help="Make PyTorch workloads fast, and prove it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}

_SUBSYSTEM_CLIS = ("torchnitro.autotune.cli", "torchnitro.serve.cli", "torchnitro.memory.cli",
                   "torchnitro.kernels.cli", "torchnitro.hrr.cli", "torchnitro.profile.cli",
                   "torchnitro.bench.cli", "torchnitro.distributed.cli", "torchnitro.xla.cli")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    _state["debug"] = debug


@app.command()
def doctor() -> None:
    """Print this machine's hardware, library versions, and which recipes can run here."""
    from torchnitro.hardware import hardware_info

    hw = hardware_info()
    con = Console()
    t = Table(title="hardware")
    t.add_column("item")
    t.add_column("value")
    t.add_row("cpu", hw.cpu_name)
    t.add_row("cores (usable)", str(hw.cpu_cores))
    t.add_row("torch threads", str(hw.torch_threads))
    t.add_row("cpu flags", " ".join(hw.cpu_flags) or "-")
    t.add_row("native bf16 on cpu", "yes" if hw.cpu_bf16 else "no")
    t.add_row("int8 dot-product (VNNI/AMX)", "yes" if hw.cpu_vnni else "no")
    from torchnitro.kernels.cpu_attention import cpu_attention_reason, kernel_name

    why = cpu_attention_reason()  # builds the kernel on first use (~1-2 s), then cached on disk
    t.add_row("native cpu attention", kernel_name("bf16") if why is None else f"no: {why}")
    t.add_row("gpu", f"{hw.gpu_name} (sm_{hw.gpu_capability[0]}{hw.gpu_capability[1]})" if hw.gpu_name else "none")
    con.print(t)
    lt = Table(title="libraries")
    lt.add_column("library")
    lt.add_column("version")
    for name, ver in hw.libraries.items():
        lt.add_row(name, ver or "[dim]not installed[/dim]")
    con.print(lt)
    from torchnitro.kernels.attention_policy import policy_summary

    con.print(policy_summary())
    try:
        from torchnitro.autotune.recipe import all_recipes
    except ImportError:
        return
    rt = Table(title="recipes on this machine")
    rt.add_column("recipe")
    rt.add_column("class")
    rt.add_column("available")
    for r in all_recipes():
        why = r.unavailable_reason(hw)
        cls = r.numeric_class.value + ("" if r.default else " (opt-in: name it)")
        rt.add_row(r.name, cls, "yes" if why is None else f"no: {why}")
    from torchnitro.autotune.recipes import BROKEN

    for module, why in BROKEN.items():
        rt.add_row(f"[red]{module}[/red] (module)", "-", f"no: failed to import: {why}")
    con.print(rt)


def _register_subsystems() -> None:
    for modname in _SUBSYSTEM_CLIS:
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:  # that subsystem has no CLI (yet); a broken import elsewhere still raises
                continue
            raise
        mod.register(app)


_register_subsystems()


def _fail(msg: str, code: int) -> int:
    Console(stderr=True).print(f"[bold red]error:[/bold red] {msg}", highlight=False, soft_wrap=True)
    return code


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point. Returns the exit code (0 ok, 1 unexpected error, 2 bad input or config)."""
    args = list(sys.argv[1:] if argv is None else argv)
    _state["debug"] = "--debug" in args
    try:
        rc = app(args=args, prog_name="torchnitro", standalone_mode=False)
        return rc if isinstance(rc, int) else 0  # typer.Exit(code) comes back as its code (bench compare: 1)
    except NitroError as exc:
        if _state["debug"]:
            raise
        return _fail(f"{exc}\n(rerun with --debug for the traceback)", 2)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except Exception as exc:  # noqa: BLE001 - last resort: one paragraph, not a traceback
        # typer ships its own copy of click, so match click's exceptions by shape, not class
        kind = type(exc).__name__
        if kind == "Exit":
            return int(getattr(exc, "exit_code", 0))
        if kind == "Abort":
            return _fail("aborted", 130)
        if hasattr(exc, "show") and hasattr(exc, "exit_code"):
            exc.show()
            return int(exc.exit_code)
        if _state["debug"]:
            raise
        return _fail(f"unexpected {type(exc).__name__}: {exc}\n(rerun with --debug for the traceback)", 1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
