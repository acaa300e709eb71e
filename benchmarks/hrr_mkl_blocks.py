"""CPU bind through cached MKL descriptors (hrr.mkl_fft) at several block sizes, against torch.fft and torchhd.

    python benchmarks/hrr_mkl_blocks.py [--threads 1] [--dims 512 1024 4096] [--batches 100 1000]
                                        [--blocks-kib 64 128 256 512 1024 0] [--unbind]

For each (d, batch), times in one interleaved run (torchnitro.bench.compare): hrr's bind through
``torch.fft`` (rfft, rfft, product, irfft), ``mkl_bind`` at each block size (``0`` = the whole batch in
one block) and torchhd's HRR bind (``fft``, product, ``ifft``) when installed; checks every result
against ``torch.fft``'s. ``--parts`` instead splits ``mkl_bind`` at the default block size into its
steps (forward transforms only; plus the product; the whole bind), timed side by side. Writes
results/hrr_mkl_blocks[_unbind][_t<threads>].{json,md} (``_parts`` with ``--parts``).
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch
from rich.progress import Progress

from torchnitro import hrr
from torchnitro.bench import ResultTable, TimingConfig, compare
from torchnitro.bench.provenance import provenance
from torchnitro.hrr import mkl_fft
from torchnitro.hrr.mkl_fft import mkl_available, mkl_bind


def _torchhd_op(unbind: bool):
    """torchhd's HRR bind (or bind with the inverse), as benchmarks/hrr.py times it; None if absent."""
    try:
        import torchhd
        from torchhd.tensors.hrr import HRRTensor
    except ImportError:
        return None
    if unbind:
        return lambda x, y: torchhd.bind(x, torchhd.inverse(y)), HRRTensor
    return lambda x, y: torchhd.bind(x, y), HRRTensor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dims", type=int, nargs="+", default=[512, 1024, 4096])
    ap.add_argument("--batches", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--blocks-kib", type=int, nargs="+", default=[64, 128, 256, 512, 1024, 0])
    ap.add_argument("--unbind", action="store_true", help="time unbind (conjugate product) instead of bind")
    ap.add_argument("--parts", action="store_true", help="time mkl_bind's steps instead of block sizes")
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if not mkl_available():
        print("hrr_mkl_blocks.py: this torch build has no MKL DFTI to call", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    op = "unbind" if args.unbind else "bind"
    hd = _torchhd_op(args.unbind)
    name = args.name or f"hrr_mkl_blocks{'_unbind' if args.unbind else ''}_t{args.threads}{'_parts' if args.parts else ''}"
    if args.parts:
        return _parts(args, name)
    t = ResultTable(f"CPU {op}: MKL descriptors in row blocks vs torch.fft and torchhd ({platform.processor() or 'cpu'}, "
                    f"{args.threads} thread{'s' if args.threads > 1 else ''})",
                    ["d", "batch", "variant", "median_us", "x_vs_torch_fft", "x_vs_torchhd", "max_abs_err"],
                    meta={**provenance("benchmarks/hrr_mkl_blocks.py", device="cpu"), "threads": args.threads})
    cfg = TimingConfig(device="cpu", min_time_s=0.3, max_time_s=3.0)
    g = torch.Generator().manual_seed(0)
    ref_fn = hrr.unbind if args.unbind else hrr.bind
    with Progress(transient=True) as prog:
        task = prog.add_task("shapes", total=len(args.dims) * len(args.batches))
        for d in args.dims:
            for batch in args.batches:
                _time_blocks(args, t, hd, ref_fn, cfg, g, d, batch)
                prog.advance(task)
    t.print()
    t.save(name)
    return 0


def _time_blocks(args, t: ResultTable, hd, ref_fn, cfg: TimingConfig, g: torch.Generator, d: int, batch: int) -> None:
    """One (d, batch) cell: torch.fft, mkl_bind at each block size and torchhd, interleaved."""
    a, b = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
    ref = ref_fn(a, b, backend="torch")
    fns = {"torch.fft": lambda: ref_fn(a, b, backend="torch")}
    errs = {"torch.fft": 0.0}
    for kib in args.blocks_kib:
        bb = kib * 1024 if kib else 1 << 62
        key = f"mkl {kib} KiB" if kib else "mkl one block"
        errs[key] = float((mkl_bind(a, b, conj_b=args.unbind, block_bytes=bb) - ref).abs().max())
        fns[key] = lambda bb=bb: mkl_bind(a, b, conj_b=args.unbind, block_bytes=bb)
    if hd is not None:
        fn, hrr_tensor = hd
        ha, hb = a.as_subclass(hrr_tensor), b.as_subclass(hrr_tensor)
        errs["torchhd"] = float((fn(ha, hb).as_subclass(torch.Tensor) - ref).abs().max())
        fns["torchhd"] = lambda: fn(ha, hb)
    res = compare(fns, cfg)
    base, hd_t = res["torch.fft"].median, res["torchhd"].median if "torchhd" in res else None
    for key, tm in res.items():
        t.add(d=d, batch=batch, variant=key, median_us=tm.median * 1e6, x_vs_torch_fft=base / tm.median,
              x_vs_torchhd=hd_t / tm.median if hd_t else None, max_abs_err=errs[key])


def _steps(a: torch.Tensor, b: torch.Tensor, upto: int) -> None:
    """mkl_bind's block loop (equal shapes, the default block) stopped after step ``upto``:
    1 = both forward transforms, 2 = and the product, 3 = and the inverse transform."""
    n, d = a.shape
    rows = min(mkl_fft.block_rows(d, a.dtype, threads=torch.get_num_threads()), n)
    sa, sb = (torch.empty(rows, d // 2 + 1, dtype=torch.complex64) for _ in range(2))
    out = torch.empty_like(a)
    for start, count in mkl_fft._blocks(n, rows):
        fwd, bwd = mkl_fft._plan(d, count, a.dtype, True), mkl_fft._plan(d, count, a.dtype, False)
        off = start * d * 4
        fwd(a.data_ptr() + off, sa.data_ptr())
        fwd(b.data_ptr() + off, sb.data_ptr())
        if upto >= 2:
            sa[:count].mul_(sb[:count])
        if upto >= 3:
            bwd(sa.data_ptr(), out.data_ptr() + off)


def _parts(args, name: str) -> int:
    t = ResultTable(f"CPU bind through MKL, step by step ({args.threads} thread(s))",
                    ["d", "batch", "steps", "median_us", "share_of_bind"],
                    meta={**provenance("benchmarks/hrr_mkl_blocks.py", device="cpu"), "threads": args.threads,
                          "note": "product by torch mul_ at every thread count; the share of each step is a difference of rows"})
    cfg = TimingConfig(device="cpu", min_time_s=0.3, max_time_s=3.0)
    g = torch.Generator().manual_seed(0)
    labels = {1: "two forward transforms", 2: "+ product", 3: "+ inverse (whole bind)"}
    with Progress(transient=True) as prog:
        task = prog.add_task("shapes", total=len(args.dims) * len(args.batches))
        for d in args.dims:
            for batch in args.batches:
                a, b = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
                res = compare({k: (lambda k=k: _steps(a, b, k)) for k in labels}, cfg)
                whole = res[3].median
                for k, label in labels.items():
                    t.add(d=d, batch=batch, steps=label, median_us=res[k].median * 1e6,
                          share_of_bind=res[k].median / whole)
                prog.advance(task)
    t.print()
    t.save(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
