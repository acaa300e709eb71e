"""The padding-free encoders' attention: native varlen kernel or SDPA, chosen by measurement at build time.

``choose_attention_`` runs the variant once on the example, takes the first packed layer's input rows
and packing as that call has them, and times ``PackedLayer.attention`` (the qkv GEMM and the attention)
with the native kernel (``torchnitro.kernels.cpu_attention``) and with SDPA, interleaved, at one torch
thread, in CPU time (``time.process_time``): on a machine shared with other work, wall-time minima of two ~10 ms
calls at 2 threads reversed a 2x difference in one build, CPU time did not (results/cpu_attention.md). One
thread, because CPU time at many threads counts the OpenMP threads' spinning: at 16 threads on an Intel Xeon
SDPA read 62 ms per layer against 2-3 ms for the native kernel, while at one thread SDPA's bf16 kernel (on
AMX) was the faster of the two in the whole model and level at 16 threads wall (results/encoder_intel_xeon_amx.md).
The native kernel stays on only where its output agrees with SDPA's on those rows
and it was faster; the note says which attention ran and the two times. The gate still verifies the
whole variant as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from torchnitro.autotune.recipes._unpad import PackedLayer

__all__ = ["AttentionChoice", "choose_attention_", "native_computes", "set_native_attention_"]

ROUNDS = 9  # interleaved timing rounds per side; the medians are compared
# relative (Frobenius) difference from SDPA on the example's rows above which the native kernel is not used:
# fp32 sums in another order (~1e-6); bf16 rounds q, k, v and the probabilities (~4e-3 on random rows)
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2}


@dataclass
class AttentionChoice:
    """What a build chose: ``compute`` "fp32"/"bf16" for the native kernel, None for SDPA; ``note`` for the
    report; the per-layer CPU times (ms, median over rounds) when both were timed."""

    compute: str | None
    note: str
    native_ms: float | None = None
    sdpa_ms: float | None = None


def set_native_attention_(model: nn.Module, compute: str | None) -> int:
    """Give every ``PackedLayer`` of ``model`` the native attention in ``compute`` (None: SDPA again).
    Returns how many layers were set."""
    from torchnitro.kernels.cpu_attention import NativeAttention

    n = 0
    for m in model.modules():
        if isinstance(m, PackedLayer):
            m.native_attention = NativeAttention(compute) if compute is not None else None
            n += 1
    return n


def native_computes() -> tuple[str, ...]:
    """The native computes an fp32 variant that may round (int8) tries, in order: bf16 first where the kernel
    has native bf16 dot products here (AVX512-BF16; emulated it is slower than fp32), then fp32."""
    from torchnitro.kernels.cpu_attention import has_native_bf16

    return ("bf16", "fp32") if has_native_bf16() else ("fp32",)


def _capture(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[PackedLayer | None, Any]:
    """The first packed layer and the ``(x, buckets)`` it received in one forward on ``inputs``."""
    layer = next((m for m in model.modules() if isinstance(m, PackedLayer)), None)
    if layer is None:
        return None, None
    seen: list[tuple[Any, ...]] = []
    handle = layer.register_forward_pre_hook(lambda mod, args: seen.append(args) if not seen else None)
    try:
        with torch.inference_mode():
            model(*inputs)
    finally:
        handle.remove()
    return layer, (seen[0] if seen else None)


def _time(fns: dict[str, Callable[[], Tensor]], rounds: int) -> dict[str, float]:
    """Median CPU seconds per call of each of ``fns`` at one torch thread (the native kernel takes torch's
    count too), interleaved in alternating order."""
    got: dict[str, list[float]] = {k: [] for k in fns}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for r in range(rounds):
            for k in (list(fns) if r % 2 == 0 else list(fns)[::-1]):  # alternate the order: drift hits both
                t0 = time.process_time()
                fns[k]()
                got[k].append(time.process_time() - t0)
    finally:
        torch.set_num_threads(threads)
    return {k: sorted(v)[len(v) // 2] for k, v in got.items()}


def choose_attention_(model: nn.Module, inputs: tuple[Any, ...], computes: tuple[str, ...],
                      accept: Callable[[], str | None] | None = None) -> AttentionChoice:
    """Switch ``model``'s packed layers to the native attention in the first of ``computes`` that runs here,
    agrees with SDPA on the example's rows, is faster there and is accepted: ``accept`` (run with it on)
    returns None to keep it, else why not (e.g. a calibration cosine under target). Leaves SDPA otherwise;
    returns the choice and its note (the reasons of the computes tried before)."""
    notes: list[str] = []
    for compute in computes:
        choice = _choose_one(model, inputs, compute, accept)
        if choice.compute is not None:
            choice.note += "".join(f"; {n}" for n in notes)
            return choice
        why = choice.note.removeprefix("attention: SDPA (").removesuffix(")")
        notes += [why] if why not in notes else []  # "unavailable" once, not per compute
    return AttentionChoice(None, f"attention: SDPA ({'; '.join(notes)})", choice.native_ms, choice.sdpa_ms)


def _choose_one(model: nn.Module, inputs: tuple[Any, ...], compute: str,
                accept: Callable[[], str | None] | None) -> AttentionChoice:
    from torchnitro.kernels.cpu_attention import NativeAttention, cpu_attention_reason, kernel_name

    why = cpu_attention_reason()
    if why is not None:
        return AttentionChoice(None, f"attention: SDPA ({why})")
    layer, args = _capture(model, inputs)
    if layer is None or args is None:
        return AttentionChoice(None, "attention: SDPA (no packed layer ran on the example)")
    x, buckets = args
    if buckets[0].bias is not None:
        return AttentionChoice(None, "attention: SDPA (an additive position bias: the native kernel takes none)")
    if x.device.type != "cpu":
        return AttentionChoice(None, f"attention: SDPA (the native kernel runs on the CPU; the rows are on {x.device})")
    native = NativeAttention(compute)

    def run(na: NativeAttention | None) -> Tensor:
        layer.native_attention = na
        return layer.attention(x, buckets)

    try:
        with torch.inference_mode():
            ref, got = run(None).float(), run(native).float()  # (N, D)
            err = float((got - ref).norm() / ref.norm().clamp(min=1e-30))
            t = _time({"native": lambda: run(native), "sdpa": lambda: run(None)}, ROUNDS) if err <= TOLERANCE[
                compute] else {}
    finally:
        layer.native_attention = None
    if not t:
        return AttentionChoice(None, f"attention: SDPA (native {compute} differs from SDPA by {err:.2g} relative "
                                     f"> {TOLERANCE[compute]:g})")
    nat, sdpa = t["native"] * 1e3, t["sdpa"] * 1e3
    if nat >= sdpa:
        return AttentionChoice(None, f"attention: SDPA (native {compute} slower here: {nat:.2f} ms vs {sdpa:.2f} ms "
                                     "CPU per layer at 1 thread)", nat, sdpa)
    set_native_attention_(model, compute)
    refused = accept() if accept is not None else None
    if refused is not None:
        set_native_attention_(model, None)
        return AttentionChoice(None, f"attention: SDPA (native {compute}: {refused})", nat, sdpa)
    return AttentionChoice(compute, f"attention: {kernel_name(compute)} ({nat:.2f} ms vs SDPA {sdpa:.2f} ms CPU per "
                                    "layer at 1 thread, qkv GEMM included)", nat, sdpa)
