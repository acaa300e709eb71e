"""The parallelism planner behind ``torchnitro plan-parallel``: per-rank memory and step time of every layout of
a ``TransformerLM`` config on a cluster, ranked, with the reasons for the choice.

Memory per rank (``rank_memory``) = parameters + gradients + optimizer state (``planner.rank_state_bytes``,
exact against real ranks) + activations (``torchnitro.memory.planner``'s per-layer and head terms on one
TP rank's shapes, for the micro-batches a pipeline stage holds at once, under the checkpointing policy)
+ communication buffers (FSDP: ``1 + prefetch`` gathered groups in the parameter dtype and one fp32
reduce-scatter input; DDP: its gradient buckets, a second copy of the gradients; PP: one receive buffer
each way per stage; PP x DDP: no buckets, but one flat copy of the gradients at the replicas' all-reduce
after the schedule, a moment of its own).

Step time (``step_time``) = compute + exposed communication. Compute: 6 FLOPs per matmul weight per token
(2 forward, 4 backward) + the attention term ``12 L T D`` per token (PaLM appendix B), one extra forward of
the blocks (``blocks``) or of ``wo``/``w2`` (``selective``) when recomputing, at ``cluster.flops *
cluster.efficiency``; pipelines stretch it by the bubble ``(m + (pp - 1) / v) / m`` for ``m`` micro-batches
and ``v`` stages per rank. Communication: ``comm.collectives`` timed by ``comm.collective_time``; TP
all-reduces and pipeline sends sit on the critical path; data-parallel gathers and reductions overlap
with compute (prefetch, bucketing) except what exceeds it and one group's gather and reduction at the ends;
PP x DDP's all-reduce runs after the schedule, all of it exposed.

Every number here is a model, not a measurement; benchmarks/distributed.py compares the bytes with what real
steps move and the state bytes with what real ranks hold (results/distributed_planner.md).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from torchnitro.distributed.comm import Cluster, collective_time, collectives, fsdp_groups, link_of
from torchnitro.distributed.comm import DTYPE_BYTES, padded_elements
from torchnitro.distributed.config import ParallelConfig
from torchnitro.distributed.planner import rank_state_bytes, stage_shapes
from torchnitro.errors import ConfigError, InputError
from torchnitro.memory.planner import checkpointed_activations, head_bytes, layer_terms, step_shape

__all__ = ["RankMemory", "StepTime", "PlanRow", "MODELS", "rank_memory", "step_time", "enumerate_layouts",
           "plan_parallel", "explain", "plan_table"]

# presets for --model; Llama shapes from their public configs (untied head, GQA)
MODELS = {
    "lm": dict(vocab_size=256, dim=256, n_layers=4, n_heads=4, max_seq_len=1024),
    "llama3-8b": dict(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0),
    "llama3-70b": dict(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       max_seq_len=8192, tie_embeddings=False, rope_theta=500000.0),
}


@dataclass(frozen=True)
class RankMemory:
    """What one rank holds at the peak of a step (the worst moment of its backward), term by term."""

    parameters: int
    gradients: int  # all of this rank's gradients (the state term; live at the peak: ``live_gradients``)
    optimizer_state: int
    activations: int  # saved for backward by the micro-batch chunks held at the peak
    comm_buffers: int  # FSDP's gathered groups, DDP's buckets, pipeline receive buffers, live at the peak
    temporaries: int = 0  # the backward's own: loss gradient, or one block's backward (and its recompute)
    live_gradients: int = 0  # gradients that exist at the peak (pipelines: earlier micro-batches' backward)
    stored: int = 0  # activations the held chunks keep before backward frees any (what a forward leaves)

    @property
    def total(self) -> int:
        return (self.parameters + self.optimizer_state + self.live_gradients + self.activations
                + self.comm_buffers + self.temporaries)


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # matmuls and attention of this rank, bubble included
    tp_s: float  # tensor-parallel all-reduces (exposed)
    pp_s: float  # pipeline sends and the tied-weight all-reduce (exposed)
    dp_s: float  # data-parallel gathers/reductions, all of them
    exposed_dp_s: float  # the part of dp_s that compute does not hide

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_s + self.pp_s + self.exposed_dp_s


@dataclass(frozen=True)
class PlanRow:
    cfg: ParallelConfig
    memory: RankMemory  # the rank that needs the most
    time: StepTime  # the slowest rank
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool

    @property
    def name(self) -> str:
        return layout_name(self.cfg)


def layout_name(cfg: ParallelConfig) -> str:
    parts = [f"{k}{getattr(cfg, a)}" for k, a in (("pp", "pp"), ("rep", "dp_replicate"), ("shard", "dp_shard"),
                                                   ("tp", "tp")) if getattr(cfg, a) > 1]
    name = " x ".join(parts) or "single"
    if cfg.pp > 1:
        v = "" if cfg.stages_per_rank == 1 else f" v{cfg.stages_per_rank}"
        name += f" ({cfg.pp_schedule}{v}, m{cfg.n_microbatches})"
    if cfg.strategy in ("fsdp", "hsdp") and cfg.mixed_precision != "fp32":
        name += f" {cfg.mixed_precision}"
    if cfg.strategy in ("fsdp", "hsdp") and not cfg.reshard_after_forward:
        name += " no-reshard"
    if cfg.checkpointing != "none":
        name += f" ac:{cfg.checkpointing}"
    return name


def _local_shape(model_config, cfg: ParallelConfig, *, micro: int, seq: int, dtype: str, device: str):
    # FSDP's mixed precision computes in its parameter dtype (no autocast casts kept)
    fsdp_mp = cfg.strategy in ("fsdp", "hsdp") and cfg.mixed_precision != "fp32"
    s = step_shape(model_config, batch=micro, seq=seq, dtype=cfg.mixed_precision if fsdp_mp else dtype, device=device)
    return replace(s, H=s.H // cfg.tp, Hkv=s.Hkv // cfg.tp, F=s.F // cfg.tp)


def _in_flight(cfg: ParallelConfig, pp_rank: int) -> int:
    """Micro-batch stage chunks whose activations a pp rank holds at its peak."""
    m, v, pp = cfg.n_microbatches, cfg.stages_per_rank, cfg.pp
    if pp == 1:
        return 1
    if cfg.pp_schedule == "gpipe":
        return m * v
    if cfg.pp_schedule == "1f1b":
        return min(m, pp - pp_rank)
    return min(m * v, (v - 1) * pp + 2 * (pp - pp_rank - 1) + 1)  # interleaved warm-up depth


def rank_memory(model_config, cfg: ParallelConfig, *, batch: int, seq: int, dtype: str = "fp32",
                optimizer: str = "adamw", pp_rank: int = 0, dp_shard_index: int = 0, device: str = "cuda") -> RankMemory:
    """Bytes one rank holds at its peak for a step of ``batch`` global samples of ``seq`` tokens.

    The peak of a step whose gradients start at None (``zero_grad(set_to_none=True)``) is in backward, at
    one of two moments (``_backward_moments``): as the loss gradient is formed (every activation still held)
    or at the start of the last block's backward (the head's activations freed; the block's backward
    intermediates, its recomputed activations under checkpointing, and the head's weight gradient live).
    A pipeline holds several micro-batch chunks at its first backward, and from its second backward on,
    the gradients as well: the larger of the two is its peak. Measured on CPU: results/distributed_planner.md.
    """
    dp = cfg.dp_replicate * cfg.dp_shard
    micro = batch // dp // (cfg.n_microbatches if cfg.pp > 1 else 1)
    if micro < 1 or batch % dp or (cfg.pp > 1 and (batch // dp) % cfg.n_microbatches):
        raise InputError(f"rank_memory: received batch={batch}, expected a multiple of data-parallel ranks x "
                         f"micro-batches = {dp} x {cfg.n_microbatches if cfg.pp > 1 else 1}.")
    state = rank_state_bytes(model_config, cfg, dp_shard_index=dp_shard_index, pp_rank=pp_rank, dtype=dtype,
                             optimizer=optimizer)
    s = _local_shape(model_config, cfg, micro=micro, seq=seq, dtype=dtype, device=device)
    layer, _ = layer_terms(s)
    stages = stage_shapes(model_config, cfg, pp_rank)
    n_layers = sum(len({n.split(".")[1] for n, _ in named if n.startswith("blocks.")}) for _, named in stages)
    last = cfg.pp == 1 or any(st == cfg.n_stages - 1 for st, _ in stages)
    head = head_bytes(s) if last else 0
    ck = checkpointed_activations(replace(s, L=n_layers), cfg.checkpointing, layer.bytes, head)
    v = cfg.stages_per_rank if cfg.pp > 1 else 1
    # one micro-batch's activations on one of this rank's stages; a pipeline stage also keeps the output it
    # sent (or the logits it computed the loss of) until that micro-batch's backward
    outputs = sum(micro * seq * (model_config.vocab_size if st == cfg.n_stages - 1 else model_config.dim) * s.c
                  for st, _ in stages) if cfg.pp > 1 else 0
    chunk = (ck.stored + head + outputs) / v
    held, chunks = _in_flight(cfg, pp_rank), (cfg.n_microbatches * v if cfg.pp > 1 else 1)
    pe = DTYPE_BYTES[cfg.mixed_precision] if cfg.strategy in ("fsdp", "hsdp") and cfg.mixed_precision != "fp32" \
        else DTYPE_BYTES[dtype]
    kept, roots, blocks, unsharded = _buffers(model_config, cfg, s, state, stages, pp_rank, micro, seq, pe)
    moments = _backward_moments(s, ck.recompute, head, pe if last else 0, roots, blocks)
    # (activations, temporaries, buffers, gradients) at each candidate moment; the first backward holds
    # `held` chunks, later ones (pipelines) at most one fewer but with every gradient of this rank made
    cands = [(held * chunk - freed, t, kept + g, 0) for freed, t, g in moments]
    if chunks > 1:  # under FSDP a pipeline stage accumulates unsharded gradients until its last micro-batch
        grads = unsharded if cfg.strategy in ("fsdp", "hsdp") else state.gradients
        cands += [(min(held, chunks - 1) * chunk - freed, t, kept + g, grads) for freed, t, g in moments]
    if cfg.pp > 1 and cfg.strategy == "ddp":  # the replicas' all-reduce after the schedule: activations are gone,
        # every gradient and one flat copy of them live (Pipeline._average_replicas); the copy is freed as the
        # step ends, not carried into the next one (a measurement that once said so: distributed/measure.py)
        cands.append((0, state.gradients, kept, state.gradients))
    acts, temps, buffers, grads = max(cands, key=sum)
    return RankMemory(state.parameters, state.gradients, state.optimizer_state, int(acts), buffers, int(temps), grads,
                      int(held * chunk))


def _backward_moments(s, recompute: int, head: int, head_grad_e: int, roots: int, blocks: int
                      ) -> list[tuple[int, int, int]]:
    """[(activations already freed, temporaries live, FSDP groups gathered)] at the two candidate peaks of one
    chunk's backward.

    The loss gradient: the fp32 NLL and log-softmax gradients, ``2 x 4BTV`` (last stage only); only the root
    groups are gathered yet. The last block's backward: the head's activations are gone, its weight gradient
    (``V x D``) exists, the block's recomputed activations (checkpointing), the gradient of its output
    (``e BTD``) and two ``c BTF`` MLP gradients live, and the block's group and those prefetched are gathered.
    """
    loss = 8 * s.BT * s.V if head else 0
    block = recompute + s.e * s.BT * s.D + 2 * s.c * s.BT * s.F + head_grad_e * s.V * s.D
    return [(0, loss, roots), (head, block, roots + blocks)]


def _buffers(model_config, cfg: ParallelConfig, s, state, stages, pp_rank: int, micro: int, seq: int, pe: int
             ) -> tuple[int, int, int, int]:
    """(buffers live all through backward, FSDP root groups gathered, FSDP block groups gathered at a block's
    backward, bytes of all this rank's FSDP groups unsharded).

    FSDP2/HSDP: the root groups (embedding, norm, head) stay gathered from forward to the end of backward; of
    the blocks, the one in backward and ``prefetch`` more are gathered (every block, without resharding after
    forward). A block's reduce-scatter input is made as its activations are freed, so it is not added.
    DDP: its gradient buckets, allocated once, a second copy of the gradients. PP: receive buffers.
    """
    buffers = roots = blocks = unsharded = 0
    if cfg.strategy in ("fsdp", "hsdp"):
        groups = fsdp_groups(model_config, cfg, pp_rank)
        sizes = {name: padded_elements(shapes, cfg.dp_shard) * pe for name, shapes in groups}
        roots, unsharded = sum(b for n, b in sizes.items() if n.endswith(".root")), sum(sizes.values())
        ordered = sorted((b for n, b in sizes.items() if not n.endswith(".root")), reverse=True)
        if cfg.reshard_after_forward:
            blocks = sum(ordered[:1 + cfg.prefetch])
        else:
            roots += sum(ordered)  # all gathered from their forward to their backward
    elif cfg.strategy == "ddp" and cfg.pp == 1:  # PP x DDP has no buckets: its flat all-reduce is a moment of its own
        buffers = state.gradients
    if cfg.pp > 1:  # one receive buffer per micro-batch, made at the first step and kept: activations into a
        # stage that is not the first, gradients into one that is not the last
        ends = sum((st > 0) + (st < cfg.n_stages - 1) for st, _ in stages)
        buffers += ends * cfg.n_microbatches * micro * seq * model_config.dim * s.c
    return buffers, roots, blocks, unsharded


def flops_per_rank(model_config, cfg: ParallelConfig, *, batch: int, seq: int, pp_rank: int = 0) -> tuple[float, float]:
    """(FLOPs this rank runs in one step with recomputation, FLOPs of the model's useful work per token)."""
    stages = stage_shapes(model_config, cfg, pp_rank)

    def matmul(named, block_only=False, names=None):
        tot = 0
        for n, sh in named:
            if n.startswith("blocks.") and len(sh) == 2 and (names is None or any(k in n for k in names)):
                tot += math.prod(sh)
            elif not block_only and n == "lm_head.weight":
                tot += math.prod(sh)
        return tot

    named = [x for _, nm in stages for x in nm]
    last = cfg.pp == 1 or any(st == cfg.n_stages - 1 for st, _ in stages)
    head = model_config.vocab_size * model_config.dim if last and model_config.tie_embeddings else 0  # tied head
    layers = len({n.split(".")[1] for n, _ in named if n.startswith("blocks.")})
    tokens = batch // (cfg.dp_replicate * cfg.dp_shard) * seq
    attn = 12 * layers * (model_config.dim // cfg.tp) * seq
    dense = 6 * (matmul(named) + head) + attn
    extra = 0
    if cfg.checkpointing == "blocks":
        extra = 2 * matmul(named, block_only=True) + attn / 3
    elif cfg.checkpointing == "selective":
        extra = 2 * matmul(named, block_only=True, names=("attn.wo", "mlp.w2"))
    n_all = sum(math.prod(sh) for _, sh in stage_shapes(model_config, ParallelConfig(), 0)[0][1]
                if len(sh) == 2) - (0 if model_config.tie_embeddings else model_config.vocab_size * model_config.dim)
    useful = 6 * n_all + 12 * model_config.n_layers * model_config.dim * seq
    return tokens * (dense + extra), useful


def step_time(model_config, cfg: ParallelConfig, cluster: Cluster, *, batch: int, seq: int, dtype: str = "bf16",
              pp_rank: int = 0) -> StepTime:
    """Seconds of one optimizer step on the rank at ``pp_rank`` (see the module docstring for the model)."""
    flops, _ = flops_per_rank(model_config, cfg, batch=batch, seq=seq, pp_rank=pp_rank)
    compute = flops / (cluster.flops * cluster.efficiency)
    if cfg.pp > 1:
        m, v = cfg.n_microbatches, cfg.stages_per_rank
        compute *= (m + (cfg.pp - 1) / v) / m
    cols = collectives(model_config, cfg, batch=batch, seq=seq, dtype=dtype, pp_rank=pp_rank)
    t = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    ends, after = {}, 0.0
    for c in cols:
        dt = collective_time(c, link_of(c.dim, cfg, cluster))
        t["tp" if c.dim == "tp" else "pp" if c.dim == "pp" else "dp"] += dt
        if c.phase == "after_backward":  # PP x DDP's all-reduce: after the schedule, nothing hides it
            after += dt
        elif c.dim.startswith("dp") and c.count:
            ends[c.kind] = max(ends.get(c.kind, 0.0), dt / c.count)
    exposed = max(0.0, t["dp"] - after - compute) + sum(ends.values()) + after
    return StepTime(compute, t["tp"], t["pp"], t["dp"], min(t["dp"], exposed))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(model_config, gpus: int, *, gpus_per_node: int = 8, batch: int,
                      checkpointing: tuple[str, ...] = ("none", "selective", "blocks"),
                      mixed_precision: str = "bf16") -> list[ParallelConfig]:
    """Every valid ``ParallelConfig`` for ``gpus`` ranks: DDP, FSDP, HSDP, TP (within a node), PP and their mixes
    (PP x FSDP/HSDP, and PP x DDP: replicas of the pipeline averaged after each step)."""
    out = []
    for pp, rep, shard in itertools.product(_divisors(gpus), repeat=3):
        if gpus % (pp * rep * shard):
            continue
        tp = gpus // (pp * rep * shard)
        if tp > gpus_per_node or (rep > 1 and shard == 1 and tp > 1):  # DDP over DTensors: not supported
            continue
        schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("interleaved1f1b", 2)]
        for (sched, v), ac in itertools.product(schedules, checkpointing):
            try:
                cfg = ParallelConfig(pp=pp, dp_replicate=rep, dp_shard=shard, tp=tp, pp_schedule=sched,
                                     stages_per_rank=v, checkpointing=ac,
                                     mixed_precision=mixed_precision if shard > 1 else "fp32")
                cfg.check_model(model_config)
            except ConfigError:
                continue
            dp = rep * shard
            if batch % dp or (pp > 1 and (batch // dp) % cfg.n_microbatches):
                continue
            out.append(cfg)
    return out


def plan_parallel(model_config, cluster: Cluster, *, batch: int, seq: int, dtype: str = "bf16",
                  optimizer: str = "adamw", checkpointing: tuple[str, ...] = ("none", "selective", "blocks"),
                  headroom: float = 0.9) -> list[PlanRow]:
    """Every layout, fitting ones first by predicted tokens/s per GPU, then the rest by memory.

    ``dtype``: the parameter dtype of layouts without FSDP (bf16 on GPUs); FSDP layouts keep fp32 master
    parameters and compute in bf16 (``mixed_precision``). ``headroom``: the share of ``gpu_mem`` a plan may use.
    """
    rows = []
    for cfg in enumerate_layouts(model_config, cluster.gpus, gpus_per_node=cluster.gpus_per_node, batch=batch,
                                 checkpointing=checkpointing, mixed_precision=dtype):
        pdtype = "fp32" if cfg.strategy in ("fsdp", "hsdp") else dtype
        mem = max((rank_memory(model_config, cfg, batch=batch, seq=seq, dtype=pdtype, optimizer=optimizer,
                               pp_rank=r) for r in range(cfg.pp)), key=lambda m: m.total)
        tm = max((step_time(model_config, cfg, cluster, batch=batch, seq=seq, dtype=pdtype, pp_rank=r)
                  for r in range(cfg.pp)), key=lambda t: t.total_s)
        _, useful = flops_per_rank(model_config, cfg, batch=batch, seq=seq)
        tps = batch * seq / tm.total_s / cluster.gpus
        rows.append(PlanRow(cfg, mem, tm, tps, tps * useful / cluster.flops, mem.total <= headroom * cluster.gpu_mem))
    rows.sort(key=lambda r: (not r.fits, -r.tokens_per_s_per_gpu if r.fits else r.memory.total))
    return rows


def explain(rows: list[PlanRow], cluster: Cluster) -> str:
    """One paragraph: why the first layout, against the fastest of each other family."""
    if not rows:
        return "No layout is valid for this model and GPU count (check the degrees against heads and layers)."
    best = rows[0]
    gb = 1e9
    if not best.fits:
        return (f"No layout fits {cluster.gpu_mem / gb:.0f} GB per GPU; the smallest, {best.name}, needs "
                f"{best.memory.total / gb:.1f} GB. Add GPUs, checkpoint activations, or shrink the batch.")
    t = best.time
    parts = [f"{best.name}: {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU (simulated), {best.memory.total / gb:.1f} "
             f"GB per rank of {cluster.gpu_mem / gb:.0f}. Compute {t.compute_s * 1e3:.1f} ms; tensor-parallel "
             f"{t.tp_s * 1e3:.1f} ms and pipeline {t.pp_s * 1e3:.1f} ms on the critical path; data-parallel "
             f"{t.dp_s * 1e3:.1f} ms of which {t.exposed_dp_s * 1e3:.1f} ms not hidden by compute."]
    seen = {_family(best.cfg)}
    for r in rows[1:]:
        fam = _family(r.cfg)
        if fam in seen:
            continue
        seen.add(fam)
        why = "does not fit" if not r.fits else f"{r.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu:.0%} of its speed"
        parts.append(f"Best {fam}: {r.name}, {why} ({r.memory.total / gb:.1f} GB, step {r.time.total_s * 1e3:.1f} ms).")
    return " ".join(parts)


def _family(cfg: ParallelConfig) -> str:
    kinds = [k for k, on in (("PP", cfg.pp > 1), ("TP", cfg.tp > 1), (cfg.strategy.upper(), cfg.strategy != "none"))
             if on]
    return "+".join(kinds) or "single"


def plan_table(rows: list[PlanRow], cluster: Cluster, top: int = 15):
    """A rich table of the first ``top`` rows (simulated numbers, labelled so)."""
    from rich.table import Table

    gb = 1e9
    table = Table(title=f"plan-parallel (simulated): {cluster.gpus} GPUs, {cluster.gpu_mem / gb:.0f} GB each")
    for col in ("#", "layout", "params+optim+live grads GB", "activations GB", "buffers+temporaries GB", "peak GB",
                "fits", "step ms", "exposed comm ms", "tokens/s/GPU", "MFU"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for i, r in enumerate(rows[:top], 1):
        m, t = r.memory, r.time
        table.add_row(str(i), r.name, f"{(m.parameters + m.optimizer_state + m.live_gradients) / gb:.2f}",
                      f"{m.activations / gb:.2f}", f"{(m.comm_buffers + m.temporaries) / gb:.2f}",
                      f"{m.total / gb:.2f}",
                      "yes" if r.fits else "no", f"{t.total_s * 1e3:.1f}", f"{(t.total_s - t.compute_s) * 1e3:.1f}",
                      f"{r.tokens_per_s_per_gpu:,.0f}", f"{r.mfu:.0%}")
    return table
