"""``torchnitro memory plan`` and ``torchnitro memory find-batch``.

Both read a versioned YAML config with a ``model`` section (``TransformerConfig`` fields) and a
``memory`` section (``MemoryConfig`` fields); command-line flags override the file::

    version: 1
    model: {dim: 512, n_layers: 8, n_heads: 8, vocab_size: 32000, max_seq_len: 2048}
    memory: {batch: 8, seq: 2048, dtype: bf16, optimizer: adamw, checkpointing: blocks}
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from torchnitro.config import from_dict, load_yaml
from torchnitro.errors import ConfigError, InputError

__all__ = ["MemoryConfig", "register", "parse_bytes", "memory_app"]

memory_app = typer.Typer(help="Plan memory, find batch sizes.", no_args_is_help=True)


@dataclass
class MemoryConfig:
    batch: int = 8  # micro-batch size to plan for
    seq: int = 512  # sequence length
    dtype: str = "fp32"  # model dtype: fp32, bf16, fp16
    amp: Optional[str] = None  # autocast dtype over fp32 params (bf16/fp16), as TrainStep runs; None: off
    optimizer: str = "adamw"  # adamw, adam, sgd_momentum, sgd, none
    checkpointing: str = "none"  # none, blocks, every_<n>, selective
    attention: str = "auto"  # SDPA backend: auto (what PyTorch would run here), flash, efficient, cudnn, math
    foreach: bool = False  # optimizer multi-tensor path (CUDA default)
    budget: str = "1GiB"  # find-batch: memory budget, e.g. 512MiB, 8GB, or bytes
    mode: str = "binsearch"  # find-batch: power, binsearch, throughput
    margin: float = 0.05  # find-batch: relative precision of the answer
    max_val: int = 1024  # find-batch: largest batch to try


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """'512MiB' / '8GB' / '1.5GiB' / 123 -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"memory size: received {text!r}, expected a number with an optional unit such as "
                         "512MiB, 8GB or 1073741824")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _load(config: Optional[str], overrides: dict[str, Any]) -> tuple[Any, MemoryConfig]:
    from torchnitro.nn.models import TransformerConfig

    data = load_yaml(config) if config else {}
    try:
        model_cfg = TransformerConfig(**(data.get("model") or {}))
    except TypeError as exc:
        raise ConfigError(f"{config}: model section: {exc}; expected TransformerConfig fields") from exc
    mem = from_dict(MemoryConfig, data.get("memory") or {}, where=f"{config}:memory" if config else "memory")
    mem = replace(mem, **{k: v for k, v in overrides.items() if v is not None})
    return model_cfg, mem


def _policy(mem: MemoryConfig) -> Any:
    return mem.checkpointing


@memory_app.command("plan")
def plan_command(
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML with model and memory sections."),
    batch: Optional[int] = typer.Option(None, help="Batch size."),
    seq: Optional[int] = typer.Option(None, help="Sequence length."),
    dtype: Optional[str] = typer.Option(None, help="fp32, bf16 or fp16."),
    checkpointing: Optional[str] = typer.Option(None, help="none, blocks, every_<n>, selective."),
    optimizer: Optional[str] = typer.Option(None, help="adamw, adam, sgd_momentum, sgd, none."),
    amp: Optional[str] = typer.Option(None, help="Autocast dtype over fp32 params: bf16 or fp16."),
) -> None:
    """Estimate a training step's memory for a TransformerLM config, term by term."""
    from torchnitro.memory.planner import plan

    model_cfg, mem = _load(config, dict(batch=batch, seq=seq, dtype=dtype, checkpointing=checkpointing,
                                        optimizer=optimizer, amp=amp))
    p = plan(model_cfg, batch=mem.batch, seq=mem.seq, dtype=mem.dtype, optimizer=mem.optimizer,
             checkpointing=_policy(mem), attention=mem.attention, foreach=mem.foreach, amp=mem.amp)
    t = Table(title=f"memory plan: batch {mem.batch}, seq {mem.seq}, {mem.dtype}"
                    f"{' + autocast ' + mem.amp if mem.amp else ''}, {mem.optimizer}, "
                    f"checkpointing {mem.checkpointing}")
    t.add_column("term")
    t.add_column("MiB", justify="right")
    t.add_column("formula")
    for term in p.terms:
        t.add_row(term.name, f"{term.bytes / 2**20:.2f}", term.formula)
    for ph, b in p.phases.items():
        t.add_row(f"peak {ph}", f"{b / 2**20:.2f}", "")
    t.add_row("[bold]peak[/bold]", f"[bold]{p.peak_bytes / 2**20:.2f}[/bold]", p.peak_phase)
    Console().print(t)


@memory_app.command("find-batch")
def find_batch_command(
    config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML with model and memory sections."),
    budget: Optional[str] = typer.Option(None, help="Memory budget, e.g. 512MiB or 8GB."),
    seq: Optional[int] = typer.Option(None, help="Sequence length."),
    mode: Optional[str] = typer.Option(None, help="power, binsearch or throughput."),
    margin: Optional[float] = typer.Option(None, help="Relative precision, e.g. 0.05."),
    max_val: Optional[int] = typer.Option(None, "--max-val", help="Largest batch to try."),
    checkpointing: Optional[str] = typer.Option(None, help="none, blocks, every_<n>, selective."),
) -> None:
    """Find the largest batch of a TransformerLM training step that fits the budget, by real trials."""
    import torch
    import torch.nn.functional as F

    from torchnitro.memory.checkpointing import checkpoint_
    from torchnitro.memory.finder import FinderConfig, find_batch_size
    from torchnitro.memory.planner import parse_dtype, plan
    from torchnitro.nn.models import TransformerLM

    model_cfg, mem = _load(config, dict(budget=budget, seq=seq, mode=mode, margin=margin, max_val=max_val,
                                        checkpointing=checkpointing))
    nbytes = parse_bytes(mem.budget)
    e = parse_dtype(mem.dtype)
    dt = {4: torch.float32, 2: torch.bfloat16 if "bf" in mem.dtype else torch.float16}[e]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = TransformerLM(model_cfg).to(device=dev, dtype=dt)
    checkpoint_(model, _policy(mem))
    opt = torch.optim.AdamW(model.parameters(), foreach=dev == "cuda")
    V, T = model_cfg.vocab_size, mem.seq

    def step(b: int) -> None:
        x = torch.randint(0, V, (b, T), device=dev)
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def estimate(b: int) -> int:
        return plan(model_cfg, batch=b, seq=T, dtype=mem.dtype, optimizer=mem.optimizer,
                    checkpointing=_policy(mem), attention=mem.attention, foreach=dev == "cuda").peak_bytes

    search = FinderConfig(budget_bytes=nbytes, mode=mem.mode, margin=mem.margin, max_val=mem.max_val)
    r = find_batch_size(step, search, estimate=estimate, model=model, optimizer=opt)
    t = Table(title=f"find-batch: budget {nbytes / 2**20:.0f} MiB, seq {T}, {mem.mode}, start {r.start}")
    for c in ("batch", "fits", "peak MiB", "planned MiB", "seconds", "reason"):
        t.add_column(c)
    for tr in r.trials:
        t.add_row(str(tr.batch_size), "yes" if tr.fits else "no",
                  "-" if tr.peak_bytes is None else f"{tr.peak_bytes / 2**20:.1f}",
                  f"{estimate(tr.batch_size) / 2**20:.1f}", f"{tr.seconds:.2f}", tr.reason)
    con = Console()
    con.print(t)
    for b, ips in r.throughput.items():
        con.print(f"throughput at batch {b}: {ips:.1f} sequences/s")
    con.print(f"[bold]batch size: {r.batch_size}[/bold] ({r.n_trials} trials)")


def register(app: typer.Typer) -> None:
    """Add the ``memory`` command group to the torchnitro CLI."""
    app.add_typer(memory_app, name="memory")
