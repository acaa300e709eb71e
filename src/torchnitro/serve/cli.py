"""``torchnitro serve`` and ``torchnitro loadtest``.

Flags override the YAML config (``--config``: sections ``batching`` = BatchingConfig fields and
``serve`` = ServeConfig fields).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Optional

import typer

from torchnitro.errors import InputError

__all__ = ["register", "build_configs", "serve_command", "loadtest_command"]


def _ints(text: str | None, what: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise InputError(f"{what}: received {text!r}, expected comma-separated integers like 1,8,32") from None


def build_configs(config: str | None = None, **flags: Any) -> tuple[Any, Any]:
    """(BatchingConfig, ServeConfig) from an optional YAML file, then flags that were given."""
    from torchnitro.config import from_dict, load_yaml
    from torchnitro.serve.batcher import BatchingConfig
    from torchnitro.serve.server import ServeConfig

    data = load_yaml(config) if config else {}
    b = dict(data.get("batching") or {})
    s = dict(data.get("serve") or {})
    bnames = {f.name for f in dataclasses.fields(BatchingConfig)}
    snames = {f.name for f in dataclasses.fields(ServeConfig)}
    for k, v in flags.items():
        if v is None:
            continue
        if k in bnames:
            b[k] = v
        elif k in snames:
            s[k] = v
        else:  # pragma: no cover - a flag without a config field is a programming error
            raise KeyError(k)
    return from_dict(BatchingConfig, b, where="batching"), from_dict(ServeConfig, s, where="serve")


def _serve_configs(config: str | None, buckets: str | None, preferred: str | None, timeout_ms: float | None,
                   token: str | None, **flags: Any) -> tuple[Any, Any]:
    """(BatchingConfig, ServeConfig) for ``serve``: the flags whose names differ from the config fields mapped."""
    return build_configs(
        config, default_timeout_ms=timeout_ms, bucket_boundaries=_ints(buckets, "--buckets") or None,
        preferred_batch_sizes=_ints(preferred, "--preferred") or None, auth_token=token, **flags)


def _start_server(model: str, mname: str, batching: Any, scfg: Any, ray: bool, replicas: int) -> None:
    """Run the chosen server (Ray Serve, or the in-house HTTP/gRPC one) until it is stopped."""
    from rich.console import Console

    if ray:
        from torchnitro.serve.ray_app import run_ray

        Console(stderr=True).print(f"serving [bold]{mname}[/bold] on Ray Serve, {replicas} replica(s), "
                                   f"proxy on http://{scfg.host}:{scfg.port}")
        run_ray(model, name=mname, replicas=replicas, batching=batching, serve_config=scfg)
        return
    from torchnitro.serve.server import InferenceServer, ModelEndpoint, make_pool

    endpoint = ModelEndpoint(mname, make_pool(model, mname, scfg), batching)
    Console(stderr=True).print(
        f"serving [bold]{mname}[/bold] on http://{scfg.host}:{scfg.port} "
        f"(workers={scfg.workers}, max_batch_size={batching.max_batch_size}, "
        f"max_wait_ms={batching.max_wait_ms}{', adaptive' if batching.adaptive else ''})"
        + (f"; gRPC on {scfg.host}:{scfg.grpc_port}" if scfg.grpc_port is not None else ""))
    InferenceServer([endpoint], scfg).run()


def serve_command(
    model: str = typer.Argument(..., help="Built-in name (minilm, encoder...), artifact dir, or module:function."),
    name: Optional[str] = typer.Option(None, help="Model name in URLs (default: the built-in/dir name)."),
    config: Optional[str] = typer.Option(None, "--config", help="YAML with batching/serve sections."),
    host: Optional[str] = typer.Option(None, help="Bind address (default 127.0.0.1)."),
    port: Optional[int] = typer.Option(None, help="Port (default 8000)."),
    workers: Optional[int] = typer.Option(None, help="Model replicas (processes); 0 = in-process."),
    threads: Optional[int] = typer.Option(None, help="Torch threads per worker (default cores // workers)."),
    device: Optional[str] = typer.Option(None, help="auto (default), cpu, or cuda (replicas on GPU streams)."),
    max_batch_size: Optional[int] = typer.Option(None, help="Rows per batch."),
    max_wait_ms: Optional[float] = typer.Option(None, help="Wait window from a batch's first request."),
    max_queue_size: Optional[int] = typer.Option(None, help="Waiting requests before 429."),
    priority_levels: Optional[int] = typer.Option(None, help="Priority levels (0 = most urgent)."),
    timeout_ms: Optional[float] = typer.Option(None, help="Default request deadline (ms)."),
    buckets: Optional[str] = typer.Option(None, help="Sequence-length buckets, e.g. 32,64,128."),
    preferred: Optional[str] = typer.Option(None, help="Preferred batch sizes, e.g. 8,16,32."),
    adaptive: Optional[bool] = typer.Option(None, "--adaptive/--no-adaptive", help="Learn batch size/wait."),
    latency_target_ms: Optional[float] = typer.Option(None, help="Latency target for --adaptive."),
    token: Optional[str] = typer.Option(None, envvar="TORCHNITRO_TOKEN", help="Require this bearer token."),
    max_body_bytes: Optional[int] = typer.Option(None, help="Larger bodies get 413."),
    trust_code: Optional[bool] = typer.Option(None, "--trust-code", help="Let an artifact dir run code it names "
                                              "or holds (.py factory, TorchScript); only for trusted sources."),
    grpc_port: Optional[int] = typer.Option(None, help="Also serve KServe v2 gRPC on this port (0 = any free)."),
    ray: bool = typer.Option(False, "--ray", help="Serve as a Ray Serve deployment (RAY_ADDRESS or a local "
                             "cluster); Ray's proxy listens on --host/--port."),
    replicas: int = typer.Option(1, help="With --ray: replicas of the deployment (each: model + batcher)."),
) -> None:
    """Serve a model over HTTP (KServe v2 JSON) with dynamic batching."""
    from pathlib import Path

    batching, scfg = _serve_configs(
        config, buckets, preferred, timeout_ms, token, host=host, port=port, workers=workers, threads=threads,
        device=device, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, max_queue_size=max_queue_size,
        priority_levels=priority_levels, adaptive=adaptive, latency_target_ms=latency_target_ms,
        max_body_bytes=max_body_bytes, trust_code=trust_code, grpc_port=grpc_port)
    meta = _artifact_meta(model)  # raises before anything is announced when serve cannot load the artifact
    scfg = _with_recorded_threads(meta, scfg)
    mname = name or (Path(model).name if Path(model).is_dir() else model.rpartition(":")[2])
    if meta is not None:  # the artifact's allocator setting, set before any worker process starts (read at start)
        from torchnitro.autotune.fair import apply_recorded_allocator

        apply_recorded_allocator(meta)
    _start_server(model, mname, batching, scfg, ray, replicas)


def _artifact_meta(model: str) -> dict[str, Any] | None:
    """The meta of the artifact directory ``model`` from its manifest, read and verified once (every file's
    SHA-256) for all of serve's start-up settings; None for a model that is not a directory. Raises InputError
    for an artifact serve cannot load from its directory alone (``models.unservable_reason``): its workers
    would fail only after the server announced itself."""
    from pathlib import Path

    if not Path(model).is_dir():
        return None
    from torchnitro.autotune.artifact import read_manifest
    from torchnitro.serve.models import unservable_reason

    manifest = read_manifest(model)
    why = unservable_reason(model, manifest)
    if why is not None:
        raise InputError(f"serve: {why}")
    return dict(manifest.get("meta") or {})


def _recorded_threads_per_worker(recorded: int | None, workers: int | None) -> int | None:
    """An artifact's recorded torch thread count, at most the usable cores // workers (None: the default;
    workers 0 or None: one process, the server's own)."""
    if recorded is None:
        return None
    from torchnitro.serve.workers import threads_per_worker

    return min(recorded, threads_per_worker(workers or 1))


def _with_recorded_threads(meta: dict[str, Any] | None, scfg: Any) -> Any:
    """``scfg`` with the thread count the optimizer measured for the artifact whose meta is ``meta``
    (``meta["torch_threads"]``; None: not an artifact) when neither ``--threads`` nor the config file set one, split
    by the workers the merged config has."""
    if scfg.threads is not None or meta is None:
        return scfg
    from torchnitro.autotune.fair_threads import recorded_threads

    threads = _recorded_threads_per_worker(recorded_threads(meta), scfg.workers)
    return scfg if threads is None else dataclasses.replace(scfg, threads=threads)


def loadtest_command(
    url: str = typer.Argument(..., help="Server base URL, e.g. http://127.0.0.1:8000"),
    model: str = typer.Option(..., help="Model name on the server."),
    concurrency: str = typer.Option("1,8,32", help="Closed-loop concurrency levels."),
    rate: Optional[str] = typer.Option(None, help="Open-loop request rates per second, e.g. 50,100."),
    duration: float = typer.Option(10.0, help="Seconds per level."),
    seq: int = typer.Option(32, help="Length for variable dimensions of synthetic inputs."),
    rows: int = typer.Option(1, help="Rows per request."),
    token: Optional[str] = typer.Option(None, envvar="TORCHNITRO_TOKEN", help="Bearer token."),
    out: str = typer.Option("loadtest", help="Name of results/<out>.{json,md,png}."),
    binary: bool = typer.Option(False, "--binary", help="Send and receive tensors in the v2 binary extension."),
) -> None:
    """Closed-loop concurrency sweep and open-loop rate sweep against a running server."""
    from rich.console import Console

    from torchnitro.serve.loadtest import save_results, sweep, v2_target

    target = asyncio.run(v2_target(url, model, seq=seq, rows=rows, token=token, binary=binary))
    rates = [float(r) for r in rate.split(",")] if rate else []
    results = sweep(target, _ints(concurrency, "--concurrency"), rates, duration)
    paths = save_results(results, out, {"url": url, "model": model, "seq": seq, "rows": rows, "binary": binary})
    from torchnitro.bench.report import ResultTable

    con = Console()
    t = ResultTable(f"loadtest {model}", ["mode", "level", "throughput", "p50_ms", "p90_ms", "p99_ms",
                                          "ok", "errors", "mean_batch"])
    for r in results:
        t.add(mode=r.mode, level=r.level, throughput=r.throughput, p50_ms=r.p50_ms, p90_ms=r.p90_ms,
              p99_ms=r.p99_ms, ok=r.ok, errors=str(r.errors), mean_batch=r.mean_batch)
    con.print(t.rich())
    con.print("wrote " + ", ".join(str(p) for p in paths))


def register(app: typer.Typer) -> None:
    app.command("serve")(serve_command)
    app.command("loadtest")(loadtest_command)
