"""Launch-configuration sweep for the one-pass FFT bind kernels (CUDA only).

    python benchmarks/hrr_fft_sweep.py [--batch 65536] [--dims 256 1024 4096] [--baseline OLD.py]
    python benchmarks/hrr_fft_sweep.py --defaults-only --normalize --dims 256 512 1024 2048

For each d, times the Triton kernel (hrr/fft_kernel.py) at rows-per-program x warps and the CUDA C++
kernel (hrr/cuda_fft.py, where d is one it builds) side by side with torch.fft's bind and a plain copy
(torchnitro.bench.compare), and prints/saves the share of copy bandwidth each reaches (bind moves
three tensors: reads a and b, writes the result). ``--batch`` is the row count at d = 1024; other d get
the same bytes. ``--defaults-only`` times each kernel at its default launch only; ``--normalize`` adds
bind_normalize (bind, then ops.normalize) against both kernels' one-pass epilogue. ``--baseline`` adds
another version of ``hrr/fft_kernel.py`` (e.g. ``git show REV:src/torchnitro/hrr/fft_kernel.py >
old.py``) at its own launch defaults, timed in the same interleaved run. Writes
results/hrr_fft_sweep.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from torchnitro import hrr
from torchnitro.bench import ResultTable, TimingConfig, compare
from torchnitro.bench.provenance import git_commit, package_versions
from torchnitro.hrr import cuda_fft
from torchnitro.hrr.fft_kernel import fft_bind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rows", type=int, nargs="*", default=[1, 2, 4], help="Triton rows per program (none: skip)")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--cuda-rows", type=int, nargs="*", default=[1, 2], help="CUDA kernel rows per block")
    ap.add_argument("--cuda-min-blocks", type=int, nargs="*", default=[0, 4],
                    help="CUDA kernel blocks per SM its registers must allow (0: no bound)")
    ap.add_argument("--defaults-only", action="store_true", help="each kernel at its default launch only")
    ap.add_argument("--normalize", action="store_true", help="also time bind_normalize's paths")
    ap.add_argument("--baseline", help="another fft_kernel.py to time side by side (its fft_bind, its defaults)")
    ap.add_argument("--name", default="hrr_fft_sweep")
    args = ap.parse_args()
    baseline = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_fft_kernel", args.baseline)
        baseline = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(baseline)
    if not torch.cuda.is_available():
        print("hrr_fft_sweep.py needs a CUDA GPU (none is visible)", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name()
    t = ResultTable(f"One-pass FFT bind kernel, launch sweep ({gpu})",
                    ["d", "batch", "variant", "median_us", "pct_of_copy_bw", "max_abs_err_vs_torch"],
                    meta={"gpu": gpu, "command": "python benchmarks/hrr_fft_sweep.py " + " ".join(sys.argv[1:]),
                          "versions": package_versions(("torch", "triton", "numpy")),
                          "commit": git_commit()})
    cfg = TimingConfig(device="cuda", min_time_s=0.2, max_time_s=2.0)
    for d in args.dims:
        batch = max(1, args.batch * 1024 // d)  # the same bytes at every d
        a, b = torch.randn(batch, d, device="cuda"), torch.randn(batch, d, device="cuda")
        out = torch.empty_like(a)
        ref = hrr.bind(a, b, backend="torch")
        fns = {"copy": lambda: out.copy_(a), "torch.fft": lambda: hrr.bind(a, b, backend="torch")}
        errs = {}
        if baseline is not None:
            errs["baseline kernel"] = float((baseline.fft_bind(a, b) - ref).abs().max())
            fns["baseline kernel"] = lambda: baseline.fft_bind(a, b)
        launches = [(None, None)] if args.defaults_only else [(r, w) for r in args.rows for w in args.warps]
        for r, w in launches:
            key = "triton kernel (default)" if r is None else f"triton kernel R{r} W{w}"
            kw = dict(rows_per_program=r, num_warps=w)
            try:
                errs[key] = float((fft_bind(a, b, **kw) - ref).abs().max())
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                t.add(d=d, batch=batch, variant=f"{key} ({type(exc).__name__})")
                continue
            fns[key] = lambda kw=kw: fft_bind(a, b, **kw)
        why = cuda_fft.cuda_bind_reason(a)
        cuda_launches = [(None, None)] + ([] if args.defaults_only else
                                          [(r, m or None) for r in args.cuda_rows for m in args.cuda_min_blocks])
        for r, m in cuda_launches if why is None else []:
            key = "cuda kernel (default)" if r is None else f"cuda kernel rows{r} minblocks{m or 0}"
            kw = dict(rows_per_block=r, min_blocks=m)
            try:
                errs[key] = float((cuda_fft.cuda_bind(a, b, **kw) - ref).abs().max())
            except Exception as exc:  # noqa: BLE001 - a build failure is reported, the rest still runs
                t.add(d=d, batch=batch, variant=f"{key} ({type(exc).__name__}: {str(exc)[:200]})")
                continue
            fns[key] = lambda kw=kw: cuda_fft.cuda_bind(a, b, **kw)
        if why is not None:
            t.add(d=d, batch=batch, variant=f"cuda kernel (not run: {why})")
        fns["hrr.bind (auto)"] = lambda: hrr.bind(a, b)
        if args.normalize:
            ref_n = hrr.normalize(ref)
            fns["bind_normalize: bind, normalize"] = lambda: hrr.normalize(hrr.bind(a, b))
            errs["bind_normalize: triton epilogue"] = float((fft_bind(a, b, normalize=True) - ref_n).abs().max())
            fns["bind_normalize: triton epilogue"] = lambda: fft_bind(a, b, normalize=True)
            if "cuda kernel (default)" in fns:
                errs["bind_normalize: cuda epilogue"] = float(
                    (cuda_fft.cuda_bind(a, b, normalize=True) - ref_n).abs().max())
                fns["bind_normalize: cuda epilogue"] = lambda: cuda_fft.cuda_bind(a, b, normalize=True)
        res = compare(fns, cfg)
        copy_bw = 2 * a.numel() * 4 / res["copy"].median
        for key, tm in res.items():
            moved = (2 if key == "copy" else 3) * a.numel() * 4
            t.add(d=d, batch=batch, variant=key, median_us=tm.median * 1e6,
                  pct_of_copy_bw=100 * moved / tm.median / copy_bw, max_abs_err_vs_torch=errs.get(key))
    t.print()
    t.save(args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
