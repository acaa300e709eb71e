"""Attention of a batch without padding on oneDNN Graph's fused bf16 attention (TorchScript's oneDNN fuser).

``softmax(q k^T * scale) v`` written as two matmuls and a softmax, traced with TorchScript and frozen: with
oneDNN fusion on, the fuser hands the whole pattern to one oneDNN Graph partition (a fused MHA kernel),
which on an AVX512-BF16 CPU takes about half the time of fp32 ``scaled_dot_product_attention`` at
all-MiniLM-L6-v2's shapes (results/encoder_full_length.md). bf16 inputs and output, fp32 inside the
softmax as oneDNN computes it.

Used by ``_unpad.PackedLayer`` for a batch without padding (no mask: every sentence has the batch's
length), traced once per ``(B, T)`` and cached (``MAX_SHAPES``). The fuser flag is global to the process,
so it is on only while a shape is traced and warmed up; the optimised graph keeps its fusion group after.
Any failure (no fuser in this torch, a trace or fusion that fails or disagrees with SDPA) returns None
and the caller runs SDPA: one warning, and the instance does not try again.

Off by default (``UnpaddedBertInt8.graph_attention``). The recipes' attention is now the native varlen
kernel (``kernels.cpu_attention``, chosen per build by ``_native_attention``), which also serves padded
batches: at MiniLM's shapes it took 7.4 ms of CPU in bf16 where this took 12.4 ms (results/cpu_attention.md,
results/encoder_full_length.md; different runs).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["graph_attention_reason", "GraphAttention", "enable_graph_attention_", "MAX_SHAPES"]

MAX_SHAPES = 8  # traced (B, T) shapes per layer; beyond that a new shape runs SDPA (one trace costs ~0.1 s)
_WARMUP = 3  # profiling runs before the executor's optimised (fused) graph is in place
_CHECK_ATOL = 0.05  # |fused - fp32 SDPA| on the trace's random example (bf16 rounding: ~0.01)


def graph_attention_reason() -> str | None:
    """None when the fused attention can run here, else why not."""
    from torchnitro.hardware import hardware_info

    if not hasattr(torch.jit, "enable_onednn_fusion") or not hasattr(torch._C, "_jit_llga_enabled"):
        return f"torch {torch.__version__} has no TorchScript oneDNN fuser (torch.jit.enable_onednn_fusion)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    if not hardware_info().cpu_bf16:
        return "the CPU has no native bf16 (avx512_bf16/amx_bf16): bf16 attention would be emulated"
    return None


@contextlib.contextmanager
def _fusion_on() -> Iterator[None]:
    prev = bool(torch._C._jit_llga_enabled())
    torch.jit.enable_onednn_fusion(True)
    try:
        yield
    finally:
        torch.jit.enable_onednn_fusion(prev)


class _Attend(nn.Module):
    """``(B*T, 3D)`` fused q|k|v rows -> ``(B*T, D)`` attention output, one shape."""

    def __init__(self, b: int, t: int, n_heads: int, head_dim: int):
        super().__init__()
        self.b, self.t, self.h, self.dh = b, t, n_heads, head_dim
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, qkv: Tensor) -> Tensor:
        q, k, v = qkv.view(self.b, self.t, 3, self.h, self.dh).permute(2, 0, 3, 1, 4)  # 3 x (B, H, T, Dh)
        s = torch.matmul(q, k.transpose(-1, -2)) * self.scale  # (B, H, T, T)
        o = torch.matmul(torch.softmax(s, -1), v)  # (B, H, T, Dh)
        return o.transpose(1, 2).reshape(self.b * self.t, self.h * self.dh)


def _sdpa(qkv: Tensor, b: int, t: int, n_heads: int, head_dim: int) -> Tensor:
    q, k, v = qkv.view(b, t, 3, n_heads, head_dim).permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b * t, n_heads * head_dim)


class GraphAttention:
    """``(qkv, b, t) -> (B*T, D)`` bf16 attention without a mask, or None where it cannot run (then the
    caller runs SDPA). A cache of traced graphs, not state: ``deepcopy`` gives an empty one."""

    def __init__(self, n_heads: int, head_dim: int):
        self.n_heads, self.head_dim = n_heads, head_dim
        self._graphs: dict[tuple[int, int], Any] = {}
        self.failed: str | None = None

    def __deepcopy__(self, memo: dict) -> GraphAttention:
        return GraphAttention(self.n_heads, self.head_dim)

    def _trace(self, b: int, t: int) -> Any:
        d3 = 3 * self.n_heads * self.head_dim
        with torch.inference_mode(False), torch.no_grad(), _fusion_on(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notices
            ex = torch.randn(b * t, d3, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            g = torch.jit.freeze(torch.jit.trace(_Attend(b, t, self.n_heads, self.head_dim).eval(), (ex,)))
            for _ in range(_WARMUP):
                out = g(ex)
            ref = _sdpa(ex.float(), b, t, self.n_heads, self.head_dim)
        err = float((out.float() - ref).abs().max())
        if out.dtype != torch.bfloat16 or not err <= _CHECK_ATOL:
            raise RuntimeError(f"fused attention differs from fp32 SDPA by {err:.3g} (> {_CHECK_ATOL}) "
                               f"or returned {out.dtype}")
        return g

    def __call__(self, qkv: Tensor, b: int, t: int) -> Tensor | None:
        if self.failed is not None or qkv.device.type != "cpu" or qkv.requires_grad:
            return None
        g = self._graphs.get((b, t))
        if g is None:
            if len(self._graphs) >= MAX_SHAPES:
                return None
            try:
                g = self._trace(b, t)
            except Exception as exc:  # noqa: BLE001 - a fast path that fails falls back to SDPA
                self.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                warnings.warn(f"fused oneDNN Graph attention unavailable ({self.failed}); using SDPA", stacklevel=2)
                return None
            self._graphs[(b, t)] = g
        return g(qkv if qkv.dtype == torch.bfloat16 else qkv.to(torch.bfloat16))


def enable_graph_attention_(model: nn.Module, on: bool = True) -> int:
    """Give every ``PackedLayer`` in ``model`` a ``GraphAttention`` (``on=False``: take it away).
    Returns how many layers were changed."""
    from torchnitro.autotune.recipes._unpad import PackedLayer

    n = 0
    for layer in model.modules():
        if isinstance(layer, PackedLayer):
            layer.graph_attention = GraphAttention(layer.n_heads, layer.head_dim) if on else None
            n += 1
    return n
