"""Load generator: closed-loop concurrency sweeps and open-loop fixed request rates.

Closed loop: ``C`` clients each send a request, wait for the answer, send the next (throughput at
a given concurrency). Open loop: requests leave on a fixed schedule of ``rate`` per second whether
or not earlier ones have returned (latency under a given offered load; a bounded number may be
outstanding, the rest count as ``dropped``). Both stop after ``duration_s`` or ``max_requests``.

The client is a small keep-alive HTTP/1.1 client on asyncio streams: on a 2-core machine the
load generator shares the CPU with the server, and a lighter client leaves more of it to the server.
Reports throughput, p50/p90/p99 latency, errors by status, and the server's average batch size
(from the ``torchnitro_batch_size`` histogram on ``/metrics``, before vs after).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence
from urllib.parse import urlsplit

from torchnitro.bench.timing import percentile
from torchnitro.errors import InputError
from torchnitro.serve.metrics import parse_batch_size

__all__ = ["LoadTarget", "LoadResult", "HttpClient", "closed_loop", "open_loop", "interleaved", "v2_target",
           "binary_request", "sweep", "save_results"]


class HttpClient:
    """One keep-alive HTTP/1.1 connection; reconnects after errors or ``Connection: close``."""

    def __init__(self, base_url: str, timeout_s: float = 30.0):
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise InputError(f"url {base_url!r}: expected http://host:port (https is not supported by the "
                             "load generator; put it behind a local port)")
        self.host, self.port, self.timeout_s = u.hostname, u.port or 80, timeout_s
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None

    async def close(self) -> None:
        if self._w is not None:
            self._w.close()
        self._r = self._w = None

    async def request(self, method: str, path: str, body: bytes = b"",
                      headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        try:
            return await asyncio.wait_for(self._request(method, path, body, headers or {}), self.timeout_s)
        except BaseException:
            await self.close()
            raise

    async def _request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        if self._r is None or self._w is None:
            self._r, self._w = await asyncio.open_connection(self.host, self.port)
        reader = self._r
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n").encode()
        self._w.write(head + body)
        raw = await reader.readuntil(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        hdrs = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        if "content-length" in hdrs:
            data = await reader.readexactly(int(hdrs["content-length"]))
        elif hdrs.get("transfer-encoding", "").lower() == "chunked":
            data = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).strip(), 16)
                data += await reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            data = await reader.read()
            await self.close()
        if hdrs.get("connection", "").lower() == "close":
            await self.close()
        return status, data


@dataclass
class LoadTarget:
    """Where to send load: ``body(i)`` makes the i-th request; ``check`` validates a 200 (optional)."""

    url: str
    path: str
    body: Callable[[int], bytes]
    headers: dict[str, str] = field(default_factory=dict)
    metrics_path: str | None = "/metrics"
    model: str | None = None
    check: Callable[[int, bytes], bool] | None = None


@dataclass
class LoadResult:
    mode: str  # "closed" (level = concurrency) or "open" (level = requests/s offered)
    level: float
    duration_s: float
    sent: int
    ok: int
    errors: dict[str, int]  # status (or "conn"/"timeout"/"dropped"/"wrong") -> count
    throughput: float  # successful requests per second
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    mean_batch: float | None  # the server's average batch size during the run, if it reports one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _metrics(target: LoadTarget) -> tuple[float, float] | None:
    if target.metrics_path is None:
        return None
    try:
        status, data = await HttpClient(target.url, 5.0).request("GET", target.metrics_path, headers=target.headers)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError):
        return None
    return parse_batch_size(data.decode(), target.model) if status == 200 else None


class _Stats:
    def __init__(self) -> None:
        self.lat: list[float] = []
        self.errors: dict[str, int] = {}
        self.sent = 0

    def err(self, key: str) -> None:
        self.errors[key] = self.errors.get(key, 0) + 1

    async def one(self, client: HttpClient, target: LoadTarget, i: int) -> None:
        self.sent += 1
        t0 = time.perf_counter()
        try:
            status, data = await client.request("POST", target.path, target.body(i), target.headers)
        except asyncio.TimeoutError:
            self.err("timeout")
            return
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            self.err("conn")
            return
        dt = time.perf_counter() - t0
        if status != 200:
            self.err(str(status))
        elif target.check is not None and not target.check(i, data):
            self.err("wrong")
        else:
            self.lat.append(dt)

    def result(self, mode: str, level: float, elapsed: float, before: Any, after: Any) -> LoadResult:
        mean_batch = None
        if before is not None and after is not None and after[1] > before[1]:
            mean_batch = (after[0] - before[0]) / (after[1] - before[1])
        pct = (lambda q: percentile(self.lat, q) * 1e3) if self.lat else (lambda q: None)
        return LoadResult(mode, level, elapsed, self.sent, len(self.lat), dict(sorted(self.errors.items())),
                          len(self.lat) / elapsed if elapsed > 0 else 0.0, pct(50), pct(90), pct(99), mean_batch)


async def _closed(target: LoadTarget, stats: _Stats, concurrency: int, duration_s: float,
                  counter: Any, timeout_s: float) -> float:
    """One closed-loop run into ``stats``; returns its elapsed seconds."""
    t0 = time.perf_counter()
    end = t0 + duration_s

    async def client_loop() -> None:
        c = HttpClient(target.url, timeout_s)
        try:
            for i in counter:
                if time.perf_counter() >= end:
                    break
                await stats.one(c, target, i)
        finally:
            await c.close()

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return time.perf_counter() - t0


async def closed_loop(target: LoadTarget, concurrency: int, duration_s: float,
                      max_requests: int = 1_000_000, timeout_s: float = 30.0) -> LoadResult:
    """``concurrency`` clients, back to back, for ``duration_s`` (or ``max_requests`` in total)."""
    stats = _Stats()
    before = await _metrics(target)
    elapsed = await _closed(target, stats, concurrency, duration_s, iter(range(max_requests)), timeout_s)
    return stats.result("closed", concurrency, elapsed, before, await _metrics(target))


async def interleaved(targets: dict[str, LoadTarget], concurrency: int, rounds: int, burst_s: float,
                      timeout_s: float = 30.0,
                      focus: Callable[[str | None], None] | None = None) -> dict[str, LoadResult]:
    """Closed-loop load on several servers in turn: ``rounds`` bursts of ``burst_s`` each, rotating
    the order every round, so drift and other load on the machine hit every server alike.

    Only one server is loaded at a time; each result merges its bursts (latencies pooled,
    throughput = answers / loaded seconds, mean batch from its /metrics over the whole run).
    ``focus(name)`` is called before each burst (e.g. to pause the idle servers, some of which poll
    and take CPU from the loaded one) and ``focus(None)`` before and after the run, when every
    server must answer its /metrics.
    """
    if rounds < 1 or burst_s <= 0:
        raise InputError(f"rounds={rounds}, burst_s={burst_s}: expected rounds >= 1 and burst_s > 0")
    names = list(targets)
    stats = {n: _Stats() for n in names}
    elapsed = dict.fromkeys(names, 0.0)
    if focus:
        focus(None)
    before = {n: await _metrics(targets[n]) for n in names}
    try:
        for k in range(rounds):
            for n in names[k % len(names):] + names[:k % len(names)]:
                if focus:
                    focus(n)
                elapsed[n] += await _closed(targets[n], stats[n], concurrency, burst_s,
                                            iter(range(1_000_000)), timeout_s)
    finally:
        if focus:
            focus(None)
    return {n: stats[n].result("closed", concurrency, elapsed[n], before[n], await _metrics(targets[n]))
            for n in names}


async def open_loop(target: LoadTarget, rate: float, duration_s: float, max_outstanding: int = 512,
                    timeout_s: float = 30.0) -> LoadResult:
    """Send ``rate`` requests/s on a fixed schedule for ``duration_s``; at most ``max_outstanding`` open."""
    if rate <= 0:
        raise InputError(f"rate: received {rate}, expected requests per second > 0")
    stats = _Stats()
    idle: list[HttpClient] = []
    tasks: set[asyncio.Task] = set()
    before = await _metrics(target)
    t0 = time.perf_counter()
    n = int(rate * duration_s)

    async def fire(i: int) -> None:
        c = idle.pop() if idle else HttpClient(target.url, timeout_s)
        await stats.one(c, target, i)
        idle.append(c)

    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if len(tasks) >= max_outstanding:
            stats.sent += 1
            stats.err("dropped")
            continue
        t = asyncio.create_task(fire(i))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    for c in idle:
        await c.close()
    return stats.result("open", rate, elapsed, before, await _metrics(target))


def _fake_tensor(spec: dict[str, Any], rows: int, seq: int, i: int) -> dict[str, Any]:
    shape = [rows if d == 0 else (seq if s == -1 else s) for d, s in enumerate(spec["shape"])]
    n = 1
    for s in shape:
        n *= s
    dt = spec["datatype"]
    if spec["name"] == "attention_mask":
        data: list[Any] = [1] * n
    elif dt.startswith(("INT", "UINT")):
        data = [1000 + (i * 7 + k * 13) % 1000 for k in range(n)]
    elif dt == "BOOL":
        data = [True] * n
    else:
        data = [((i + k) % 97) / 97.0 for k in range(n)]
    return {"name": spec["name"], "shape": shape, "datatype": dt, "data": data}


def binary_request(tensors: list[dict[str, Any]]) -> tuple[bytes, int]:
    """A v2 request (``_fake_tensor`` dicts) in the binary tensor extension, asking binary outputs
    back: (body, length of its JSON header for ``Inference-Header-Content-Length``)."""
    import numpy as np

    from torchnitro.serve.protocol import _NP

    blobs, inputs = [], []
    for t in tensors:
        blob = np.asarray(t["data"], dtype=np.dtype(_NP[t["datatype"]]).newbyteorder("<")).tobytes()
        blobs.append(blob)
        inputs.append({"name": t["name"], "shape": t["shape"], "datatype": t["datatype"],
                       "parameters": {"binary_data_size": len(blob)}})
    head = json.dumps({"inputs": inputs, "parameters": {"binary_data_output": True}}).encode()
    return head + b"".join(blobs), len(head)


async def v2_target(url: str, model: str, *, seq: int = 32, rows: int = 1, token: str | None = None,
                    variants: int = 64, binary: bool = False) -> LoadTarget:
    """A KServe v2 target whose requests are synthesised from the model's metadata (JSON, or with
    ``binary`` the binary tensor extension both ways)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        status, data = await HttpClient(url, 10.0).request("GET", f"/v2/models/{model}", headers=headers)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
        raise InputError(f"could not reach {url} ({type(exc).__name__}: {exc}); expected a running "
                         "`torchnitro serve` there - check the address and port") from None
    if status != 200:
        raise InputError(f"GET {url}/v2/models/{model} answered {status}: {data[:200]!r}; "
                         "check the model name and that the server is ready")
    meta = json.loads(data)
    tensors = [[_fake_tensor(s, rows, seq, i) for s in meta["inputs"]] for i in range(variants)]
    if binary:  # every variant has the same JSON header (names, shapes, sizes): one header value
        parts = [binary_request(t) for t in tensors]
        bodies = [b for b, _ in parts]
        headers = {**headers, "Inference-Header-Content-Length": str(parts[0][1])}
    else:
        bodies = [json.dumps({"inputs": t}).encode() for t in tensors]
    return LoadTarget(url, f"/v2/models/{model}/infer", lambda i: bodies[i % variants], headers, "/metrics", model)


def sweep(target: LoadTarget, concurrency: Sequence[int] = (), rates: Sequence[float] = (),
          duration_s: float = 10.0, max_requests: int = 1_000_000) -> list[LoadResult]:
    """Run a closed-loop sweep then an open-loop sweep against ``target``; returns one row per level."""

    async def main() -> list[LoadResult]:
        out = [await closed_loop(target, c, duration_s, max_requests) for c in concurrency]
        out += [await open_loop(target, r, duration_s) for r in rates]
        return out

    return asyncio.run(main())


def save_results(results: Sequence[LoadResult], name: str, meta: dict[str, Any] | None = None) -> list[Any]:
    """Write ``results/<name>.json``/``.md`` and a latency-vs-throughput PNG; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchnitro.bench.report import ResultTable, save_plot

    cols = ["mode", "level", "throughput", "p50_ms", "p90_ms", "p99_ms", "ok", "errors", "mean_batch"]
    table = ResultTable(f"loadtest {name}", cols, meta=dict(meta or {}))
    for r in results:
        table.add(**{c: (str(r.errors) if c == "errors" else getattr(r, c)) for c in cols})
    paths = list(table.save(name))
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in ("closed", "open"):
        rs = [r for r in results if r.mode == mode and r.p99_ms is not None]
        if rs:
            ax.plot([r.throughput for r in rs], [r.p99_ms for r in rs], "o-", label=f"{mode} loop p99")
            ax.plot([r.throughput for r in rs], [r.p50_ms for r in rs], "x--", label=f"{mode} loop p50")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(name)
    ax.legend()
    paths.append(save_plot(fig, name))
    return paths
