"""The reference LM wired to the sharded step: one call from sizes, mesh and rules to a TrainStep."""

from __future__ import annotations

from functools import partial
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from torchnitro.xla.flash import sharded_flash_attention
from torchnitro.xla.model import Attend, LMConfig, logical_axes, loss_fn, param_spec
from torchnitro.xla.rules import Rules, activation_constraint, logical_to_spec
from torchnitro.xla.train import TrainStep, sharded_train_step

__all__ = ["lm_train_step", "random_batch", "batch_spec", "lm_attention"]

# logical axes of attention's (B, H, T, Dh) operands: batch and heads may be split, sequence and head dim not
ATTN_AXES = ("activation_batch", "activation_heads", None, None)


def batch_spec(batch_size: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
    s = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    return {"tokens": s, "targets": s}


def random_batch(cfg: LMConfig, batch_size: int, seq_len: int, seed: int = 0) -> dict[str, jax.Array]:
    """Random token ids below the true vocab size; targets are the tokens shifted left by one."""
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch_size, seq_len + 1), dtype=np.int32)
    return {"tokens": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}


def lm_attention(cfg: LMConfig, mesh: Mesh, rules: str | Rules, batch_size: int) -> Attend | None:
    """Flash attention per (batch, heads) shard under shard_map for ``attention="flash"``, else None.

    XLA's partitioner cannot split a Pallas call; shard_map hands each device its own batch rows and
    heads (split as the rules split the activations) and runs the kernel on them.
    """
    if cfg.attention != "flash":
        return None
    spec = logical_to_spec(ATTN_AXES, rules, mesh, (batch_size, cfg.padded_heads, 1, cfg.head_dim),
                           what="attention (B, H, T, Dh)")
    on_tpu = mesh.devices.flat[0].platform == "tpu"  # a TPU topology target compiles the Mosaic kernel, AOT
    return sharded_flash_attention(mesh, spec, causal=True, block=cfg.attn_block, interpret=not on_tpu)


def lm_train_step(cfg: LMConfig, optimizer: optax.GradientTransformation, mesh: Mesh, rules: str | Rules,
                  batch_size: int, seq_len: int, remat: str | Sequence[str] = "none",
                  donate: bool = True) -> TrainStep:
    """A sharded train step for the reference LM at the given batch shape."""
    loss = partial(loss_fn, cfg=cfg, remat=remat, constrain=activation_constraint(rules, mesh),
                   attend=lm_attention(cfg, mesh, rules, batch_size))
    return sharded_train_step(loss, optimizer, mesh, rules, logical_axes(cfg),
                              param_spec(cfg), batch_spec(batch_size, seq_len), donate=donate)
