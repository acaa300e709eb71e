"""Measure what one rank holds at the peak of a training step: the quantity ``plan.rank_memory`` predicts.

"Measured" means: the most bytes live at once in the CPU allocator during the second training step of the
rank (the first one creates the optimizer state), counted from the allocator's own allocation and free
reports (``torch.profiler`` with ``profile_memory=True``: every ``c10`` CPU allocation and free with its
size, in order). The window opens before the model is built, so every byte the rank holds is in it:
parameters, optimizer state, gradients, saved activations, the all-gather/reduce-scatter buffers of FSDP,
DDP's buckets, pipeline receive buffers, and the temporaries live at that moment (the loss gradient, a
block's backward intermediates). Nothing is estimated; the counter is the allocator's.

The step is the trainer's (``train.train``): forward, fp32 cross-entropy, backward, AdamW step,
``zero_grad(set_to_none=True)``; a pipeline runs its schedule (``Pipeline.step``) over its micro-batches.
Alongside the peak: the parameter, gradient and optimizer-state storages (as ``validate`` measures them),
the bytes the forward left alive (live at the end of forward minus live at the step's start: saved
activations, the logits, FSDP groups not yet resharded), and the phase the peak fell in.

Ranks: ``measure_fake`` runs one rank of any layout without pipeline stages in this process on the fake
process group (collectives return at once; the buffers are allocated as on a real run);
``measure_isolated`` does so in a fresh process (DTensor caches sharding by mesh shape, see ``validate``);
``measure_ranks`` starts every rank of a layout as real gloo processes (pipelines need real sends: their
stages infer shapes by communicating). Tiny models only: this is a CPU check of the planner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from torchnitro.distributed.config import ParallelConfig
from torchnitro.distributed.planner import RankState

__all__ = ["StepMemory", "measure_step", "measure_fake", "measure_isolated", "measure_ranks"]


@dataclass
class StepMemory:
    cfg: ParallelConfig
    rank: int
    pp_rank: int
    dp_shard_index: int
    batch: int  # global samples per step
    seq: int
    peak: int  # most bytes live in the allocator during the measured step
    phase: str  # where the peak fell: forward, backward or optimizer ("step" for pipelines)
    start: int  # bytes live when the measured step began (parameters, optimizer state, buffers kept)
    forward_left: int  # bytes the forward left alive (0 for pipelines: forward and backward interleave)
    state: RankState  # parameter, gradient and optimizer-state storages


def _allocations(prof) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """[(time ns, signed bytes)] of every CPU allocation/free in time order, and {marker: start ns}."""
    from torch._C._profiler import _EventType

    allocs, marks = [], {}
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            if e.extra_fields.device.type == "cpu":
                allocs.append((e.start_time_ns, e.extra_fields.alloc_size))
        elif e.name.startswith("nitro."):
            marks[e.name] = e.start_time_ns
    allocs.sort()
    return allocs, marks


def _live(allocs, marks: dict[str, int]) -> tuple[int, str, int, int]:
    """(peak inside the measured step, its phase, live at the step's start, live at the end of forward)."""
    t0, t_fwd, t_bwd, t1 = (marks.get(f"nitro.{k}") for k in ("start", "forward_end", "backward_end", "end"))
    live, peak, phase, at_start, at_fwd = 0, 0, "", None, None
    for t, d in allocs:
        if at_start is None and t >= t0:
            at_start = live
        if t_fwd is not None and at_fwd is None and t >= t_fwd:
            at_fwd = live
        live += d
        if t0 <= t <= t1 and live > peak:
            peak = live
            phase = "step" if t_fwd is None else "forward" if t < t_fwd else "backward" if t < t_bwd else "optimizer"
    at_start = live if at_start is None else at_start
    return peak, phase, at_start, (at_fwd - at_start) if at_fwd is not None else 0


def _storages(tensors) -> int:
    from torchnitro.distributed.validate import storage_bytes

    return storage_bytes(tensors)


def measure_step(model_config, cfg: ParallelConfig, mesh, *, batch: int, seq: int, fake: bool = False,
                 seed: int = 0) -> StepMemory:
    """Build ``cfg`` on ``mesh`` (group already initialized), run two trainer steps, measure the second."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from torchnitro import distributed as D
    from torchnitro.distributed.train import next_token_loss
    from torchnitro.nn.models import TransformerLM

    dp = cfg.dp_replicate * cfg.dp_shard
    b = batch // dp
    pp_rank = mesh.get_local_rank("pp") if cfg.pp > 1 else 0
    shard = mesh.get_local_rank("dp_shard") if cfg.dp_shard > 1 else 0
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(0, model_config.vocab_size, (b, seq + 1), generator=g)  # (b, T+1): inputs and targets
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(seed)
        model = TransformerLM(model_config)
        if cfg.pp > 1:
            pipe = D.pipeline(model, cfg, mesh)
            owner = pipe.model
        else:
            owner = pipe = D.parallelize(model, cfg, mesh)
            if fake and cfg.strategy == "ddp":
                from torchnitro.distributed.validate import _record_ddp

                _record_ddp(owner, mesh["dp_replicate"].get_group())
        del model
        params = list(owner.parameters())
        opt = torch.optim.AdamW(params)
        grads = 0
        for step in range(2):
            measured = step == 1
            if measured:
                record_function("nitro.start").__enter__().__exit__(None, None, None)
            if cfg.pp > 1:
                pipe.step(x[:, :-1], x[:, 1:])
            else:
                loss = next_token_loss(owner, x)  # the trainer's loss: the logits are gone already
                if measured:
                    record_function("nitro.forward_end").__enter__().__exit__(None, None, None)
                loss.backward()
                del loss
            if measured:
                record_function("nitro.backward_end").__enter__().__exit__(None, None, None)
                grads = _storages(p.grad for p in params)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if measured:
                record_function("nitro.end").__enter__().__exit__(None, None, None)
    moments = _storages(v for s in opt.state.values() for k, v in s.items() if k != "step")
    counters = sum(4 for s in opt.state.values() if "step" in s)
    state = RankState(_storages(params), grads, moments + counters)
    peak, phase, start, forward_left = _live(*_allocations(prof))
    return StepMemory(cfg, dist.get_rank(), pp_rank, shard, batch, seq, peak, phase, start, forward_left, state)


def measure_fake(model_config, cfg: ParallelConfig, *, rank: int = 0, batch: int = 0, seq: int = 16) -> StepMemory:
    """``measure_step`` as rank ``rank`` of a fake ``cfg.world_size``-rank job in this process (no pipelines)."""
    from torchnitro import distributed as D
    from torchnitro.distributed.validate import fake_group

    if cfg.pp > 1:
        raise ValueError(f"measure_fake: received pp={cfg.pp}; a pipeline's stages infer shapes by communicating, "
                         "which the fake backend cannot: use measure_ranks (real gloo ranks).")
    fake_group(cfg.world_size, rank)
    try:
        mesh = D.init(cfg)
        return measure_step(model_config, cfg, mesh, batch=batch or cfg.dp_replicate * cfg.dp_shard, seq=seq,
                            fake=True)
    finally:
        dist.destroy_process_group()


def _to_json(m: StepMemory) -> dict:
    return {**asdict(m), "cfg": asdict(m.cfg), "state": asdict(m.state)}


def _from_json(d: dict) -> StepMemory:
    return StepMemory(**{**d, "cfg": ParallelConfig(**d["cfg"]), "state": RankState(**d["state"])})


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}


def measure_isolated(model_config, cfg: ParallelConfig, *, rank: int = 0, batch: int = 0, seq: int = 16,
                     timeout: float = 300.0) -> StepMemory:
    """``measure_fake`` in a fresh process."""
    args = json.dumps({"model": asdict(model_config), "cfg": asdict(cfg), "rank": rank, "batch": batch, "seq": seq,
                       "fake": True})
    done = subprocess.run([sys.executable, "-m", "torchnitro.distributed.measure", args], capture_output=True,
                          text=True, timeout=timeout, env=_clean_env())
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        raise RuntimeError(f"measure of {cfg} rank {rank} failed (rc={done.returncode}):\n{done.stderr[-3000:]}")
    return _from_json(json.loads(lines[-1]))


def measure_ranks(model_config, cfg: ParallelConfig, *, batch: int = 0, seq: int = 16,
                  timeout: float = 240.0) -> list[StepMemory]:
    """Every rank of ``cfg`` as a real gloo process on this machine (env:// rendezvous); one StepMemory per rank."""
    from torchnitro.distributed.launch import free_port

    args = json.dumps({"model": asdict(model_config), "cfg": asdict(cfg), "batch": batch, "seq": seq, "fake": False})
    port, n = free_port(), cfg.world_size
    procs = [subprocess.Popen([sys.executable, "-m", "torchnitro.distributed.measure", args],
                              env={**_clean_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise RuntimeError(f"measure_ranks of {cfg}: the {n} ranks did not finish in {timeout:.0f} s") from None
    results = []
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode or not lines:
            raise RuntimeError(f"measure_ranks of {cfg}: rank {r} failed (rc={p.returncode}):\n{err[-3000:]}")
        results.append(_from_json(json.loads(lines[-1])))
    return results


def _main(a: dict) -> StepMemory:
    from torchnitro import distributed as D
    from torchnitro.nn.models import TransformerConfig

    mc, cfg = TransformerConfig(**a["model"]), ParallelConfig(**a["cfg"])
    if a["fake"]:
        return measure_fake(mc, cfg, rank=a["rank"], batch=a["batch"], seq=a["seq"])
    torch.set_num_threads(1)
    mesh = D.init(cfg)
    try:
        dp = cfg.dp_replicate * cfg.dp_shard
        batch = a["batch"] or dp * (cfg.n_microbatches if cfg.pp > 1 else 1)
        return measure_step(mc, cfg, mesh, batch=batch, seq=a["seq"])
    finally:
        D.shutdown()


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    result = _main(json.loads(sys.argv[1]))
    sys.stdout.write(json.dumps(_to_json(result)) + "\n")  # the parent reads the last JSON line of stdout
