"""Run a script as N real ranks on gloo, the way torchrun would start them (env:// rendezvous).

Every rank is a fresh ``python`` process with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and a free
MASTER_PORT in its environment; the whole group gets one deadline, after which every rank is killed
and the test fails with each rank's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchnitro.distributed.launch import run_local_ranks

__all__ = ["run_ranks", "WORKERS"]

WORKERS = Path(__file__).parent / "workers"


def run_ranks(script: str, world: int, *args: str, timeout: float = 90.0) -> list[str]:
    """Run ``workers/<script>`` on ``world`` ranks; returns each rank's output, raises on failure or timeout."""
    run = run_local_ranks([sys.executable, str(WORKERS / script), *args], world, timeout)
    if run.failed:
        raise AssertionError(f"{script} on {world} ranks {'timed out' if run.timed_out else 'failed'}:\n{run.log(3000)}")
    return run.outputs
