"""Flash attention forward and backward (Dao et al., 2022; FlashAttention-2, Dao 2023).

    O = softmax(Q K^T * scale + mask) V, computed block by block with an online softmax: per query
    block keep the running max m, normaliser l and accumulator; rescale by exp(m_old - m_new).
Forward saves only O and the row log-sum-exp L. Backward recomputes P = exp(S - L):
    dV = P^T dO;  dP = dO V^T;  dS = P * (dP - rowsum(dO * O));  dQ = dS K * scale;  dK = dS^T Q * scale
Masks: causal (top-left aligned, as SDPA's ``is_causal``), sliding window (|q - k| < window, and
k <= q when causal); blocks wholly outside the mask are skipped and blocks wholly inside it run without
masking. GQA/MQA: query head h reads K/V head h // (H / Hkv); in the backward each K/V block loops
over the query heads of its group and accumulates dK/dV in registers (no per-query-head copies).
The backward is three launches, no atomics: delta = rowsum(dO * O); dK/dV with a K/V block resident,
looping over query blocks; dQ with a query block resident, looping over K/V blocks. Scores are scaled
by scale * log2(e) so every exponential is an exp2; accumulators are fp32.
Launch configs come from short explicit candidate lists (``candidates``), timed with CUDA events on
first use per (length bucket, dtype, head dim, group, mask kind, GPU) and cached in-process
(``chosen_configs()`` lists them; ``TORCHNITRO_KERNEL_TUNE=0`` takes the first candidate untimed).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor, nn

from torchnitro.errors import BackendUnavailableError, InputError
from torchnitro.kernels import reference
from torchnitro.kernels._common import autocast_inputs, check_float, check_qkv
from torchnitro.kernels._triton import LazyKernel, cdiv, cuda_ms, interpreting, next_pow2, tuning_enabled
from torchnitro.kernels.dispatch import use_triton

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["flash_attention", "FlashAttention", "flash_attention_forward", "flash_attention_backward",
           "FlashAttentionFunction", "KernelConfig", "candidates", "chosen_configs"]


def _fa_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, sm_scale, H, G, Tq, Tk, D, WINDOW,
                   sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot,
                   CAUSAL: constexpr, HAS_WINDOW: constexpr, PREC: constexpr,
                   BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr):
    start_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: launch them first so the tail of the grid is short
        start_m = tl.num_programs(0) - 1 - start_m
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    q = tl.load(q_base + offs_m[:, None] * sqt + offs_d[None, :], mask=(offs_m[:, None] < Tq) & dmask[None, :],
                other=0.0)
    m_i = tl.full((BLOCK_M,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # work in base 2: exp(x) = exp2(x * log2 e)
    lo = 0
    hi = Tk
    if HAS_WINDOW:
        lo = tl.maximum(0, start_m * BLOCK_M - WINDOW + 1) // BLOCK_N * BLOCK_N
        if not CAUSAL:
            hi = tl.minimum(Tk, (start_m + 1) * BLOCK_M + WINDOW - 1)
    if CAUSAL:
        hi = tl.minimum(Tk, (start_m + 1) * BLOCK_M)
    mid = lo
    if not HAS_WINDOW:
        # stage 1, key blocks wholly inside the mask (in range, and before this query block when causal):
        # no masking at all, so the loop body is only the two MMAs, the exp2 and the rescale
        full = Tk // BLOCK_N * BLOCK_N
        if CAUSAL:
            full = tl.minimum(full, start_m * BLOCK_M // BLOCK_N * BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * skt + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * svt + offs_d[None, :]
        for start_n in range(0, full, BLOCK_N):
            k = tl.load(k_ptrs + start_n * skt, mask=dmask[None, :], other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PREC)  # (BLOCK_M, BLOCK_N)
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)  # max commutes with the scale (> 0)
            p = tl.exp2(qk * qk_scale - m_new[:, None])  # one FMA per score
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptrs + start_n * svt, mask=dmask[None, :], other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
            m_i = m_new
        mid = full
    for start_n in range(mid, hi, BLOCK_N):  # stage 2, boundary blocks (diagonal, window edges, Tk tail): masked
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < Tk) & dmask[None, :]
        k = tl.load(k_base + cols[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        keep = (cols[None, :] < Tk) & (offs_m[:, None] >= 0)
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            keep = keep & (offs_m[:, None] - cols[None, :] < WINDOW)
            if not CAUSAL:
                keep = keep & (cols[None, :] - offs_m[:, None] < WINDOW)
        s = tl.where(keep, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, -float("inf"), (m_i + tl.log2(l_safe)) * 0.6931471805599453)  # natural log
    o_base = o_ptr + b.to(tl.int64) * sob + h.to(tl.int64) * soh
    tl.store(o_base + offs_m[:, None] * sot + offs_d[None, :], o.to(o_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < Tq) & dmask[None, :])
    tl.store(lse_ptr + bh.to(tl.int64) * Tq + offs_m, lse, mask=offs_m < Tq)


def _fa_bwd_pre_kernel(o_ptr, do_ptr, delta_ptr, Tq, D, BLOCK_M: constexpr, BLOCK_D: constexpr):
    """delta = rowsum(dO * O) per (b, h, t); O and dO are contiguous (B*H, Tq, D)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Tq) & (offs_d[None, :] < D)
    off = bh * Tq * D + offs_m[:, None] * D + offs_d[None, :]
    o = tl.load(o_ptr + off, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptr + off, mask=mask, other=0.0).to(tl.float32)
    tl.store(delta_ptr + bh * Tq + offs_m, tl.sum(o * do, axis=1), mask=offs_m < Tq)


def _fa_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, sm_scale, H, G, Tq, Tk, D,
                        WINDOW, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                        CAUSAL: constexpr, HAS_WINDOW: constexpr, PREC: constexpr,
                        BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr):
    """dK, dV for one K/V block held in registers, looping over query blocks (FlashAttention-2 bwd).

    The query blocks split into a masked set (causal diagonal, window edges, Tq tail, or a partial key
    block) and a contiguous unmasked middle; the masked set is walked by one loop whose block index
    jumps from the head run to the tail run, so neither loop body branches."""
    start_n = tl.program_id(0)
    bk = tl.program_id(1)  # (batch, K/V head): the G query heads sharing it accumulate into one dK/dV
    Hkv = H // G
    b = bk // Hkv
    hk = bk % Hkv
    offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_mb = tl.arange(0, BLOCK_M)
    dmask = offs_d < D
    kv_mask = (offs_n[:, None] < Tk) & dmask[None, :]
    k = tl.load(k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh + offs_n[:, None] * skt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh + offs_n[:, None] * svt + offs_d[None, :],
                mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    lo = 0
    hi = Tq
    if CAUSAL:
        lo = start_n * BLOCK_N // BLOCK_M * BLOCK_M
    if HAS_WINDOW:
        hi = tl.minimum(Tq, (start_n + 1) * BLOCK_N + WINDOW - 1)
        if not CAUSAL:
            lo = tl.maximum(0, start_n * BLOCK_N - WINDOW + 1) // BLOCK_M * BLOCK_M
    # unmasked query blocks [first_full, last_full): whole blocks in range, key block whole, and (causal)
    # every query at or after every key of this block; masked: [lo, first_full) and [last_full, hi)
    first_full = lo
    last_full = lo
    if not HAS_WINDOW:
        if CAUSAL:
            first_full = tl.minimum((start_n * BLOCK_N + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M * BLOCK_M,
                                    (Tq + BLOCK_M - 1) // BLOCK_M * BLOCK_M)
        last_full = tl.where((start_n + 1) * BLOCK_N <= Tk, Tq // BLOCK_M * BLOCK_M, 0)
        last_full = tl.maximum(last_full, first_full)
    n_head = (first_full - lo) // BLOCK_M
    n_masked = n_head + tl.maximum(hi - last_full + BLOCK_M - 1, 0) // BLOCK_M
    for g in range(0, G):
        h = hk * G + g
        bh = b * H + h
        q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_base = do_ptr + bh.to(tl.int64) * Tq * D
        row_base = lse_ptr + bh.to(tl.int64) * Tq
        delta_base = delta_ptr + bh.to(tl.int64) * Tq
        q_ptrs = q_base + offs_mb[:, None] * sqt + offs_d[None, :]
        do_ptrs = do_base + offs_mb[:, None] * D + offs_d[None, :]
        for start_m in range(first_full, last_full, BLOCK_M):  # no masks but D's
            q = tl.load(q_ptrs + start_m * sqt, mask=dmask[None, :], other=0.0)
            do = tl.load(do_ptrs + start_m * D, mask=dmask[None, :], other=0.0)
            lse2 = tl.load(row_base + start_m + offs_mb) * 1.4426950408889634
            delta = tl.load(delta_base + start_m + offs_mb)
            p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale - lse2[None, :])  # (BN, BM)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
        for i in range(0, n_masked):  # head run, then tail run
            start_m = tl.where(i < n_head, lo + i * BLOCK_M, last_full + (i - n_head) * BLOCK_M)
            offs_m = start_m + offs_mb
            qmask = (offs_m[:, None] < Tq) & dmask[None, :]
            q = tl.load(q_ptrs + start_m * sqt, mask=qmask, other=0.0)
            do = tl.load(do_ptrs + start_m * D, mask=qmask, other=0.0)
            lse2 = tl.load(row_base + offs_m, mask=offs_m < Tq, other=float("inf")) * 1.4426950408889634
            delta = tl.load(delta_base + offs_m, mask=offs_m < Tq, other=0.0)
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (BLOCK_N, BLOCK_M)
            keep = (offs_m[None, :] < Tq) & (offs_n[:, None] < Tk)
            if CAUSAL:
                keep = keep & (offs_n[:, None] <= offs_m[None, :])
            if HAS_WINDOW:
                keep = keep & (offs_m[None, :] - offs_n[:, None] < WINDOW)
                if not CAUSAL:
                    keep = keep & (offs_n[:, None] - offs_m[None, :] < WINDOW)
            p_t = tl.where(keep, tl.exp2(s_t - lse2[None, :]), 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PREC)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PREC)
    out = bk.to(tl.int64) * Tk * D + offs_n[:, None] * D + offs_d[None, :]  # dK/dV are (B, Hkv, Tk, D)
    tl.store(dk_ptr + out, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=kv_mask)


def _fa_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, sm_scale, H, G, Tq, Tk, D, WINDOW,
                      sqb, sqh, sqt, skb, skh, skt, svb, svh, svt,
                      CAUSAL: constexpr, HAS_WINDOW: constexpr, PREC: constexpr,
                      BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr):
    """dQ for one query block held in registers, looping over key blocks (unmasked interior, then edges)."""
    start_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: launch them first so the tail of the grid is short
        start_m = tl.num_programs(0) - 1 - start_m
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    qmask = (offs_m[:, None] < Tq) & dmask[None, :]
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + offs_m[:, None] * sqt + offs_d[None, :],
                mask=qmask, other=0.0)
    row = bh.to(tl.int64) * Tq + offs_m
    do = tl.load(do_ptr + bh.to(tl.int64) * Tq * D + offs_m[:, None] * D + offs_d[None, :], mask=qmask, other=0.0)
    lse2 = tl.load(lse_ptr + row, mask=offs_m < Tq, other=float("inf")) * 1.4426950408889634  # log2 units
    delta = tl.load(delta_ptr + row, mask=offs_m < Tq, other=0.0)
    k_base = k_ptr + b.to(tl.int64) * skb + hk.to(tl.int64) * skh
    v_base = v_ptr + b.to(tl.int64) * svb + hk.to(tl.int64) * svh
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    qk_scale = sm_scale * 1.4426950408889634
    lo = 0
    hi = Tk
    if HAS_WINDOW:
        lo = tl.maximum(0, start_m * BLOCK_M - WINDOW + 1) // BLOCK_N * BLOCK_N
        if not CAUSAL:
            hi = tl.minimum(Tk, (start_m + 1) * BLOCK_M + WINDOW - 1)
    if CAUSAL:
        hi = tl.minimum(Tk, (start_m + 1) * BLOCK_M)
    mid = lo
    if not HAS_WINDOW:  # interior key blocks: no masking (rows past Tq have lse = +inf, so p = 0 there)
        full = Tk // BLOCK_N * BLOCK_N
        if CAUSAL:
            full = tl.minimum(full, start_m * BLOCK_M // BLOCK_N * BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * skt + offs_d[None, :]
        v_ptrs = v_base + offs_n[:, None] * svt + offs_d[None, :]
        for start_n in range(0, full, BLOCK_N):
            k = tl.load(k_ptrs + start_n * skt, mask=dmask[None, :], other=0.0)
            v = tl.load(v_ptrs + start_n * svt, mask=dmask[None, :], other=0.0)
            p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale - lse2[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PREC)
            dq = tl.dot((p * (dp - delta[:, None])).to(k.dtype), k, dq, input_precision=PREC)
        mid = full
    for start_n in range(mid, hi, BLOCK_N):  # boundary blocks: masked
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < Tk) & dmask[None, :]
        k = tl.load(k_base + cols[:, None] * skt + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + cols[:, None] * svt + offs_d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        keep = (cols[None, :] < Tk) & (offs_m[:, None] < Tq)
        if CAUSAL:
            keep = keep & (cols[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            keep = keep & (offs_m[:, None] - cols[None, :] < WINDOW)
            if not CAUSAL:
                keep = keep & (cols[None, :] - offs_m[:, None] < WINDOW)
        p = tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PREC)
    tl.store(dq_ptr + bh.to(tl.int64) * Tq * D + offs_m[:, None] * D + offs_d[None, :],
             (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=qmask)


_fwd = LazyKernel(_fa_fwd_kernel)
_bwd_kv = LazyKernel(_fa_bwd_dkdv_kernel)
_bwd_q = LazyKernel(_fa_bwd_dq_kernel)
_pre = LazyKernel(_fa_bwd_pre_kernel)


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of a flash-attention kernel."""

    block_m: int  # query rows per block
    block_n: int  # key rows per block
    num_warps: int
    num_stages: int  # software-pipelining depth of the main loop

    def __str__(self) -> str:
        return f"M{self.block_m}/N{self.block_n}/w{self.num_warps}/s{self.num_stages}"


# Candidates per kernel, tried in order; the first is the default when nothing is timed (CPU, tuning off).
# Centred on the FlashAttention-2 / Triton fused-attention tutorial settings (forward 128x64-128 with 8
# warps; dK/dV 32x128 and dQ 128x32-64), with 8 warps first for dK/dV: at D=128 its two fp32 (128, D)
# accumulators overflow 4 warps' registers (ptxas reports spills for sm_90); the 4-warp ones are for
# D <= 64. One that fails to compile (shared memory) is skipped by the picker.
FWD_CANDIDATES = (KernelConfig(128, 64, 8, 3), KernelConfig(128, 128, 8, 2), KernelConfig(128, 64, 8, 4),
                  KernelConfig(128, 128, 8, 3), KernelConfig(128, 64, 4, 3), KernelConfig(64, 64, 4, 3))
DKDV_CANDIDATES = (KernelConfig(32, 128, 8, 3), KernelConfig(32, 128, 8, 4), KernelConfig(64, 128, 8, 2),
                   KernelConfig(16, 128, 8, 4), KernelConfig(32, 128, 4, 5), KernelConfig(64, 64, 4, 3))
DQ_CANDIDATES = (KernelConfig(128, 64, 8, 3), KernelConfig(128, 32, 8, 3), KernelConfig(128, 32, 8, 4),
                 KernelConfig(128, 64, 8, 2), KernelConfig(64, 64, 4, 3), KernelConfig(128, 32, 4, 5))
# Head dims above 128: the 128-wide tiles above overflow shared memory, so smaller tiles, fewer stages.
FWD_CANDIDATES_WIDE = (KernelConfig(64, 32, 4, 2), KernelConfig(64, 64, 4, 2), KernelConfig(128, 32, 8, 2))
DKDV_CANDIDATES_WIDE = (KernelConfig(16, 64, 4, 2), KernelConfig(32, 64, 4, 2), KernelConfig(16, 32, 4, 2))
DQ_CANDIDATES_WIDE = (KernelConfig(64, 32, 4, 2), KernelConfig(32, 32, 4, 2), KernelConfig(64, 16, 4, 2))


def candidates(head_dim: int) -> tuple[tuple[KernelConfig, ...], tuple[KernelConfig, ...], tuple[KernelConfig, ...]]:
    """(forward, dK/dV, dQ) candidate lists for a head dim."""
    if head_dim > 128:
        return FWD_CANDIDATES_WIDE, DKDV_CANDIDATES_WIDE, DQ_CANDIDATES_WIDE
    return FWD_CANDIDATES, DKDV_CANDIDATES, DQ_CANDIDATES


_INTERPRET_CONFIG = KernelConfig(16, 16, 4, 1)  # interpreter: tiny blocks keep the numpy emulation fast

_CHOSEN: dict[tuple, KernelConfig] = {}


def chosen_configs() -> dict[str, str]:
    """The configs picked so far in this process, ``"kernel key" -> "M128/N64/w8/s3"`` (for benchmarks)."""
    return {" ".join(map(str, key)): str(cfg) for key, cfg in _CHOSEN.items()}


def _time_ms(launch: Callable[[], None], reps: int = 5) -> float:
    launch()  # compile and warm up
    return cuda_ms(launch, reps)


def _pick_config(name: str, key: tuple, candidates: tuple[KernelConfig, ...], like: Tensor,
                 launch: Callable[[KernelConfig], None]) -> KernelConfig:
    """The fastest of ``candidates`` for ``key``, timed once with CUDA events and cached in-process.

    A local version of a config picker (to be unified with the shared one in ``_triton``). The
    interpreter uses tiny fixed blocks; wherever ``_triton.tuning_enabled`` says no (CPU,
    ``TORCHNITRO_KERNEL_TUNE=0``, CUDA-graph capture, a torch.compile trace) ``candidates[0]`` is used.
    ``launch`` must be safe to repeat (each kernel overwrites its outputs, nothing accumulates).
    """
    if interpreting():
        return _INTERPRET_CONFIG
    full = (name, *key)
    cfg = _CHOSEN.get(full)
    if cfg is not None:
        return cfg
    if not tuning_enabled(like.device):
        return candidates[0]
    times: dict[KernelConfig, float] = {}
    errors: list[str] = []
    for c in candidates:
        try:
            times[c] = _time_ms(lambda c=c: launch(c))
        except Exception as e:  # noqa: BLE001 - a candidate over the shared-memory or register budget
            errors.append(f"{c}: {type(e).__name__}: {str(e)[:200]}")
    if not times:
        raise BackendUnavailableError(f"flash_attention {name}: no launch config ran for {key}; errors: {errors}")
    cfg = _CHOSEN[full] = min(times, key=times.__getitem__)
    return cfg


def _launch_kw(cfg: KernelConfig) -> dict[str, int]:
    kw = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n}
    if not interpreting():
        kw.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return kw


def _key(q: Tensor, k: Tensor, causal: bool, window: int | None) -> tuple:
    """Tuning bucket: lengths rounded up to powers of two; everything the kernels specialise on."""
    dev = torch.cuda.get_device_name(q.device) if q.is_cuda else q.device.type
    return (str(q.dtype).replace("torch.", ""), next_pow2(q.shape[2]), next_pow2(k.shape[2]), q.shape[3],
            q.shape[1] // k.shape[1], "causal" if causal else "full", "window" if window is not None else "",
            dev)


def _prec(q: Tensor) -> str:
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _strides(t: Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def flash_attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None, scale: float,
                            config: KernelConfig | None = None) -> tuple[Tensor, Tensor]:
    """Returns (O (B, H, Tq, D) contiguous, L (B*H, Tq) fp32 natural-log row log-sum-exp).

    ``scale`` must be positive; ``config`` forces a launch config (tests), by default one is picked by
    :func:`_pick_config`."""
    if not scale > 0:
        raise InputError(f"flash_attention_forward: scale={scale}; expected > 0 (flash_attention routes other "
                         "scales to the reference)")
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    o = torch.empty(B, H, Tq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B * H, Tq, device=q.device, dtype=torch.float32)

    def launch(c: KernelConfig) -> None:
        _fwd[(cdiv(Tq, c.block_m), B * H)](
            q, k, v, o, lse, scale, H, H // Hkv, Tq, Tk, D, window or 0, *_strides(q), *_strides(k),
            *_strides(v), *_strides(o), CAUSAL=causal, HAS_WINDOW=window is not None, PREC=_prec(q),
            BLOCK_D=max(16, next_pow2(D)), **_launch_kw(c))

    launch(config or _pick_config("fwd", _key(q, k, causal, window), candidates(D)[0], q, launch))
    return o, lse


def flash_attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, causal: bool,
                             window: int | None, scale: float,
                             configs: tuple[KernelConfig, KernelConfig] | None = None
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ, dK, dV); ``configs`` = (dK/dV config, dQ config) forces launch configs (tests)."""
    B, H, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    G = H // Hkv
    do = do.contiguous()
    bd = max(16, next_pow2(D))
    delta = torch.empty_like(lse)
    _pre[(cdiv(Tq, 64), B * H)](o, do, delta, Tq, D, BLOCK_M=64, BLOCK_D=bd)
    dq = torch.empty(B, H, Tq, D, device=q.device, dtype=q.dtype)
    dk = torch.empty(B, Hkv, Tk, D, device=q.device, dtype=k.dtype)
    dv = torch.empty_like(dk)
    common = dict(CAUSAL=causal, HAS_WINDOW=window is not None, PREC=_prec(q), BLOCK_D=bd)
    args = (scale, H, G, Tq, Tk, D, window or 0, *_strides(q), *_strides(k), *_strides(v))

    def launch_kv(c: KernelConfig) -> None:
        _bwd_kv[(cdiv(Tk, c.block_n), B * Hkv)](
            q, k, v, do, lse, delta, dk, dv, *args, **common, **_launch_kw(c))

    def launch_q(c: KernelConfig) -> None:
        _bwd_q[(cdiv(Tq, c.block_m), B * H)](
            q, k, v, do, lse, delta, dq, *args, **common, **_launch_kw(c))

    key = _key(q, k, causal, window)
    c_kv, c_q = configs or (_pick_config("bwd_dkdv", key, candidates(D)[1], q, launch_kv),
                            _pick_config("bwd_dq", key, candidates(D)[2], q, launch_q))
    launch_kv(c_kv)
    launch_q(c_q)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, window: int | None, scale: float):  # type: ignore[override]
        o, lse = flash_attention_forward(q, k, v, causal, window, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, window, scale)
        return o

    @staticmethod
    def backward(ctx, do: Tensor):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, window: int | None) -> None:
    check_float("flash_attention", q=q, k=k, v=v)
    check_qkv("flash_attention", q, k, v, window)
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise InputError(f"flash_attention: dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}; expected one dtype")


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, window: int | None = None,
                    scale: float | None = None) -> Tensor:
    """Exact attention (B, H, Tq, D) from q (B, H, Tq, D), k/v (B, Hkv, Tk, D); GQA when Hkv < H.

    ``window`` limits attention to keys with |q - k| < window (a sliding window, Mistral-style).
    Triton path: head dims up to 256 (64 and 128 are the tuned ones); CPU path: SDPA.
    """
    _check(q, k, v, window)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if q.shape[-1] <= 256 and scale > 0 and use_triton(q, op="flash_attention"):
        q, k, v = autocast_inputs(q, k, v)  # as SDPA under torch.autocast
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # kernels need unit-stride D
        try:
            return FlashAttentionFunction.apply(q, k, v, causal, window, scale)
        except BackendUnavailableError as e:  # no launch config compiled on this GPU for this shape
            warnings.warn(f"flash_attention: {e}; using the PyTorch reference", stacklevel=2)
    return reference.flash_attention(q, k, v, causal, window, scale)


class FlashAttention(nn.Module):
    """``forward(q, k, v)`` with fixed ``causal``/``window``/``scale``."""

    def __init__(self, causal: bool = False, window: int | None = None, scale: float | None = None):
        super().__init__()
        self.causal, self.window, self.scale = causal, window, scale

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return flash_attention(q, k, v, self.causal, self.window, self.scale)
