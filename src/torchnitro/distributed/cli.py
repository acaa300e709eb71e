"""``torchnitro launch``: run a command on N ranks under torchrun with our defaults (see ``launch.py``)."""

from __future__ import annotations

from typing import List, Optional

import typer

__all__ = ["register"]


def register(app: typer.Typer) -> None:
    @app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def launch(
        command: List[str] = typer.Argument(..., help="the command after `--`, e.g. python train.py --steps 10"),
        nproc: int = typer.Option(1, "--nproc", help="worker processes on this node"),
        nnodes: str = typer.Option("1", "--nnodes", help="nodes, or MIN:MAX (elastic)"),
        max_restarts: int = typer.Option(0, "--max-restarts", help="restarts of the whole job after a failure"),
        rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint",
                                                    help="HOST:PORT shared by all nodes (default: a local free port)"),
        rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="job id shared by all nodes"),
        log_dir: Optional[str] = typer.Option(None, "--log-dir", help="per-rank logs (default: this terminal)"),
    ) -> None:
        """Run a command on N ranks under torchrun (c10d rendezvous, fresh port, short timeouts)."""
        from torchnitro.distributed.launch import LaunchConfig
        from torchnitro.distributed.launch import launch as run

        cfg = LaunchConfig(nproc=nproc, nnodes=nnodes, max_restarts=max_restarts, rdzv_endpoint=rdzv_endpoint,
                           rdzv_id=rdzv_id, log_dir=log_dir)
        code = run(cfg, list(command))
        if code:
            raise typer.Exit(code)
