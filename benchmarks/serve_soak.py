"""Fault-injection soak of `torchnitro serve` on CPU: mixed load while faults are injected, with the
serving invariants checked on every request and at the end.

    flock /tmp/torchnitro-bench.lock python benchmarks/serve_soak.py --duration 600   # the soak
    python benchmarks/serve_soak.py --duration 30                                      # smoke run

The server (`torchnitro.serve.testing:picky_affine`, 2 worker processes, worker watchdog 2 s, request
heads due within 2 s) runs in its own session. Clients (closed loop) send a mix of kinds:

  good        a valid request: 200 with its own result (``2x + 1``), or an error caused by a fault
  deadline    ``parameters.timeout`` of 1-50 ms: 200 or 504, never answered later than timeout + 1 s
  disconnect  the client gives up after 5-50 ms; its request must not be computed twice or wedge anything
  bad_value   a row the model raises on (``testing.RAISE``): 500 for it alone
  bad_json    a truncated body: 400
  poison      a row that kills its worker (``testing.POISON``), at most one per ``--poison-every`` s

and a chaos task injects, every ``--fault-every`` seconds, one of: SIGKILL a worker, SIGSTOP a worker for
0.5 s (below the watchdog), SIGSTOP a worker past the watchdog (it is killed and replaced), or 20 slow
clients that open a connection and never finish their request head.

Invariants: every request gets exactly one outcome (an HTTP status, or the client's own give-up for
``disconnect``); every 200 carries the right numbers; expected statuses per kind; no ``deadline``
request answered later than its deadline + 1 s; once idle, ``torchnitro_queue_depth`` and
``torchnitro_requests_pending`` are 0; the server's RSS grows < 10% from the first to the last
quarter (mean RSS of the server process, sampled every second, over the run's last quarter against
its first; no warm-up is left out: the server is ready, so the model is loaded, before the load
starts). The server's anonymous and shared-memory RSS (the workers' arenas) and the workers' RSS are
reported beside it; the server's stderr goes to a file, not a pipe nobody reads (a full pipe would
block the server). Writes results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_cpu import free_port, stop, wait_ready  # noqa: E402

from torchnitro.bench import ResultTable  # noqa: E402
from torchnitro.bench.provenance import provenance  # noqa: E402
from torchnitro.serve.loadtest import HttpClient  # noqa: E402
from torchnitro.serve.testing import POISON, RAISE  # noqa: E402

PATH = "/v2/models/soak/infer"
# status codes each kind may get; anything else is a violation
ALLOWED = {
    "good": {200, 429, 500, 503},  # 500: its batch's worker was killed / replaced by a fault
    "deadline": {200, 504, 429, 500, 503},
    "disconnect": {200, 504, 429, 500, 503, "gave up"},
    "bad_value": {500, 429, 503},
    "bad_json": {400},
    "poison": {500, 429, 503},
}
WEIGHTS = {"good": 60, "deadline": 12, "disconnect": 10, "bad_value": 8, "bad_json": 5, "poison": 5}


def body(kind: str, i: int, rng: random.Random) -> tuple[bytes, list[float], float | None]:
    """(request body, the row sent, its deadline in ms or None)."""
    row = [float(i % 1000), 0.5, -1.0, 2.0]
    params: dict[str, Any] = {}
    if kind == "bad_value":
        row[0] = RAISE
    elif kind == "poison":
        row[0] = POISON
    elif kind == "deadline":
        params["timeout"] = rng.uniform(1, 50) * 1e3  # microseconds, as in Triton
    req = {"id": str(i), "inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": row}]}
    if params:
        req["parameters"] = params
    data = json.dumps(req).encode()
    timeout = params.get("timeout")
    return (data[:-7] if kind == "bad_json" else data), row, None if timeout is None else timeout / 1e3


class Soak:
    def __init__(self, url: str, proc: Any, args: argparse.Namespace):
        self.url, self.proc, self.args = url, proc, args
        self.rng = random.Random(args.seed)
        self.outcomes: dict[str, Counter] = {k: Counter() for k in WEIGHTS}
        self.violations: list[str] = []
        self.faults: Counter = Counter()
        self.sent = 0
        self.last_poison = 0.0
        self.rss: list[tuple[float, int]] = []
        self.memory: list[dict[str, float]] = []  # every 10 s: server anon/shared MiB, workers' RSS

    def violate(self, msg: str) -> None:
        if len(self.violations) < 50:
            self.violations.append(msg)

    def kind(self) -> str:
        k = self.rng.choices(list(WEIGHTS), list(WEIGHTS.values()))[0]
        if k == "poison":
            if time.monotonic() - self.last_poison < self.args.poison_every:
                return "good"
            self.last_poison = time.monotonic()
        return k

    async def one(self, client: HttpClient, i: int) -> None:
        kind = self.kind()
        data, row, deadline_ms = body(kind, i, self.rng)
        self.sent += 1
        t0 = time.monotonic()
        try:
            if kind == "disconnect":
                give_up = self.rng.uniform(0.005, 0.05)
                status, out = await asyncio.wait_for(client.request("POST", PATH, data), give_up)
            else:
                status, out = await client.request("POST", PATH, data)
        except asyncio.TimeoutError:
            await client.close()
            if kind != "disconnect":
                self.violate(f"{kind} request {i}: no answer within the client's {client.timeout_s} s")
            self.outcomes[kind]["gave up" if kind == "disconnect" else "no answer"] += 1
            return
        except (OSError, asyncio.IncompleteReadError) as exc:
            await client.close()
            self.outcomes[kind][f"connection error ({type(exc).__name__})"] += 1
            self.violate(f"{kind} request {i}: connection error {exc!r}")
            return
        waited = time.monotonic() - t0
        self.outcomes[kind][status] += 1
        if status not in ALLOWED[kind]:
            self.violate(f"{kind} request {i}: status {status}: {out[:200]!r}")
        if status == 200:
            got = json.loads(out)
            if got.get("id") != str(i) or got["outputs"][0]["data"] != [2 * v + 1 for v in row]:
                self.violate(f"{kind} request {i}: wrong answer {out[:200]!r}")
        if deadline_ms is not None and waited > deadline_ms / 1e3 + 1.0:
            self.violate(f"deadline request {i}: answered after {waited:.2f} s for a {deadline_ms:.0f} ms deadline")

    async def client(self, cid: int, end: float) -> None:
        c = HttpClient(self.url, 30)
        i = cid * 10_000_000
        try:
            while time.monotonic() < end:
                await self.one(c, i)
                i += 1
        finally:
            await c.close()

    def workers(self) -> list[psutil.Process]:
        """The server's live worker processes; a child that cannot be read (a zombie, one that just
        exited) is left out, not allowed to empty the whole list."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.Error:
            return []
        out = []
        for p in children:
            try:
                if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline()):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    async def chaos(self, end: float) -> None:
        port = int(self.url.rsplit(":", 1)[1])
        while time.monotonic() < end - self.args.fault_every:
            await asyncio.sleep(self.args.fault_every)
            fault = self.rng.choice(["kill", "short stop", "long stop", "slow clients"])
            ws = self.workers()
            if fault != "slow clients" and not ws:
                self.faults[f"{fault} (skipped: no worker process listed)"] += 1
                continue  # both being replaced right now
            self.faults[fault] += 1
            try:
                if fault == "kill":
                    os.kill(self.rng.choice(ws).pid, signal.SIGKILL)
                elif fault in ("short stop", "long stop"):
                    w = self.rng.choice(ws)
                    os.kill(w.pid, signal.SIGSTOP)
                    await asyncio.sleep(0.5 if fault == "short stop" else self.args.watchdog_s + 1.5)
                    try:
                        os.kill(w.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass  # the watchdog killed it
                else:
                    socks = []
                    for _ in range(20):
                        s = socket.create_connection(("127.0.0.1", port), timeout=5)
                        s.sendall(f"POST {PATH} HTTP/1.1\r\nHost: x\r\n".encode())
                        socks.append(s)
                    await asyncio.sleep(self.args.header_timeout_s + 1)
                    for s in socks:
                        s.close()
            except (ProcessLookupError, OSError) as exc:
                self.faults[f"{fault} (could not inject: {type(exc).__name__})"] += 1

    def breakdown(self, t: float) -> dict[str, float]:
        """Server RSS split as the kernel counts it (MiB), and each worker's RSS."""
        rec: dict[str, Any] = {"t": round(t, 1)}
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    key, _, val = line.partition(":")
                    if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                        rec[key] = int(val.split()[0]) / 1024
        except OSError:
            pass
        rec["workers"] = []
        for w in self.workers():
            try:
                rec["workers"].append(round(w.memory_info().rss / 2**20))
            except psutil.Error:
                pass  # it exited since it was listed
        return rec

    async def sample_rss(self, end: float) -> None:
        start = last = time.monotonic()
        while time.monotonic() < end:
            now = time.monotonic()
            try:
                self.rss.append((now, psutil.Process(self.proc.pid).memory_info().rss))
            except psutil.Error:
                pass
            if now - last >= 10 or not self.memory:
                try:
                    self.memory.append(self.breakdown(now - start))
                except psutil.Error:
                    pass
                last = now
            await asyncio.sleep(1.0)

    async def idle_check(self) -> dict[str, float]:
        """Once the load stops: queue depth and pending back to 0 (bounded wait)."""
        vals: dict[str, float] = {}
        c = HttpClient(self.url, 10)
        try:
            for _ in range(100):
                _, text = await c.request("GET", "/metrics")
                vals = {name: sum(float(ln.rsplit(" ", 1)[1]) for ln in text.decode().splitlines()
                                  if ln.startswith(name + "{"))
                        for name in ("torchnitro_queue_depth", "torchnitro_requests_pending",
                                     "torchnitro_worker_restarts_total")}
                if vals["torchnitro_queue_depth"] == 0 and vals["torchnitro_requests_pending"] == 0:
                    break
                await asyncio.sleep(0.1)
            else:
                self.violate(f"not idle after the load stopped: {vals}")
            status, _ = await c.request("POST", PATH, body("good", 1, self.rng)[0])
            if status != 200:
                self.violate(f"a request after the soak answered {status}")
        finally:
            await c.close()
        return vals

    async def run(self) -> dict[str, float]:
        end = time.monotonic() + self.args.duration
        await asyncio.gather(*(self.client(k, end) for k in range(self.args.concurrency)),
                             self.chaos(end), self.sample_rss(end))
        return await self.idle_check()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--fault-every", type=float, default=5.0, help="seconds between injected faults")
    ap.add_argument("--poison-every", type=float, default=10.0, help="at most one worker-killing request per this")
    ap.add_argument("--watchdog-s", type=float, default=2.0)
    ap.add_argument("--header-timeout-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="serve_soak", help="results/<name>.{json,md}")
    args = ap.parse_args()
    meta = provenance("benchmarks/serve_soak.py", device="cpu")  # before the run: its load average at start
    port = free_port()
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"version: 1\nbatching:\n  max_batch_size: 16\n  max_wait_ms: 5\n  max_queue_size: 256\n"
                f"serve:\n  workers: 2\n  threads: 1\n  worker_timeout_s: {args.watchdog_s}\n"
                f"  header_timeout_s: {args.header_timeout_s}\n")
    log = tempfile.TemporaryFile()  # the server's stderr: a pipe nobody reads would fill and block it
    proc = subprocess.Popen([sys.executable, "-m", "torchnitro", "serve", "torchnitro.serve.testing:picky_affine",
                             "--name", "soak", "--port", str(port), "--config", f.name],
                            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_ready(proc, url, "/v2/health/ready")
        except (RuntimeError, AttributeError):
            log.seek(0)
            raise RuntimeError(f"the server did not start: {log.read().decode(errors='replace')[-2000:]}") from None
        soak = Soak(url, proc, args)
        idle = asyncio.run(soak.run())
    finally:
        stop(proc)
        os.unlink(f.name)
    log.seek(0)
    stderr = log.read().decode(errors="replace")
    if not soak.rss:
        soak.violate("no RSS sample of the server could be read")
    rss = soak.rss or [(0.0, 1)]
    q = max(1, len(rss) // 4)
    first, last = (sum(r for _, r in part) / len(part) for part in (rss[:q], rss[-q:]))
    growth = last / first - 1
    if growth >= 0.10:
        soak.violate(f"server RSS grew {growth:.1%} (first quarter {first / 2**20:.0f} MiB, "
                     f"last {last / 2**20:.0f} MiB)")
    table = ResultTable(f"serve_soak: {args.duration:.0f} s, concurrency {args.concurrency}",
                        ["what", "count", "outcomes"],
                        meta=meta)
    for kind, c in soak.outcomes.items():
        table.add(what=f"requests: {kind}", count=sum(c.values()),
                  outcomes=", ".join(f"{k}: {v}" for k, v in c.items()))
    for fault, n in soak.faults.items():
        injected = "(" not in fault  # "(skipped: ...)" and "(could not inject: ...)" were not
        table.add(what=f"fault: {fault}", count=n,
                  outcomes="not injected" if not injected else "server kept answering" if not soak.violations else "")
    table.add(what="worker restarts", count=int(idle.get("torchnitro_worker_restarts_total", 0)), outcomes="")
    table.add(what="RSS growth (server process)", count=None,
              outcomes=f"{growth:+.1%} (mean {first / 2**20:.0f} MiB in the first quarter, {last / 2**20:.0f} MiB "
                       f"in the last; peak {max(r for _, r in rss) / 2**20:.0f} MiB)")
    if soak.memory:
        a, b = soak.memory[0], soak.memory[-1]
        table.add(what="server RSS: anonymous / shared memory", count=None,
                  outcomes=f"{a.get('RssAnon', 0):.0f} / {a.get('RssShmem', 0):.0f} MiB at {a['t']:.0f} s, "
                           f"{b.get('RssAnon', 0):.0f} / {b.get('RssShmem', 0):.0f} MiB at {b['t']:.0f} s")
        peak = max((w for m in soak.memory for w in m["workers"]), default=0)
        table.add(what="worker RSS", count=None, outcomes=f"largest sample {peak} MiB (workers are replaced by faults)")
    table.add(what="server stderr", count=len(stderr.splitlines()), outcomes="lines written (to a file)")
    table.add(what="invariant violations", count=len(soak.violations), outcomes="; ".join(soak.violations[:5]))
    from rich.console import Console

    Console().print(table.rich())
    table.meta.update(violations=soak.violations, idle_metrics=idle, faults=dict(soak.faults), rss_growth=growth,
                      memory_every_10s=soak.memory, server_stderr_tail=stderr[-4000:],
                      outcomes={k: {str(s): n for s, n in c.items()} for k, c in soak.outcomes.items()})
    paths = table.save(args.name)
    print("wrote " + ", ".join(str(p) for p in paths))
    sys.exit(1 if soak.violations else 0)


if __name__ == "__main__":
    main()
