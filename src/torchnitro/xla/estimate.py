"""The analytic memory model of the LM train step, per device, to hold against XLA's compiled plan.

Nothing is compiled: every term comes from shapes, shardings and JAX's own trace. The model, and
what each term stands for in the TPU compile's ``memory_analysis()`` (results/xla_tpu.md has the
term-by-term comparison):

* **arguments** = parameter + optimizer-state + batch shards. On a TPU each array is stored in
  (8, 128) tiles of its two minor dims (XLA picks which two; we take the cheapest pair), a rank-1
  array in 128-element rows, so a 64-wide head dim costs twice its bytes. Exact to <0.5% on v5p.
* **temp** = the largest of three phases, not their sum (XLA reuses freed scratch):
  - *loss head*: every layer's saved residuals + the loss head's vocab-sized fp32 buffers
    (logits, their gradient, and a bf16 copy of it for the two MXU matmuls: 2.5x the logits; 1.5x
    when the vocab is split over the tensor axis, where the softmax is reduced piecewise) + a bf16
    copy of the gathered embedding (FSDP);
  - *weights*: FSDP's all-gathered layer weights and their unsharded gradients before the
    reduce-scatter (XLA's collective combiners gather and scatter all layers at once), 2.5x the
    gathered layer bytes (fp32 weights and grads, bf16 copies of some), plus the gathered embedding;
  - *block backward*: every layer's saved residuals + the intermediates a rematerialised block
    recomputes (what ``none`` would have kept, less what the policy kept; fp32) + the gathered
    layer weights (FSDP).
* **saved residuals per layer** come from JAX's partial evaluation of the block
  (``saved_residuals``) at the device-local shapes, for the remat policy: dots_saveable keeps the
  matmul outputs, nothing_saveable the block input; flash attention keeps q, k, v, o and one
  float per row instead of (B, H, T, T) scores, all fp32 as JAX saves them. For ``none`` on a TPU
  we count dots_saveable's set:
  XLA's TPU fusion recomputes the elementwise residuals ``none`` would keep (measured: compiled
  temp of none and dots_saveable within a few percent of each other).

The 2.5x / 1.5x / 2.5x buffer counts were read off the buffer assignment of v5p compiles of two
width-256 LMs; they are the model's only fitted numbers. What the model cannot see is XLA's
schedule: which phase peaks, and how far the combiners stretch live ranges.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from torchnitro.xla.lm import batch_spec
from torchnitro.xla.model import LMConfig, _block, _layer_shapes, attention_fn, param_spec
from torchnitro.xla.remat import layer_policies, remat_block
from torchnitro.xla.train import TrainStep

__all__ = ["MemoryEstimate", "estimate_memory", "tpu_array_bytes", "layer_residual_bytes",
           "HEAD_BUFFERS", "HEAD_BUFFERS_SPLIT_VOCAB", "GATHER_BUFFERS"]

HEAD_BUFFERS = 2.5  # fp32 logits + fp32 dlogits + bf16 dlogits, in units of the local fp32 logits
HEAD_BUFFERS_SPLIT_VOCAB = 1.5  # the same with the vocab split over the tensor axis
GATHER_BUFFERS = 2.5  # FSDP-gathered layer weights + unsharded grads (+ bf16 copies), in gathered fp32 weights


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def tpu_array_bytes(shape: Sequence[int], itemsize: int) -> int:
    """Bytes of an array in TPU HBM: two minor dims in (8, 128) tiles (cheapest pair), rank 1 in 128s."""
    if len(shape) == 0:
        return itemsize
    if len(shape) == 1:
        return _round_up(shape[0], 128) * itemsize
    best = None
    for minor, second in itertools.permutations(range(len(shape)), 2):
        rest = math.prod(s for i, s in enumerate(shape) if i not in (minor, second))
        b = rest * _round_up(shape[minor], 128) * _round_up(shape[second], 8) * itemsize
        best = b if best is None else min(best, b)
    return int(best)


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
    saved: int  # residuals every layer keeps for the backward pass, by remat policy
    head: int  # the loss head's vocab-sized fp32 buffers (and the gathered embedding's bf16 copy)
    gathered: int  # FSDP: gathered weights + unsharded gradients (0 without an fsdp split)
    backward: int  # one rematerialised block's recomputed intermediates + the gathered layer weights (FSDP)

    @property
    def argument(self) -> int:
        return self.params + self.opt_state + self.batch

    @property
    def temp(self) -> int:
        return max(self.saved + self.head, self.saved + self.backward, self.gathered)

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
                    remat: str | Sequence[str] = "none") -> MemoryEstimate:
    """The analytic per-device estimate for ``step`` (built by lm_train_step) at this batch shape."""
    tpu = step.mesh.devices.flat[0].platform == "tpu"
    params = param_spec(cfg)
    opt = jax.eval_shape(step.optimizer.init, params)
    seqs, tp, fsdp, vocab = _local(step, cfg, batch_size)
    per_policy = {p: layer_residual_bytes(cfg, p, seqs, seq_len, tp, tpu) for p in set(layer_policies(remat,
                                                                                                       cfg.n_layers))}
    saved = sum(per_policy[p] for p in layer_policies(remat, cfg.n_layers))
    logits = seqs * seq_len * vocab * 4
    embed = vocab * cfg.padded_dim * 4  # the embedding as gathered for the head matmul (fsdp undone)
    k = HEAD_BUFFERS_SPLIT_VOCAB if vocab != cfg.padded_vocab else HEAD_BUFFERS
    head = int(k * logits) + (embed // 2 if fsdp > 1 else 0)
    p = _tree_bytes(params, step.param_shardings, tpu)
    layers_full = _tree_bytes(params["layers"], step.param_shardings["layers"], tpu=False) * fsdp  # fsdp undone
    gathered = int(GATHER_BUFFERS * layers_full) + embed if fsdp > 1 else 0
    # a block under remat recomputes its forward inside the backward: everything "none" would keep, less what
    # the policy kept, is live for that block
    full = layer_residual_bytes(cfg, "none", seqs, seq_len, tp, tpu=False)
    recompute = max((full - layer_residual_bytes(cfg, p, seqs, seq_len, tp, tpu=False)
                     for p in per_policy if p != "none"), default=0)
    backward = recompute + (layers_full if fsdp > 1 else 0)
    return MemoryEstimate(params=p, opt_state=_tree_bytes(opt, step.opt_shardings, tpu),
                          batch=_tree_bytes(batch_spec(batch_size, seq_len), step.batch_shardings, tpu),
                          saved=saved, head=head, gathered=gathered, backward=backward)
