"""Layout padding: store LM dimensions at multiples the TPU matrix unit tiles well, and say what it costs.

A TPU's MXU multiplies 128x128 tiles (256x256 on v6e); a weight dimension that is not a multiple
of the tile is padded by XLA at every matmul anyway, and a head count that the tensor axis does not
divide cannot be split at all. ``pad_config`` picks padded sizes, ``pad_params`` / ``unpad_params``
move weights between the layouts, and ``PaddingReport`` lists the waste per dimension and in
parameters. The padded model computes exactly the unpadded one (see torchnitro.xla.model).
Not padded: the head dimension, whose RoPE pairs and softmax scale depend on its true size.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from torchnitro.errors import ConfigError
from torchnitro.xla.model import LMConfig, logical_axes, param_spec, true_index
from torchnitro.xla.rules import is_axes

__all__ = ["TPU_TILE", "PaddedDim", "PaddingReport", "pad_config", "pad_report", "pad_params", "unpad_params"]

# MXU tile edge per TPU generation (v6e Trillium's MXU is 256x256, earlier ones 128x128)
TPU_TILE: dict[str, int] = {"v4": 128, "v5e": 128, "v5p": 128, "v6e": 256}


@dataclass(frozen=True)
class PaddedDim:
    """One padded dimension: its true and stored size."""

    name: str  # "vocab", "dim", "hidden", "heads"
    true: int  # size the model computes with
    padded: int  # size it is stored and multiplied at

    @property
    def waste(self) -> float:
        """Fraction of the stored size that is padding."""
        return 1.0 - self.true / self.padded


@dataclass(frozen=True)
class PaddingReport:
    """What a padded layout costs: per dimension, and in parameters (the compile's argument bytes follow)."""

    config: LMConfig  # the padded config to build the model from
    dims: tuple[PaddedDim, ...]  # every padded dimension
    true_params: int  # parameter count of the unpadded model
    padded_params: int  # parameter count as stored

    @property
    def param_ratio(self) -> float:
        return self.padded_params / self.true_params

    def table(self) -> str:
        rows = [f"| {d.name} | {d.true} | {d.padded} | {100 * d.waste:.1f}% |" for d in self.dims]
        return "\n".join(["| dim | true | padded | waste |", "| --- | --- | --- | --- |", *rows,
                          f"| parameters | {self.true_params:,} | {self.padded_params:,} | "
                          f"{100 * (1 - 1 / self.param_ratio):.1f}% |"])


def _count(cfg: LMConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(param_spec(cfg)))


def pad_config(cfg: LMConfig, multiple: int = 128, heads_to: int = 1) -> LMConfig:
    """``cfg`` with vocab/width/hidden stored at multiples of ``multiple`` and heads of ``heads_to``."""
    if multiple < 1 or heads_to < 1:
        raise ConfigError(f"pad_config: multiple={multiple}, heads_to={heads_to}; expected integers >= 1")
    if cfg.pad_multiple != 1 or cfg.pad_heads_to != 1:
        raise ConfigError(f"pad_config: the config is already padded (pad_multiple={cfg.pad_multiple}, "
                          f"pad_heads_to={cfg.pad_heads_to}); pad an unpadded config")
    return dataclasses.replace(cfg, pad_multiple=multiple, pad_heads_to=heads_to)


def pad_report(cfg: LMConfig, multiple: int = 128, heads_to: int = 1) -> PaddingReport:
    """Padded config plus the waste of each dimension and of the parameter count."""
    p = pad_config(cfg, multiple, heads_to)
    dims = (PaddedDim("vocab", cfg.vocab_size, p.padded_vocab), PaddedDim("dim", cfg.dim, p.padded_dim),
            PaddedDim("hidden", cfg.hidden_dim, p.padded_hidden), PaddedDim("heads", cfg.n_heads, p.padded_heads))
    return PaddingReport(p, dims, _count(cfg), _count(p))


def pad_params(params: Any, padded: LMConfig) -> Any:
    """Unpadded weights (e.g. from_torch_state_dict) -> the padded layout of ``padded``, zeros in the padding."""
    def one(axes: tuple, w: jax.Array, spec: Any) -> jax.Array:
        return jnp.zeros(spec.shape, w.dtype).at[true_index(padded, axes)].set(w)

    return jax.tree.map(one, logical_axes(padded), params, param_spec(padded), is_leaf=is_axes)


def unpad_params(params: Any, padded: LMConfig) -> Any:
    """Padded weights -> the unpadded block of each (what the unpadded model would hold)."""
    return jax.tree.map(lambda axes, w: w[true_index(padded, axes)], logical_axes(padded), params, is_leaf=is_axes)
