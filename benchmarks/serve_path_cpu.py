"""CPU per request of the server's own inference path, without sockets: where the batching path's
microseconds go (issue 16).

    python benchmarks/serve_path_cpu.py                       # no-op model: the path alone
    python benchmarks/serve_path_cpu.py --model real          # with the model's compute (batches on the loop)
    python benchmarks/serve_path_cpu.py --profile             # cProfile of the measured requests
    PYTHONPATH=/tmp/old/src python benchmarks/serve_path_cpu.py    # another source tree (A/B, interleave runs)

Drives ``InferPath`` (the raw ASGI infer route: binary tensor extension both ways), the
``DynamicBatcher`` and an ``InlinePool`` in one process and one event loop (uvloop when installed),
with ``--concurrency`` clients in a closed loop calling the ASGI app directly: no uvicorn, no
socket, so only the route, parsing, batching, assembling/splitting and encoding are counted (and
the model with ``--model real``). The no-op model returns a kept output of the right shape per batch
size, so the batch path (assemble, split, encode) still runs. Prints CPU microseconds per request
(``time.process_time`` over the measured requests), the mean batch and how many batches ran on the
event loop; writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import time
from typing import Any

import torch

from torchnitro.serve.batcher import BatchingConfig
from torchnitro.serve.loadtest import _fake_tensor, binary_request
from torchnitro.serve.models import ServedModel, resolve_model
from torchnitro.serve.server import InferenceServer, ModelEndpoint, ServeConfig
from torchnitro.serve.workers import InlinePool


class _Cycle:
    """What the infer route reads from uvicorn's request cycle: the whole body already received."""

    disconnected = False
    more_body = False

    def __init__(self, body: bytes) -> None:
        self.body = body

    async def receive(self) -> dict[str, Any]:
        return {"type": "http.request", "body": self.body, "more_body": False}


def _noop(sm: ServedModel) -> ServedModel:
    kept: dict[int, Any] = {}

    def fn(*xs: torch.Tensor) -> Any:
        out = kept.get(xs[0].shape[0])
        if out is None:
            out = kept[xs[0].shape[0]] = sm.fn(*xs)
        return out

    return ServedModel(fn, sm.signature)


async def run(args: argparse.Namespace) -> dict[str, float]:
    sm = resolve_model(args.spec, args.spec)
    if args.model == "noop":
        sm = _noop(sm)
    pool = InlinePool(sm, 1, loop_max_ms=5.0)
    ep = ModelEndpoint(args.spec, pool, BatchingConfig(max_batch_size=args.batch, max_wait_ms=5))
    srv = InferenceServer([ep], ServeConfig(workers=0))
    await ep.start(srv.metrics)
    app = srv.app
    app.own_connections = True  # receive() is a cycle's bound method, as under torchnitro serve
    meta = sm.signature.metadata()
    bodies = [binary_request([_fake_tensor(s, 1, 1, i) for s in meta["inputs"]]) for i in range(64)]
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(len(bodies[0][0])).encode()),
               (b"inference-header-content-length", str(bodies[0][1]).encode())]
    scope = {"type": "http", "method": "POST", "path": f"/v2/models/{args.spec}/infer", "headers": headers}
    done = bad = 0

    async def send(msg: dict[str, Any]) -> None:
        nonlocal bad
        if msg["type"] == "http.response.start" and msg["status"] != 200:
            bad += 1

    async def client(k: int, n: int) -> None:
        nonlocal done
        i = k
        while done < n:
            await app(dict(scope), _Cycle(bodies[i % len(bodies)][0]).receive, send)
            i += args.concurrency
            done += 1

    await asyncio.gather(*(client(k, args.warmup) for k in range(args.concurrency)))
    done, batches0 = 0, srv.metrics.stats[args.spec].execution_count
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    ru0, c0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
    await asyncio.gather(*(client(k, args.requests) for k in range(args.concurrency)))
    c1, ru1 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    await ep.batcher.stop()
    batches = srv.metrics.stats[args.spec].execution_count - batches0
    return {"requests": done, "errors": bad, "cpu_us_per_request": (c1 - c0) / done * 1e6,
            "sys_us_per_request": (ru1.ru_stime - ru0.ru_stime) / done * 1e6,
            "mean_batch": done / max(1, batches), "batches_on_loop": pool.on_loop}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default="mlp", help="built-in model whose signature (and, --model real, compute) is used")
    ap.add_argument("--model", choices=["noop", "real"], default="noop", help="noop: kept outputs, no compute")
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="max batch size")
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the measured requests")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    runner = getattr(uvloop, "run", None) or asyncio.run  # the server's loop: uvloop where uvicorn finds it
    res = runner(run(args))
    print(f"{args.spec} ({'no-op model' if args.model == 'noop' else 'model'}): {res['requests']} requests, "
          f"{res['cpu_us_per_request']:.1f} us CPU per request ({res['sys_us_per_request']:.1f} system), "
          f"mean batch {res['mean_batch']:.1f}, {res['batches_on_loop']} batches on the loop, "
          f"{res['errors']} errors")
    return res


if __name__ == "__main__":
    main()
