"""Distributed training: a thin layer over torch.distributed, composed from one ``ParallelConfig``.

::

    from torchnitro import distributed as dist
    cfg = dist.ParallelConfig(dp_shard=2, tp=2)
    mesh = dist.init(cfg)                            # process group + DeviceMesh ("cpu:gloo,cuda:nccl")
    model = dist.parallelize(model, cfg, mesh)       # TP plan, checkpointing, FSDP2/HSDP or DDP
    batches = dist.loader(dataset, mesh, batch_size=8, drop_last=True)
    state = {"train": dist.ModelState(model, optimizer)}
    step = dist.load(state, "./ckpt")                # latest finished checkpoint, resharded; None: fresh start
    dist.save(state, "./ckpt", step=100)             # atomic; async_=True returns a PendingSave
    rows = dist.plan_parallel(model_cfg, dist.Cluster(gpus=32), batch=64, seq=8192)   # layouts, ranked (simulated)

What exists and what does not yet: docs/distributed.md.
"""

from __future__ import annotations

from torchnitro.distributed.checkpoint import ModelState, PendingSave, latest_step, load, save
from torchnitro.distributed.config import ParallelConfig
from torchnitro.distributed.data import ShardedSampler, dp_sum, exact_mean, loader
from torchnitro.distributed.mesh import dp_coords, init, shutdown
from torchnitro.distributed.parallelize import parallelize, tp_plan
from torchnitro.distributed.pipeline import Pipeline, pipeline
from torchnitro.distributed.comm import Cluster, Link
from torchnitro.distributed.plan import plan_parallel
from torchnitro.distributed.planner import RankState, rank_state_bytes

__all__ = ["ParallelConfig", "init", "shutdown", "dp_coords", "parallelize", "tp_plan", "pipeline", "Pipeline",
           "loader", "ShardedSampler", "dp_sum", "exact_mean", "save", "load", "latest_step", "ModelState", "PendingSave",
           "RankState", "rank_state_bytes", "plan_parallel", "Cluster", "Link"]
