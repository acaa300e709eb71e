"""Benchmark torchnitro.hrr against NumPy and torchhd, side by side in one run.

    flock /tmp/torchnitro-bench.lock python benchmarks/hrr.py            # CPU (default)
    python benchmarks/hrr.py --device cuda                               # GPU (device machine)
    python benchmarks/hrr.py --quick                                     # smoke run, small grid

For each op (bind, unbind, superpose of 16 vectors, cleanup against 10,000 items) at batch
1/10/100/1000 and d = 512/1024/4096, the three implementations compute the same thing and are timed
interleaved by ``torchnitro.bench.compare``. Then:

* GEMM: this machine's fp32 GEMM FLOP/s (2048^3, and the exact cleanup shape), and cleanup of 1,000
  queries x 100,000 items at d = 1024 (top-1 by cosine) as a percentage of both;
* fused: bind+superpose (k = 16) in the Fourier domain vs bind-then-sum, and bind_normalize;
* on CUDA: batch-1000 bind latency at d = 1024 and bind's effective bandwidth as % of copy bandwidth.

Writes results/hrr_<device>.{json,md} and results/hrr_<device>.png.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import numpy as np
import torch

from torchnitro import hrr
from torchnitro.bench import ResultTable, TimingConfig, compare, save_plot
from torchnitro.hardware import hardware_info
from torchnitro.hrr.cuda_fft import cuda_bind_reason

K_SUPERPOSE = 16  # vectors bundled per output in "superpose"
N_CODEBOOK = 10_000  # items in the grid's cleanup memory


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _numpy_blas() -> str:
    try:
        from threadpoolctl import threadpool_info

        infos = [f"{i.get('internal_api')} {i.get('version')} ({i.get('architecture')}, {i.get('num_threads')} threads)"
                 for i in threadpool_info() if i.get("user_api") == "blas"]
        return "; ".join(infos) or "unknown"
    except ImportError:
        return "unknown (threadpoolctl not installed)"


def _torchhd():
    try:
        import torchhd
        from torchhd.tensors.hrr import HRRTensor

        return torchhd, HRRTensor
    except ImportError:
        return None, None


def _candidates(op: str, batch: int, d: int, device: str, g: torch.Generator) -> dict:
    """name -> zero-arg callable, all computing the same result for (op, batch, d)."""
    hd, HRR = _torchhd()
    fns: dict = {}
    if op in ("bind", "unbind"):
        a, b = hrr.random((2, batch), d, generator=g)
        an, bn = a.numpy(), b.numpy()
        a, b = a.to(device), b.to(device)
        if op == "bind":
            fns["torchnitro"] = lambda: hrr.bind(a, b)
            fns["numpy"] = lambda: np.fft.irfft(np.fft.rfft(an) * np.fft.rfft(bn), n=d)
            if hd is not None:
                ah, bh = a.as_subclass(HRR), b.as_subclass(HRR)
                fns["torchhd"] = lambda: hd.bind(ah, bh)
        else:
            fns["torchnitro"] = lambda: hrr.unbind(a, b)
            fns["numpy"] = lambda: np.fft.irfft(np.fft.rfft(an) * np.conj(np.fft.rfft(bn)), n=d)
            if hd is not None:
                ah, bh = a.as_subclass(HRR), b.as_subclass(HRR)
                fns["torchhd"] = lambda: hd.bind(ah, hd.inverse(bh))
    elif op == "superpose":
        v = hrr.random((batch, K_SUPERPOSE), d, generator=g)
        vn = v.numpy()
        v = v.to(device)
        fns["torchnitro"] = lambda: hrr.superpose(v)

        def np_sup():
            s = vn.sum(axis=1)
            return s / np.linalg.norm(s, axis=-1, keepdims=True)

        fns["numpy"] = np_sup
        if hd is not None:
            vh = v.as_subclass(HRR)

            def hd_sup():
                s = hd.multiset(vh)
                return s / s.norm(dim=-1, keepdim=True)

            fns["torchhd"] = hd_sup
    elif op == "cleanup":
        # Both GPU candidates take host queries and hand back host answers (ItemMemory's contract):
        # the codebook is resident on the device for both, the queries sit in pinned memory.
        book = hrr.random(N_CODEBOOK, d, generator=g)
        q = hrr.random(batch, d, generator=g)
        mem = hrr.ItemMemory(book, device=device)
        unit = (book / book.norm(dim=1, keepdim=True)).numpy()
        qn = q.numpy()
        q_host = q.pin_memory() if device == "cuda" else q
        fns["torchnitro"] = lambda: mem.topk(q_host, 1)
        fns["numpy"] = lambda: (qn @ unit.T).argmax(axis=1)
        if hd is not None:
            bh = book.to(device).as_subclass(HRR)

            def hd_cleanup():
                qh = q_host.to(device, non_blocking=True).as_subclass(HRR)
                return hd.cosine_similarity(qh, bh).argmax(-1).cpu()

            fns["torchhd"] = hd_cleanup
    return fns


def run_grid(args, device: str, table: ResultTable) -> None:
    from rich.progress import Progress

    cfg = TimingConfig(device=device, warmup=2, warmup_s=0.02, min_iters=5, min_time_s=args.min_time,
                       max_time_s=args.max_time)
    cpu_cfg = TimingConfig(device="cpu", warmup=2, warmup_s=0.02, min_iters=5, min_time_s=args.min_time,
                           max_time_s=args.max_time)
    grid = [(op, d, b) for op in args.ops for d in args.dims for b in args.batches]
    g = torch.Generator().manual_seed(0)
    with Progress(transient=True) as prog:
        task = prog.add_task("hrr grid", total=len(grid))
        for op, d, batch in grid:
            fns = _candidates(op, batch, d, device, g)
            if device == "cuda":
                # NumPy runs on the host with multi-threaded BLAS: interleaved with the GPU candidates
                # it left the GPU idle and contended with their launch threads (cleanup cells read
                # 7-15 ms instead of 0.2-0.5 ms). Time it alone; interleave only the GPU candidates.
                np_fn = fns.pop("numpy")
                res = compare(fns, cfg, items_per_call=batch)
                res["numpy"] = compare({"numpy": np_fn}, cpu_cfg, items_per_call=batch)["numpy"]
            else:
                res = compare(fns, cfg, items_per_call=batch)
            ours = res["torchnitro"]
            row = {"op": op, "d": d, "batch": batch, "torchnitro_us": ours.median * 1e6,
                   "numpy_us": res["numpy"].median * 1e6,
                   "torchhd_us": res["torchhd"].median * 1e6 if "torchhd" in res else None,
                   "x_vs_numpy": res["numpy"].median / ours.median,
                   "x_vs_torchhd": res["torchhd"].median / ours.median if "torchhd" in res else None,
                   "items_per_s": ours.throughput, "cv": ours.cv}
            table.add(**row)
            prog.advance(task)


def run_gemm_cleanup(args, device: str) -> ResultTable:
    q_n, n_items, d = args.cleanup_shape
    t = ResultTable(f"cleanup {q_n} queries x {n_items} items, d={d}, vs GEMM ({device})",
                    ["what", "median_ms", "gflops", "pct_of_gemm_2048", "pct_of_same_shape_gemm", "cv"])
    g = torch.Generator().manual_seed(1)
    book = hrr.random(n_items, d, generator=g)
    q = hrr.random(q_n, d, generator=g)
    mem = hrr.ItemMemory(book, device=device)
    qd, bd = q.to(device), book.to(device)
    sq = torch.randn(2048, 2048, device=device), torch.randn(2048, 2048, device=device)
    cfg = TimingConfig(device=device, warmup=1, warmup_s=0.0, min_iters=args.gemm_iters, min_time_s=0.5,
                       max_time_s=args.max_time * 3)
    fns = {"gemm_2048": lambda: sq[0] @ sq[1], "gemm_same_shape": lambda: qd @ bd.T,
           "torchnitro_cleanup": lambda: mem.topk(q, 1)}
    res = compare(fns, cfg)
    flops = {"gemm_2048": 2 * 2048**3, "gemm_same_shape": 2 * q_n * n_items * d, "torchnitro_cleanup": 2 * q_n * n_items * d}
    peak = flops["gemm_2048"] / res["gemm_2048"].median
    same = flops["gemm_same_shape"] / res["gemm_same_shape"].median
    for name, tm in res.items():
        rate = flops[name] / tm.median
        t.add(what=name, median_ms=tm.median * 1e3, gflops=rate / 1e9, pct_of_gemm_2048=100 * rate / peak,
              pct_of_same_shape_gemm=100 * rate / same, cv=tm.cv)
    t.meta["target"] = "cleanup >= 70% of this machine's measured GEMM FLOP/s"
    t.meta["gemm_gflops"] = round(peak / 1e9, 1)
    return t


def _normalize_path(a: torch.Tensor, b: torch.Tensor) -> str:
    """Which path hrr.bind_normalize's "auto" takes for these inputs."""
    from torchnitro.hrr.backend import one_pass_kernel

    kernel = one_pass_kernel(a, b, "auto")
    return {"cuda": "CUDA kernel", "triton": "Triton kernel"}.get(kernel, "plain")


def run_fused(args, device: str) -> ResultTable:
    t = ResultTable(f"fused paths ({device})", ["op", "d", "batch", "k", "fused_us", "unfused_us", "speedup", "backend"])
    cfg = TimingConfig(device=device, warmup=2, warmup_s=0.02, min_iters=5, min_time_s=args.min_time,
                       max_time_s=args.max_time)
    g = torch.Generator().manual_seed(2)
    backend = "triton" if device == "cuda" else "torch"
    shapes = [(256, 10, 4)] if args.quick else [(1024, 10, 16), (1024, 100, 16), (1024, 1000, 16), (4096, 100, 16)]
    for d, batch, k in shapes:
        keys, vals = (x.to(device) for x in hrr.random((2, batch, k), d, generator=g))
        res = compare({"fused": lambda: hrr.bind_superpose(keys, vals, backend=backend),
                       "unfused": lambda: hrr.bind(keys, vals).sum(-2)}, cfg)
        t.add(op="bind_superpose", d=d, batch=batch, k=k, fused_us=res["fused"].median * 1e6,
              unfused_us=res["unfused"].median * 1e6, speedup=res["unfused"].median / res["fused"].median,
              backend=backend)
        a, b = keys[:, 0].contiguous(), vals[:, 0].contiguous()
        fns = {"auto": lambda: hrr.bind_normalize(a, b),
               "unfused": lambda: hrr.normalize(hrr.bind(a, b)),
               "Parseval, torch": lambda: hrr.bind_superpose(a.unsqueeze(-2), b.unsqueeze(-2), normalized=True,
                                                             backend="torch")}
        if device == "cuda":
            fns["Triton kernel epilogue"] = lambda: hrr.bind_normalize(a, b, backend="triton")
            if cuda_bind_reason(a) is None:
                fns["CUDA kernel epilogue"] = lambda: hrr.bind_normalize(a, b, backend="cuda")
        res = compare(fns, cfg)
        for key, tm in res.items():
            if key == "unfused":
                continue
            label = f"auto: {_normalize_path(a, b)}" if key == "auto" else key
            t.add(op=f"bind_normalize ({label})", d=d, batch=batch, k=1, fused_us=tm.median * 1e6,
                  unfused_us=res["unfused"].median * 1e6, speedup=res["unfused"].median / tm.median,
                  backend=key)
    return t


def run_cuda_targets(args) -> ResultTable:
    """Batch-1000 latency and large-batch bandwidth of each bind path: torch.fft, the Triton kernel,
    the CUDA C++ kernel (d it builds) and "auto" (what hrr.bind picks)."""
    t = ResultTable("CUDA targets", ["what", "batch", "d", "median_us", "gb_per_s", "pct_of_copy_bw"])
    cfg = TimingConfig(device="cuda", min_time_s=0.3)
    g = torch.Generator().manual_seed(3)

    def paths(a, b, unbind=False):
        fns = {"torch.fft": lambda: hrr.bind(a, b, backend="torch"),
               "Triton kernel": lambda: hrr.bind(a, b, backend="triton")}
        if cuda_bind_reason(a) is None:
            fns["CUDA kernel"] = lambda: hrr.bind(a, b, backend="cuda")
            if unbind:
                fns["unbind, CUDA kernel"] = lambda: hrr.unbind(a, b, backend="cuda")
        if unbind:
            fns["unbind, Triton kernel"] = lambda: hrr.unbind(a, b, backend="triton")
        fns["auto"] = lambda: hrr.bind(a, b)
        return fns

    a, b = (x.cuda() for x in hrr.random((2, 1000), 1024, generator=g))
    lat = compare(paths(a, b), cfg)
    for key, tm in lat.items():
        t.add(what=f"bind latency, {key} (target <= 100 us)", batch=1000, d=1024, median_us=tm.median * 1e6)
    for batch, d in ((16384, 1024), (65536, 1024), (16384, 4096)):
        a, b = torch.randn(batch, d, device="cuda"), torch.randn(batch, d, device="cuda")
        out = torch.empty_like(a)
        res = compare({**paths(a, b, unbind=True), "copy": lambda: out.copy_(a)}, cfg)
        nbytes = a.numel() * 4
        copy_bw = 2 * nbytes / res["copy"].median
        t.add(what="copy", batch=batch, d=d, median_us=res["copy"].median * 1e6, gb_per_s=copy_bw / 1e9,
              pct_of_copy_bw=100.0)
        for key, tm in res.items():
            if key == "copy":
                continue
            bw = 3 * nbytes / tm.median  # reads two tensors, writes one
            label = key if key.startswith("unbind") else f"bind, {key}"
            t.add(what=f"{label} (3 tensors of traffic)", batch=batch, d=d, median_us=tm.median * 1e6,
                  gb_per_s=bw / 1e9, pct_of_copy_bw=100 * bw / copy_bw)
    t.meta["targets"] = "batch-1000 bind at d=1024 <= 0.1 ms; >= 70% of copy bandwidth at large batches"
    return t


def plot(table: ResultTable, name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in table.rows}, key=["bind", "unbind", "superpose", "cleanup"].index)
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.6), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for d in sorted({r["d"] for r in table.rows}):
            rows = [r for r in table.rows if r["op"] == op and r["d"] == d]
            xs = [r["batch"] for r in rows]
            ax.plot(xs, [r["x_vs_numpy"] for r in rows], "o--", label=f"vs numpy d={d}")
            if rows and rows[0]["x_vs_torchhd"] is not None:
                ax.plot(xs, [r["x_vs_torchhd"] for r in rows], "s-", label=f"vs torchhd d={d}")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("batch")
    axes[0][0].set_ylabel("torchnitro speedup (x)")
    axes[0][-1].legend(fontsize=6)
    fig.suptitle(table.title, fontsize=9)
    save_plot(fig, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="small grid and short timings (smoke run)")
    p.add_argument("--ops", nargs="+", default=["bind", "unbind", "superpose", "cleanup"])
    p.add_argument("--dims", nargs="+", type=int, default=[512, 1024, 4096])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 10, 100, 1000])
    p.add_argument("--min-time", type=float, default=0.3)
    p.add_argument("--max-time", type=float, default=5.0)
    p.add_argument("--cleanup-shape", nargs=3, type=int, default=[1000, 100_000, 1024], metavar=("Q", "N", "D"))
    p.add_argument("--gemm-iters", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.dims, args.batches, args.min_time, args.max_time = [64, 256], [1, 10], 0.02, 0.5
        args.cleanup_shape, args.gemm_iters = [50, 2000, 64], 3
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA GPU is visible", file=sys.stderr)
        return 2
    device = args.device
    hw = hardware_info()
    hd, _ = _torchhd()
    machine = hw.gpu_name if device == "cuda" else f"{hw.cpu_name}, {hw.cpu_cores} cores"
    table = ResultTable(f"torchnitro.hrr vs NumPy and torchhd ({device}: {machine})",
                        ["op", "d", "batch", "torchnitro_us", "numpy_us", "torchhd_us", "x_vs_numpy",
                         "x_vs_torchhd", "items_per_s", "cv"])
    table.meta.update({
        "command": "python " + " ".join(sys.argv), "machine": machine, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "numpy": np.__version__, "numpy_blas": _numpy_blas(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "(unset)"),
        "torchhd": getattr(hd, "__version__", None) if hd is not None else "not installed (pip install torch-hd)",
        "python": platform.python_version(),
        "load_average_at_start": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "ops": f"superpose bundles {K_SUPERPOSE} vectors per output (normalized); cleanup is top-1 cosine "
               f"against {N_CODEBOOK} items; numpy runs on the CPU; timings are medians, ratios >1 mean "
               "torchnitro is faster",
        "placement": ("bind/unbind/superpose: inputs already on the device for torchnitro and torchhd; cleanup: "
                      "codebook resident on the device, queries from pinned host memory and answers back on "
                      "the host for both; numpy timed in its own compare(), only the GPU candidates "
                      "interleaved") if device == "cuda" else "all candidates on the CPU, interleaved in one compare()",
    })
    run_grid(args, device, table)
    table.print()
    extra = [run_gemm_cleanup(args, device), run_fused(args, device)]
    if device == "cuda":
        extra.append(run_cuda_targets(args))
    for t in extra:
        t.print()
    big = [r for r in table.rows if r["op"] in ("bind", "unbind") and r["batch"] >= 100 and r["x_vs_torchhd"]]
    if big:
        table.meta["target bind/unbind >= 2x torchhd at batch >= 100"] = (
            f"min {min(r['x_vs_torchhd'] for r in big):.2f}x, max {max(r['x_vs_torchhd'] for r in big):.2f}x")
    cleanup = next(r for r in extra[0].rows if r["what"] == "torchnitro_cleanup")
    table.meta["cleanup vs GEMM"] = (f"{cleanup['pct_of_gemm_2048']:.0f}% of 2048^3 GEMM, "
                                     f"{cleanup['pct_of_same_shape_gemm']:.0f}% of the same-shape GEMM")
    table.meta["load_average_at_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    name = f"hrr_{device}" + (f"_t{args.threads}" if args.threads is not None else "") + ("_quick" if args.quick else "")
    json_path, md_path = table.save(name)
    data = json.loads(json_path.read_text())
    data["sections"] = [t.to_json() for t in extra]
    json_path.write_text(json.dumps(data, indent=2, default=str))
    with open(md_path, "a") as f:
        for t in extra:
            f.write("\n" + t.to_markdown())
    plot(table, name)
    print(f"wrote {json_path}, {md_path} and {name}.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
