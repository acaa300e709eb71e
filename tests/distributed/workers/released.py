"""Collectives under ``measure._released_collectives`` on real gloo ranks: after each all-reduce of a fresh
tensor, no other thread may still hold it (its ``_use_count`` is back to 1), the sum must be right, and an
``async_op=True`` caller must still get a work object; and the allocation log of wrapped reduce-scatters
must end with nothing live (their backend copies freed at the call's end). Prints one JSON line: argv[1] all-reduces; argv[2] "1"
to wrap (the test), "0" for plain collectives (to see gloo's worker hold tensors after a call returns)."""

from __future__ import annotations

import contextlib
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from torch.profiler import ProfilerActivity, profile

from torchnitro.distributed.measure import _allocations, _released_collectives

if __name__ == "__main__":
    n, wrap = int(sys.argv[1]), sys.argv[2] == "1"
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    world = dist.get_world_size()
    held, sums_ok = 0, True
    with _released_collectives() if wrap else contextlib.nullcontext():
        for i in range(n):
            t = torch.ones(1024 + i % 3)
            dist.all_reduce(t)
            held += t._use_count() > 1  # a reference the worker thread has not dropped yet
            sums_ok &= bool((t == world).all())
        t = torch.ones(4)
        work = dist.all_reduce(t, async_op=True)
        async_ok = isinstance(work, dist.distributed_c10d.Work) and work.wait() is not False and bool((t == world).all())
    rs_left = None
    if wrap:  # gloo's reduce-scatter copies its input into the work object, freed on the worker thread
        with _released_collectives(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            for i in range(n // 4):
                inp, out = torch.ones(world * 4096), torch.empty(4096)
                dist.reduce_scatter_tensor(out, inp, async_op=True).wait()
                del inp, out
        rs_left = sum(d for _, d, _ in _allocations(prof)[0])  # bytes still counted live after every call
    print(json.dumps({"held": held, "sums_ok": sums_ok, "async_ok": async_ok, "rs_left": rs_left}))
    dist.destroy_process_group()
