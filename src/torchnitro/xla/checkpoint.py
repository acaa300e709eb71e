"""Sharded checkpoints with orbax: each host writes its shards; restore lays them out on any mesh.

A checkpoint stores arrays, not their mesh, so restoring onto a different mesh (8-way FSDP saved,
2x4 FSDP+tensor restored) is a matter of handing orbax the target shardings: it reads each
device's slice straight from the stored chunks.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from torchnitro.errors import ArtifactError
from torchnitro.xla.model import LMConfig, param_spec
from torchnitro.xla.train import TrainStep

__all__ = ["save_checkpoint", "restore_checkpoint", "restore_train_state"]


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp  # only needed when checkpointing

    return ocp.StandardCheckpointer()


def save_checkpoint(path: str | os.PathLike, tree: Any) -> None:
    """Write a pytree of (sharded) arrays to the new directory ``path`` and wait until it is complete."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        raise ArtifactError(f"checkpoint directory {path} already exists; orbax never overwrites, pick a new one")
    ck = _checkpointer()
    ck.save(path, tree)
    ck.wait_until_finished()


def restore_checkpoint(path: str | os.PathLike, like: Any, shardings: Any) -> Any:
    """Read ``path`` into arrays shaped like ``like`` (arrays or ShapeDtypeStructs) with ``shardings``."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise ArtifactError(f"checkpoint directory {path} does not exist; expected one written by save_checkpoint")
    abstract = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), like, shardings)
    return _checkpointer().restore(path, abstract)


def restore_train_state(path: str | os.PathLike, cfg: LMConfig, step: TrainStep) -> tuple[Any, Any]:
    """Parameters and optimizer state saved as ``{"params": ..., "opt_state": ...}``, laid out for ``step``."""
    params = param_spec(cfg)
    like = {"params": params, "opt_state": jax.eval_shape(step.optimizer.init, params)}
    state = restore_checkpoint(path, like, {"params": step.param_shardings, "opt_state": step.opt_shardings})
    return state["params"], state["opt_state"]
