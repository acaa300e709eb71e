"""Distributed benchmark, first section: how long a DCP checkpoint save blocks training, sync vs async,
and host memory over repeated async saves (issue 18's async-checkpoint goal).

    flock /tmp/torchnitro-bench.lock python benchmarks/distributed.py [--quick] [--saves 20]

One process (world 1, in-memory store); the state is a TransformerLM and its AdamW state. Each save
is followed by one training step, as in a loop; "blocks" is the time save() takes to return (sync: the
whole write; async: the copy to host memory), "wait" the time the next PendingSave.wait() still
blocks. RSS is sampled after every async save; growth is last vs the 5th sample. Writes
results/distributed_<device>.{json,md}. Kill-and-resume trials, the planner and scaling come later.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import psutil
import torch
import torch.nn.functional as F

from torchnitro.bench import ResultTable
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


def _run(state, step, saves: int, async_: bool, directory: str) -> dict:
    blocks, waits, rss = [], [], []
    proc = psutil.Process()
    pending = None
    for i in range(saves):
        t0 = time.perf_counter()
        if pending is not None:  # what the next save would wait for anyway, timed on its own
            pending.wait()
        t1 = time.perf_counter()
        out = save(state, directory, step=i + 1, async_=async_, keep=2)
        t2 = time.perf_counter()
        pending = out if async_ else None
        blocks.append(t2 - t1)
        waits.append(t1 - t0)
        step()
        rss.append(proc.memory_info().rss)
    if pending is not None:
        pending.wait()
    base = rss[min(4, len(rss) - 1)]
    return {"block_median_s": statistics.median(blocks), "block_max_s": max(blocks),
            "wait_median_s": statistics.median(waits[1:]) if async_ and len(waits) > 1 else 0.0,
            "rss_growth": rss[-1] / base - 1, "rss_last_mib": rss[-1] / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny model, 6 saves: a smoke run")
    ap.add_argument("--saves", type=int, default=20)
    args = ap.parse_args()
    saves = 6 if args.quick else args.saves
    meta = provenance("benchmarks/distributed.py", device="cpu")
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(k, None)
    init(ParallelConfig())
    try:
        state, step, n = _setup(args.quick)
        rows = {}
        for mode in ("sync", "async"):
            with tempfile.TemporaryDirectory() as d:
                rows[mode] = _run(state, step, saves, mode == "async", d)
    finally:
        shutdown()
    table = ResultTable(f"DCP save: {n / 1e6:.1f} M params + AdamW state, {saves} saves, one process",
                        ["mode", "save blocks (median s)", "save blocks (max s)", "next wait (median s)",
                         "RSS growth (last vs 5th)"], meta=meta)
    for mode, r in rows.items():
        table.add(**{"mode": mode, "save blocks (median s)": round(r["block_median_s"], 4),
                     "save blocks (max s)": round(r["block_max_s"], 4),
                     "next wait (median s)": round(r["wait_median_s"], 4),
                     "RSS growth (last vs 5th)": f"{r['rss_growth']:+.1%}"})
    table.meta.update(params=n, saves=saves, raw=rows, quick=args.quick)
    from rich.console import Console

    Console().print(table.rich())
    paths = table.save("distributed_cpu_quick" if args.quick else "distributed_cpu")
    print("wrote " + ", ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
