"""What the attention of ``TransformerLM`` saves for backward, by the SDPA backend that runs.

Used by the memory planner (``planner.py``; notation there: B batch, T sequence, D width, H heads,
Hkv K/V heads, Dh head dim, c bytes of what the matmuls produce). Per layer, the fused kernels keep
q and k after RoPE and v, ``c(BTD + 2BT*Hkv*Dh)``, plus the kernel's output and fp32 log-sum-exp
``4BHT``; the output is ``cBTD``, and the input of ``wo`` is a second ``cBTD`` copy when the kernel
returns (B, H, T, Dh) memory (CPU flash, cuDNN), a free view when it returns (B, T, H, Dh) memory
(CUDA flash, memory-efficient; the latter pads the log-sum-exp to 32 rows). The math backend
instead keeps scaled q, k^T and v expanded to H heads, the softmax ``BHT^2`` and the output copy
(fp32 on CPU; c-byte on CUDA).

``attention="auto"`` in the planner is the backend PyTorch would pick for the device, dtype, head
dim and GQA (``sdpa_backend``).
"""

from __future__ import annotations

import math

__all__ = ["ATTENTION_KINDS", "sdpa_backend", "attention_bytes", "selective_attention_bytes"]

ATTENTION_KINDS = ("auto", "flash", "efficient", "cudnn", "math")
_SDP_CHOICE = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn"}  # torch.nn.attention.SDPBackend values


def _lse_rows(kind: str, T: int) -> int:
    """Rows of the fp32 log-sum-exp a fused kernel keeps: memory-efficient pads T to 32."""
    return 32 * math.ceil(T / 32) if kind == "efficient" else T


def sdpa_backend(device: str, dtype_bytes: int, *, n_heads: int, kv_heads: int, head_dim: int, seq: int) -> str:
    """The SDPA backend ``TransformerLM``'s causal attention would run: flash/efficient/cudnn/math.

    Asks PyTorch (``torch._fused_sdp_choice`` on small empty tensors, honouring ``sdpa_kernel``
    contexts and the ``torch.backends.cuda.*_sdp_enabled()`` switches) when the device is present.
    Planning for CUDA on a machine without one uses the order seen with torch 2.11 on Hopper:
    16-bit: cuDNN (Dh <= 128, Dh % 8 == 0), else flash (Dh <= 256); fp32 or what is left:
    memory-efficient for plain multi-head attention, math for GQA.
    """
    import torch

    gqa = n_heads != kv_heads
    dt = {4: torch.float32, 2: torch.bfloat16}[dtype_bytes]
    if device == "cpu" or torch.cuda.is_available():
        try:
            # requires_grad: a training step is planned, and some kernels are chosen only without grad
            q = torch.empty(1, n_heads, seq, head_dim, dtype=dt, device=device, requires_grad=True)
            k = torch.empty(1, kv_heads, seq, head_dim, dtype=dt, device=device, requires_grad=True)
            choice = torch._fused_sdp_choice(q, k, k, None, 0.0, True, scale=None, enable_gqa=gqa)
            return _SDP_CHOICE.get(int(choice), "math")
        except (RuntimeError, TypeError, AttributeError):  # private API moved: use the rules below
            pass
    if device == "cpu":
        return "flash" if torch.backends.cpu.flash_sdp_enabled() else "math"
    b = torch.backends.cuda
    if dtype_bytes == 2 and head_dim % 8 == 0:
        if b.cudnn_sdp_enabled() and head_dim <= 128:
            return "cudnn"
        if b.flash_sdp_enabled() and head_dim <= 256:
            return "flash"
    if b.mem_efficient_sdp_enabled() and not gqa and head_dim % (4 if dtype_bytes == 4 else 8) == 0:
        return "efficient"
    return "math"


def attention_bytes(kind: str, device: str, *, B: int, T: int, H: int, Hkv: int, Dh: int, c: int) -> tuple[int, str]:
    """Bytes one attention layer saves for backward with SDPA backend ``kind``, and the formula."""
    q, kv = B * T * H * Dh, B * T * Hkv * Dh  # q-sized (= BTD) and k/v-sized element counts
    if kind == "math":
        if device == "cpu":  # fp32 scaled q, k^T and v expanded to H heads, fp32 softmax, output copy
            return 4 * 3 * q + 4 * B * H * T * T + c * q, "12BTD + 4BHT^2 + cBTD (CPU math)"
        return c * (4 * q + B * H * T * T), "c(4BTD + BHT^2) (CUDA math: scaled q, k^T, v, softmax, copy)"
    lse_rows = _lse_rows(kind, T)
    copy = kind == "cudnn" or device == "cpu"  # output in (B, H, T, Dh) memory: wo's input is a copy
    b = c * ((3 if copy else 2) * q + 2 * kv) + 4 * B * H * lse_rows
    return b, f"c({'3' if copy else '2'}BTD + 2BT*Hkv*Dh) + 4BH*{'ceil32(T)' if kind == 'efficient' else 'T'} ({kind})"


def selective_attention_bytes(kind: str, device: str, *, B: int, T: int, H: int, D: int, c: int) -> int:
    """The attention kernel's outputs that a block keeps under selective checkpointing."""
    if kind == "math":  # the two bmm outputs: scores (B, H, T, T) and (B, H, T, Dh); fp32 on CPU
        return (4 if device == "cpu" else c) * (B * H * T * T + B * T * D)
    return c * B * T * D + 4 * B * H * _lse_rows(kind, T)
