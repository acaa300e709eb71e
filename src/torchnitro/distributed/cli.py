"""``torchnitro launch`` (a command on N ranks under torchrun, see ``launch.py``) and ``torchnitro train``
(the byte-level LM loop of ``train.py`` on N ranks).

``train --config train.yaml`` reads a versioned file; flags given on the command line override it::

    version: 1
    train: {data: corpus/, steps: 200, seq: 128, batch: 8, ckpt: ./ckpt}
    parallel: {dp_shard: 2}
    nproc: 2
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any, List, Optional

import typer

from torchnitro.errors import ConfigError

__all__ = ["register", "train_configs", "launch_command", "train_command"]

_TRAIN_FLAGS = ("data", "steps", "seq", "batch", "grad_accum", "lr", "ckpt", "ckpt_every", "log_every", "dim",
                "n_layers", "n_heads")
_PARALLEL_FLAGS = ("dp_replicate", "dp_shard", "tp", "mixed_precision", "checkpointing")


def train_configs(config: Optional[str], flags: dict[str, Any]) -> tuple[Any, Any, int]:
    """(TrainConfig, ParallelConfig, nproc) from an optional YAML file and the flags that were given."""
    from torchnitro.config import from_dict, load_yaml
    from torchnitro.distributed.config import ParallelConfig
    from torchnitro.distributed.train import TrainConfig

    data = load_yaml(config) if config else {}
    unknown = sorted(set(data) - {"version", "train", "parallel", "nproc"})
    if unknown:
        raise ConfigError(f"config file {config!r}: unknown top-level key(s) {unknown}; expected train, parallel, nproc.")
    given = {k: v for k, v in flags.items() if v is not None}
    train = {**(data.get("train") or {}), **{k: given[k] for k in _TRAIN_FLAGS if k in given}}
    par = {**(data.get("parallel") or {}), **{k: given[k] for k in _PARALLEL_FLAGS if k in given}}
    nproc = given.get("nproc", data.get("nproc"))
    pcfg = from_dict(ParallelConfig, par, where="parallel")
    if nproc is None:
        nproc = pcfg.world_size
    return from_dict(TrainConfig, train, where="train"), pcfg, int(nproc)


def launch_command(
    command: List[str] = typer.Argument(..., help="the command after `--`, e.g. python train.py --steps 10"),
    nproc: int = typer.Option(1, "--nproc", help="worker processes on this node"),
    nnodes: str = typer.Option("1", "--nnodes", help="nodes, or MIN:MAX (elastic)"),
    max_restarts: int = typer.Option(0, "--max-restarts", help="restarts of the whole job after a failure"),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                help="HOST:PORT shared by all nodes (default: a local free port)"),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="job id shared by all nodes"),
    log_dir: Optional[str] = typer.Option(None, "--log-dir", help="per-rank logs (default: this terminal)"),
) -> None:
    """Run a command on N ranks under torchrun (c10d rendezvous, fresh port, short timeouts)."""
    from torchnitro.distributed.launch import LaunchConfig
    from torchnitro.distributed.launch import launch as run

    cfg = LaunchConfig(nproc=nproc, nnodes=nnodes, max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint,
                       rdzv_id=rdzv_id, log_dir=log_dir)
    code = run(cfg, list(command))
    if code:
        raise typer.Exit(code)


def train_command(
    model: str = typer.Option("lm", "--model", help="the model to train: lm (byte-level TransformerLM)"),
    config: Optional[str] = typer.Option(None, "--config", help="versioned YAML: train, parallel, nproc"),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="processes (default: the product of the degrees)"),
    data: Optional[str] = typer.Option(None, "--data", help="directory of text (default: Python's stdlib)"),
    steps: Optional[int] = typer.Option(None, "--steps"),
    seq: Optional[int] = typer.Option(None, "--seq"),
    batch: Optional[int] = typer.Option(None, "--batch", help="global micro-batch"),
    grad_accum: Optional[int] = typer.Option(None, "--grad-accum"),
    lr: Optional[float] = typer.Option(None, "--lr"),
    ckpt: Optional[str] = typer.Option(None, "--ckpt", help="checkpoint directory; resumes from its latest"),
    ckpt_every: Optional[int] = typer.Option(None, "--ckpt-every"),
    log_every: Optional[int] = typer.Option(None, "--log-every"),
    dim: Optional[int] = typer.Option(None, "--dim"),
    n_layers: Optional[int] = typer.Option(None, "--layers"),
    n_heads: Optional[int] = typer.Option(None, "--heads"),
    dp_replicate: Optional[int] = typer.Option(None, "--dp-replicate"),
    dp_shard: Optional[int] = typer.Option(None, "--dp-shard"),
    tp: Optional[int] = typer.Option(None, "--tp"),
    mixed_precision: Optional[str] = typer.Option(None, "--mixed-precision", help="fp32, bf16, fp16"),
    checkpointing: Optional[str] = typer.Option(None, "--checkpointing", help="none, blocks, selective"),
    max_restarts: int = typer.Option(0, "--max-restarts", help="torchrun restarts; each resumes from --ckpt"),
) -> None:
    """Train the byte-level LM on N ranks (launches torchrun itself), resuming from --ckpt."""
    from torchnitro.distributed.launch import LaunchConfig
    from torchnitro.distributed.launch import launch as run
    from torchnitro.distributed.train import main as train_main

    if model != "lm":
        raise ConfigError(f"train --model: received {model!r}, expected 'lm' (the only model so far).")
    flags = dict(locals())
    tcfg, pcfg, n = train_configs(config, flags)
    pcfg.check_world(n)
    args = ["--train", json.dumps(asdict(tcfg)), "--parallel", json.dumps(asdict(pcfg))]
    if n == 1 and max_restarts == 0:
        train_main(args)
        return
    code = run(LaunchConfig(nproc=n, max_restarts=max_restarts),
               [sys.executable, "-m", "torchnitro.distributed.train", *args])
    if code:
        raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(launch_command)
    app.command("train")(train_command)
