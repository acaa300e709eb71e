"""GPU recipes benchmark (CUDA): bf16 nn.Linear vs fp8-inference vs sparse-2:4.

    python benchmarks/gpu_recipes.py            # ~30-60 s on an H100
    python benchmarks/gpu_recipes.py --quick    # one GEMM shape, a 2-layer lm

Times (CUDA events, median of single calls after warm-up; providers interleaved call by call so
clock drift hits all of them) the three layer variants at M = 8192 tokens on the large GEMM shapes
(K x N) 4096x4096, 4096x14336, 14336x4096, and the ``lm`` model (TransformerLM) at dim 4096 on
8192 tokens, with every Linear converted as the recipes convert it. Each variant's output is also
compared with bf16 (worst row cosine). Target (issue 21): fp8-inference >= 1.3x bf16 on the lm.
Writes results/gpu_recipes_<gpu>.{json,md}. On a machine without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import re
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

M_TOKENS = 8192
GEMMS = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K in, N out)
TARGET = 1.3


def _time(fns: dict[str, Callable[[], torch.Tensor]], iters: int, warmup: int = 3) -> dict[str, float]:
    """Median ms per call of each fn; calls interleaved (a, b, c, a, b, c, ...)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(iters):
        for k, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples[k].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in samples.items()}


def _cos(ref: torch.Tensor, out: torch.Tensor) -> float:
    r, o = ref.float().reshape(-1, ref.shape[-1]), out.float().reshape(-1, out.shape[-1])
    return float(F.cosine_similarity(r, o, dim=-1).min())


def _variants(base: nn.Module) -> tuple[dict[str, nn.Module], dict[str, str]]:
    """bf16 as given, and the fp8-inference / sparse-2:4 conversions of a copy; errors by name."""
    from torchnitro.autotune.recipes.sparse24 import sparsify_linears_
    from torchnitro.precision.fp8_inference import to_fp8_inference_

    out: dict[str, nn.Module] = {"bf16": base}
    errors: dict[str, str] = {}
    for name, convert in (("fp8-inference", lambda m: to_fp8_inference_(m, backend="scaled_mm")),
                          ("sparse-2:4", lambda m: sparsify_linears_(m, backend="sparse"))):
        try:
            m = copy.deepcopy(base)
            if isinstance(m, nn.Linear):
                m = nn.Sequential(m)
            convert(m)
            out[name] = m
        except Exception as exc:  # noqa: BLE001 - one unavailable variant must not end the benchmark
            errors[name] = f"{type(exc).__name__}: {exc}"[:160]
    return out, errors


def _run_case(table, label: str, base: nn.Module, x: torch.Tensor, flops: float, iters: int) -> dict[str, float]:
    models, errors = _variants(base)
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    outs: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        for name, m in models.items():
            try:
                outs[name] = m(x)
                fns[name] = (lambda mm: lambda: mm(x))(m)
            except Exception as exc:  # noqa: BLE001
                errors[name] = f"{type(exc).__name__}: {exc}"[:160]
        ms = _time(fns, iters) if fns else {}
    speed: dict[str, float] = {}
    for name in ("bf16", "fp8-inference", "sparse-2:4"):
        if name not in ms:
            table.add(case=label, provider=name, note=errors.get(name, "not run"))
            continue
        speed[name] = ms["bf16"] / ms[name] if "bf16" in ms else float("nan")
        table.add(case=label, provider=name, ms=round(ms[name], 4), tflops=round(flops / ms[name] / 1e9, 1),
                  x_bf16=round(speed[name], 3),
                  cos_vs_bf16=round(_cos(outs["bf16"], outs[name]), 5) if "bf16" in outs else None, note="")
    del models, fns, outs
    torch.cuda.empty_cache()
    return speed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one GEMM shape and a 2-layer lm")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per provider and case")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu_recipes.py needs a CUDA GPU (none is visible): FP8 _scaled_mm and semi-structured "
              "sparse matmuls do not run on the CPU. Nothing to measure here.")
        return 0
    from torchnitro.bench import ResultTable
    from torchnitro.bench.provenance import provenance
    from torchnitro.kernels.sparsity import SemiSparseLinear  # noqa: F401  (import errors surface before timing)
    from torchnitro.nn.models import TransformerLM

    gpu = torch.cuda.get_device_name()
    tag = re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_")
    cap = torch.cuda.get_device_capability()
    cusparselt = bool(getattr(torch.backends, "cusparselt", None) and torch.backends.cusparselt.is_available())
    table = ResultTable(f"GPU recipes on {gpu} (bf16 baseline, M={M_TOKENS} tokens)",
                        ["case", "provider", "ms", "tflops", "x_bf16", "cos_vs_bf16", "note"],
                        meta={**provenance("benchmarks/gpu_recipes.py", argv, device="cuda"), "gpu": gpu,
                              "capability": f"sm_{cap[0]}{cap[1]}", "sparse_backend": "cuSPARSELt" if cusparselt
                              else "CUTLASS", "timer": "CUDA events, median of single calls, providers interleaved",
                              "tflops": "dense-equivalent FLOPs / time (2*M*K*N per GEMM)"})
    torch.manual_seed(0)
    for k, n in GEMMS[:1] if args.quick else GEMMS:
        lin = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(M_TOKENS, k, device="cuda", dtype=torch.bfloat16)
        _run_case(table, f"linear {M_TOKENS}x{k}x{n}", lin, x, 2.0 * M_TOKENS * k * n, args.iters)
        del lin, x
    layers = 2 if args.quick else 4
    with torch.device("cuda"):
        lm = TransformerLM(dim=4096, n_layers=layers, n_heads=32, vocab_size=8192, max_seq_len=2048)
    lm = lm.to(torch.bfloat16).eval()
    ids = torch.randint(0, 8192, (M_TOKENS // 2048, 2048), device="cuda")
    n_lin = sum(p.numel() for n, p in lm.named_parameters() if n.endswith("weight") and p.dim() == 2
                and not n.startswith("embed"))
    speed = _run_case(table, f"lm dim 4096, {layers} layers, {ids.shape[0]}x{ids.shape[1]} tokens", lm, ids,
                      2.0 * M_TOKENS * n_lin, max(10, args.iters // 2))
    fp8 = speed.get("fp8-inference")
    verdict = (f"fp8-inference on the lm: {fp8:.2f}x bf16 (target >= {TARGET}x: {'met' if fp8 >= TARGET else 'NOT met'})"
               if fp8 else "fp8-inference on the lm: not measured (see the note column)")
    table.meta["target"] = verdict
    table.print()
    print(verdict)
    jp, mp = table.save(f"gpu_recipes_{tag}")
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
