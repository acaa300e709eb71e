"""The TPU path on JAX/XLA (optional extra ``torchnitro[xla]``): meshes, sharding rules, a sharded
train step for a reference LM, Pallas flash attention, layout padding, remat policies and compile-time memory planning.

Names resolve on first use (PEP 562): ``import torchnitro.xla`` does not import jax; using any
name below does. See docs/xla.md for what exists and what does not yet.
"""

from __future__ import annotations

from torchnitro._lazy import lazy_names

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    "MeshConfig": "torchnitro.xla.mesh",
    "make_mesh": "torchnitro.xla.mesh",
    "parse_target": "torchnitro.xla.mesh",
    "target_devices": "torchnitro.xla.mesh",
    "Rules": "torchnitro.xla.rules",
    "logical_to_spec": "torchnitro.xla.rules",
    "shard_tree": "torchnitro.xla.rules",
    "LMConfig": "torchnitro.xla.model",
    "init_params": "torchnitro.xla.model",
    "logical_axes": "torchnitro.xla.model",
    "TrainStep": "torchnitro.xla.train",
    "sharded_train_step": "torchnitro.xla.train",
    "lm_train_step": "torchnitro.xla.lm",
    "pad_report": "torchnitro.xla.layout",
    "PaddingReport": "torchnitro.xla.layout",
    "plan_memory": "torchnitro.xla.memory",
    "estimate_memory": "torchnitro.xla.estimate",
    "MemoryEstimate": "torchnitro.xla.estimate",
    "MemoryPlan": "torchnitro.xla.memory",
    "find_batch_size": "torchnitro.xla.memory",
    "find_lm_batch_size": "torchnitro.xla.memory",
    "REMAT_POLICIES": "torchnitro.xla.remat",
    "save_checkpoint": "torchnitro.xla.checkpoint",
    "restore_checkpoint": "torchnitro.xla.checkpoint",
    "restore_train_state": "torchnitro.xla.checkpoint",
    "XlaOptions": "torchnitro.xla.options",
    "flash_attention": "torchnitro.xla.flash",
    "blockwise_attention": "torchnitro.xla.flash",
    "sharded_flash_attention": "torchnitro.xla.flash",
    "profile_step": "torchnitro.xla.profile",
    "StepProfile": "torchnitro.xla.profile",
}
_SUBMODULES = ("mesh", "rules", "model", "remat", "train", "lm", "layout", "memory", "checkpoint", "flash", "estimate",
               "liveness", "options", "profile", "cli")

__all__, __getattr__, __dir__ = lazy_names(globals(), _EXPORTS, _SUBMODULES)
