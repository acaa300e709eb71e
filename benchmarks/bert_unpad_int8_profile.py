"""Where the CPU time of ``bert-unpad-int8`` goes at full length: self time per op kind, one thread.

    python benchmarks/bert_unpad_int8_profile.py [--kind full|short] [--out DIR] [--name STEM]

all-MiniLM-L6-v2 as a user wraps it (``encoder_full_length.load_minilm``), batch 32 x 128, built by the
recipe as ``optimize`` builds it; then, at one torch thread: CPU time per forward (``time.process_time``,
median of 7, split into user and system time with the page faults per call), and ``torch.profiler``'s self
time per op over 3 forwards, grouped by kind. The native attention kernel and the native activation quantiser
are called through ctypes, which the profiler does not see: they are wrapped in a ``record_function`` here.
Profiled times are wall time (inflated by other load); the last column spreads the measured CPU time by each
kind's share.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from encoder_full_length import _ctx, load_minilm  # noqa: E402
from optimize_user_models import minilm_inputs  # noqa: E402
from torchnitro.autotune.recipe import get_recipe  # noqa: E402
from torchnitro.bench import ResultTable  # noqa: E402
from torchnitro.bench.provenance import provenance  # noqa: E402

COLUMNS = ("op kind", "calls per forward", "profiled ms per forward", "share", "cpu ms (share x cpu time)")
KINDS = (
    ("int8 GEMM (oneDNN qlinear, epilogue incl.)", ("onednn::qlinear_pointwise",)),
    ("bf16 GEMM (oneDNN, kept Linears)", ("mkldnn::_linear_pointwise",)),
    ("fp32 GEMM (outlier input channels)", ("aten::mm", "aten::addmm", "aten::addmm_")),
    ("attention (native varlen kernel)", ("native_attention",)),
    ("activation quantize (native kernel; torch: aminmax, quantize_per_tensor)",
     ("native_quantize_u8", "aten::aminmax", "aten::quantize_per_tensor", "aten::set_", "aten::item",
      "aten::_local_scalar_dense")),
    ("LayerNorm", ("aten::native_layer_norm",)),
    ("element-wise (residual scale, smoothing, adds, GELU)", ("aten::mul", "aten::mul_", "aten::add_", "aten::add",
                                                             "aten::addcmul", "aten::gelu", "aten::gelu_")),
    ("outlier channels gather/zero", ("aten::index_select", "aten::index_fill_")),
    ("copies, dtype conversions", ("aten::cat", "aten::copy_", "aten::_to_copy", "aten::clone")),
    ("allocation", ("aten::empty", "aten::empty_strided", "aten::fill_", "aten::zero_", "aten::new_zeros")),
)


def _traced_attention() -> None:
    """Make the ctypes calls (attention, the activation quantiser) visible to the profiler."""
    from torchnitro.autotune.recipes import onednn_int8
    from torchnitro.kernels import cpu_attention as ca

    call, quantize = ca.NativeAttention.__call__, onednn_int8.quantize_u8

    def traced(self: Any, *a: Any, **k: Any) -> torch.Tensor:
        with torch.profiler.record_function("native_attention"):
            return call(self, *a, **k)

    def traced_quantize(*a: Any, **k: Any) -> Any:
        with torch.profiler.record_function("native_quantize_u8"):
            return quantize(*a, **k)

    ca.NativeAttention.__call__ = traced  # type: ignore[method-assign]
    onednn_int8.quantize_u8 = traced_quantize  # type: ignore[assignment]


def cpu_time(fn: Any, x: tuple, n: int = 7) -> dict[str, float]:
    """Median process time per call (ms) and the mean user / system ms and page faults per call."""
    ts = []
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(n):
        t0 = time.process_time()
        fn(*x)
        ts.append(time.process_time() - t0)
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu": sorted(ts)[n // 2] * 1e3, "user": (r1.ru_utime - r0.ru_utime) / n * 1e3,
            "sys": (r1.ru_stime - r0.ru_stime) / n * 1e3, "faults": (r1.ru_minflt - r0.ru_minflt) / n}


def profile_rows(fn: Any, x: tuple, cpu_ms: float, n: int = 3) -> list[dict[str, Any]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(n):
            fn(*x)
    self_ms = {e.key: e.self_cpu_time_total / 1e3 / n for e in p.key_averages()}
    calls = {e.key: e.count // n for e in p.key_averages()}
    total = sum(self_ms.values())
    rows, seen = [], set()
    for name, keys in KINDS:
        seen.update(keys)
        rows.append((name, sum(calls.get(k, 0) for k in keys), sum(self_ms.get(k, 0.0) for k in keys)))
    rest = sorted(((k, v) for k, v in self_ms.items() if k not in seen), key=lambda kv: -kv[1])
    rows.append((f"other ({', '.join(k for k, _ in rest[:3])}, ...)", sum(calls[k] for k, _ in rest),
                 sum(v for _, v in rest)))
    return [{"op kind": k, "calls per forward": c, "profiled ms per forward": ms, "share": f"{ms / total:.1%}",
             "cpu ms (share x cpu time)": ms / total * cpu_ms} for k, c, ms in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=("full", "short"), default="full")
    ap.add_argument("--out", default=str(ROOT / "results"))
    ap.add_argument("--name", default="bert_unpad_int8_profile", help="results file stem")
    args = ap.parse_args(argv)
    meta = provenance("benchmarks/bert_unpad_int8_profile.py", argv, device="cpu", packages=("torch", "transformers"))
    model = load_minilm()
    x = minilm_inputs(args.kind, 32, 128, 0)
    with tempfile.TemporaryDirectory() as tmp:
        built = get_recipe("bert-unpad-int8").build(_ctx(model, x, Path(tmp)))
    _traced_attention()
    torch.set_num_threads(1)
    with torch.inference_mode():
        built.fn(*x), built.fn(*x)  # warm-up at one thread
        t = cpu_time(built.fn, x)
        rows = profile_rows(built.fn, x, t["cpu"])
    meta.update({"torch threads": 1, "variant": built.notes,
                 "cpu ms per forward": f"{t['cpu']:.1f} (user {t['user']:.1f}, system {t['sys']:.1f}, "
                                       f"{t['faults']:.0f} page faults per call)"})
    table = ResultTable(f"bert-unpad-int8, all-MiniLM-L6-v2 as a user wraps it, {args.kind} 32 x 128: self time "
                        "per op kind, 1 thread", COLUMNS, rows, meta)
    table.save(args.name, Path(args.out))
    table.print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
