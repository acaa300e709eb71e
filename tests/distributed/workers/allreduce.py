"""Launched by torchnitro launch: all-reduce (rank + 1) and write OUT/rank<r>.txt.

With FAIL_FIRST set, rank 1 exits with an error on torchrun's first attempt (before joining the
process group), so a run that succeeds proves the restart happened."""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":
    out = Path(sys.argv[1])
    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if os.environ.get("FAIL_FIRST") and rank == 1 and attempt == 0:
        sys.exit(3)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    (out / f"rank{rank}.txt").write_text(f"{int(t.item())} {os.environ['WORLD_SIZE']} {attempt}")
    dist.destroy_process_group()
