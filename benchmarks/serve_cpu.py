"""Serving on CPU: dynamic batching vs no batching vs the offline ceiling vs LitServe, in one run.

    flock /tmp/torchnitro-bench.lock python benchmarks/serve_cpu.py            # full run
    python benchmarks/serve_cpu.py --quick                                       # smoke run

For each model (all-MiniLM-L6-v2 with real weights, 32-token requests; the built-in ``mlp``):
  1. offline: the model alone, batched, in this process (the ceiling), via torchnitro.bench.measure;
  2. torchnitro server, max_batch_size=1 (no batching);
  3. torchnitro server, dynamic batching (max_batch_size=32, max_wait_ms=5);
  4. torchnitro server, adaptive batching (latency target);
  5. LitServe with its own batching (max_batch_size=32, batch_timeout=5 ms, fast_queue) on the same model;
  3b, 4b. the same dynamic and adaptive servers with requests and answers in the v2 binary tensor
     extension (checked first: one request both ways must come back binary with the JSON answer's numbers);
  3c. "inproc" / "inproc binary": the dynamic server with ``--workers 0`` (the model in the server
     process, cheap batches on its event loop: no worker hand-off), JSON and binary;
  6. "http+json floor" / "binary floor": a bare uvicorn app that reads the same request into numpy
     and writes a same-size answer (JSON, or the binary extension) with no model at all, the most
     any HTTP server in Python can do on this machine with this client.
Every server runs in its own process(es) with the same worker count and torch threads; all are up
at once and the load generator (closed loop, keep-alive connections, in this process) loads one at
a time in short bursts, rotating the order every round, so other load on the machine hits all of
them alike. The servers not being loaded are paused (SIGSTOP on their process group, SIGCONT before
their burst): an idle LitServe polls and would otherwise take CPU from whichever server is loaded.
Concurrency 32 for throughput, concurrency 1 for per-request overhead.
The ceiling is the model alone at the served row's mean batch, on the same torch threads as a
worker, measured after the servers stop (batch 1 and 32 also before they start: the faster of the
two counts); the served rows share the machine's cores with the load generator. At concurrency 32 each
row also gets the CPU it cost per request: the load generator (this process), the server's main
process and its workers (cpu_us_* columns; the inproc rows' server column holds the model too), next
to the CPU the machine has per request at 0.85x of the binary ceiling (cores / (0.85 x offline rate)).
Writes results/serve_cpu.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import torch

from torchnitro.bench import ResultTable, TimingConfig, measure, save_plot
from torchnitro.bench.provenance import git_commit, package_versions
from torchnitro.serve.loadtest import HttpClient, LoadTarget, interleaved, v2_target

SEQ = {"minilm": 32, "minilm-int8": 32, "mlp": 0}
SPECS: dict[str, str] = {}  # model label -> what `torchnitro serve` is given (an artifact dir for minilm-int8)


def spec(model: str) -> str:
    return SPECS.get(model, model)


def load_model(spec_: str) -> torch.nn.Module:
    """A built-in model, or the variant an optimize artifact directory holds."""
    from pathlib import Path

    if Path(spec_).is_dir():
        import torchnitro

        return torchnitro.load(spec_)
    from torchnitro.nn.zoo import get_builtin

    return get_builtin(spec_).build().eval()


INT8_RECIPE = "bert-unpad-int8"


def check_int8_artifact(path: str) -> str:
    """``path`` if it holds the int8 variant; otherwise RuntimeError saying what it holds and why
    (``optimize`` falls back to eager when the int8 build fails, e.g. past its time limit when loaded)."""
    from pathlib import Path

    manifest = Path(path) / "manifest.json"
    if not manifest.is_file():
        raise RuntimeError(f"{path}: no manifest.json; expected a `torchnitro optimize` artifact directory")
    recipe = json.loads(manifest.read_text()).get("recipe")
    if recipe != INT8_RECIPE:
        why = ""
        report = Path(path) / "report.json"
        if report.is_file():
            for cand in json.loads(report.read_text()).get("candidates", []):
                if isinstance(cand, dict) and INT8_RECIPE in json.dumps(cand):
                    why = f" ({INT8_RECIPE}: {cand.get('status')}, {cand.get('reason') or ''})"
        raise RuntimeError(f"{path} holds recipe {recipe!r}, expected {INT8_RECIPE!r}{why}")
    return path


def build_int8_artifact(out: str, budget: float) -> str:
    """`torchnitro optimize` on MiniLM with 32-token requests, int8 only: what a user would serve."""
    cmd = [sys.executable, "-m", "torchnitro", "optimize", "--model", "minilm", "--batch", "32", "--seq", "32",
           "--shape", "1x32", "--shape", "8x32", "-r", INT8_RECIPE, "--budget", str(budget), "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return check_int8_artifact(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- LitServe side
try:
    import litserve as ls

    class LitModelAPI(ls.LitAPI):
        """The same built-in model behind LitServe, with LitServe's own batching."""

        def __init__(self, model: str, threads: int, **kw: Any):
            super().__init__(**kw)
            self.model_name, self.threads = model, threads

        def setup(self, device: str) -> None:
            torch.set_num_threads(self.threads)
            self.model = load_model(self.model_name)

        def decode_request(self, request):  # noqa: ANN001 - LitServe reads the annotation; none = JSON body
            import numpy as np  # the same list -> numpy -> tensor route our server takes

            return [torch.from_numpy(np.asarray(t["data"], dtype=t["dtype"]).reshape(t["shape"]))
                    for t in request["inputs"]]

        def batch(self, inputs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
            return [torch.cat([x[k] for x in inputs]) for k in range(len(inputs[0]))]

        def predict(self, xs: list[torch.Tensor]) -> torch.Tensor:
            with torch.inference_mode():
                return self.model(*xs)

        def unbatch(self, out: torch.Tensor) -> list[torch.Tensor]:
            return list(out.split(1))

        def encode_response(self, out: torch.Tensor) -> dict[str, Any]:
            return {"output": out.reshape(-1).tolist(), "shape": list(out.shape)}
except ImportError:  # the bench extra is not installed: the LitServe rows are skipped
    ls = None


def litserve_main(model: str, port: int, max_batch: int, timeout_s: float, threads: int, fast_queue: bool) -> None:
    api = LitModelAPI(model, threads, max_batch_size=max_batch, batch_timeout=timeout_s)
    # its fastest documented transport (ZeroMQ), one HTTP process and one worker like ours
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, timeout=60,
                          fast_queue=fast_queue)
    server.run(host="127.0.0.1", port=port, num_api_servers=1, log_level="warning", generate_client_file=False)


# ----------------------------------------------------------------------------- http+json floor
def floor_main(port: int) -> None:
    """Bare uvicorn + orjson + numpy, no model: parse the request, answer as many FP32 numbers as its
    first input holds, in JSON or (``Inference-Header-Content-Length`` sent) the binary extension."""
    import numpy as np
    import orjson
    import uvicorn

    _FLOOR_NP = {"FP32": np.dtype("<f4"), "INT64": np.dtype("<i8"), "INT32": np.dtype("<i4")}

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        head_len = next((v for k, v in scope["headers"] if k == b"inference-header-content-length"), None)
        headers = [(b"content-type", b"application/json")]
        if scope["method"] == "GET":
            out = b"{}"
        elif head_len is None:
            req = orjson.loads(body)
            arrs = [np.asarray(t["data"]).reshape(t["shape"]) for t in req["inputs"]]
            out = orjson.dumps({"outputs": [{"name": "output", "data": arrs[0].reshape(-1).astype(np.float32)}]},
                               option=orjson.OPT_SERIALIZE_NUMPY)
        else:  # binary tensor extension both ways: JSON header, raw input bytes in, raw FP32 bytes out
            n = int(head_len)
            req, off = orjson.loads(body[:n]), n
            arrs = []
            for t in req["inputs"]:
                size = t["parameters"]["binary_data_size"]
                arrs.append(np.frombuffer(body, dtype=_FLOOR_NP[t["datatype"]], count=size // _FLOOR_NP[
                    t["datatype"]].itemsize, offset=off).reshape(t["shape"]))
                off += size
            blob = arrs[0].astype(np.float32).tobytes()
            head = orjson.dumps({"outputs": [{"name": "output", "datatype": "FP32", "shape": list(arrs[0].shape),
                                              "parameters": {"binary_data_size": len(blob)}}]})
            out = head + blob
            headers = [(b"content-type", b"application/octet-stream"),
                       (b"inference-header-content-length", str(len(head)).encode())]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [*headers, (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def litserve_target(v2: LoadTarget, url: str) -> LoadTarget:
    dt = {"INT64": "int64", "FP32": "float32"}

    def body(i: int) -> bytes:
        req = json.loads(v2.body(i))
        return json.dumps({"inputs": [{"data": t["data"], "shape": t["shape"], "dtype": dt[t["datatype"]]}
                                      for t in req["inputs"]]}).encode()

    bodies = [body(i) for i in range(64)]
    return LoadTarget(url, "/predict", lambda i: bodies[i % 64], metrics_path=None)


# ----------------------------------------------------------------------------- helpers
def wait_ready(proc: subprocess.Popen, url: str, path: str, timeout_s: float = 180) -> None:
    end = time.monotonic() + timeout_s

    async def probe() -> int:
        return (await HttpClient(url, 2).request("GET", path))[0]

    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if asyncio.run(probe()) == 200:
                return
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, IndexError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"server at {url} not ready after {timeout_s} s")


def start(cmd: list[str]) -> subprocess.Popen:
    """Start a server in its own process group, so stop() reaches the workers it spawns."""
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (LitServe leaves its workers running otherwise); SIGCONT
    first, since a group paused by pauser() would not act on SIGTERM until resumed."""
    try:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        pass
    time.sleep(0.5)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of this group still alive
    except ProcessLookupError:
        pass
    proc.wait(10)


def metric_means(url: str, model: str) -> dict[str, float]:
    async def get() -> str:
        return (await HttpClient(url, 5).request("GET", "/metrics"))[1].decode()

    out: dict[str, float] = {}
    for line in asyncio.run(get()).splitlines():
        if f'model="{model}"' not in line:
            continue
        for m in ("request_seconds", "compute_seconds", "batch_size"):
            for kind in ("sum", "count"):
                if line.startswith(f"torchnitro_{m}_{kind}"):
                    out[f"{m}_{kind}"] = float(line.rsplit(" ", 1)[1])
    return out


def pauser(procs: dict[str, tuple[subprocess.Popen, str, str]], same: dict[str, str] | None = None) -> Any:
    """focus() for interleaved(): SIGSTOP every server's process group but the loaded one (an idle
    LitServe polls and takes ~16% of a core here), SIGCONT them all for None. ``same`` maps a target
    label to the server it loads when that is another target's server."""
    def focus(name: str | None) -> None:
        name = (same or {}).get(name, name) if name is not None else None
        for label, (proc, _, _) in procs.items():
            try:
                os.killpg(proc.pid, signal.SIGCONT if name is None or label == name else signal.SIGSTOP)
            except ProcessLookupError:
                pass
    return focus


def _tree_cpu(pid: int) -> tuple[float, float]:
    """(CPU seconds of process ``pid``, of its live descendants): a server's main process, its workers."""
    import psutil

    try:
        p = psutil.Process(pid)
        own = sum(p.cpu_times()[:2])
        kids = 0.0
        for c in p.children(recursive=True):
            try:
                kids += sum(c.cpu_times()[:2])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return own, kids
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0, 0.0


class CpuMeter:
    """A focus() wrapper that charges CPU time to the target whose burst it is: the load generator
    (this process, ``time.process_time``), the loaded server's main process and its workers. Only
    one server runs at a time (the others are stopped), so the deltas are that burst's own."""

    def __init__(self, procs: dict[str, tuple[subprocess.Popen, str, str]], same: dict[str, str], inner: Any):
        self.procs, self.same, self.inner = procs, same, inner
        self.cpu: dict[str, list[float]] = {}  # target -> [client, server, workers] CPU seconds
        self._cur: tuple[str, float, float, float] | None = None

    def _sample(self, name: str) -> tuple[float, float, float]:
        server, workers = _tree_cpu(self.procs[self.same.get(name, name)][0].pid)
        return time.process_time(), server, workers

    def __call__(self, name: str | None) -> None:
        if self._cur is not None:
            prev, *before = self._cur
            acc = self.cpu.setdefault(prev, [0.0, 0.0, 0.0])
            for k, (a, b) in enumerate(zip(self._sample(prev), before)):
                acc[k] += a - b
            self._cur = None
        self.inner(name)
        if name is not None:
            self._cur = (name, *self._sample(name))

    def per_request_us(self, results: dict[str, Any]) -> dict[str, dict[str, float]]:
        """CPU microseconds per request sent, by target: client, server (main process), workers."""
        out = {}
        for name, (client, server, workers) in self.cpu.items():
            n = max(results[name].sent, 1)
            out[name] = {"client": client / n * 1e6, "server": server / n * 1e6, "workers": workers / n * 1e6}
        return out


def run_interleaved(targets: dict[str, LoadTarget], conc: int, rounds: int, burst: float,
                    focus: Any = None) -> dict[str, Any]:
    return asyncio.run(interleaved(targets, conc, rounds, burst, focus=focus))


def check_binary(url: str, json_target: LoadTarget, binary_target: LoadTarget) -> str:
    """One request both ways to the same server: the binary answer must come back in the binary
    extension (octet-stream, Inference-Header-Content-Length, binary_data_size) and hold the same
    numbers as the JSON answer; raises otherwise. Returns a line for the results header."""
    import httpx
    import numpy as np

    js = httpx.post(url + json_target.path, content=json_target.body(0), headers=json_target.headers, timeout=30)
    bn = httpx.post(url + binary_target.path, content=binary_target.body(0), headers=binary_target.headers,
                    timeout=30)
    if js.status_code != 200 or bn.status_code != 200:
        raise RuntimeError(f"binary check: JSON answered {js.status_code}, binary {bn.status_code}: {bn.text[:300]}")
    n = bn.headers.get("inference-header-content-length")
    if n is None or not bn.headers.get("content-type", "").startswith("application/octet-stream"):
        raise RuntimeError(f"binary check: the answer is not in the binary extension (headers {dict(bn.headers)})")
    head, off = json.loads(bn.content[:int(n)]), int(n)
    for out_json, out_bin in zip(js.json()["outputs"], head["outputs"]):
        size = out_bin["parameters"]["binary_data_size"]
        got = np.frombuffer(bn.content[off:off + size], dtype={"FP32": "<f4", "INT64": "<i8"}[out_bin["datatype"]])
        off += size
        want = np.asarray(out_json["data"], dtype=np.float32)
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-5, atol=1e-6):
            raise RuntimeError(f"binary check: output {out_bin['name']!r} differs from the JSON answer")
    if off != len(bn.content):
        raise RuntimeError(f"binary check: {len(bn.content) - off} bytes after the last binary output")
    return (f"request {len(binary_target.body(0))} B (JSON {len(json_target.body(0))} B), answer {len(bn.content)} B "
            f"(JSON {len(js.content)} B), header {n} B; outputs equal the JSON answer's")


def offline(model: str, batch_sizes: list[int], threads: int, quick: bool) -> dict[int, Any]:
    from torchnitro.nn.zoo import get_builtin

    torch.set_num_threads(threads)
    m = load_model(spec(model))
    cfg = TimingConfig(min_time_s=0.5 if quick else 2.0, max_time_s=10.0)
    out = {}
    for bs in batch_sizes:
        if model.startswith("minilm"):  # same synthetic 32-token requests the servers get: no padding
            xs = (torch.randint(1000, 2000, (bs, SEQ[model])), torch.ones(bs, SEQ[model], dtype=torch.int64))
        else:
            b = get_builtin(model)
            xs = b.inputs(bs, SEQ[model], 0) if SEQ[model] else b.inputs(bs, 0, 0)
        with torch.inference_mode():
            out[bs] = measure(lambda: m(*xs), cfg, items_per_call=bs)
    return out


# ----------------------------------------------------------------------------- main
def start_servers(model: str, args: argparse.Namespace) -> dict[str, tuple[subprocess.Popen, str, str]]:
    """Every server for ``model`` at once: label -> (process, base url, readiness path)."""
    threads = str(args.threads)
    configs = {
        "no batching": ["--max-batch-size", "1", "--max-wait-ms", "0"],
        "dynamic": ["--max-batch-size", "32", "--max-wait-ms", "5"],
        "adaptive": ["--max-batch-size", "32", "--max-wait-ms", "5", "--adaptive", "--latency-target-ms",
                     str(args.target_ms)],
    }
    procs: dict[str, tuple[subprocess.Popen, str, str]] = {}
    for label, flags in configs.items():
        port = free_port()
        procs[label] = (start([sys.executable, "-m", "torchnitro", "serve", spec(model), "--name", model,
                               "--port", str(port), "--workers", str(args.workers), "--threads", threads, *flags]),
                        f"http://127.0.0.1:{port}", "/v2/health/ready")
    if not args.no_inproc:  # the model in the server process: no worker hand-off (--workers 0)
        port = free_port()
        procs["inproc"] = (start([sys.executable, "-m", "torchnitro", "serve", spec(model), "--name", model,
                                  "--port", str(port), "--workers", "0", "--threads", threads,
                                  *configs["dynamic"]]), f"http://127.0.0.1:{port}", "/v2/health/ready")
    if not args.no_litserve and ls is not None:
        port = free_port()
        procs["litserve"] = (start([sys.executable, __file__, "--litserve-server", spec(model), "--port", str(port),
                                    "--threads", threads]), f"http://127.0.0.1:{port}", "/health")
    port = free_port()
    procs["http+json floor"] = (start([sys.executable, __file__, "--floor-server", "--port", str(port)]),
                                f"http://127.0.0.1:{port}", "/")
    return procs


def bench_model(model: str, args: argparse.Namespace, table: ResultTable, raw: dict[str, Any]) -> None:
    # the model alone at batch 1 and 32 before any server starts too: the ceiling at a size measured
    # twice is the faster of the two, so a slow moment on a shared machine cannot lower it
    early = offline(model, [1, 32], args.threads, args.quick)
    procs = start_servers(model, args)
    res: dict[str, dict[int, Any]] = {}
    raw_meta: dict[str, Any] = {}
    server_side: dict[str, dict[str, float]] = {}
    c = args.concurrency
    try:
        for proc, url, path in procs.values():
            wait_ready(proc, url, path)
        targets: dict[str, LoadTarget] = {}
        v2 = asyncio.run(_v2_shape_only(model))
        for label, (_, url, _) in procs.items():
            if label == "litserve":
                targets[label] = litserve_target(v2, url)
            elif label == "http+json floor":
                targets[label] = LoadTarget(url, "/infer", v2.body, metrics_path=None)
            else:
                targets[label] = asyncio.run(v2_target(url, model, seq=SEQ[model] or 1))
        # the dynamic and adaptive servers again, spoken to in the binary tensor extension (both
        # ways), and the no-model floor in the binary extension
        same = {"dynamic binary": "dynamic", "adaptive binary": "adaptive", "binary floor": "http+json floor"}
        if "inproc" in procs:
            same["inproc binary"] = "inproc"
        for label in [k for k, v in same.items() if v != "http+json floor"]:
            targets[label] = asyncio.run(v2_target(procs[same[label]][1], model, seq=SEQ[model] or 1, binary=True))
        targets["binary floor"] = LoadTarget(procs["http+json floor"][1], "/infer", targets["dynamic binary"].body,
                                             targets["dynamic binary"].headers, metrics_path=None)
        raw_meta["binary_check"] = check_binary(procs["dynamic"][1], targets["dynamic"], targets["dynamic binary"])
        focus = pauser(procs, same)
        run_interleaved(targets, c, 1, args.warmup, focus)  # warm-up (and the adaptive policy's first curve)
        before = {k: metric_means(procs[k][1], model) for k in ("no batching", "adaptive")}
        low = run_interleaved(targets, 1, args.rounds, args.burst, focus)
        for k, b in before.items():
            after = metric_means(procs[k][1], model)
            server_side[k] = {m: after.get(m, 0) - b.get(m, 0) for m in after}
        meter = CpuMeter(procs, same, focus)
        high = run_interleaved(targets, c, args.rounds, args.burst, meter)
        cpu_us = meter.per_request_us(high)
        res = {label: {1: low[label], c: high[label]} for label in targets}
    finally:
        for proc, _, _ in procs.values():
            stop(proc)
    def at(label: str) -> int:  # the offline batch matching a served row's mean batch
        return max(1, round(res[label][c].mean_batch or 1.0))

    mean_b = res["dynamic"][c].mean_batch or 1.0
    served = [k for k in ("dynamic", "adaptive", "dynamic binary", "adaptive binary", "inproc", "inproc binary")
              if k in res]
    sizes = sorted({1, 32, *(at(k) for k in served)})
    off = offline(model, sizes, args.threads, args.quick)
    raw_meta["offline_before_servers"] = {str(k): v.to_dict() for k, v in early.items()}
    off.update({bs: t for bs, t in early.items() if t.throughput > off[bs].throughput})
    unb = res["no batching"][c].throughput
    for label, levels in res.items():
        for conc, r in sorted(levels.items()):
            cpu = cpu_us.get(label) if conc == c else None
            table.add(model=model, config=label, concurrency=conc, throughput=r.throughput, p50_ms=r.p50_ms,
                      p99_ms=r.p99_ms, mean_batch=r.mean_batch, errors=str(r.errors) if r.errors else "",
                      vs_unbatched=r.throughput / unb if conc == c else None,
                      cpu_us_client=cpu and cpu["client"], cpu_us_server=cpu and cpu["server"],
                      cpu_us_workers=cpu and cpu["workers"])
    for bs, t in off.items():
        table.add(model=model, config=f"offline batch {bs}", concurrency=None, throughput=t.throughput,
                  p50_ms=t.median * 1e3, p99_ms=t.p99 * 1e3, mean_batch=bs, errors="", vs_unbatched=None,
                  cpu_us_client=None, cpu_us_server=None, cpu_us_workers=None)
    dyn, ada = res["dynamic"][c], res["adaptive"][c]
    ceiling = off[max(1, round(mean_b))].throughput
    dbin, abin = res["dynamic binary"][c], res["adaptive binary"][c]
    summary: dict[str, Any] = {
        "dynamic_vs_unbatched_c32": dyn.throughput / unb,
        "adaptive_vs_unbatched_c32": ada.throughput / unb,
        "dynamic_vs_offline_same_batch": dyn.throughput / ceiling,
        "dynamic_binary_vs_offline_same_batch": dbin.throughput / off[at("dynamic binary")].throughput,
        "adaptive_binary_vs_offline_same_batch": abin.throughput / off[at("adaptive binary")].throughput,
        # the stricter ceiling for both binary rows: offline at the dynamic binary row's (larger) batch
        "best_binary_vs_offline_dynamic_batch":
            max(dbin.throughput, abin.throughput) / off[at("dynamic binary")].throughput,
        "best_vs_offline_same_batch": max(dyn.throughput, ada.throughput) / ceiling,
        "floor_vs_offline_same_batch": res["http+json floor"][c].throughput / ceiling,
        "binary_floor_vs_offline_same_batch": res["binary floor"][c].throughput / off[at("dynamic binary")].throughput,
        # CPU the whole machine has per request at 0.85x of the binary ceiling (cores / rate), against
        # what the load generator and the no-model binary floor server spend per request
        "cpu_budget_us_at_0.85x_binary": (os.cpu_count() or 1) * 1e6 / (0.85 * off[at("dynamic binary")].throughput),
        "offline_b32_vs_b1": off[32].throughput / off[1].throughput,
        # the goal's ceiling: the model alone at batch 32, whatever batch the row served
        "dynamic_binary_vs_offline_b32": dbin.throughput / off[32].throughput,
        "dynamic_mean_batch": mean_b,
        "offline_batch1_ms": off[1].median * 1e3,
    }
    if "inproc binary" in res:
        ib = res["inproc binary"][c]
        summary["inproc_binary_vs_offline_same_batch"] = ib.throughput / off[at("inproc binary")].throughput
        summary["inproc_binary_vs_offline_b32"] = ib.throughput / off[32].throughput
        summary["inproc_vs_offline_same_batch"] = res["inproc"][c].throughput / off[at("inproc")].throughput
        summary["inproc_binary_mean_batch"] = ib.mean_batch or 0.0
    for label in ("no batching", "adaptive"):
        s = server_side[label]
        if s.get("request_seconds_count"):
            inside = s["request_seconds_sum"] / s["request_seconds_count"]
            compute = s["compute_seconds_sum"] / max(s["compute_seconds_count"], 1)
            summary[f"server_overhead_ms_{label.replace(' ', '_')}"] = (inside - compute) * 1e3
        summary[f"client_p50_minus_model_ms_{label.replace(' ', '_')}"] = res[label][1].p50_ms - off[1].median * 1e3
    for label, cpu in cpu_us.items():
        summary[f"cpu_us_per_request_{label.replace(' ', '_').replace('+', '_')}"] = sum(cpu.values())
    if "litserve" in res:
        lit = res["litserve"][c]
        summary["dynamic_vs_litserve_c32"] = dyn.throughput / lit.throughput
        summary["best_vs_litserve_c32"] = max(dyn.throughput, ada.throughput) / lit.throughput
        summary["p99_dynamic_ms"], summary["p99_adaptive_ms"] = dyn.p99_ms, ada.p99_ms
        summary["p99_litserve_ms"] = lit.p99_ms
    raw[model] = {"summary": summary, "cpu_us_per_request_c32": cpu_us, **raw_meta,
                  "runs": {k: {str(n): r.to_dict() for n, r in v.items()} for k, v in res.items()},
                  "offline": {str(k): v.to_dict() for k, v in off.items()}}


async def _v2_shape_only(model: str) -> LoadTarget:
    """v2-style request bodies without a server (for LitServe): same data the v2 servers get."""
    from torchnitro.serve.loadtest import _fake_tensor
    from torchnitro.serve.models import resolve_model

    sig = resolve_model(spec(model)).signature
    seq = SEQ[model] or 1
    bodies = [json.dumps({"inputs": [_fake_tensor(s.to_dict(), 1, seq, i) for s in sig.inputs]}).encode()
              for i in range(64)]
    return LoadTarget("", "", lambda i: bodies[i % 64])


def plot(raw: dict[str, Any], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(raw), figsize=(6 * len(raw), 4), squeeze=False)
    for ax, (model, d) in zip(axes[0], raw.items()):
        for label, levels in d["runs"].items():
            pts = sorted((r["throughput"], r["p99_ms"]) for r in levels.values() if r["p99_ms"] is not None)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
        ax.set_yscale("log")
        for bs, t in d["offline"].items():  # labels at the axes' bottom (axes-fraction y): clear of the title
            ax.axvline(t["throughput_per_s"], ls=":", color="gray")
            ax.text(t["throughput_per_s"], 0.02, f" offline b{bs}", rotation=90, fontsize=7, va="bottom",
                    transform=ax.get_xaxis_transform())
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel("p99 latency (ms)")
        ax.set_title(f"{model}: concurrency 1 and 32")
        ax.legend(fontsize=8)
    save_plot(fig, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="minilm,minilm-int8,mlp",
                    help="minilm (eager fp32), minilm-int8 (the bert-unpad-int8 artifact `optimize` makes), mlp")
    ap.add_argument("--rounds", type=int, default=6, help="interleaved bursts per server and concurrency")
    ap.add_argument("--burst", type=float, default=1.5, help="seconds per burst")
    ap.add_argument("--warmup", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)  # 2 OMP threads collapse on a shared 2-core box
    ap.add_argument("--target-ms", type=float, default=300.0)
    ap.add_argument("--no-litserve", action="store_true")
    ap.add_argument("--no-inproc", action="store_true", help="skip the --workers 0 (in-process) rows")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--name", default="serve_cpu", help="results/<name>.{json,md,png}")
    ap.add_argument("--int8-artifact", help="serve this bert-unpad-int8 artifact directory as minilm-int8 instead "
                    "of building one (the build can pass its 120 s limit on a loaded machine)")
    ap.add_argument("--note", help="a line for the results header (e.g. what else loaded the machine)")
    ap.add_argument("--litserve-server")
    ap.add_argument("--floor-server", action="store_true")
    ap.add_argument("--litserve-fast-queue", type=int, default=1, help="1: LitServe's ZeroMQ transport, 0: its default")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    if args.litserve_server:
        litserve_main(args.litserve_server, args.port, 32, 0.005, args.threads, args.litserve_fast_queue == 1)
        return
    if args.floor_server:
        floor_main(args.port)
        return
    if args.quick:
        args.rounds, args.burst, args.warmup = 2, 0.5, 0.5
    from torchnitro.hardware import hardware_info

    hw = hardware_info()
    table = ResultTable("serve_cpu: requests/s and latency on this machine",
                        ["model", "config", "concurrency", "throughput", "p50_ms", "p99_ms", "mean_batch",
                         "errors", "vs_unbatched", "cpu_us_client", "cpu_us_server", "cpu_us_workers"],
                        meta={"machine": f"{hw.cpu_name}, {hw.cpu_cores} cores, no GPU",
                              "command": "flock /tmp/torchnitro-bench.lock python benchmarks/serve_cpu.py "
                                         + " ".join(sys.argv[1:]),
                              "versions": package_versions(("torch", "numpy", "uvicorn", "starlette",
                                                            "httpx", "orjson", "litserve")),
                              "commit": git_commit(),
                              "workers": args.workers, "threads_per_worker": args.threads,
                              "rounds": args.rounds, "burst_s": args.burst, "concurrency": args.concurrency,
                              "litserve": getattr(ls, "__version__", "not installed") if ls else "not installed"})
    if args.note:
        table.meta["note"] = args.note
    raw: dict[str, Any] = {}
    models = args.models.split(",")
    if "minilm" in models:
        try:
            import torchnitro.hf  # noqa: F401
        except ImportError as exc:
            table.meta["note"] = f"torchnitro.hf unavailable ({exc}); served the built-in encoder instead"
            models = ["encoder" if m == "minilm" else m for m in models if m != "minilm-int8"]
            SEQ["encoder"] = 32
    if "minilm-int8" in models:
        import tempfile

        try:
            if args.int8_artifact:
                SPECS["minilm-int8"] = check_int8_artifact(args.int8_artifact)
            else:
                tmp = tempfile.mkdtemp(prefix="serve_cpu_")
                SPECS["minilm-int8"] = build_int8_artifact(os.path.join(tmp, "minilm-int8"),
                                                           60 if args.quick else 120)
            table.meta["minilm-int8"] = ("served artifact of `torchnitro optimize --model minilm --batch 32 --seq 32 "
                                         "--shape 1x32 --shape 8x32 -r bert-unpad-int8`"
                                         + (f" ({args.int8_artifact}, built beforehand)" if args.int8_artifact else "")
                                         + "; LitServe and offline load the same artifact")
        except (RuntimeError, subprocess.CalledProcessError) as exc:  # the other models still run
            table.meta["minilm-int8"] = f"not measured: {exc}"
            print(f"minilm-int8 skipped: {exc}", file=sys.stderr)
            models = [m for m in models if m != "minilm-int8"]
    for model in models:
        bench_model(model, args, table, raw)
    for model, d in raw.items():
        table.meta[f"summary {model}"] = json.dumps({k: round(v, 3) for k, v in d["summary"].items()})
        if "binary_check" in d:
            table.meta[f"binary check {model}"] = d["binary_check"]
    table.print()
    table.save(args.name)
    from torchnitro.bench.report import results_dir

    (results_dir() / f"{args.name}_raw.json").write_text(json.dumps(raw, indent=2, default=str))
    plot(raw, args.name)
    for model, d in raw.items():
        print(model, json.dumps(d["summary"], indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
