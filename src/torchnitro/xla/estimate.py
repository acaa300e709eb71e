"""The analytic memory model of the LM train step, per device, to hold against XLA's compiled plan.

Nothing is compiled: every term comes from shapes, shardings and JAX's own trace.

* **arguments** = parameter + optimizer-state + batch shards. On a TPU each array is stored in
  (8, 128) tiles of its two minor dims (XLA picks which two; we take the cheapest pair), a rank-1
  array in 128-element rows, so a 64-wide head dim costs twice its bytes. Exact to <0.5% on v5p.
* **temp** = the heap of a liveness walk (``torchnitro.xla.liveness``) over one device's
  loss-and-gradient program: the step traced at device-local shapes (batch split over data/fsdp,
  heads, MLP hidden and vocab over tensor, weights as FSDP gathers them) under the remat policy,
  with XLA's fusion rules deciding which values get a buffer, the buffers then packed largest first
  at the best-fitting offset as XLA's buffer assignment does. No fitted constants.
* ``at_peak`` says what is live at that peak: FSDP-gathered weights, matmul outputs (``dots``,
  mostly residuals saved for the backward), other materialised values (reductions, the embedding
  gather and its scatter-add gradient, the stored residual stream) and gradients: an FSDP
  gradient waits whole from its completion to XLA's combined all-reduce at the end of the backward
  (``grad_sync``, results/xla_tpu_peak.md).

``layer_residual_bytes`` is JAX's own list of what one block saves for its backward under a
policy (before XLA fuses anything); results/xla_tpu.md compares the walk with the compile.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from torchnitro.xla.liveness import Liveness, simulate, tpu_array_bytes
from torchnitro.xla.lm import batch_spec
from torchnitro.xla.model import LMConfig, _block, _layer_shapes, attention_fn, loss_fn, param_spec
from torchnitro.xla.remat import remat_block
from torchnitro.xla.train import TrainStep

__all__ = ["MemoryEstimate", "estimate_memory", "simulated_temp", "tpu_array_bytes", "layer_residual_bytes"]

def _tree_bytes(specs: Any, shardings: Any, tpu: bool) -> int:
    total = 0
    for s, sh in zip(jax.tree.leaves(specs), jax.tree.leaves(shardings)):
        shard = sh.shard_shape(s.shape)
        total += tpu_array_bytes(shard, s.dtype.itemsize) if tpu else math.prod(shard) * s.dtype.itemsize
    return total


@dataclass(frozen=True)
class MemoryEstimate:
    """The analytic per-device model of the step (bytes); see the module docstring for each term."""

    params: int  # parameter shards as stored
    opt_state: int  # optimizer-state shards (moments follow their parameter's sharding)
    batch: int  # token and target shards
    temp: int  # scratch: the liveness walk's buffers packed as XLA packs its heap (>= their live peak)
    at_peak: dict[str, int] = field(default_factory=dict)  # what is live at that peak, by kind

    @property
    def argument(self) -> int:
        return self.params + self.opt_state + self.batch

    @property
    def peak(self) -> int:
        return self.argument + self.temp


def _local(step: TrainStep, cfg: LMConfig, batch_size: int) -> tuple[int, int, int, int]:
    """(sequences, tensor degree, fsdp degree, local vocab) on one device."""
    m = step.mesh.shape
    tp, fsdp = m.get("tensor", 1), m.get("fsdp", 1)
    vocab_split = tp > 1 and "tensor" in step.rules.mesh_axes("vocab")
    return batch_size // (m.get("data", 1) * fsdp), tp, fsdp, cfg.padded_vocab // (tp if vocab_split else 1)


def layer_residual_bytes(cfg: LMConfig, policy: str, seqs: int, seq_len: int, tp: int = 1,
                         tpu: bool = True) -> int:
    """Bytes one block keeps for its backward at device-local shapes (heads and MLP hidden split ``tp`` ways).

    From JAX's own partial evaluation of the block; weights are not counted (they are arguments),
    the block input is. ``none`` on a TPU counts as dots_saveable (see the module docstring).
    """
    from jax._src.ad_checkpoint import saved_residuals  # jax <0.11 (pinned): the listing behind print_saved_residuals

    split = {"heads": tp, "kv_heads": tp if cfg.padded_kv_heads % tp == 0 else 1, "mlp": tp}
    lp = {k: jax.ShapeDtypeStruct(tuple(s // split.get(a, 1) for s, a in zip(shape, axes)), jnp.float32)
          for k, (shape, axes) in _layer_shapes(cfg).items()}
    x = jax.ShapeDtypeStruct((seqs, seq_len, cfg.padded_dim), jnp.float32)
    cos = sin = jnp.zeros((seq_len, cfg.head_dim // 2), jnp.float32)
    pol = "dots_saveable" if tpu and policy == "none" else policy
    attend = attention_fn(cfg)
    fn = remat_block(lambda p_, x_: _block(cfg, p_, x_, cos, sin, attend), pol)
    total = 0
    for s, what in saved_residuals(fn, lp, x):
        if what.startswith(("from the argument p_", "from a constant", "from a literal")):
            continue  # a weight (counted as an argument) or the RoPE table (shared by all layers, small)
        total += math.prod(s.shape) * s.dtype.itemsize
    return total


def estimate_memory(cfg: LMConfig, step: TrainStep, batch_size: int, seq_len: int,
                    remat: str | Sequence[str] = "none", grad_sync: str = "combined") -> MemoryEstimate:
    """The analytic per-device estimate for ``step`` (built by lm_train_step) at this batch shape.

    ``grad_sync``: when FSDP gradients are synchronised (``torchnitro.xla.liveness.simulate``).
    """
    tpu = step.mesh.devices.flat[0].platform == "tpu"
    params = param_spec(cfg)
    opt = jax.eval_shape(step.optimizer.init, params)
    walk = simulated_temp(cfg, step, batch_size, seq_len, remat, grad_sync)
    return MemoryEstimate(params=_tree_bytes(params, step.param_shardings, tpu),
                          opt_state=_tree_bytes(opt, step.opt_shardings, tpu),
                          batch=_tree_bytes(batch_spec(batch_size, seq_len), step.batch_shardings, tpu),
                          temp=walk.heap, at_peak=dict(walk.at_peak))


def _local_leaf(shape: tuple[int, ...], sharding: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape after the FSDP gather, i.e. split only by the tensor axis; the stored shard's shape)."""
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    mesh = sharding.mesh.shape
    gathered = []
    for s, ax in zip(shape, spec):
        axes = (ax,) if isinstance(ax, str) else tuple(ax or ())
        gathered.append(s // math.prod(mesh[a] for a in axes if a == "tensor"))
    return tuple(gathered), tuple(sharding.shard_shape(shape))


def simulated_temp(cfg: LMConfig, step: TrainStep, batch_size: int, seq_len: int,
                   remat: str | Sequence[str] = "none", grad_sync: str = "combined") -> Liveness:
    """torchnitro.xla.liveness's walk over one device's loss-and-gradient program for this step.

    ``grad_sync`` (``liveness.GRAD_SYNC``) says when FSDP gradients are synchronised; the default,
    "combined", is what XLA compiled in 38 of the 42 v5p programs of results/xla_tpu_peak.md (the
    other 4 ran their gradient matmuls as deferred collective matmuls: "deferred").
    """
    tpu = step.mesh.devices.flat[0].platform == "tpu"
    seqs, tp, fsdp, vocab = _local(step, cfg, batch_size)
    params = param_spec(cfg)
    leaves, tree = jax.tree.flatten(params)
    shapes = [_local_leaf(s.shape, sh) for s, sh in zip(leaves, jax.tree.leaves(step.param_shardings))]
    local = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(g, s.dtype) for (g, _), s in zip(shapes, leaves)])
    toks = jax.ShapeDtypeStruct((seqs, seq_len), jnp.int32)
    # the local vocab is a model of its own size (no padding mask: the split is over the padded vocab)
    lcfg = dataclasses.replace(cfg, vocab_size=vocab, pad_multiple=1) if vocab != cfg.padded_vocab else cfg
    lcfg = dataclasses.replace(lcfg, pad_heads_to=1) if tp > 1 else lcfg

    def fn(p: Any, b: Any) -> Any:
        return jax.value_and_grad(loss_fn)(p, b, lcfg, remat)

    def kinds(i: int, shape: tuple[int, ...]) -> str:
        if i < len(shapes) and math.prod(shapes[i][1]) < math.prod(shapes[i][0]):
            return "weights"  # FSDP-split: gathered before its uses
        return "arg"

    def outputs(i: int, shape: tuple[int, ...]) -> tuple[str, int]:
        if i == 0 or i > len(shapes):
            return "", 0
        g, s = shapes[i - 1]
        if math.prod(s) < math.prod(g):  # reduce-scattered: the shard waits for the optimizer
            return "grads", tpu_array_bytes(s, 4) if tpu else math.prod(s) * 4
        return "", 0

    # a vocab split over the tensor axis: the partitioner turns the target gather (and its scatter
    # transpose) on the split dim into a masked select, elementwise
    extra = frozenset({"scatter-add", "gather"}) if vocab != cfg.padded_vocab else frozenset()
    # an FSDP table split along its width keeps whole rows on every device: lookups stay on the shards
    rows = frozenset(k for k, (g, s) in enumerate(shapes) if len(g) == 2 and s[0] == g[0] and s[1] < g[1])
    return simulate(fn, (local, {"tokens": toks, "targets": toks}), kinds, tpu, outputs, extra, grad_sync, rows)
