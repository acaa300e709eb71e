"""Per-rank memory of a parallel layout: parameters, gradients and optimizer state (the first part of
the parallelism planner; activations, comm buffers and step time come later, see docs/distributed.md).

Two layers, so the single-replica arithmetic lives in one place:

1. Tensor parallelism shrinks the model a rank holds: a ``StepShape`` with ``H/tp`` heads, ``Hkv/tp``
   K/V heads and ``F/tp`` MLP hidden size counts exactly one TP rank's parameters (embedding, norms
   and the tied head stay whole), so ``torchnitro.memory.planner``'s ``parameter_terms``,
   ``gradient_term`` and ``optimizer_state_term`` give the per-rank bytes before data parallelism.
2. FSDP2 then shards every tensor on dim 0 over ``dp_shard`` ranks. Its parameter and gradient
   storage is padded to ``ceil(rows / dp_shard)`` rows on every rank; the optimizer's state follows the
   unpadded local shard, so the last ranks hold less. This needs per-tensor shapes, read from the
   model built on the meta device (no memory) with the TP split table ``LM_TP_SPLIT``.

DDP and ``dp_replicate`` keep whole replicas (DDP's gradient buckets, another copy of the gradients,
are communication buffers and not counted here yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from torchnitro.distributed.config import ParallelConfig
from torchnitro.distributed.parallelize import LM_TP_SPLIT
from torchnitro.errors import InputError
from torchnitro.memory.planner import optimizer_state_term, parameter_terms, step_shape
from torchnitro.nn.models import TransformerConfig, TransformerLM

__all__ = ["RankState", "tp_local_shapes", "stage_shapes", "rank_state_bytes"]


@dataclass(frozen=True)
class RankState:
    parameters: int  # bytes of this rank's parameter storage (FSDP: the padded shard)
    gradients: int  # bytes of its gradient storage (FSDP: the padded reduce-scatter output)
    optimizer_state: int  # bytes of optimizer state tensors (FSDP: the unpadded local shard) + step counters

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state


def tp_local_shapes(model_config: TransformerConfig, tp: int) -> list[tuple[int, ...]]:
    """Shape of every parameter on one TP rank, in ``named_parameters`` order (tied weights once)."""
    return [sh for _, sh in _named_tp_shapes(model_config, tp)]


_SHAPES: dict[tuple[str, int], tuple] = {}


def _named_tp_shapes(model_config: TransformerConfig, tp: int) -> list[tuple[str, tuple[int, ...]]]:
    # cached by the config's repr (a dataclass is unhashable; its repr names every field): the planner asks often
    key = (repr(model_config), tp)
    if key not in _SHAPES:
        _SHAPES[key] = _build_tp_shapes(model_config, tp)
    return list(_SHAPES[key])


def _build_tp_shapes(model_config: TransformerConfig, tp: int) -> tuple:
    with torch.device("meta"):
        model = TransformerLM(model_config)
    out = []
    for name, p in model.named_parameters():
        shape = list(p.shape)
        split = LM_TP_SPLIT.get(name.split(".", 2)[-1].rsplit(".", 1)[0]) if name.startswith("blocks.") else None
        if split is not None:
            shape[split] //= tp
        out.append((name, tuple(shape)))
    return tuple(out)


def stage_shapes(model_config: TransformerConfig, cfg: ParallelConfig,
                 pp_rank: int = 0) -> list[tuple[int, list[tuple[str, tuple[int, ...]]]]]:
    """[(stage, [(name, TP-local shape)])] of the pipeline stages pp rank ``pp_rank`` holds (one stage without PP).

    As ``pipeline()`` builds them: the first stage has the embedding, the last the final norm and the head
    (with tied embeddings, its own copy named ``embed.weight``), each stage its blocks.
    """
    from torchnitro.distributed.pipeline import stage_ids, stage_layers

    named = _named_tp_shapes(model_config, cfg.tp)
    if cfg.pp == 1:
        return [(0, named)]
    if not 0 <= pp_rank < cfg.pp:
        raise InputError(f"stage_shapes: received pp_rank={pp_rank}, expected 0 <= pp_rank < pp={cfg.pp}.")
    by = dict(named)
    layers = stage_layers(model_config.n_layers, cfg.n_stages)
    out = []
    for s in stage_ids(cfg, pp_rank):
        first, last = s == 0, s == cfg.n_stages - 1
        mine = [(n, sh) for n, sh in named if n.startswith("blocks.") and int(n.split(".")[1]) in layers[s]]
        if first or (last and model_config.tie_embeddings):
            mine.insert(0, ("embed.weight", by["embed.weight"]))
        if last:
            mine.append(("norm.weight", by["norm.weight"]))
            if not model_config.tie_embeddings:
                mine.append(("lm_head.weight", by["lm_head.weight"]))
        out.append((s, mine))
    return out


def _rows(n: int, shards: int, index: int) -> int:
    """Rows of shard ``index`` when ``n`` rows are cut into ``chunk = ceil(n / shards)`` rows each."""
    chunk = math.ceil(n / shards)
    return max(0, min(chunk, n - index * chunk))


def rank_state_bytes(model_config: TransformerConfig, cfg: ParallelConfig, *, dp_shard_index: int = 0,
                     pp_rank: int = 0, dtype: str = "fp32", optimizer: str = "adamw") -> RankState:
    """Parameter, gradient and optimizer-state bytes held by the rank at ``dp_shard_index`` of the shard dim
    and ``pp_rank`` of the pipeline dim."""
    if not 0 <= dp_shard_index < cfg.dp_shard:
        raise InputError(f"rank_state_bytes: received dp_shard_index={dp_shard_index}, expected 0 <= index < "
                         f"dp_shard={cfg.dp_shard}.")
    cfg.check_model(model_config)
    s = step_shape(model_config, batch=1, seq=1, dtype=dtype, device="cpu")
    s = replace(s, H=s.H // cfg.tp, Hkv=s.Hkv // cfg.tp, F=s.F // cfg.tp)  # one TP rank's share of the blocks
    params = parameter_terms(s)[0].bytes  # [0]: the weights; RoPE buffers are not parameters
    state = optimizer_state_term(s, optimizer).bytes
    whole = tp_local_shapes(model_config, cfg.tp)
    numel = sum(math.prod(sh) for sh in whole)
    if numel * s.e != params:  # the meta model and the estimator must count the same tensors
        raise AssertionError(f"planner mismatch: {numel} params from the model, {params // s.e} from the estimator")
    # the state is k whole copies of the parameters (Adam's two moments) plus 4-byte step counters per tensor,
    # far smaller than one copy; the copies follow the unpadded shard, the counters stay one per tensor
    k, counters = divmod(state, numel * s.e)
    per_tensor = counters // len(whole)
    shapes = [sh for _, named in stage_shapes(model_config, cfg, pp_rank) for _, sh in named]
    n, i = cfg.dp_shard, dp_shard_index
    padded = sum(math.ceil(sh[0] / n) * math.prod(sh[1:]) for sh in shapes) * s.e
    local = sum(_rows(sh[0], n, i) * math.prod(sh[1:]) for sh in shapes) * s.e
    return RankState(padded, padded, k * local + per_tensor * len(shapes))
