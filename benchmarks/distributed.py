"""Distributed benchmark. Sections (``--section``, default all):

- ``checkpoint``: how long a DCP checkpoint save blocks training, sync vs async, and host memory over
  repeated async saves (issue 18's async-checkpoint goal).
- ``planner``: the planner against real steps, one rank at a time on the fake process group (CPU, one
  process per check): per-rank parameter + gradient + AdamW-state bytes measured from the storages vs
  ``rank_state_bytes``, and the bytes of every collective of one step counted by ``CommCounter`` vs
  ``comm.collectives``, for 18 layouts (DP, FSDP, HSDP, TP, PP and mixes) at their first and last rank. A
  pipeline's sends carry no data on the fake backend: pipeline layouts of up to ``GLOO_MAX_WORLD`` ranks run
  on real gloo ranks instead (``pp_comm.check_pipeline_comm``: one warm-up step, one counted step, every rank).
  Writes results/distributed_planner.{json,md}.
- ``memory``: the planner's per-rank peak memory (``plan.rank_memory``) against the peak a real training step
  reaches (``distributed/measure.py``: the CPU allocator's live bytes, counted from its own allocation
  reports), for 20 layouts (DDP, FSDP incl. bf16/no-reshard/checkpointing, HSDP, TP, FSDP+TP, HSDP+TP, PP
  schedules, PP+FSDP, PP+DDP); layouts without pipeline stages at their first and last rank on the fake process
  group, pipelines on real gloo ranks (every rank). Writes results/distributed_memory.{json,md} and appends
  the table to results/distributed_planner.md.
- ``resume``: kill-and-resume trials. ``torchnitro train --nproc 2 --dp-shard 2 --max-restarts 2`` on the
  byte-level LM (workers forked from the prewarm server, train's default without CUDA); at a random logged step a random rank gets SIGKILL; torchrun restarts the group, which
  resumes from the last published checkpoint. Per trial: did it finish on its own, are the per-step losses
  (the last record of each step) bit-identical to one uninterrupted run, seconds from the kill to the
  first step logged by the restarted group, steps lost. Writes results/distributed_resume.{json,md}.
- ``scaling``: torchtitan's published tokens/s per GPU of Llama-3-8B under FSDP on 8 and 128 H100s (a cited
  constant, ``TORCHTITAN_LLAMA3_8B_FSDP``) beside plan-parallel's simulated ones from 8 to 128 GPUs (nothing
  measured here), and the weak-scaling efficiency of each. Writes results/distributed_scaling.{json,md}.

    flock /tmp/torchnitro-bench.lock python benchmarks/distributed.py [--quick] [--saves 40] [--section planner]

One process (world 1, in-memory store); the state is a TransformerLM and its AdamW state. Each save
is followed by one training step, as in a loop; "blocks" is the time save() takes to return (sync: the
whole write; async: the copy to host memory), "wait" the time the next PendingSave.wait() still
blocks. Memory is sampled before every save, once the previous one has finished (no host copy in flight,
the same point of every cycle), and once after the last: RSS, USS, PSS and the bytes glibc malloc holds in
use (``bench/growth.py``). Per series, the least-squares slope per save after a 5-save warm-up with its 95%
confidence interval; "no growth" means the interval's upper end lies far below the slope a leak of one state
copy per save would give (the copy's size is in the title). Two control rows: async with ``malloc_trim(0)``
before each sample (allocator retention vs live memory) and async with an injected leak of one
embedding-sized tensor per save (the statistic must find it). Writes results/distributed_<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
import torch.nn.functional as F

from torchnitro.bench import ResultTable
from torchnitro.bench.growth import fit_growth, memory_sample, trim_heap
from torchnitro.bench.provenance import provenance
from torchnitro.distributed import ModelState, ParallelConfig, init, save, shutdown
from torchnitro.nn.models import TransformerConfig, TransformerLM


def _setup(quick: bool):
    cfg = TransformerConfig(vocab_size=8192, dim=128 if quick else 512, n_layers=2 if quick else 8,
                            n_heads=4 if quick else 8, max_seq_len=128)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (4, 65))

    def step() -> None:
        F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # AdamW state exists from here on
    n = sum(p.numel() for p in model.parameters())
    return {"train": ModelState(model, opt)}, step, n


SERIES = {"rss": "RSS", "uss": "USS", "pss": "PSS", "malloc_in_use": "malloc in use"}
WARMUP = 5  # cycles left out of the fit: the first saves build DCP's planner caches and the allocator's pools


def _state_bytes(state) -> int:
    """Bytes of one host copy of the state: what an async save stages, and what a leak of one copy would add."""
    def walk(x) -> int:
        if isinstance(x, torch.Tensor):
            return x.nbytes
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0
    return sum(walk(v.state_dict() if isinstance(v, ModelState) else v) for v in state.values())


def _run(state, step, saves: int, async_: bool, directory: str, leak_bytes: int = 0, trim: bool = False) -> dict:
    """``leak_bytes`` > 0 keeps that many bytes alive per save (an injected leak: the statistic must see it);
    ``trim`` returns malloc's free heap pages to the system before each sample (allocator retention vs live)."""
    blocks, waits, samples, leaked = [], [], [], []
    pending = None
    for i in range(saves):
        t0 = time.perf_counter()
        if pending is not None:  # what the next save would wait for anyway, timed on its own
            pending.wait()
        t1 = time.perf_counter()
        if trim:
            trim_heap()
        samples.append(memory_sample())  # no save in flight: every sample at the same point of the cycle
        out = save(state, directory, step=i + 1, async_=async_, keep=2)
        t2 = time.perf_counter()
        if leak_bytes:
            leaked.append(torch.ones(leak_bytes // 4))  # touched, so resident
        pending = out if async_ else None
        blocks.append(t2 - t1)
        waits.append(t1 - t0)
        step()
    if pending is not None:
        pending.wait()
    if trim:
        trim_heap()
    samples.append(memory_sample())
    fits = {}
    for key in SERIES:
        ys = [s[key] for s in samples]
        if None not in ys and len(ys) - WARMUP >= 7:
            g = fit_growth(ys, warmup=WARMUP)
            fits[key] = {"slope_mib": g.slope / 2**20, "low_mib": g.low / 2**20, "high_mib": g.high / 2**20, "n": g.n}
    return {"block_median_s": statistics.median(blocks), "block_max_s": max(blocks),
            "wait_median_s": statistics.median(waits[1:]) if async_ and len(waits) > 1 else 0.0,
            "leak_injected_mib_per_save": leak_bytes / 2**20, "fits": fits,
            "samples_mib": {k: [None if s[k] is None else round(s[k] / 2**20, 2) for s in samples] for k in SERIES}}


def _verdict(r: dict, copy_mib: float) -> str:
    """What the fits say: any growth the interval proves, and whether one state copy per save is ruled out."""
    fits = r["fits"]
    if not fits:
        return "too few saves to fit"
    parts = [f"grows {f['slope_mib'] * 1024:.0f} KiB/save in {SERIES[k]} ({f['slope_mib'] / copy_mib:.3%} of a copy)"
             for k, f in fits.items() if f["low_mib"] > 0]
    bound = max(f["high_mib"] for f in fits.values())
    ruled = "rules out" if bound < copy_mib else "cannot rule out"
    parts.append(f"{ruled} one copy per save (highest upper bound {bound:+.2f} MiB/save = {bound / copy_mib:.1%} "
                 "of a copy)")
    return "; ".join(parts)


def checkpoint_section(args, meta) -> None:
    saves = 12 if args.quick else args.saves
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    init(ParallelConfig())
    try:
        state, step, n = _setup(args.quick)
        copy = _state_bytes(state)
        # the injected leak: one tensor the size of the embedding table per save, ~1/22 of a state copy
        leak = state["train"].model.embed.weight.nbytes
        rows = {}
        for mode, async_, leak_bytes, trim in (("sync", False, 0, False), ("async", True, 0, False),
                                               ("async, malloc_trim(0) before each sample", True, 0, True),
                                               ("async + injected leak", True, leak, False)):
            with tempfile.TemporaryDirectory() as d:
                rows[mode] = _run(state, step, saves, async_, d, leak_bytes, trim)
    finally:
        shutdown()
    copy_mib = copy / 2**20

    def ci(r, key):
        f = r["fits"].get(key)
        return "n/a" if f is None else f"{f['slope_mib']:+.2f} [{f['low_mib']:+.2f}, {f['high_mib']:+.2f}]"

    cols = [f"{name} slope MiB/save [95% CI]" for name in SERIES.values()]
    table = ResultTable(f"DCP save: {n / 1e6:.1f} M params + AdamW state ({copy_mib:.0f} MiB a copy), {saves} saves, "
                        "one process", ["mode", "save blocks (median s)", "save blocks (max s)",
                                        "next wait (median s)", *cols, "injected leak (MiB/save)", "verdict"],
                        meta=meta)
    for mode, r in rows.items():
        table.add(**{"mode": mode, "save blocks (median s)": round(r["block_median_s"], 4),
                     "save blocks (max s)": round(r["block_max_s"], 4),
                     "next wait (median s)": round(r["wait_median_s"], 4),
                     **{c: ci(r, k) for c, k in zip(cols, SERIES)},
                     "injected leak (MiB/save)": round(r["leak_injected_mib_per_save"], 2),
                     "verdict": _verdict(r, copy_mib)})
    table.meta.update(params=n, saves=saves, warmup=WARMUP, state_copy_mib=copy_mib, raw=rows, quick=args.quick,
                      note="slopes fitted over the idle samples after the warm-up (one per save, taken once the "
                           "previous save has finished, plus one after the last); a leak of one state copy per save "
                           f"would be a slope of {copy_mib:.0f} MiB/save in every column")
    _emit(table, "distributed_cpu_quick" if args.quick else "distributed_cpu")


# 100 vocab rows, 160 MLP rows, GQA 8/4 heads: uneven FSDP shards and TP splits of every kind
PLAN_MODEL = dict(vocab_size=100, dim=64, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=160, max_seq_len=32)
PLAN_LAYOUTS = [
    dict(dp_replicate=4), dict(dp_shard=4), dict(dp_shard=8, mixed_precision="bf16"),
    dict(dp_shard=8, reshard_after_forward=False), dict(dp_replicate=2, dp_shard=4), dict(tp=2), dict(tp=4),
    dict(dp_shard=2, tp=2), dict(dp_replicate=2, dp_shard=2, tp=2), dict(dp_shard=32),
    dict(dp_replicate=4, dp_shard=4, tp=2), dict(dp_shard=4, checkpointing="selective"), dict(pp=2),
    dict(pp=2, pp_schedule="interleaved1f1b", stages_per_rank=2), dict(pp=2, dp_shard=4),
    dict(pp=2, dp_replicate=2, dp_shard=2), dict(pp=4, dp_shard=8), dict(pp=2, dp_replicate=2),
    dict(pp=2, dp_shard=2),
]
GLOO_MAX_WORLD = 8  # pipeline layouts up to this many ranks also run on real gloo ranks (about 35 s for 8 on 2 cores)


def planner_section(args, meta) -> None:
    from rich.progress import track

    from torchnitro.distributed.plan import layout_name
    from torchnitro.distributed.pp_comm import LOSS_KEY, check_pipeline_comm
    from torchnitro.distributed.validate import check_layout_isolated
    from torchnitro.nn.models import TransformerConfig

    mc = TransformerConfig(**PLAN_MODEL)
    layouts = PLAN_LAYOUTS[:4] if args.quick else PLAN_LAYOUTS
    jobs = [(kw, r) for kw in layouts for r in sorted({0, ParallelConfig(**kw).world_size - 1})]
    table = ResultTable("Planner vs measured, one rank per check on the fake process group (CPU); pipeline "
                        "collectives counted on real gloo ranks",
                        ["layout", "ranks", "rank", "state bytes measured", "state bytes planned", "memory error",
                         "collectives counted on", "collective bytes counted", "collective bytes planned",
                         "worst collective error", "calls counted / planned"], meta=meta)
    worst_mem, worst_comm, failures = 0.0, 0.0, []
    gloo: dict[str, dict[int, object]] = {}  # pipeline layout -> rank -> RankComm
    for kw in layouts:
        cfg = ParallelConfig(**kw)
        if cfg.pp > 1 and cfg.world_size <= GLOO_MAX_WORLD:
            try:
                gloo[layout_name(cfg)] = {r.rank: r for r in check_pipeline_comm(mc, cfg, timeout=240)}
            except Exception as e:  # one failing layout must not take the table down
                failures.append(f"{layout_name(cfg)} on gloo: {str(e)[-300:]}")
    for kw, rank in track(jobs, description="planner checks"):
        cfg = ParallelConfig(**kw)
        try:
            c = check_layout_isolated(mc, cfg, rank=rank)
        except Exception as e:  # one failing layout must not take the table down
            failures.append(f"{layout_name(cfg)} rank {rank}: {str(e)[-300:]}")
            continue
        worst_mem = max(worst_mem, c.memory_error)
        row = {"layout": layout_name(cfg), "ranks": cfg.world_size, "rank": rank,
               "state bytes measured": c.measured.total, "state bytes planned": c.predicted.total,
               "memory error": f"{c.memory_error:.2%}"}
        if cfg.pp == 1:
            counted_d, planned_d, err, where = c.comm_counted, c.comm_predicted, c.comm_error, "fake"
        elif rank in gloo.get(layout_name(cfg), {}):
            r = gloo[layout_name(cfg)][rank]
            counted_d = {k: v for k, v in r.counted.items() if k != LOSS_KEY}
            planned_d, err, where = r.predicted, r.error, f"gloo, {cfg.world_size} ranks"
        else:
            table.add(**row, **{"collectives counted on": f"not counted (pipeline, > {GLOO_MAX_WORLD} ranks)",
                                "collective bytes counted": "n/a", "collective bytes planned": "n/a",
                                "worst collective error": "n/a", "calls counted / planned": "n/a"})
            continue
        worst_comm = max(worst_comm, err)
        table.add(**row, **{"collectives counted on": where,
                            "collective bytes counted": sum(b for _, b in counted_d.values()),
                            "collective bytes planned": sum(b for _, b in planned_d.values()),
                            "worst collective error": f"{err:.2%}",
                            "calls counted / planned": f"{sum(n for n, _ in counted_d.values())} / "
                                                       f"{sum(n for n, _ in planned_d.values())}"})
    pipeline_gloo = {name: {rank: {"pp_rank": r.pp_rank, "error": r.error,
                                   "counted": [[*k, *v] for k, v in r.counted.items()],
                                   "predicted": [[*k, *v] for k, v in r.predicted.items()]}
                            for rank, r in ranks.items()} for name, ranks in gloo.items()}
    table.meta.update(model=PLAN_MODEL, layouts=len(layouts), checks=len(jobs), failures=failures,
                      worst_memory_error=worst_mem, worst_collective_error=worst_comm,
                      goal="memory within 5%, bytes per collective within 1%", pipeline_gloo=pipeline_gloo,
                      note="layouts without pipeline stages: collectives counted on the fake backend (one rank per "
                           "process); pipeline layouts of up to "
                           f"{GLOO_MAX_WORLD} ranks: on real gloo ranks (pp_comm.check_pipeline_comm: one warm-up "
                           "step, then one counted step; every rank's counts in meta pipeline_gloo), larger ones "
                           "not counted (their sends carry no data on the fake backend). Not in the comparison: "
                           "the 4-byte loss broadcast over pp that Pipeline.step runs for logging")
    _emit(table, "distributed_planner_quick" if args.quick else "distributed_planner")
    if not args.quick:
        _attach("distributed_planner", "distributed_memory")
    print(f"worst memory error {worst_mem:.2%}, worst collective-bytes error {worst_comm:.2%}, "
          f"{len(failures)} failed checks")


# the memory section's model: activations dominate a rank's peak at (4 samples x 64 tokens) per rank
MEM_MODEL = dict(PLAN_MODEL, max_seq_len=64)
MEM_LAYOUTS = [
    dict(dp_replicate=2), dict(dp_shard=4), dict(dp_shard=8), dict(dp_shard=4, mixed_precision="bf16"),
    dict(dp_shard=4, reshard_after_forward=False), dict(dp_shard=4, checkpointing="blocks"),
    dict(dp_shard=4, checkpointing="selective"), dict(dp_replicate=2, dp_shard=2), dict(tp=2), dict(tp=4),
    dict(dp_shard=2, tp=2), dict(dp_replicate=2, dp_shard=2, tp=2), dict(tp=2, checkpointing="selective"),
    dict(pp=2), dict(pp=2, pp_schedule="gpipe", microbatches=4),
    dict(pp=2, pp_schedule="interleaved1f1b", stages_per_rank=2), dict(pp=2, checkpointing="blocks", microbatches=4),
    dict(pp=2, dp_shard=2), dict(pp=2, dp_replicate=2), dict(pp=2, dp_replicate=2, pp_schedule="gpipe", microbatches=4),
]


def memory_section(args, meta) -> None:
    """Planner per-rank peak memory vs the allocator's measured peak of a real training step (measure.py)."""
    from rich.progress import track

    from torchnitro.distributed.measure import measure_isolated, measure_ranks
    from torchnitro.distributed.plan import layout_name, rank_memory
    from torchnitro.nn.models import TransformerConfig

    mc, per_rank, seq = TransformerConfig(**MEM_MODEL), 4, 64
    layouts = MEM_LAYOUTS[:3] + MEM_LAYOUTS[-1:] if args.quick else MEM_LAYOUTS
    table = ResultTable("Planner vs measured peak memory per rank, one training step on CPU",
                        ["layout", "ranks", "rank", "ranks run as", "peak in", "state measured = planned",
                         "forward left (measured)", "activations held (planned)", "activation error",
                         "peak measured", "peak planned", "peak error", "unseen frees"], meta=meta)
    failures, errors = [], []
    for kw in track(layouts, description="memory checks"):
        cfg = ParallelConfig(**kw)
        batch = per_rank * cfg.dp_replicate * cfg.dp_shard
        try:
            if cfg.pp > 1:
                runs, how = measure_ranks(mc, cfg, batch=batch, seq=seq), "gloo processes"
            else:
                ranks = sorted({0, cfg.world_size - 1})
                runs, how = [measure_isolated(mc, cfg, rank=r, batch=batch, seq=seq) for r in ranks], "fake group"
        except Exception as e:  # one failing layout must not take the table down
            failures.append(f"{layout_name(cfg)}: {str(e)[-300:]}")
            continue
        for m in runs:
            p = rank_memory(mc, cfg, batch=batch, seq=seq, pp_rank=m.pp_rank, dp_shard_index=m.dp_shard_index,
                            device="cpu")
            planned_state = p.parameters + p.gradients + p.optimizer_state
            err = (p.total - m.peak) / m.peak
            errors.append(err)
            # without resharding after forward, the forward also leaves every FSDP group gathered
            left = p.stored + (p.comm_buffers if cfg.strategy in ("fsdp", "hsdp") and not cfg.reshard_after_forward
                               else 0)
            act_err = f"{(left - m.forward_left) / m.forward_left:+.2%}" if cfg.pp == 1 else "n/a"
            table.add(**{"layout": layout_name(cfg), "ranks": cfg.world_size, "rank": m.rank, "ranks run as": how,
                         "peak in": m.phase, "state measured = planned": "yes" if m.state.total == planned_state
                         else f"no ({m.state.total} vs {planned_state})",
                         "forward left (measured)": m.forward_left if cfg.pp == 1 else "n/a (pipeline)",
                         "activations held (planned)": left, "activation error": act_err,
                         "peak measured": m.peak, "peak planned": p.total, "peak error": f"{err:+.2%}",
                         "unseen frees": m.unseen_frees})
    within = sum(abs(e) <= 0.05 for e in errors)
    table.meta.update(model=MEM_MODEL, per_rank_batch=per_rank, seq=seq, layouts=len(layouts), checks=len(errors),
                      within_5_percent=within, worst_peak_error=max(map(abs, errors), default=None),
                      failures=failures, goal="planner memory per rank within 5% of measured for >= 12 layouts",
                      measured="the most bytes live at once in the CPU allocator during the second training step "
                               "(torch.profiler memory events, window opened before the model is built), see "
                               "src/torchnitro/distributed/measure.py",
                      forward_left="live at the end of forward minus live at the step's start: saved activations, "
                                   "the loss, FSDP groups not resharded after forward (planned: the held "
                                   "activations, plus the gathered groups without resharding)",
                      unseen_frees="bytes allocated again at an address whose free the profiler never recorded "
                                   "(the block stops counting there); collectives return only once gloo's worker "
                                   "thread has let go of their tensors, so frees happen on the measured thread",
                      load_average_at_end=" ".join(f"{x:.2f}" for x in os.getloadavg()))
    _emit(table, "distributed_memory_quick" if args.quick else "distributed_memory")
    if not args.quick:
        _attach("distributed_planner", "distributed_memory")
    print(f"{within} of {len(errors)} rank checks within 5%, worst {max(map(abs, errors), default=0):.2%}, "
          f"{len(failures)} failed layouts")


# torchtitan's published Llama 3.1 8B FSDP rows (not ours): benchmarks/llama3_h100_202412_torchtitan.md at
# pytorch/torchtitan commit 820504e20d1149fbf0b98c567af24c4b0433b22d (the same numbers as docs/performance.md at
# d4c86e3758a84cf23e2e879ab3c995cba9d5e410), Tables 1 (8 GPUs) and 3 (128 GPUs): 1D FSDP over all GPUs, local
# batch 2 (global 16 / 256), selective activation checkpointing, bf16 parameters with fp32 reduction (torchtitan's
# defaults), H100 SXM 96 GB HBM2e at a 500 W power limit, NVLink in the node, 400 Gb/s RDMA per GPU between nodes;
# torch 1963fc8 / torchao eab345c / torchtitan 9dec370 (Dec 2024); TPS/GPU read at iteration 90. The tables do
# not state the sequence length: 8192 is the llama3_8b.toml preset at torchtitan 9dec370 (an inference). No
# 16/32/64-GPU rows were published.
TORCHTITAN_LLAMA3_8B_FSDP = {
    "FSDP": {8: 5762, 128: 5605},
    "FSDP + torch.compile": {8: 6667, 128: 6514},
    "FSDP + torch.compile + Float8": {8: 8532, 128: 8380},
}
TORCHTITAN_SOURCE = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md @ 820504e20d11 (Tables 1 and 3; "
                     "runs of Dec 2024 at torchtitan 9dec370)")


def scaling_section(args, meta) -> None:
    """torchtitan's published tokens/s per GPU beside plan-parallel's simulated ones for the same setup.

    Rows per setting and GPU count. The published settings are simulated with the planner's compute speed
    (``Cluster.efficiency``) calibrated so its 8-GPU step equals the published 8-GPU step: the 128-GPU row then
    tests only what the planner adds with scale (the communication model and its overlap). The planner cannot
    express torch.compile or Float8 except through that calibrated speed (its FSDP all-gather stays bf16;
    torchtitan's fp8 all-gather is off by default and the table does not say), nor torchtitan's unresharded
    last block. A what-if setting follows (the FSDP row with a node-spanning ring given 8 NICs' bandwidth, 400
    GB/s per rank, instead of the planner's one NIC, 50 GB/s: not the planner's model), then two uncalibrated
    settings: the planner's default 50% of peak at torchtitan's local batch 2, and the seed's setting (one
    sequence per GPU), which gave "74% at 32 GPUs".
    """
    from dataclasses import replace as _replace

    from torchnitro.distributed.comm import Cluster, Link
    from torchnitro.distributed.plan import MODELS, step_time
    from torchnitro.nn.models import TransformerConfig

    seq, gpu_counts = 8192, (8, 16, 32, 64, 128)
    mc = TransformerConfig(**MODELS["llama3-8b"])
    table = ResultTable("Llama-3-8B FSDP weak scaling, 8-128 H100: torchtitan's PUBLISHED numbers beside "
                        "plan-parallel's SIMULATED ones (seq 8192, selective checkpointing, bf16 compute, fp32 "
                        "reduce-scatter, NVLink 450 GB/s, IB 50 GB/s per GPU)",
                        ["setting", "GPUs", "local batch", "published TPS/GPU (torchtitan)",
                         "published weak scaling vs 8", "compute speed (simulated)", "step ms (simulated)",
                         "exposed comm ms (simulated)", "tokens/s/GPU (simulated)", "weak scaling vs 8 (simulated)"],
                        meta=meta)

    def simulate(gpus: int, local: int, efficiency: float, inter: Link | None = None):
        cfg = ParallelConfig(dp_shard=gpus, mixed_precision="bf16", checkpointing="selective")
        cl = Cluster(gpus=gpus, gpu_mem=96e9, efficiency=efficiency)
        cl = _replace(cl, inter=inter) if inter is not None else cl
        t = step_time(mc, cfg, cl, batch=gpus * local, seq=seq, dtype="fp32")
        return t, local * seq / t.total_s

    def calibrate(published_8: float) -> float:
        # at 8 GPUs (one node) the data-parallel traffic hides under compute except the ends, which do not depend
        # on the compute speed: solve compute = step - exposed for the efficiency, then check it
        t, _ = simulate(8, 2, 0.5)
        compute = 2 * seq / published_8 - (t.total_s - t.compute_s)
        eff = 0.5 * t.compute_s / compute
        _, tps = simulate(8, 2, eff)
        if abs(tps / published_8 - 1) > 1e-3:
            raise AssertionError(f"calibration missed: {tps:.0f} simulated vs {published_8} published tokens/s/GPU")
        return eff

    settings = [(name, 2, calibrate(pub[8]), pub, None) for name, pub in TORCHTITAN_LLAMA3_8B_FSDP.items()]
    # what-if, not the planner's model: a shard group's ring leaves the node over all 8 of its NICs (one ring per
    # NIC), so a rank's share of the cross-node bandwidth is 8 x 50 GB/s instead of its own NIC's 50 GB/s
    fsdp = TORCHTITAN_LLAMA3_8B_FSDP["FSDP"]
    settings += [("FSDP, what-if: cross-node rings over 8 NICs (400 GB/s per rank)", 2, calibrate(fsdp[8]), fsdp,
                  Link(400e9, 15e-6))]
    settings += [("planner default (uncalibrated)", 2, 0.5, {}, None),
                 ("seed setting (uncalibrated)", 1, 0.5, {}, None)]
    for name, local, eff, pub, inter in settings:
        base = None
        for gpus in gpu_counts:
            t, tps = simulate(gpus, local, eff, inter)
            base = base or tps
            row = {"setting": name, "GPUs": gpus, "local batch": local,
                   "compute speed (simulated)": f"{eff:.1%} of 989 TFLOP/s",
                   "step ms (simulated)": round(t.total_s * 1e3, 1),
                   "exposed comm ms (simulated)": round((t.total_s - t.compute_s) * 1e3, 1),
                   "tokens/s/GPU (simulated)": round(tps), "weak scaling vs 8 (simulated)": f"{tps / base:.1%}"}
            if gpus in pub:
                row.update({"published TPS/GPU (torchtitan)": pub[gpus],
                            "published weak scaling vs 8": f"{pub[gpus] / pub[8]:.1%}"})
            table.add(**row)
    table.meta.update(
        simulated=True, published_source=TORCHTITAN_SOURCE,
        note="'published' columns are torchtitan's numbers (their H100 runs, not ours); every other number is "
             "plan-parallel's model, nothing here ran on a GPU. Published settings are simulated with the compute "
             "speed calibrated to their own 8-GPU row, so only the 16-128 GPU rows are predictions. torchtitan "
             "published no 16/32/64-GPU rows; the seq length 8192 is its llama3_8b.toml preset (the tables omit "
             "it). Not expressible in the planner: torch.compile and Float8 (only via the calibrated speed), "
             "torchtitan's unresharded last block, the optimizer step's own time (not modelled at any scale). "
             "The what-if rows change the cross-node bandwidth only; they are not what plan-parallel predicts.")
    _emit(table, "distributed_scaling")


RESUME_ARGS = ["--nproc", "2", "--dp-shard", "2", "--steps", "30", "--seq", "64", "--batch", "8", "--dim", "96",
               "--layers", "3", "--heads", "4", "--log-every", "1", "--ckpt-every", "5"]


def _train_cmd(ckpt: str, restarts: int, data: str = "DATA") -> list[str]:
    return [sys.executable, "-m", "torchnitro.cli", "train", *RESUME_ARGS, "--data", data, "--ckpt", ckpt,
            "--max-restarts", str(restarts)]


def _log(ckpt: str) -> list[dict]:
    path = Path(ckpt) / "log.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            pass
    return out


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}  # the last record of each step wins


def _workers(proc: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the train workers under the launcher."""
    out = {}
    for c in psutil.Process(proc.pid).children(recursive=True):
        try:
            env = c.environ()
            # the workers, not torchrun's agent (whose command line names the module too)
            if "torchnitro.distributed.train" in " ".join(c.cmdline()) and "RANK" in env:
                out[int(env["RANK"])] = c.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
            continue
    return out


def _trial(ckpt: str, data: str, rng: random.Random, reference: dict[int, float], timeout: float) -> dict:
    steps = int(RESUME_ARGS[RESUME_ARGS.index("--steps") + 1])
    kill_at = rng.randint(3, steps - 3)
    proc = subprocess.Popen(_train_cmd(ckpt, 2, data), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    t_kill = t_resumed = t_survivor_gone = None  # wall clock (time.time), comparable with the ranks' stamps
    victim = last_before = survivor = None
    old_pids: set[int] = set()
    created: list[float] = []
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            recs = _log(ckpt)
            if t_kill is None and recs and recs[-1]["step"] >= kill_at:
                ranks = _workers(proc)
                if len(ranks) == 2:
                    victim = rng.choice(sorted(ranks))
                    last_before = recs[-1]["step"]
                    old_pids = set(ranks.values())
                    survivor = ranks[1 - victim]
                    os.kill(ranks[victim], signal.SIGKILL)
                    t_kill = time.time()
            elif t_kill is not None and t_resumed is None:
                if t_survivor_gone is None and not psutil.pid_exists(survivor):
                    t_survivor_gone = time.time()
                if not created:
                    new = [pid for pid in _workers(proc).values() if pid not in old_pids]
                    created = [psutil.Process(pid).create_time() for pid in new if psutil.pid_exists(pid)]
                if any(r.get("restart", 0) > 0 for r in recs):
                    t_resumed = time.time()
                    first = next(r for r in recs if r.get("restart", 0) > 0)
            time.sleep(0.02)
        finished = proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        finished = False
    got = _losses(_log(ckpt))
    identical = finished and got == reference
    out = {"kill_at_step": last_before, "killed_rank": victim, "finished": finished, "identical": identical,
           "kill_to_first_resumed_step_s": (t_resumed - t_kill) if t_resumed and t_kill else None,
           "steps_lost": (last_before - (first["step"] - 1)) if t_resumed and last_before else None}
    if t_resumed and t_kill:
        out["phases_s"] = _phases(t_kill, t_survivor_gone, min(created) if created else None,
                                  first.get("startup", {}), t_resumed)
    return out


# where the time from kill to the first resumed step goes, in order (each phase ends at the named moment)
PHASES = (("survivor stopped", "torchrun notices the dead rank and stops the other"),
          ("workers started", "rendezvous of the next round, new worker processes forked"),
          ("imported", "python, torch and torchnitro imports (prewarm server: the client's start and the fork)"),
          ("initialized", "process group and device mesh"),
          ("loaded", "model built, parallelized, checkpoint loaded"),
          ("logged", "first resumed step run and logged"),
          ("seen", "the benchmark's poll of the log"))


def _phases(t_kill: float, gone: float | None, created: float | None, startup: dict, seen: float) -> dict:
    """Seconds of each phase of ``PHASES``; None where a moment was not observed."""
    moments = [gone, created, startup.get("imported"), startup.get("initialized"), startup.get("loaded"),
               startup.get("logged"), seen]
    out, prev = {}, t_kill
    for (name, _), t in zip(PHASES, moments):
        out[name] = None if t is None or prev is None else round(t - prev, 3)
        prev = t
    return out


def resume_section(args, meta) -> None:
    from rich.progress import track

    trials = 2 if args.quick else args.trials
    import shutil

    with tempfile.TemporaryDirectory() as d:
        # a frozen copy of real text (this package's sources): the live tree may change between runs
        data = str(Path(d) / "data")
        shutil.copytree(Path(__file__).resolve().parents[1] / "src" / "torchnitro" / "distributed", data)
        ref_dir = str(Path(d) / "reference")
        subprocess.run(_train_cmd(ref_dir, 0, data), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=600)
        reference = _losses(_log(ref_dir))
        rng = random.Random(0)
        rows = [_trial(str(Path(d) / f"trial{i}"), data, rng, reference, timeout=300)
                for i in track(range(trials), description="kill-and-resume trials")]
    table = ResultTable(f"Kill -9 of a random rank at a random step, torchnitro train --nproc 2 (CPU, gloo), "
                        f"{trials} trials", ["trial", "killed rank", "killed after step", "finished on its own",
                                             "losses identical", "kill -> first resumed step (s)", "steps lost"],
                        meta=meta)
    for i, r in enumerate(rows):
        t = r["kill_to_first_resumed_step_s"]
        table.add(**{"trial": i, "killed rank": r["killed_rank"], "killed after step": r["kill_at_step"],
                     "finished on its own": r["finished"], "losses identical": r["identical"],
                     "kill -> first resumed step (s)": round(t, 2) if t is not None else None,
                     "steps lost": r["steps_lost"]})
    times = [r["kill_to_first_resumed_step_s"] for r in rows if r["kill_to_first_resumed_step_s"] is not None]
    summary = {"trials": trials, "finished": sum(r["finished"] for r in rows),
               "identical": sum(r["identical"] for r in rows),
               "kill_to_resumed_median_s": statistics.median(times) if times else None,
               "kill_to_resumed_max_s": max(times) if times else None, "command": " ".join(_train_cmd("CKPT", 2)[1:]),
               "goal": "20 of 20 resume with identical losses; kill to first resumed step <= 10 s on CPU"}
    phased = [r["phases_s"] for r in rows if r.get("phases_s")]
    summary["phase_medians_s"] = {name: statistics.median(v) if v else None for name, _ in PHASES
                                  for v in [[p[name] for p in phased if p.get(name) is not None]]}
    summary["phases"] = {name: what for name, what in PHASES}
    table.meta.update(summary=summary, raw=rows, reference_losses=reference)
    _emit(table, "distributed_resume_quick" if args.quick else "distributed_resume")
    print(json.dumps(summary))


def _emit(table, name: str) -> None:
    from rich.console import Console

    Console().print(table.rich())
    paths = table.save(name)
    print("wrote " + ", ".join(str(p) for p in paths))


_MARK = "<!-- memory section: benchmarks/distributed.py --section memory -->"


def _attach(host: str, part: str) -> None:
    """Put results/<part>.md under results/<host>.md (replacing an earlier copy), so one page has both tables."""
    root = Path(__file__).resolve().parents[1] / "results"
    host_md, part_md = root / f"{host}.md", root / f"{part}.md"
    if not host_md.exists() or not part_md.exists():
        return
    text = host_md.read_text().split(_MARK)[0].rstrip() + "\n\n" + _MARK + "\n\n" + part_md.read_text()
    host_md.write_text(text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny model, 6 saves, 4 planner layouts: a smoke run")
    ap.add_argument("--saves", type=int, default=40)
    ap.add_argument("--section", choices=("all", "checkpoint", "planner", "memory", "scaling", "resume"),
                    default="all")
    ap.add_argument("--trials", type=int, default=20, help="kill-and-resume trials")
    args = ap.parse_args()
    meta = provenance("benchmarks/distributed.py", device="cpu")
    if args.section in ("all", "checkpoint"):
        checkpoint_section(args, meta)
    if args.section in ("all", "planner"):
        planner_section(args, dict(meta))
    if args.section in ("all", "memory"):
        memory_section(args, dict(meta))
    if args.section in ("all", "scaling"):
        scaling_section(args, dict(meta))
    if args.section in ("all", "resume"):
        resume_section(args, dict(meta))


if __name__ == "__main__":
    main()
