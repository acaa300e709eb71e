"""``init(cfg) -> DeviceMesh``: the process group and the mesh every other verb reads.

The default group is created once per process with ``"cpu:gloo,cuda:nccl"`` (CPU tensors over gloo,
CUDA tensors over NCCL) and the config's short timeout, from torchrun's environment (RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). A one-process job needs no environment: it gets an in-memory
store. Calling ``init`` again with another config of the same world size reuses the group and
builds a new mesh.

The mesh has one named dim per degree above 1, outermost first (``pp, dp_replicate, dp_shard,
tp``); a config with every degree 1 gets a one-rank ``dp_shard`` dim, so a mesh is never empty.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchnitro.distributed.config import MESH_DIMS, ParallelConfig
from torchnitro.errors import ConfigError

__all__ = ["init", "shutdown", "backend_of", "dp_coords", "dp_dims"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _init_group(cfg: ParallelConfig) -> None:
    timeout = timedelta(seconds=cfg.timeout_s)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    missing = [k for k in _ENV if k not in os.environ]
    if not missing:
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    if cfg.world_size == 1:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    raise ConfigError(
        f"this config needs {cfg.world_size} processes, but the environment has no {', '.join(missing)}: the "
        "process was not started by a launcher. Start it with `torchnitro launch --nproc "
        f"{cfg.world_size} -- python your_script.py` (or torchrun), which sets them for every rank.")


def init(cfg: ParallelConfig) -> DeviceMesh:
    """Create (or reuse) the default process group and build the config's DeviceMesh."""
    if not dist.is_initialized():
        _init_group(cfg)
    cfg.check_world(dist.get_world_size())
    device = _device_type()
    cfg.check_backend(backend_of(device))
    names = tuple(n for n in MESH_DIMS if getattr(cfg, n) > 1) or ("dp_shard",)
    shape = tuple(getattr(cfg, n) for n in names)
    return init_device_mesh(device, shape, mesh_dim_names=names)


def shutdown() -> None:
    """Destroy the default process group (and every sub-group); a no-op when none exists."""
    if dist.is_initialized():
        dist.destroy_process_group()


def backend_of(device_type: str) -> str:
    """The collective backend that moves tensors of this device type under ``"cpu:gloo,cuda:nccl"``."""
    return "nccl" if device_type == "cuda" else "gloo"


def dp_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh's data-parallel dims (replicate outer, shard inner); ranks differing only in others see the same data."""
    names = mesh.mesh_dim_names or ()
    return tuple(n for n in ("dp_replicate", "dp_shard") if n in names)


def dp_coords(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's data-parallel index, number of data-parallel ranks): which data shard it reads."""
    idx, size = 0, 1
    for name in dp_dims(mesh):
        n = mesh.size(mesh.mesh_dim_names.index(name))
        idx, size = idx * n + mesh.get_local_rank(name), size * n
    return idx, size
