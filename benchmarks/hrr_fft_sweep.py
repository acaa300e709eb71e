"""Launch-configuration sweep for the one-pass FFT bind kernel (CUDA only).

    python benchmarks/hrr_fft_sweep.py [--batch 65536] [--dims 256 1024 4096] [--baseline OLD.py]

For each d, times hrr's kernel at rows-per-program x warps side by side with torch.fft's bind and a
plain copy (torchnitro.bench.compare), and prints/saves the share of copy bandwidth each reaches
(bind moves three tensors: reads a and b, writes the result). ``--baseline`` adds another version of
``hrr/fft_kernel.py`` (e.g. ``git show REV:src/torchnitro/hrr/fft_kernel.py > old.py``) at its own
launch defaults, timed in the same interleaved run. Writes results/hrr_fft_sweep.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

from torchnitro import hrr
from torchnitro.bench import ResultTable, TimingConfig, compare
from torchnitro.hrr.fft_kernel import fft_bind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=65536)
    ap.add_argument("--dims", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
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
                    meta={"gpu": gpu, "command": "python benchmarks/hrr_fft_sweep.py " + " ".join(sys.argv[1:])})
    cfg = TimingConfig(device="cuda", min_time_s=0.2, max_time_s=2.0)
    for d in args.dims:
        batch = max(1024, args.batch * 1024 // d)  # the same bytes at every d
        a, b = torch.randn(batch, d, device="cuda"), torch.randn(batch, d, device="cuda")
        out = torch.empty_like(a)
        ref = hrr.bind(a, b, backend="torch")
        fns = {"copy": lambda: out.copy_(a), "torch.fft": lambda: hrr.bind(a, b, backend="torch")}
        errs = {}
        if baseline is not None:
            errs["baseline kernel"] = float((baseline.fft_bind(a, b) - ref).abs().max())
            fns["baseline kernel"] = lambda: baseline.fft_bind(a, b)
        for r in args.rows:
            for w in args.warps:
                key = f"kernel R{r} W{w}"
                kw = dict(rows_per_program=r, num_warps=w)
                try:
                    errs[key] = float((fft_bind(a, b, **kw) - ref).abs().max())
                except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                    t.add(d=d, batch=batch, variant=f"{key} ({type(exc).__name__})")
                    continue
                fns[key] = lambda kw=kw: fft_bind(a, b, **kw)
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
