"""Run a script as N real ranks on gloo, the way torchrun would start them (env:// rendezvous).

Every rank is a fresh ``python`` process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and a free
MASTER_PORT in its environment; the whole group gets one deadline, after which every rank is killed
and the test fails with each rank's output.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from torchnitro.distributed.launch import free_port

__all__ = ["free_port", "run_ranks", "WORKERS"]

WORKERS = Path(__file__).parent / "workers"


def run_ranks(script: str, world: int, *args: str, timeout: float = 90.0) -> list[str]:
    """Run ``workers/<script>`` on ``world`` ranks; returns each rank's output, raises on failure or timeout."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen([sys.executable, str(WORKERS / script), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outs, timed_out = [], False
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for q in procs:
                q.kill()
            out, _ = p.communicate()
        outs.append(out)
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if timed_out or failed:
        log = "\n".join(f"--- rank {r} (rc={p.returncode}) ---\n{o[-3000:]}" for r, (p, o) in enumerate(zip(procs, outs)))
        raise AssertionError(f"{script} on {world} ranks {'timed out' if timed_out else 'failed'}:\n{log}")
    return outs
