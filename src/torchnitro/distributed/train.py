"""A real training loop on the distributed layer: a byte-level LM on a directory of text.

``python -m torchnitro.distributed.train --data DIR --steps N --ckpt DIR [--dp-shard 2 ...]``, started
by ``torchnitro train --nproc N`` through ``torchnitro launch`` (or by torchrun; one process needs no
launcher). The corpus is every ``*.py``/``*.txt``/``*.md`` file under ``--data`` in sorted path order,
read as bytes (vocabulary 256: no tokenizer, no download); by default the Python standard library's
own sources.

Determinism: the samples of step ``s`` are a function of ``s`` alone (a fixed permutation of the
corpus windows, read ``global_batch`` at a time), so a run resumed from a checkpoint at step ``k``
sees exactly the batches an uninterrupted run sees from step ``k`` on, and with the model, optimizer
and schedule restored its losses are identical. A step is ``grad_accum`` micro-batches, clipped,
then one AdamW update with linear warm-up and cosine decay. With ``pp > 1`` the model is split by
``pipeline()`` and each micro-batch runs through its schedule (every pp rank reads the same samples;
the first stage takes the inputs, the last the targets); optimizer, clipping and checkpoints work on
the rank's stages under the unsplit names. Rank 0 appends one JSON line per logged
step (loss, tokens/s, MFU when ``peak_flops`` is given, peak memory of the rank, torchrun's restart
count) to ``log``.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchnitro.distributed.checkpoint import ModelState, load, save
from torchnitro.distributed.config import ParallelConfig
from torchnitro.distributed.data import dp_sum
from torchnitro.distributed.mesh import dp_coords, init
from torchnitro.distributed.parallelize import parallelize
from torchnitro.errors import InputError
from torchnitro.nn.models import TransformerConfig, TransformerLM

_IMPORTED_AT = time.time()  # wall clock when this module (torch, torchnitro.distributed) finished importing

__all__ = ["TrainConfig", "ByteCorpus", "train", "lr_at", "clip_grad_norm_", "main"]

_SUFFIXES = (".py", ".txt", ".md", ".rst")


@dataclass
class TrainConfig:
    data: str = ""  # directory of text files; "": the Python standard library's sources
    max_bytes: int = 8_000_000  # read at most this much of the corpus (sorted file order)
    seq: int = 128  # tokens (bytes) per sample
    batch: int = 8  # global micro-batch (all data-parallel ranks together), split evenly
    grad_accum: int = 1  # micro-batches per optimizer step
    steps: int = 100  # optimizer steps to reach (a resumed run continues to this step)
    lr: float = 3e-3  # peak learning rate
    warmup: int = 10  # linear warm-up steps, then cosine decay to lr/10 at `steps`
    clip: float = 1.0  # gradient-norm clipping threshold (0: off)
    dim: int = 128  # model width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention heads
    seed: int = 0  # model init and data order
    ckpt: str = ""  # checkpoint directory ("": no checkpoints, no resume)
    ckpt_every: int = 50  # save every N steps (and at the last step)
    keep: int = 3  # finished checkpoints kept
    log: str = ""  # JSON-lines log written by rank 0 ("": <ckpt>/log.jsonl, or none)
    log_every: int = 10  # log every N steps
    peak_flops: float = 0.0  # device peak FLOP/s for MFU; 0: unknown, MFU not reported

    def model_config(self) -> TransformerConfig:
        return TransformerConfig(vocab_size=256, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
                                 max_seq_len=self.seq)


class ByteCorpus:
    """Non-overlapping windows of ``seq + 1`` bytes (inputs and next-byte targets) over the corpus."""

    def __init__(self, directory: str, seq: int, max_bytes: int) -> None:
        root = Path(directory or sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*") if p.suffix in _SUFFIXES and p.is_file()) if root.is_dir() else []
        chunks, total = [], 0
        for p in files:
            if total >= max_bytes:
                break
            b = p.read_bytes()[: max_bytes - total]
            chunks.append(b)
            total += len(b)
        data = b"".join(chunks)
        if len(data) < 2 * (seq + 1):
            raise InputError(f"train data: received {root} with {len(files)} text files ({len(data)} bytes), expected a "
                             f"directory of *.py/*.txt/*.md files with at least {2 * (seq + 1)} bytes.")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq = seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * self.seq: i * self.seq + self.seq + 1].long()  # (T+1,)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``lr / 10`` at ``steps``."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def _micro_batch(corpus: ByteCorpus, order: torch.Tensor, step: int, micro: int, cfg: TrainConfig,
                 rank: int, size: int) -> torch.Tensor:
    """This rank's slice of global micro-batch ``micro`` of ``step``: a function of (step, micro) only."""
    start = (step * cfg.grad_accum + micro) * cfg.batch
    per = cfg.batch // size
    ids = order[[(start + rank * per + j) % len(order) for j in range(per)]]
    return torch.stack([corpus[int(i)] for i in ids])  # (B/size, T+1)


def next_token_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """fp32 cross-entropy of ``model(x[:, :-1])`` against ``x[:, 1:]``. The (b, T, V) logits die on return:
    backward needs the log-softmax the loss saved, not them, so they are off the step's peak (which
    ``measure`` measures with this same function)."""
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float, *,
                    counted: Iterable[torch.nn.Parameter] | None = None,
                    group: dist.ProcessGroup | None = None) -> float:
    """Scale gradients so their global 2-norm is at most ``max_norm``; returns the norm before clipping.

    Unlike ``torch.nn.utils.clip_grad_norm_`` it takes a mix of plain tensors (replicated parameters
    under TP) and DTensors on different meshes (TP shards, FSDP shards): each DTensor's norm is
    reduced over its own mesh, then the squares are summed. One small collective per DTensor gradient.
    Pipelines: ``group`` (the pp ranks) sums the stages' squares, and ``counted`` (default: ``params``)
    leaves out a gradient another stage counts (the last stage's copy of a tied weight); every one of
    ``params`` is scaled.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    sq = 0.0
    for p in params if counted is None else counted:
        if p.grad is None:
            continue
        n = p.grad.detach().norm(2)
        sq += float((n.full_tensor() if isinstance(n, DTensor) else n).item()) ** 2
    if group is not None:
        box = torch.tensor([sq], dtype=torch.float64)
        dist.all_reduce(box, group=group)
        sq = float(box.item())
    total = math.sqrt(sq)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        for g in grads:
            g.detach().mul_(coef)
    return total


def _check(cfg: TrainConfig, size: int, microbatches: int = 1) -> None:
    if cfg.batch % size:
        raise InputError(f"train: received batch={cfg.batch} (global) with {size} data-parallel ranks, expected a "
                         f"multiple of {size} so every rank gets the same number of samples.")
    if (cfg.batch // size) % microbatches:
        raise InputError(f"train: received batch={cfg.batch} (global), {cfg.batch // size} samples per data-parallel "
                         f"rank, with a pipeline of microbatches={microbatches}; expected the per-rank batch to be a "
                         f"multiple of {microbatches} (equal micro-batches). Set batch to a multiple of "
                         f"{size * microbatches} or change microbatches.")
    if cfg.steps < 1 or cfg.grad_accum < 1 or cfg.log_every < 1 or cfg.ckpt_every < 1:
        raise InputError(f"train: received steps={cfg.steps}, grad_accum={cfg.grad_accum}, log_every={cfg.log_every}, "
                         f"ckpt_every={cfg.ckpt_every}; expected each >= 1.")


def train(cfg: TrainConfig, pcfg: ParallelConfig, on_log: Callable[[dict[str, Any]], None] | None = None
          ) -> list[dict[str, Any]]:
    """Train (or resume) to ``cfg.steps``; returns the logged records (every rank gets the same list)."""
    mesh = init(pcfg)
    startup = {"imported": _IMPORTED_AT, "initialized": time.time()}  # wall clock; the resume benchmark reads it
    rank, size = dp_coords(mesh)
    _check(cfg, size, pcfg.n_microbatches if pcfg.pp > 1 else 1)
    corpus = ByteCorpus(cfg.data, cfg.seq, cfg.max_bytes)
    order = torch.randperm(len(corpus), generator=torch.Generator().manual_seed(cfg.seed))
    torch.manual_seed(cfg.seed)
    model = TransformerLM(cfg.model_config()).to(mesh.device_type)
    n_params = sum(p.numel() for p in model.parameters())  # before sharding: the whole model
    pipe = None
    if pcfg.pp > 1:  # this rank's stages under the unsplit names: optimizer and checkpoint keys as without PP
        from torchnitro.distributed.pipeline import pipeline

        pipe = pipeline(model, pcfg, mesh, grad_accum=cfg.grad_accum)
        model = pipe.model
    else:
        model = parallelize(model, pcfg, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    state = {"train": ModelState(model, opt)}
    start = (load(state, cfg.ckpt) if cfg.ckpt else None) or 0  # resume from the latest finished checkpoint
    startup["loaded"] = time.time()
    log_path = Path(cfg.log or (Path(cfg.ckpt) / "log.jsonl" if cfg.ckpt else "")) if (cfg.log or cfg.ckpt) else None
    records, t0 = [], time.perf_counter()
    for step in range(start, cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(cfg.grad_accum):
            x = _micro_batch(corpus, order, step, micro, cfg, rank, size).to(mesh.device_type)
            if pipe is not None:  # every pp rank reads the same x: the first stage its inputs, the last its targets
                mean = pipe.step(x[:, :-1], x[:, 1:], sync=micro == cfg.grad_accum - 1)
                total += torch.tensor(mean, dtype=torch.float32).double() / cfg.grad_accum
                continue
            loss = next_token_loss(model, x) / cfg.grad_accum
            loss.backward()
            total += loss.detach().double().cpu()
        if cfg.clip > 0 and pipe is not None:
            clip_grad_norm_(model.parameters(), cfg.clip, counted=pipe.norm_parameters, group=pipe.pp_group)
        elif cfg.clip > 0:
            clip_grad_norm_(model.parameters(), cfg.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps:
            records.append(_record(done, total, mesh, size, t0, start, cfg, n_params))
            if len(records) == 1:  # this attempt's first record: when its start-up phases ended
                records[-1]["startup"] = {**startup, "logged": time.time()}
            if log_path and dist.get_rank() == 0:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                with log_path.open("a") as f:
                    f.write(json.dumps(records[-1]) + "\n")
            if on_log:
                on_log(records[-1])
        if cfg.ckpt and (done % cfg.ckpt_every == 0 or done == cfg.steps):
            save(state, cfg.ckpt, done, keep=cfg.keep)
    return records


def _record(step: int, local_loss: torch.Tensor, mesh: Any, size: int, t0: float, start: int, cfg: TrainConfig,
            n_params: int) -> dict[str, Any]:
    loss = (dp_sum(local_loss, mesh) / size).item()
    elapsed = time.perf_counter() - t0
    tokens_per_s = (step - start) * cfg.batch * cfg.grad_accum * cfg.seq / elapsed
    flops_per_token = 6 * n_params + 12 * cfg.n_layers * cfg.dim * cfg.seq  # dense + attention (PaLM appendix B)
    world = dist.get_world_size()
    mfu = tokens_per_s * flops_per_token / (cfg.peak_flops * world) if cfg.peak_flops > 0 else None
    if torch.cuda.is_available():
        mem = torch.cuda.max_memory_allocated()
    else:
        import resource
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS of this rank (Linux: KiB)
    return {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_bytes_rank": mem,
            "world": world, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}


def main(argv: list[str] | None = None) -> None:
    """Rank entry point: ``--train JSON --parallel JSON`` (what ``torchnitro train`` passes)."""
    import argparse

    from torchnitro.config import from_dict
    from torchnitro.distributed.mesh import shutdown

    ap = argparse.ArgumentParser(prog="python -m torchnitro.distributed.train")
    ap.add_argument("--train", default="{}", help="TrainConfig fields as JSON")
    ap.add_argument("--parallel", default="{}", help="ParallelConfig fields as JSON")
    a = ap.parse_args(argv)
    cfg = from_dict(TrainConfig, json.loads(a.train), where="train")
    pcfg = from_dict(ParallelConfig, json.loads(a.parallel), where="parallel")

    from rich.console import Console

    console = Console()  # the launched command's own output, rank 0 only

    def show(r: dict[str, Any]) -> None:
        if dist.get_rank() == 0:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            console.print(f"step {r['step']:>6}  loss {r['loss']:.4f}  {r['tokens_per_s']:.0f} tok/s  mfu {mfu}  "
                          f"mem/rank {r['peak_mem_bytes_rank'] / 2**20:.0f} MiB", highlight=False)
    try:
        train(cfg, pcfg, on_log=show)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
