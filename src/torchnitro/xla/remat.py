"""Rematerialisation policies: which activations a transformer block keeps for the backward pass.

``none`` keeps everything (most memory, no recompute); ``dots_saveable`` keeps the outputs of
matmuls and recomputes the cheap elementwise work; ``dots_with_no_batch_dims_saveable`` keeps only
weight matmuls (not the attention score matmuls, which have a batch dim); ``nothing_saveable``
(alias ``full``) keeps only each block's input and recomputes the whole block. A sequence of names,
one per layer, gives a per-layer policy.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax

from torchnitro.errors import ConfigError

__all__ = ["REMAT_POLICIES", "remat_block", "layer_policies"]

# name -> jax.checkpoint policy; None means "do not wrap in jax.checkpoint"
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


def layer_policies(remat: str | Sequence[str], n_layers: int) -> list[str]:
    """One policy name per layer; unknown names and a wrong-length list raise ConfigError."""
    names = [remat] * n_layers if isinstance(remat, str) else list(remat)
    if len(names) != n_layers:
        raise ConfigError(f"remat: got {len(names)} per-layer policies for {n_layers} layers; give one per layer "
                          "or a single name")
    for n in names:
        if n not in REMAT_POLICIES:
            raise ConfigError(f"unknown remat policy {n!r}; known: {', '.join(REMAT_POLICIES)}")
    return names


def remat_block(fn: Callable, policy: str) -> Callable:
    """``fn`` wrapped in ``jax.checkpoint`` with the named policy (unchanged for ``none``)."""
    p = REMAT_POLICIES[layer_policies(policy, 1)[0]]
    return fn if p is None else jax.checkpoint(fn, policy=p)
