"""Attention alone at the padding-free encoders' shapes: SDPA (as ``PackedLayer`` runs it) against the native
varlen kernel (``torchnitro.kernels.cpu_attention``), fp32 and bf16.

    python benchmarks/cpu_attention.py [--rounds 15] [--out DIR] [--name STEM]

Cases: all-MiniLM-L6-v2 full length (32 sentences x 128 tokens, 12 heads x 32), the same batch of short
sentences (the lengths of ``optimize_user_models.minilm_inputs("short")``: 17-34 tokens, 4 length
buckets for SDPA with the copies into and out of each bucket), and BERT-base full length (12 heads x 64).
Each variant takes the packed ``(N, 3D)`` qkv rows and returns ``(N, D)``, as in the encoder layer.
``cpu ms (1 thread)``: median ``time.process_time`` per call at one torch thread (other processes' load
moves it least); ``wall ms (2 threads)``: median ``time.perf_counter`` at two. Rounds interleave the
variants in a rotating order.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from torchnitro.autotune.recipes._unpad import PackedLayer, cu_seqlens, length_buckets  # noqa: E402
from torchnitro.bench import ResultTable  # noqa: E402
from torchnitro.bench.provenance import provenance  # noqa: E402
from torchnitro.kernels.cpu_attention import cpu_attention_reason, kernel_name, varlen_attention  # noqa: E402

COLUMNS = ("case", "variant", "cpu ms (1 thread)", "x SDPA fp32 (cpu)", "wall ms (2 threads)", "x SDPA fp32 (wall)",
           "max abs diff vs fp32 SDPA")
BF16, F32 = torch.bfloat16, torch.float32


def short_lengths() -> list[int]:
    from optimize_user_models import minilm_inputs

    return [int(n) for n in minilm_inputs("short", 32, 128, 0)[1].sum(1)]


def case(lens: list[int], t: int, heads: int, head_dim: int) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Packed qkv rows in bucket order, the buckets SDPA runs by, and the native kernel's cu_seqlens."""
    mask = (torch.arange(t)[None] < torch.tensor(lens)[:, None]).long()  # (B, T), right padding
    buckets = length_buckets(mask, 4)
    qkv = torch.randn(sum(lens), 3 * heads * head_dim, generator=torch.Generator().manual_seed(0))
    return qkv, buckets, cu_seqlens(buckets)


def variants(qkv: torch.Tensor, buckets: list, cu: torch.Tensor, heads: int) -> dict[str, Callable[[], Any]]:
    layer = SimpleNamespace(n_heads=heads, head_dim=qkv.shape[1] // 3 // heads)
    qb = qkv.to(BF16)
    out = {"SDPA fp32": lambda: PackedLayer._attend(layer, qkv, buckets),
           "SDPA bf16": lambda: PackedLayer._attend(layer, qb, buckets)}
    if cpu_attention_reason() is None:
        out.update({
            "native fp32": lambda: varlen_attention(qkv, cu, heads),
            "native bf16 (fp32 in, fp32 out)": lambda: varlen_attention(qkv, cu, heads, compute="bf16"),
            "native bf16 (bf16 in, fp32 out)": lambda: varlen_attention(qb, cu, heads, compute="bf16", out_dtype=F32),
            "native bf16 (bf16 in, bf16 out)": lambda: varlen_attention(qb, cu, heads, compute="bf16"),
        })
    return out


def timed(fns: dict[str, Callable[[], Any]], rounds: int, threads: int,
          clock: Callable[[], float]) -> dict[str, float]:
    """Median seconds per call at ``threads`` torch threads, rounds in a rotating order."""
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        names, got = list(fns), {n: [] for n in fns}
        with torch.inference_mode():
            for n in names:
                fns[n]()  # warm-up at this thread count
            for r in range(rounds):
                for n in names[r % len(names):] + names[:r % len(names)]:
                    t0 = clock()
                    fns[n]()
                    got[n].append(clock() - t0)
    finally:
        torch.set_num_threads(prev)
    return {n: sorted(v)[len(v) // 2] for n, v in got.items()}


def rows_for(name: str, lens: list[int], t: int, heads: int, head_dim: int, rounds: int) -> list[dict[str, Any]]:
    qkv, buckets, cu = case(lens, t, heads, head_dim)
    fns = variants(qkv, buckets, cu, heads)
    with torch.inference_mode():
        ref = fns["SDPA fp32"]()
        diff = {n: float((f().float() - ref).abs().max()) for n, f in fns.items()}
    cpu = timed(fns, rounds, 1, time.process_time)
    wall = timed(fns, rounds, 2, time.perf_counter)
    rows = []
    for n in fns:
        rows.append({"case": name, "variant": n, "cpu ms (1 thread)": cpu[n] * 1e3,
                     "x SDPA fp32 (cpu)": cpu["SDPA fp32"] / cpu[n], "wall ms (2 threads)": wall[n] * 1e3,
                     "x SDPA fp32 (wall)": wall["SDPA fp32"] / wall[n], "max abs diff vs fp32 SDPA": diff[n]})
        print(f"{name} {n}: cpu {cpu[n] * 1e3:.2f} ms, wall {wall[n] * 1e3:.2f} ms", file=sys.stderr, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--name", default="cpu_attention", help="results file stem")
    args = ap.parse_args(argv)
    meta = provenance("benchmarks/cpu_attention.py", argv, device="cpu", packages=("torch",))
    meta["native kernel"] = cpu_attention_reason() or f"{kernel_name('fp32')}; {kernel_name('bf16')}"
    cases = [("MiniLM full 32x128, 12x32", [128] * 32, 128, 12, 32),
             ("MiniLM short (17-34 tokens), 12x32", short_lengths(), 128, 12, 32),
             ("BERT-base full 32x128, 12x64", [128] * 32, 128, 12, 64)]
    rows: list[dict[str, Any]] = []
    for c in cases:
        rows += rows_for(*c, rounds=args.rounds)
    meta["load average at end"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    table = ResultTable("Attention alone: SDPA as the padding-free layers run it vs the native varlen kernel", COLUMNS,
                        rows, meta)
    table.save(args.name, args.out)
    table.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
