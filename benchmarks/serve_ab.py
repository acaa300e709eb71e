"""A/B of two source trees of the server: requests/s and server CPU per request, interleaved.

    git archive HEAD~3 src | tar -x -C /tmp/old                        # the "before" tree
    flock /tmp/torchnitro-bench.lock python benchmarks/serve_ab.py old=/tmp/old/src new=src --binary
    python benchmarks/serve_ab.py procs=src inproc=src@0 --binary       # one tree, worker process vs in-process

Each NAME=SRC[@W] starts ``torchnitro serve mlp --workers W --threads 1 --max-batch-size 32
--max-wait-ms 5`` (W defaults to 1; 0 runs the model in the server process) with ``PYTHONPATH=SRC``
(so that tree's ``torchnitro`` is imported), then
``loadtest.interleaved`` loads them in turn (``--rounds`` bursts of ``--burst`` s each, rotating
the order) at ``--concurrency``. Server CPU per request is the server process's own CPU time
(``/proc``, not its worker's) over the run divided by its answers: on a shared machine it moves far
less than requests/s, which every other job on the box shifts; with W=0 the model's CPU is in it
too, so compare W=0 rows by server CPU plus the other rows' worker CPU (printed as ``workers``).
Writes nothing; prints one line per tree.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil

from torchnitro.serve.loadtest import interleaved, v2_target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(src: str, port: int, model: str) -> subprocess.Popen:
    src, _, workers = src.partition("@")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src)}
    return subprocess.Popen([sys.executable, "-m", "torchnitro", "serve", model, "--workers", workers or "1",
                             "--threads", "1",
                             "--max-batch-size", "32", "--max-wait-ms", "5", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def _cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of the server process, of its worker processes)."""
    p = psutil.Process(pid)
    kids = 0.0
    for c in p.children(recursive=True):
        try:
            kids += sum(c.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return sum(p.cpu_times()[:2]), kids


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(url + "/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"server at {url} did not become ready (exit code {proc.poll()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="NAME=SRC[@WORKERS] pairs, e.g. old=/tmp/old/src new=src@0")
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--binary", action="store_true", help="v2 binary tensor extension both ways")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--burst", type=float, default=3.0)
    args = ap.parse_args()
    trees = dict(t.split("=", 1) for t in args.trees)
    servers = {}
    try:
        for name, src in trees.items():
            port = _free_port()
            servers[name] = (_start(src, port, args.model), f"http://127.0.0.1:{port}")
        for proc, url in servers.values():
            _wait_ready(url, proc)
        targets = {n: asyncio.run(v2_target(url, args.model, seq=1, binary=args.binary))
                   for n, (_, url) in servers.items()}
        cpu0 = {n: _cpu(p.pid) for n, (p, _) in servers.items()}
        res = asyncio.run(interleaved(targets, args.concurrency, args.rounds, args.burst))
        for n, (p, _) in servers.items():
            own, kids = (a - b for a, b in zip(_cpu(p.pid), cpu0[n]))
            r = res[n]
            per = 1e6 / max(r.ok, 1)
            print(f"{n}: {r.throughput:.0f} req/s, p50 {r.p50_ms:.2f} ms, mean batch {r.mean_batch or 0:.1f}, "
                  f"ok {r.ok}, errors {r.errors}, server CPU per request {own * per:.0f} us, "
                  f"workers {kids * per:.0f} us")
    finally:
        for p, _ in servers.values():
            os.killpg(p.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
