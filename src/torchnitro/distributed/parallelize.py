"""``parallelize(model, cfg, mesh)``: TP, activation checkpointing, then FSDP2/HSDP or DDP.

The order is torchtitan's: tensor parallelism first (it rewrites parameters into DTensors on the
``tp`` mesh dim), then activation checkpointing (it wraps block forwards, names unchanged), then
data parallelism last, so FSDP2 shards the TP shards again (2-D) and DDP wraps the finished model.

- FSDP2: ``fully_shard`` on every block and on the root, all with the config's reshard-after-forward;
  ``prefetch`` blocks are all-gathered ahead
  (explicit forward and backward prefetch). ``mixed_precision`` sets the parameter dtype of
  compute; gradients are reduced in fp32.
- HSDP: the same calls on the 2-D ``(dp_replicate, dp_shard)`` mesh: sharded inside a group,
  replicated (all-reduced) across groups, the job hierarchical all-reduce used to do.
- DDP: ``DistributedDataParallel`` over the ``dp_replicate`` group with the bucket size and
  gradient compression hook of the config. Parameters stay fp32 (autocast is the loop's job).
- TP: a plan per model class (``TP_PLANS``). ``TransformerLM``: q/k/v and the MLP gate/up are split by
  output (``ColwiseParallel``), o and the MLP down projection by input (``RowwiseParallel``), so a
  block needs one all-reduce after attention and one after the MLP. Embedding, norms and the tied
  LM head stay replicated.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from torchnitro.distributed.config import ParallelConfig
from torchnitro.distributed.mesh import dp_dims
from torchnitro.errors import ConfigError
from torchnitro.memory.checkpointing import checkpoint_, find_blocks

__all__ = ["parallelize", "apply_tp", "apply_fsdp", "apply_ddp", "tp_plan", "TP_PLANS", "LM_TP_SPLIT"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

TP_PLANS: dict[str, Callable[[nn.Module, DeviceMesh], None]] = {}


def tp_plan(model_class: str) -> Callable[[Callable[[nn.Module, DeviceMesh], None]], Callable[[nn.Module, DeviceMesh], None]]:
    """Register the tensor-parallel plan of a model class (by class name)."""
    def deco(fn: Callable[[nn.Module, DeviceMesh], None]) -> Callable[[nn.Module, DeviceMesh], None]:
        TP_PLANS[model_class] = fn
        return fn
    return deco


# which weight dim each TransformerLM block linear is split on: 0 (output, colwise) or 1 (input, rowwise);
# the memory planner reads the same table
LM_TP_SPLIT = {"attn.wq": 0, "attn.wk": 0, "attn.wv": 0, "attn.wo": 1, "mlp.w1": 0, "mlp.w3": 0, "mlp.w2": 1}


@tp_plan("TransformerLM")
def _transformer_lm_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    n = tp_mesh.size()
    plan = {name: ColwiseParallel() if dim == 0 else RowwiseParallel() for name, dim in LM_TP_SPLIT.items()}
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
        # the attention views its projections as (B, T, heads, Dh); a rank now holds heads/n of them
        c = block.attn.cfg
        block.attn.cfg = replace(c, dim=c.dim // n, n_heads=c.n_heads // n, n_kv_heads=c.kv_heads // n)


def apply_tp(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh) -> None:
    """Split the model across the ``tp`` mesh dim in place, by its class's plan."""
    name = type(model).__name__
    if name not in TP_PLANS:
        raise ConfigError(f"tensor parallelism (tp={cfg.tp}) needs a plan for the model class, but there is none for "
                          f"{name!r}; known: {', '.join(sorted(TP_PLANS))}. Use tp=1 (FSDP/DDP work on any model), "
                          "or register a plan with torchnitro.distributed.tp_plan.")
    cfg.check_model(getattr(model, "cfg", None))
    TP_PLANS[name](model, mesh["tp"])


def _dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    dims = dp_dims(mesh)
    return mesh[dims] if len(dims) > 1 else mesh[dims[0]]


def apply_fsdp(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh, blocks: list[nn.Module] | None = None) -> None:
    """FSDP2 (1-D shard mesh) or HSDP (2-D replicate x shard mesh) on every block and the root, in place.

    ``blocks``: the modules to shard one by one (default: the model's largest ``nn.ModuleList``).
    """
    dp_mesh = _dp_mesh(mesh)
    dtype = _DTYPES[cfg.mixed_precision]
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 \
        else MixedPrecisionPolicy()
    blocks = list(find_blocks(model)) if blocks is None else blocks
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    # the root reshards too (torchtitan does the same without PP): left gathered after a no_grad forward,
    # its registered parameters are the unsharded ones, and an optimizer built then would never step them
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    if cfg.prefetch > 0:
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + cfg.prefetch])
            block.set_modules_to_backward_prefetch(blocks[max(0, i - cfg.prefetch):i][::-1])


def apply_ddp(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh) -> nn.Module:
    """Wrap in DDP over the ``dp_replicate`` group, with the config's bucket size and compression hook."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    group = mesh["dp_replicate"].get_group()
    device_ids = [torch.cuda.current_device()] if mesh.device_type == "cuda" else None
    ddp = DistributedDataParallel(model, process_group=group, device_ids=device_ids,
                                  bucket_cap_mb=cfg.bucket_cap_mb)
    if cfg.comm_hook == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif cfg.comm_hook == "bf16":
        ddp.register_comm_hook(group, default_hooks.bf16_compress_hook)
    elif cfg.comm_hook == "powersgd":
        # PyTorch's defaults: plain all-reduce for the first 1000 steps, then rank-1 compression with error feedback
        ddp.register_comm_hook(powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=1),
                               powerSGD_hook.powerSGD_hook)
    return ddp


def parallelize(model: nn.Module, cfg: ParallelConfig, mesh: DeviceMesh) -> nn.Module:
    """Apply the config to ``model`` on ``mesh``; returns the model to train (a DDP wrapper for DDP).

    TP, checkpointing and FSDP2/HSDP change ``model`` in place and return it; DDP returns its wrapper.
    """
    if cfg.pp > 1:
        raise ConfigError(f"parallelize() does not split a model into pipeline stages (pp={cfg.pp}); call "
                          "torchnitro.distributed.pipeline(model, cfg, mesh), which applies checkpointing and "
                          "FSDP/HSDP per stage and returns the stages with their schedule.")
    if cfg.tp > 1:
        apply_tp(model, cfg, mesh)
    if cfg.checkpointing != "none":
        checkpoint_(model, cfg.checkpointing)
    if cfg.strategy in ("fsdp", "hsdp"):
        apply_fsdp(model, cfg, mesh)
    elif cfg.strategy == "ddp":
        return apply_ddp(model, cfg, mesh)
    return model
