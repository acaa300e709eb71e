"""Benchmark suites over a fixed size matrix: what ``torchnitro bench run`` times and writes.

Tiers are batch x heads x seq x head_dim (issue 19's matrix); each tier has its own time limit,
shared by its cases, and is skipped with a stated reason when its working set would take more
than half of the device's free memory. Only the ``attention`` suite exists so far: fused SDPA
(``F.scaled_dot_product_attention``, causal) against the math reference (matmul, mask, softmax,
matmul), interleaved per tier with ``bench.compare``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from torchnitro.bench.timing import Timing, TimingConfig, compare
from torchnitro.errors import InputError

__all__ = ["TIERS", "TIER_LIMIT_S", "SUITES", "SuiteRun", "run_suite", "free_memory_bytes"]

TIERS: dict[str, tuple[int, int, int, int]] = {  # name -> (batch, heads, seq, head_dim)
    "micro": (1, 2, 32, 16), "small": (1, 4, 64, 32), "realistic": (2, 8, 512, 64),
    "large": (4, 16, 1024, 64), "xlarge": (8, 32, 2048, 128),
}
TIER_LIMIT_S = {"micro": 10.0, "small": 15.0, "realistic": 60.0, "large": 120.0, "xlarge": 300.0}  # per tier


@dataclass
class SuiteRun:
    timings: dict[str, Timing] = field(default_factory=dict)  # "suite/tier/case" -> timing
    skipped: dict[str, str] = field(default_factory=dict)  # "suite/tier" -> why


def free_memory_bytes(device: str) -> int:
    """Free bytes on ``device``: CUDA's free memory, or the host's available memory."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info()[0])
    import psutil

    return int(psutil.virtual_memory().available)


def _attention_bytes(shape: tuple[int, int, int, int]) -> int:
    """fp32 working set of the math path: (B, H, T, T) scores, mask and softmax, plus q, k, v, out."""
    b, h, t, d = shape
    return 4 * (3 * b * h * t * t + 4 * b * h * t * d)


def _attention(shape: tuple[int, int, int, int], device: str) -> dict[str, Callable[[], Any]]:
    b, h, t, d = shape
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, generator=g).to(device, dtype) for _ in range(3))
    mask = torch.ones(t, t, dtype=torch.bool, device=device).tril()

    def math() -> torch.Tensor:
        s = (q @ k.transpose(-2, -1)) * d ** -0.5  # (B, H, T, T)
        return torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v

    def sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {"sdpa": sdpa, "math": math}


_Shape = tuple[int, int, int, int]
# suite -> (cases of a tier on a device, bytes a tier needs)
SUITES: dict[str, tuple[Callable[[_Shape, str], dict[str, Callable[[], Any]]], Callable[[_Shape], int]]] = {
    "attention": (_attention, _attention_bytes),
}


def run_suite(suite: str, tiers: Sequence[str], *, device: str = "cpu", timing: TimingConfig | None = None,
              free_bytes: int | None = None) -> SuiteRun:
    """Time every case of ``suite`` at each tier; ``free_bytes`` overrides the measured free memory."""
    if suite not in SUITES:
        raise InputError(f"suite {suite!r} is unknown; expected one of {sorted(SUITES)}")
    unknown = [t for t in tiers if t not in TIERS]
    if unknown or not tiers:
        raise InputError(f"tiers {list(tiers)}: {unknown or 'none given'}; expected some of {list(TIERS)}")
    free = free_memory_bytes(device) if free_bytes is None else free_bytes
    out = SuiteRun()
    build, need = SUITES[suite]
    for tier in tiers:
        if need(TIERS[tier]) > free // 2:  # decided before allocating anything
            out.skipped[f"{suite}/{tier}"] = (f"needs about {need(TIERS[tier]) / 2**20:.0f} MiB, more than half of "
                                              f"the {free / 2**20:.0f} MiB free on {device}")
            continue
        fns = build(TIERS[tier], device)
        base = timing or TimingConfig(device=device)
        limit = TIER_LIMIT_S[tier] / (2 * len(fns))  # compare() may spend max_time_s per function
        with torch.inference_mode():
            res = compare(fns, dataclasses.replace(base, max_time_s=min(base.max_time_s, limit)))
        out.timings.update({f"{suite}/{tier}/{name}": t for name, t in res.items()})
    return out
