"""Collectives under ``measure._released_collectives`` on real gloo ranks: after each all-reduce of a fresh
tensor, no other thread may still hold it (its ``_use_count`` is back to 1), the sum must be right, and an
``async_op=True`` caller must still get a work object. Prints one JSON line: argv[1] all-reduces; argv[2] "1"
to wrap (the test), "0" for plain collectives (to see gloo's worker hold tensors after a call returns)."""

from __future__ import annotations

import contextlib
import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from torchnitro.distributed.measure import _released_collectives

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
    print(json.dumps({"held": held, "sums_ok": sums_ok, "async_ok": async_ok}))
    dist.destroy_process_group()
