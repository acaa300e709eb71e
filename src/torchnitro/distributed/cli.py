"""``torchnitro launch`` (a command on N ranks under torchrun, see ``launch.py``) and ``torchnitro train``
(the byte-level LM loop of ``train.py`` on N ranks).

``train --config train.yaml`` reads a versioned file; flags given on the command line override it::

    version: 1
    train: {data: corpus/, steps: 200, seq: 128, batch: 8, ckpt: ./ckpt}
    parallel: {dp_shard: 2}
    nproc: 2

Pipelines take the same keys as ``ParallelConfig``: ``parallel: {pp: 2, dp_replicate: 2, pp_schedule: 1f1b,
microbatches: 4}`` (or ``--pp 2 --dp-replicate 2 --pp-schedule 1f1b --microbatches 4``) runs 2 stages on 2
replicas each; the per-rank batch must divide by the micro-batches.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any, List, Optional

import typer

from torchnitro.errors import ConfigError

__all__ = ["register", "train_configs", "launch_command", "train_command", "plan_command", "parse_quantity"]

_TRAIN_FLAGS = ("data", "steps", "seq", "batch", "grad_accum", "lr", "ckpt", "ckpt_every", "log_every", "dim",
                "n_layers", "n_heads")
_PARALLEL_FLAGS = ("dp_replicate", "dp_shard", "tp", "pp", "pp_schedule", "microbatches", "stages_per_rank",
                   "mixed_precision", "checkpointing")


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
    pp: Optional[int] = typer.Option(None, "--pp", help="pipeline ranks (stages of consecutive layers)"),
    pp_schedule: Optional[str] = typer.Option(None, "--pp-schedule", help="gpipe, 1f1b, interleaved1f1b"),
    microbatches: Optional[int] = typer.Option(None, "--microbatches",
                                               help="micro-batches per pipeline step (default: pp x stages per rank)"),
    stages_per_rank: Optional[int] = typer.Option(None, "--stages-per-rank",
                                                  help="pipeline stages per pp rank (interleaved1f1b: >= 2)"),
    mixed_precision: Optional[str] = typer.Option(None, "--mixed-precision", help="fp32, bf16, fp16"),
    checkpointing: Optional[str] = typer.Option(None, "--checkpointing", help="none, blocks, selective"),
    max_restarts: int = typer.Option(0, "--max-restarts", help="torchrun restarts; each resumes from --ckpt"),
    prewarm: Optional[bool] = typer.Option(None, "--prewarm/--no-prewarm",
                                           help="fork the workers from a server that imported torch once (faster "
                                                "restarts); default: on without CUDA devices"),
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
    if prewarm is None:  # CUDA workers are not forked from a process that may have touched the driver: untested
        import torch

        prewarm = not torch.cuda.is_available()
    code = run(LaunchConfig(nproc=n, max_restarts=max_restarts, prewarm=prewarm),
               [sys.executable, "-m", "torchnitro.distributed.train", *args])
    if code:
        raise typer.Exit(code)


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15, "ki": 2**10, "mi": 2**20, "gi": 2**30,
          "ti": 2**40}


def parse_quantity(text: str, unit: str) -> float:
    """``"80GB"`` -> 8e10 bytes, ``"900GB/s"`` -> 9e11 bytes/s, ``"400Gb/s"`` -> 5e10 bytes/s (b: bits),
    ``"989T"`` -> 9.89e14 (``unit`` names what is parsed, for the error)."""
    import re

    m = re.fullmatch(r"\s*([0-9.]+(?:e[0-9+-]+)?)\s*([kKmMgGtTpP]i?)?([bB])?(/s)?\s*", text)
    if not m:
        raise ConfigError(f"{unit}: received {text!r}, expected a number with an optional unit such as 80GB, "
                          "900GB/s or 400Gb/s (b: bits, B: bytes).")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    return value / 8 if m.group(3) == "b" else value


def plan_command(
    model: str = typer.Option("llama3-8b", "--model", help="lm, llama3-8b, llama3-70b"),
    gpus: int = typer.Option(8, "--gpus", help="ranks in the job"),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node"),
    gpu_mem: str = typer.Option("80GB", "--gpu-mem", help="memory per GPU"),
    flops: str = typer.Option("989T", "--flops", help="peak FLOP/s per GPU in the compute dtype (H100: 989T bf16)"),
    efficiency: float = typer.Option(0.5, "--efficiency", help="share of peak the compute reaches (measured MFU)"),
    nvlink: str = typer.Option("900GB/s", "--nvlink", help="intra-node bandwidth per GPU, both directions"),
    ib: str = typer.Option("400Gb/s", "--ib", help="inter-node bandwidth per GPU, one direction"),
    batch: int = typer.Option(0, "--batch", help="global batch in sequences (default: 2 per GPU)"),
    seq: int = typer.Option(8192, "--seq"),
    top: int = typer.Option(15, "--top", help="rows to show"),
    json_out: Optional[str] = typer.Option(None, "--json", help="write every row to this JSON file"),
) -> None:
    """Rank the parallel layouts of a model on a cluster: memory per rank and step time (simulated)."""
    from rich.console import Console

    from torchnitro.distributed.comm import Cluster, Link
    from torchnitro.distributed.plan import MODELS, explain, plan_parallel, plan_table
    from torchnitro.nn.models import TransformerConfig

    if model not in MODELS:
        raise ConfigError(f"plan-parallel --model: received {model!r}, expected one of {', '.join(MODELS)}.")
    cluster = Cluster(gpus=gpus, gpus_per_node=gpus_per_node, gpu_mem=parse_quantity(gpu_mem, "--gpu-mem"),
                      flops=parse_quantity(flops, "--flops"), efficiency=efficiency,
                      intra=Link(parse_quantity(nvlink, "--nvlink") / 2, 5e-6),  # both directions -> one
                      inter=Link(parse_quantity(ib, "--ib"), 15e-6))
    rows = plan_parallel(TransformerConfig(**MODELS[model]), cluster, batch=batch or 2 * gpus, seq=seq)
    console = Console()
    console.print(plan_table(rows, cluster, top=top))
    console.print(explain(rows, cluster))
    if json_out:
        data = [{"layout": r.name, "config": asdict(r.cfg), "memory": asdict(r.memory), "time": asdict(r.time),
                 "tokens_per_s_per_gpu": r.tokens_per_s_per_gpu, "mfu": r.mfu, "fits": r.fits} for r in rows]
        with open(json_out, "w") as f:
            json.dump({"simulated": True, "model": model, "cluster": asdict(cluster), "rows": data}, f, indent=1)


def register(app: typer.Typer) -> None:
    app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(launch_command)
    app.command("train")(train_command)
    app.command("plan-parallel")(plan_command)
