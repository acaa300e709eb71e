"""``pipeline(model, cfg, mesh)``: pipeline parallelism for ``TransformerLM`` on ``torch.distributed.pipelining``.

The model's layers are cut into ``cfg.n_stages = pp * stages_per_rank`` stages of consecutive blocks
(as even as possible, earlier stages take the extra layer). Stage ``s`` runs on pp rank ``s % pp``
(the "loop" placement Interleaved1F1B expects; with one stage per rank, stage ``s`` is rank ``s``).
The first stage also embeds the tokens, the last applies the final norm and the LM head.

Names stay the unsplit model's: a stage keeps ``embed``, ``blocks.<i>`` (an ``nn.ModuleDict`` keyed
by the original layer index), ``norm`` and ``lm_head`` as attributes, so ``named_parameters`` and
DCP keys (``blocks.5.attn.wq.weight``) are the same on every layout and a pipeline checkpoint loads
into an unsplit model and back. A rank's stages are also gathered into one container module
(``Pipeline.model``) that the optimizer, ``ModelState`` and parity checks read.

Tied embeddings: the first stage embeds with ``embed.weight`` and the last stage projects with the
same weight. The last stage holds its own copy, registered under the same name ``embed.weight``
(so the optimizer state keys match the unsplit model's); after each step the copy's and the
original's gradients are summed over a two-rank group (first and last pp rank of each data-parallel
coordinate), which is exactly the unsplit model's gradient of the shared weight, and both copies then
take identical optimizer steps.

Loss scaling: ``loss_fn`` returns the mean loss of one micro-batch; the schedule runs it divided by
``n_microbatches * grad_accum`` and sums the micro-batches' gradients (``scale_grads=False``), which
equals the gradient of the mean over the whole batch when the micro-batches are the same size
(checked: the batch must divide by ``cfg.n_microbatches``). The schedule's own ``scale_grads=True``
divides *every* ``.grad`` after each step, so gradients accumulated over several ``step`` calls
(``grad_accum``) would be divided again; scaling the loss instead keeps accumulation linear. FSDP/HSDP
or the replicas' all-reduce average over data-parallel ranks on top.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from torchnitro.distributed.config import ParallelConfig
from torchnitro.errors import ConfigError, InputError

__all__ = ["LMStage", "Pipeline", "pipeline", "stage_layers", "stage_ids", "lm_loss", "SCHEDULES"]

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B"}


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of one micro-batch: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def stage_layers(n_layers: int, n_stages: int) -> list[range]:
    """The layer indices of every stage: consecutive, sizes differ by at most one (earlier stages larger)."""
    if n_stages < 1 or n_layers < n_stages:
        raise ConfigError(f"cannot split {n_layers} layers into {n_stages} pipeline stages: every stage needs at "
                          "least one layer. Use fewer stages or a deeper model.")
    base, extra = divmod(n_layers, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (s < extra)
        out.append(range(start, start + n))
        start += n
    return out


def stage_ids(cfg: ParallelConfig, pp_rank: int) -> list[int]:
    """The stages pp rank ``pp_rank`` runs (loop placement: stage s on rank s % pp)."""
    return [pp_rank + k * cfg.pp for k in range(cfg.stages_per_rank)]


class LMStage(nn.Module):
    """Consecutive layers of a ``TransformerLM`` under the unsplit model's attribute names.

    First stage: tokens (B, T) -> hidden (B, T, D); middle: hidden -> hidden; last: hidden -> logits
    (B, T, V); a stage that is both (one stage in all) is the whole model.
    """

    def __init__(self, model: nn.Module, layers: list[int], *, first: bool, last: bool,
                 embed: nn.Module | None = None, lm_head: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg, self.first, self.last = model.cfg, first, last
        if embed is not None:
            self.embed = embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.norm = model.norm
            self.lm_head = lm_head if lm_head is not None else model.lm_head
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)  # (B, T) -> (B, T, D)
        T = x.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for block in self.blocks.values():
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x)) if self.last else x  # (B, T, V) or (B, T, D)


def _split(model: nn.Module, cfg: ParallelConfig, pp_rank: int) -> tuple[nn.Module, list[LMStage], bool]:
    """(container of this rank's parts, its stage modules, whether a tied-weight copy was made here)."""
    if not all(hasattr(model, a) for a in ("embed", "blocks", "norm", "lm_head", "cfg")):
        raise ConfigError(f"pipeline parallelism splits a TransformerLM (embed, blocks, norm, lm_head), but received "
                          f"{type(model).__name__}; use pp=1 for other models.")
    cfg.check_model(model.cfg)
    layers = stage_layers(model.cfg.n_layers, cfg.n_stages)
    tied = model.lm_head.weight is model.embed.weight
    stages, copied = [], False
    head = model.lm_head
    mine = stage_ids(cfg, pp_rank)
    if tied and 0 not in mine and cfg.n_stages - 1 in mine:
        # the last stage's own copy of the shared weight, under the name the unsplit model gives it
        copied = True
        embed = nn.Embedding(model.embed.num_embeddings, model.embed.embedding_dim)
        embed.weight = nn.Parameter(model.embed.weight.detach().clone())
        head = nn.Linear(model.embed.embedding_dim, model.embed.num_embeddings, bias=False)
        head.weight = embed.weight
    for s in mine:
        first, last = s == 0, s == cfg.n_stages - 1
        e = model.embed if first else (embed if last and copied else None)
        stages.append(LMStage(model, list(layers[s]), first=first, last=last, embed=e, lm_head=head if last else None))
    all_layers = [i for s in mine for i in layers[s]]
    has_first, has_last = 0 in mine, cfg.n_stages - 1 in mine
    container = LMStage(model, sorted(all_layers), first=has_first, last=has_last,
                        embed=model.embed if has_first else (embed if copied else None),
                        lm_head=head if has_last else None)
    return container, stages, tied


def _tied_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """Two-rank groups {first pp rank, last pp rank} per data-parallel coordinate; None on middle ranks."""
    grid = mesh.mesh.reshape(mesh.size(0), -1)  # (pp, everything else), pp outermost
    pairs = [[int(grid[0, j]), int(grid[-1, j])] for j in range(grid.shape[1])]
    group, _ = dist.new_subgroups_by_enumeration(pairs)
    return group


@dataclass
class Pipeline:
    """One rank's share of a pipelined model: its stages, the schedule, and the training step."""

    model: nn.Module  # this rank's parts under the unsplit names: give it to the optimizer, ModelState, parity
    stages: list[LMStage]  # the stage modules this rank runs (stages_per_rank of them)
    schedule: object  # the torch.distributed.pipelining schedule
    cfg: ParallelConfig
    pp_group: dist.ProcessGroup
    tied_group: dist.ProcessGroup | None = None  # set when the embedding and head share a weight
    is_first: bool = False
    is_last: bool = False
    replica_group: dist.ProcessGroup | None = None  # PP x DDP: the ranks holding the same stages (dp_replicate)
    grad_accum: int = 1  # step() calls per optimizer step: each one's loss is divided by it

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, *, sync: bool = True) -> float:
        """Forward and backward of one batch through the pipeline; returns its mean loss on every pp rank.

        Every rank passes the same (B, T) ``tokens`` and ``targets`` of its data-parallel shard; the first
        stage reads the tokens, the last the targets. Gradients accumulate into ``.grad`` (zero them first),
        as the gradient of ``mean loss / grad_accum``. ``sync=False`` (every accumulation step but the
        last) leaves out the replicas' all-reduce and the tied weight's sum: the sum is not idempotent, so
        it must run once per optimizer step, after the last accumulation step.
        """
        n = self.cfg.n_microbatches
        if tokens.shape[0] % n:
            raise InputError(f"pipeline step: received a batch of {tokens.shape[0]} samples, expected a multiple of "
                             f"microbatches={n} (equal micro-batches keep the mean loss and its gradient exact).")
        losses: list = []
        args = (tokens,) if self.is_first else ()
        self.schedule.step(*args, target=targets if self.is_last else None, losses=losses)
        if sync:
            self._average_replicas()
            self._sync_tied()
        # the schedule saw loss / (n * grad_accum) per micro-batch: their sum times grad_accum is the mean
        loss = torch.stack([x.detach().float() for x in losses]).sum() * self.grad_accum if self.is_last \
            else torch.zeros(())
        last = dist.get_global_rank(self.pp_group, dist.get_world_size(self.pp_group) - 1)
        dist.broadcast(loss, src=last, group=self.pp_group)
        return loss.item()

    def _average_replicas(self) -> None:
        """PP x DDP: average every gradient over the stage's replicas, in one flat all-reduce per step.

        ``DistributedDataParallel`` around each stage failed inside the 1F1B schedule on torch 2.13 (the
        reducer's internal assert "rebuilt parameter indices size ... 19 versus ... 38": every parameter's
        gradient reported ready twice), so the replicas are averaged here, after the schedule has
        accumulated every micro-batch; one flat buffer, no overlap with the backward.
        """
        if self.replica_group is None:
            return
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.replica_group)
        flat /= dist.get_world_size(self.replica_group)
        for g, avg in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(avg)

    @property
    def norm_parameters(self) -> list[nn.Parameter]:
        """This rank's parameters that count towards the global gradient norm: all but the last stage's copy of
        a tied weight (the first stage counts it; both hold the same gradient after the step)."""
        copy = self.tied_group is not None and self.is_last and not self.is_first
        return [p for n, p in self.model.named_parameters() if not (copy and n == "embed.weight")]

    def _sync_tied(self) -> None:
        if self.tied_group is None or not (self.is_first or self.is_last):
            return
        w = self.model.embed.weight
        if w.grad is None:
            return
        g = w.grad.to_local() if hasattr(w.grad, "to_local") else w.grad
        dist.all_reduce(g, group=self.tied_group)


def pipeline(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss, *,
             grad_accum: int = 1) -> Pipeline:
    """Split ``model`` (a ``TransformerLM``) into this rank's stages on the mesh's ``pp`` dim, apply activation
    checkpointing and FSDP2/HSDP per stage as the config says (DDP: gradients averaged over the replicas after
    each step, ``Pipeline._average_replicas``), and build ``cfg.pp_schedule``. ``grad_accum``: how many
    ``Pipeline.step`` calls make one optimizer step (their gradients add up to the mean's)."""
    from torch.distributed import pipelining

    from torchnitro.distributed.parallelize import apply_fsdp
    from torchnitro.memory.checkpointing import checkpoint_

    if cfg.pp == 1 or "pp" not in (mesh.mesh_dim_names or ()):
        raise ConfigError(f"pipeline() needs pp > 1 and a mesh with a 'pp' dim; received pp={cfg.pp} and mesh dims "
                          f"{mesh.mesh_dim_names}. Build the mesh with init(cfg) from the same config.")
    pp_rank = mesh.get_local_rank("pp")
    container, stages, tied = _split(model, cfg, pp_rank)
    for st in stages:
        if cfg.checkpointing != "none":
            checkpoint_(st, cfg.checkpointing, blocks=list(st.blocks.values()))
        if cfg.strategy in ("fsdp", "hsdp"):
            apply_fsdp(st, cfg, mesh, blocks=list(st.blocks.values()))
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else torch.device("cpu")
    pp_group = mesh["pp"].get_group()
    pstages = [pipelining.PipelineStage(st, s, cfg.n_stages, device, group=pp_group)
               for st, s in zip(stages, stage_ids(cfg, pp_rank))]
    if not isinstance(grad_accum, int) or isinstance(grad_accum, bool) or grad_accum < 1:
        raise InputError(f"pipeline: received grad_accum={grad_accum!r}, expected an integer >= 1.")
    kind = getattr(pipelining, SCHEDULES[cfg.pp_schedule])
    first = pstages if cfg.pp_schedule == "interleaved1f1b" else pstages[0]
    scale = cfg.n_microbatches * grad_accum

    def scaled_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss_fn(output, target) / scale

    schedule = kind(first, n_microbatches=cfg.n_microbatches, loss_fn=scaled_loss, scale_grads=False)
    tied_group = _tied_group(mesh) if tied else None
    mine = stage_ids(cfg, pp_rank)
    replicas = mesh["dp_replicate"].get_group() if cfg.strategy == "ddp" else None
    return Pipeline(container, stages, schedule, cfg, pp_group, tied_group,
                    is_first=0 in mine, is_last=cfg.n_stages - 1 in mine, replica_group=replicas,
                    grad_accum=grad_accum)
