"""``torchnitro launch``: torchrun (``torch.distributed.run``) with our defaults.

- c10d rendezvous; on one node (no ``rdzv_endpoint`` given) it binds 127.0.0.1 on a fresh free port
  for every launch, so two jobs on one machine, or a job relaunched right after a crash, never meet a
  port still held by an old store.
- a short rendezvous timeout (``rdzv_timeout_s``): a node that never comes is an error in a minute.
  The process-group timeout is the script's: ``ParallelConfig.timeout_s`` in ``init``.
- the agent polls its workers every 0.1 s (torch 2.13's default; set explicitly, it was 0.5 here): after a
  rank dies, the rest of the group is stopped and restarted within a poll (results/distributed_resume.md).
- ``--max-restarts K``: torchrun restarts every rank of the job up to K times when one fails; each
  attempt's workers meet at a new store on a new port (``launch_env``), not the agent's shared one.
- ``python script.py ...`` and ``python -m module ...`` run under the launcher's own interpreter;
  any other command runs as is (torchrun's ``--no-python``).
- ``prewarm`` (``torchnitro train``'s default without CUDA): for ``python -m module``, one fork server per
  node imports the module once and every worker of every attempt is forked from it (``prewarm.py``), so a
  restart does not pay for importing torch again (results/distributed_resume.md).

Multi-node: run the same command on every node with ``--nnodes N --rdzv-endpoint HOST:PORT`` (the
host of one node, a port open between them) and the same ``--rdzv-id``; under Slurm, one task per
node with ``HOST`` the first node of ``$SLURM_JOB_NODELIST``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass

from torchnitro.errors import InputError

__all__ = ["LaunchConfig", "torchrun_args", "launch", "launch_env", "free_port", "RankRun", "run_local_ranks"]

_PYTHONS = ("python", "python3", os.path.basename(sys.executable))


@dataclass
class LaunchConfig:
    nproc: int = 1  # worker processes on this node
    nnodes: str = "1"  # number of nodes, or MIN:MAX for an elastic job
    max_restarts: int = 0  # restarts of the whole job after a worker fails
    rdzv_endpoint: str | None = None  # HOST:PORT of the rendezvous; None: 127.0.0.1 on a fresh free port
    rdzv_id: str | None = None  # job id shared by all nodes; None: a fresh one per launch (one node only)
    rdzv_timeout_s: int = 60  # how long the rendezvous waits for every node
    log_dir: str | None = None  # torchrun's per-rank log directory; None: output goes to this terminal
    prewarm: bool = False  # `python -m module`: fork each worker from a server that imported it once (prewarm.py)

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise InputError(f"launch: received nproc={self.nproc}, expected the number of processes (>= 1).")
        if self.max_restarts < 0:
            raise InputError(f"launch: received max_restarts={self.max_restarts}, expected >= 0.")
        if self.nnodes != "1" and self.rdzv_endpoint is None:
            raise InputError(f"launch: nnodes={self.nnodes} needs --rdzv-endpoint HOST:PORT, the address every node "
                             "meets at (one node's host name and an open port); a local free port works on one "
                             "node only.")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RankRun:
    """What the ranks of one ``run_local_ranks`` call left, in rank order."""

    returncodes: list[int]  # each rank's exit code (negative: killed by that signal)
    outputs: list[str]  # each rank's stdout and stderr together
    timed_out: bool  # the deadline passed and every rank was killed

    @property
    def failed(self) -> bool:
        return self.timed_out or any(rc != 0 for rc in self.returncodes)

    def log(self, tail: int) -> str:
        """Each rank's exit code and the last ``tail`` characters of its output, for an error message."""
        return "\n".join(f"--- rank {r} (rc={rc}) ---\n{out[-tail:]}"
                         for r, (rc, out) in enumerate(zip(self.returncodes, self.outputs)))


def run_local_ranks(argv: list[str], world: int, timeout: float) -> RankRun:
    """Run ``argv`` as ``world`` ranks on this machine, the way torchrun starts them, and wait for all of them.

    Every rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE and an env:// rendezvous on 127.0.0.1 at a free
    port, one OpenMP thread and no GPU (gloo on CPU). The group shares one deadline of ``timeout`` seconds; when it
    passes, every rank is killed. A failed or killed rank does not raise: the caller reads ``RankRun``.
    """
    if world < 1:
        raise InputError(f"run_local_ranks: received world={world}, expected the number of ranks (>= 1).")
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
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
    return RankRun([p.returncode for p in procs], outs, timed_out)


def torchrun_args(cfg: LaunchConfig, command: list[str]) -> list[str]:
    """The ``torch.distributed.run`` argument list for ``command`` (``python script.py ...`` or any program)."""
    if not command:
        raise InputError("launch: received no command, expected one after `--`, e.g. "
                         "`torchnitro launch --nproc 2 -- python train.py`.")
    endpoint = cfg.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    args = ["--nproc-per-node", str(cfg.nproc), "--nnodes", cfg.nnodes, "--max-restarts", str(cfg.max_restarts),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", cfg.rdzv_id or uuid.uuid4().hex,
            "--rdzv-conf", f"join_timeout={cfg.rdzv_timeout_s},read_timeout={cfg.rdzv_timeout_s}",
            "--monitor-interval", "0.1"]  # the agent's poll of its workers: a dead rank is seen within 0.1 s
    if cfg.log_dir:
        args += ["--log-dir", cfg.log_dir]
    head, rest = command[0], command[1:]
    if os.path.basename(head) in _PYTHONS or head == sys.executable:
        if rest[:1] == ["-m"] and len(rest) > 1:
            return args + ["--module", *rest[1:]]
        if not rest:
            raise InputError(f"launch: received {' '.join(command)!r}, expected a script after python.")
        return args + rest
    return args + ["--no-python", *command]


def launch(cfg: LaunchConfig, command: list[str]) -> int:
    """Run ``command`` on ``cfg.nproc`` ranks under torchrun; returns torchrun's exit code.

    With ``cfg.prewarm`` and a ``python -m module ...`` command, a fork server (``prewarm.serve``) imports the
    module once for this node and every worker of every attempt is forked from it (``prewarm.run``).
    """
    env = launch_env()
    server, tmp = None, None
    head, rest = (command[0], command[1:]) if command else ("", [])
    if cfg.prewarm and (os.path.basename(head) in _PYTHONS or head == sys.executable) and rest[:1] == ["-m"] \
            and len(rest) > 1:
        import tempfile

        from torchnitro.distributed import prewarm

        tmp = tempfile.mkdtemp(prefix="nitro-prewarm-")
        sock = os.path.join(tmp, "s")
        server = subprocess.Popen([sys.executable, "-m", "torchnitro.distributed.prewarm", "serve", sock, rest[1]],
                                  env=env)
        env = {**env, prewarm.ENV_SOCKET: sock, prewarm.ENV_PID: str(server.pid)}
        command = prewarm.worker_command(rest[1], rest[2:])
    argv = [sys.executable, "-m", "torch.distributed.run", *torchrun_args(cfg, command)]
    try:
        return subprocess.call(argv, env=env)
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


def launch_env() -> dict[str, str]:
    """The environment torchrun runs in: workers get a fresh store on a fresh port for every attempt.

    By default the workers of every restart share the rendezvous store of the agent; after a restart,
    gloo then intermittently reads peer addresses of the killed attempt and fails with
    "connectFullMesh ... Connection refused" (or hangs). With the sharing off, rank 0's agent picks a
    new MASTER_PORT each round and the workers build their own store there.
    """
    return {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
