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

Frees on other threads: the profiler records an allocation or free only on a thread it profiles, and gloo
runs each collective on a worker thread of its own that holds the collective's tensors until it loops back.
When that thread lets go last (the caller already dropped the tensor: PP x DDP's flat all-reduce buffer, an
FSDP all-gather output), the free is never recorded and the block would count as live for the rest of the
window: one replica of a stage then measured one stage-gradient block (or FSDP group) above its twin, at
random (results/distributed_memory.md). ``measure_step`` therefore runs every ``torch.distributed``
collective to completion and returns only once the worker has released its tensors
(``_released_collectives``), so every free happens, and is recorded, on the rank's own thread. A free still
missing (the profiler itself lost 7 frees in 86,000 wrapped all-reduces of a tight loop on a world-1 gloo
group, each right after a call; cause not found) shows up as ``unseen_frees`` when the address is allocated
again, and the block stops counting there; a block made inside a wrapped call whose free is missing (gloo's
reduce-scatter clones its input into its work object) is freed at the call's end (``_freed_by_call_end``).

Ranks: ``measure_fake`` runs one rank of any layout without pipeline stages in this process on the fake
process group (collectives return at once; the buffers are allocated as on a real run);
``measure_isolated`` does so in a fresh process (DTensor caches sharding by mesh shape, see ``validate``);
``measure_ranks`` starts every rank of a layout as real gloo processes (pipelines need real sends: their
stages infer shapes by communicating). Tiny models only: this is a CPU check of the planner.
"""

from __future__ import annotations

import bisect
import functools
import inspect
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
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
    unseen_frees: int = 0  # bytes allocated again at an address whose free was never recorded (should be 0)


# the torch.distributed collectives a training step may call (the names this torch has are wrapped)
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                "_reduce_scatter_base", "all_to_all_single", "gather", "scatter")


_CALL = "nitro_collective"  # the profiler span of one wrapped collective call (not a "nitro." step marker)


def _tensor_args(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _released(fn, timeout: float):
    """``fn`` run to completion, returning once no other thread holds its tensors (see the module docstring).

    A tensor's ``_use_count`` counts the C++ references to it: the collective's work object (held by gloo's
    worker until it loops back) adds to it, so the count falling back to its value before the call is the
    worker letting go. An asynchronous caller (FSDP's prefetch) gets an already completed work object: it
    still sees an async op (FSDP frees its gather buffers by that), and its ``wait()`` returns at once.
    """
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        wanted_async = bool(bound.arguments.pop("async_op", False))
        tensors = _tensor_args(bound.arguments.values())
        before = [t._use_count() for t in tensors]
        with torch.profiler.record_function(_CALL):
            fn(*bound.args, **bound.kwargs)
            deadline = time.monotonic() + timeout
            while any(t._use_count() > b for t, b in zip(tensors, before)) and time.monotonic() < deadline:
                time.sleep(0)  # gloo's worker drops its work object right after the collective completes
        if not wanted_async:
            return None
        done = torch.futures.Future()
        done.set_result(None)
        return torch._C._distributed_c10d._create_work_from_future(done)

    return call


@contextmanager
def _released_collectives(timeout: float = 10.0):
    """Inside: every ``torch.distributed`` collective (called as ``torch.distributed.<name>``) returns only after
    gloo's worker has released its tensors, so their frees happen on, and are recorded for, this thread."""
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    try:
        for name, fn in saved.items():
            setattr(dist, name, _released(fn, timeout))
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _allocations(prof) -> tuple[list[tuple[int, int, int]], dict[str, int]]:
    """[(time ns, signed bytes, address)] of every CPU allocation/free in time order, and {marker: start ns}."""
    from torch._C._profiler import _EventType

    allocs, marks, calls = [], {}, []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation:
            if e.extra_fields.device.type == "cpu":
                allocs.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
        elif e.name == _CALL:
            calls.append((e.start_time_ns, e.end_time_ns))
        elif e.name.startswith("nitro."):
            marks[e.name] = e.start_time_ns
    return _freed_by_call_end(sorted(allocs), sorted(calls)), marks


def _freed_by_call_end(allocs, calls: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``allocs`` plus a free at the end of the wrapped collective call for each block made inside one whose free
    was never recorded: the backend's own copies (gloo's reduce-scatter clones its input) belong to the work
    object, which was gone when the call returned (``_released``). If the address came back sooner, the free
    goes just before that."""
    made: dict[int, tuple[int, int]] = {}  # address -> (time, bytes) of the block there with no free yet
    lost = []  # (time, bytes, address, time the address came back or None)
    for t, d, ptr in allocs:
        if d > 0:
            if ptr in made:
                lost.append((*made[ptr], ptr, t))
            made[ptr] = (t, d)
        else:
            made.pop(ptr, None)
    lost += [(t, d, ptr, None) for ptr, (t, d) in made.items()]
    starts = [a for a, _ in calls]
    extra = []
    for t, d, ptr, back in lost:
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= calls[i][1]:
            end = calls[i][1] if back is None else min(calls[i][1], back - 1)
            extra.append((end, -d, ptr))
    return sorted(allocs + extra) if extra else allocs


def _unseen_frees(allocs) -> int:
    """Bytes of blocks whose address was allocated again with no free recorded in between: frees the profiler
    did not record (another thread's, or an event it lost; ``_live`` ends such a block at the reuse)."""
    live: dict[int, int] = {}
    unseen = 0
    for _, d, ptr in allocs:
        if d > 0:
            unseen += live.get(ptr, 0)
            live[ptr] = d
        else:
            live.pop(ptr, None)
    return unseen


def _live(allocs, marks: dict[str, int]) -> tuple[int, str, int, int]:
    """(peak inside the measured step, its phase, live at the step's start, live at the end of forward).

    ``allocs``: (time, signed bytes[, address]). With addresses, a block whose free was never recorded stops
    counting when its address is allocated again at the latest (``_unseen_frees``): it cannot outlive that.
    """
    t0, t_fwd, t_bwd, t1 = (marks.get(f"nitro.{k}") for k in ("start", "forward_end", "backward_end", "end"))
    live, peak, phase, at_start, at_fwd = 0, 0, "", None, None
    sizes: dict[int, int] = {}
    for t, d, *ptr in allocs:
        if at_start is None and t >= t0:
            at_start = live
        if t_fwd is not None and at_fwd is None and t >= t_fwd:
            at_fwd = live
        if ptr and d > 0:
            live -= sizes.pop(ptr[0], 0)
            sizes[ptr[0]] = d
        elif ptr:
            sizes.pop(ptr[0], None)
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
    with _released_collectives(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
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
    allocs, marks = _allocations(prof)
    peak, phase, start, forward_left = _live(allocs, marks)
    return StepMemory(cfg, dist.get_rank(), pp_rank, shard, batch, seq, peak, phase, start, forward_left, state,
                      _unseen_frees(allocs))


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
