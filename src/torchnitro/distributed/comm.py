"""The communication a layout runs per training step, and what it costs under an alpha-beta model per link.

``collectives(model_config, cfg, batch=..., seq=...)`` lists, for one rank, every collective of one
optimizer step with the bytes of its full buffer (all-gather output, reduce-scatter input, all-reduce
tensor, point-to-point message) -- the same quantity ``counter.CommCounter`` counts from the ops a real step
dispatches, so the two can be compared exactly (benchmarks/distributed.py, tests/distributed).

What each strategy runs (as torch 2.x does it for ``TransformerLM``):

- FSDP2: one all-gather per ``fully_shard`` group (the root: embedding, tied head, final norm; and each
  block) in forward, again in backward when it reshards after forward, and one reduce-scatter per group
  in backward. Buffers hold ``dp_shard`` padded shards (``ceil(rows / dp_shard)`` rows per tensor); the
  all-gather moves the parameter dtype, the reduce-scatter fp32 (the reduce dtype).
- HSDP: the same over ``dp_shard``, then an all-reduce of each group's gradient shard over ``dp_replicate``.
- DDP: all-reduces of the gradient buckets over ``dp_replicate`` (all parameters once; fp16/bf16 hooks
  halve the bytes); buckets of ``bucket_cap_mb`` with PyTorch's 1 MiB first bucket; a broadcast of the
  module buffers (RoPE tables) before each forward.
- TP: per block two all-reduces of the (B, T, D) activations in forward (after ``wo`` and ``w2``,
  rowwise) and one per column-wise projection in backward (q, k, v, gate, up: their input gradient).
- PP: per micro-batch, a send of (b, T, D) activations out of every stage but the last and of their
  gradient out of every stage but the first; with tied embeddings one all-reduce of the shared weight's
  gradient between the first and the last stage.

Time: ring collectives, ``(n-1)`` (all-gather, reduce-scatter) or ``2(n-1)`` (all-reduce) steps of
latency ``alpha`` plus ``(n-1)/n`` or ``2(n-1)/n`` of the buffer over the link's bandwidth. A group whose
ranks fit in one node uses the intra-node link (NVLink), otherwise the inter-node one (the slowest hop
bounds a ring). Ranks are placed node by node with ``tp`` innermost (the mesh order ``pp, dp_replicate,
dp_shard, tp``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from torchnitro.distributed.config import MESH_DIMS, ParallelConfig
from torchnitro.errors import InputError

__all__ = ["Link", "Cluster", "Collective", "collectives", "collective_totals", "collective_time", "link_of",
           "fsdp_groups", "DTYPE_BYTES", "padded_elements"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_FIRST_BUCKET = 1024 * 1024  # DDP's first gradient bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES)


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s one rank sends over this link, one direction
    alpha_s: float  # latency of one message step of a ring


@dataclass(frozen=True)
class Cluster:
    gpus: int  # ranks in the job
    gpus_per_node: int = 8  # ranks that share the intra-node link
    gpu_mem: float = 80e9  # bytes of memory per rank
    flops: float = 989e12  # peak dense FLOP/s per rank in the compute dtype (H100 SXM bf16)
    efficiency: float = 0.5  # fraction of peak a training step's compute reaches (measured MFU, or a guess)
    intra: Link = field(default_factory=lambda: Link(450e9, 5e-6))  # NVLink 900 GB/s both ways = 450 one way
    inter: Link = field(default_factory=lambda: Link(50e9, 15e-6))  # 400 Gb/s InfiniBand per GPU


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather, reduce_scatter, all_reduce, send
    dim: str  # mesh dim of the group: pp, dp_replicate, dp_shard, tp
    size: int  # ranks in the group
    bytes: int  # full buffer: all-gather output, reduce-scatter input, all-reduce tensor, message
    count: int  # how many of these per optimizer step
    phase: str  # forward, backward, after_backward (nothing to overlap with: all of it on the critical path)
    what: str = ""  # which tensors


def link_of(dim: str, cfg: ParallelConfig, cluster: Cluster) -> Link:
    """The link a group on ``dim`` runs over: intra-node when its ranks span at most one node."""
    inner = 1
    for name in reversed(MESH_DIMS):  # tp innermost
        if name == dim:
            break
        inner *= getattr(cfg, name)
    span = inner * getattr(cfg, dim)  # consecutive ranks one group reaches across
    return cluster.intra if span <= cluster.gpus_per_node else cluster.inter


def collective_time(c: Collective, link: Link) -> float:
    """Seconds for ``c.count`` collectives of ``c.bytes`` on ``link`` (ring algorithms)."""
    n = c.size
    if n <= 1:
        return 0.0
    if c.kind == "send":
        one = link.alpha_s + c.bytes / link.bandwidth
    elif c.kind == "all_reduce":
        one = 2 * (n - 1) * link.alpha_s + 2 * (n - 1) / n * c.bytes / link.bandwidth
    elif c.kind in ("all_gather", "reduce_scatter", "broadcast"):  # broadcast: pipelined ring, the same cost
        one = (n - 1) * link.alpha_s + (n - 1) / n * c.bytes / link.bandwidth
    else:
        raise InputError(f"collective_time: received kind {c.kind!r}, expected send, all_reduce, all_gather or "
                         "reduce_scatter.")
    return c.count * one


def fsdp_groups(model_config, cfg: ParallelConfig, pp_rank: int = 0) -> list[tuple[str, list[tuple[int, ...]]]]:
    """(name, TP-local parameter shapes) of every ``fully_shard`` group a rank holds: its stages' roots, then blocks.

    A rank with several pipeline stages has one root group per stage (embedding/norm/head only where present).
    """
    from torchnitro.distributed.planner import stage_shapes

    out = []
    for stage, named in stage_shapes(model_config, cfg, pp_rank):
        root = [sh for n, sh in named if not n.startswith("blocks.")]
        out.append((f"stage{stage}.root", root))
        blocks: dict[str, list] = {}
        for n, sh in named:
            if n.startswith("blocks."):
                blocks.setdefault(n.split(".")[1], []).append(sh)
        out.extend((f"blocks.{i}", shapes) for i, shapes in blocks.items())
    return out


def padded_elements(shapes: list[tuple[int, ...]], n: int) -> int:
    """Elements of ``n`` padded FSDP shards of these tensors (dim 0 cut in ``ceil(rows / n)``)."""
    return n * sum(math.ceil(sh[0] / n) * math.prod(sh[1:]) for sh in shapes)


def _ddp_buckets(model_config, cfg: ParallelConfig, e: int) -> list[int]:
    """Bytes of DDP's gradient buckets: parameters in reverse order, 1 MiB first bucket, then bucket_cap_mb."""
    from torchnitro.distributed.planner import stage_shapes

    sizes = [math.prod(sh) * e for _, named in stage_shapes(model_config, cfg, 0) for _, sh in named][::-1]
    buckets, cur, cap = [], 0, _FIRST_BUCKET
    for s in sizes:
        cur += s
        if cur >= cap:
            buckets.append(cur)
            cur, cap = 0, int(cfg.bucket_cap_mb * 1024 * 1024)
    if cur:
        buckets.append(cur)
    return buckets


def collectives(model_config, cfg: ParallelConfig, *, batch: int, seq: int, dtype: str = "fp32",
                pp_rank: int = 0) -> list[Collective]:
    """Every collective one rank runs in one optimizer step (forward + backward of ``batch`` global samples).

    ``dtype``: the model's parameter dtype (fp32, bf16); ``cfg.mixed_precision`` sets FSDP's compute dtype.
    """
    dp = cfg.dp_replicate * cfg.dp_shard
    if batch % dp:
        raise InputError(f"collectives: received batch={batch}, expected a multiple of the data-parallel degree {dp}.")
    e = DTYPE_BYTES[dtype]
    fsdp = cfg.strategy in ("fsdp", "hsdp")
    act = DTYPE_BYTES[cfg.mixed_precision] if fsdp and cfg.mixed_precision != "fp32" else e
    b = batch // dp  # samples per data-parallel rank
    mb = cfg.n_microbatches if cfg.pp > 1 else 1
    out: list[Collective] = []
    if fsdp:
        n, pe = cfg.dp_shard, DTYPE_BYTES[cfg.mixed_precision] if cfg.mixed_precision != "fp32" else e
        # forward gathers per micro-batch; in backward one gather per group, as a pipeline schedule keeps the
        # parameters unsharded from the first micro-batch's backward to the last (counted on gloo ranks:
        # results/distributed_planner.md); the reduce-scatter only after the last one
        for name, shapes in fsdp_groups(model_config, cfg, pp_rank):
            elems = padded_elements(shapes, n)
            out.append(Collective("all_gather", "dp_shard", n, elems * pe, mb, "forward", name))
            if cfg.reshard_after_forward:
                out.append(Collective("all_gather", "dp_shard", n, elems * pe, 1, "backward", name))
            out.append(Collective("reduce_scatter", "dp_shard", n, elems * 4, 1, "backward", name))
            if cfg.dp_replicate > 1:
                out.append(Collective("all_reduce", "dp_replicate", cfg.dp_replicate, elems // n * 4, 1,
                                      "backward", name))
    elif cfg.strategy == "ddp" and cfg.pp > 1:
        # PP x DDP has no DDP wrapper: the schedule accumulates every micro-batch, then the replicas average this
        # rank's gradients in one flat all-reduce (Pipeline._average_replicas), nothing left to overlap it with
        from torchnitro.distributed.planner import stage_shapes

        elems = sum(math.prod(sh) for _, named in stage_shapes(model_config, cfg, pp_rank) for _, sh in named)
        out.append(Collective("all_reduce", "dp_replicate", cfg.dp_replicate, elems * e, 1, "after_backward",
                              "stage gradients, one flat buffer"))
    elif cfg.strategy == "ddp":
        # DDP re-broadcasts module buffers before every forward (broadcast_buffers=True): here the RoPE cos/sin
        rope = 2 * model_config.max_seq_len * (model_config.head_dim // 2) * 4
        out.append(Collective("broadcast", "dp_replicate", cfg.dp_replicate, rope, 1, "forward", "module buffers"))
        scale = 2 if cfg.comm_hook in ("fp16", "bf16") else e
        for size in _ddp_buckets(model_config, cfg, e):
            out.append(Collective("all_reduce", "dp_replicate", cfg.dp_replicate, size // e * scale, 1, "backward",
                                  "gradient bucket"))
    if cfg.tp > 1:
        layers = model_config.n_layers
        one = b * seq * model_config.dim * act
        out.append(Collective("all_reduce", "tp", cfg.tp, one, 2 * layers, "forward", "wo, w2 outputs"))
        out.append(Collective("all_reduce", "tp", cfg.tp, one, 5 * layers, "backward", "wq, wk, wv, w1, w3 input grads"))
    if cfg.pp > 1:
        mine = list(range(pp_rank, cfg.n_stages, cfg.pp))
        message = b // mb * seq * model_config.dim * act
        fwd = sum(s != cfg.n_stages - 1 for s in mine) * mb
        bwd = sum(s != 0 for s in mine) * mb
        if fwd:
            out.append(Collective("send", "pp", cfg.pp, message, fwd, "forward", "activations to the next stage"))
        if bwd:
            out.append(Collective("send", "pp", cfg.pp, message, bwd, "backward", "gradients to the previous stage"))
        if model_config.tie_embeddings and (0 in mine or cfg.n_stages - 1 in mine):
            shard = math.ceil(model_config.vocab_size / cfg.dp_shard) * model_config.dim if fsdp else \
                model_config.vocab_size * model_config.dim
            out.append(Collective("all_reduce", "pp", 2, shard * 4, 1, "backward", "tied embedding/head gradient"))
    return out


def collective_totals(model_config, cfg: ParallelConfig, *, batch: int, seq: int, dtype: str = "fp32",
                      pp_rank: int = 0) -> dict[tuple[str, str], tuple[int, int]]:
    """{(kind, mesh dim): (calls, bytes)} of ``collectives(...)``, the form ``CommCounter.by_dim`` counts a step in."""
    calls: Counter = Counter()
    nbytes: Counter = Counter()
    for c in collectives(model_config, cfg, batch=batch, seq=seq, dtype=dtype, pp_rank=pp_rank):
        calls[(c.kind, c.dim)] += c.count
        nbytes[(c.kind, c.dim)] += c.bytes * c.count
    return {k: (calls[k], nbytes[k]) for k in nbytes}
