"""Cross-entropy over a large vocabulary, and a chunked fused Linear + cross-entropy.

Forward per row (online log-sum-exp over V in blocks, Milakov & Gimelshein, 2018):
    lse = log sum_j exp(z_j);  loss = (1 - eps)(lse - z_t) + eps (lse - mean_j z_j)
Backward: dz_j = (softmax_j - (1 - eps) [j = t] - eps / V) * dloss_row; ignored rows get 0.

``fused_linear_cross_entropy`` never holds the (N, V) logits: it walks N in chunks, computes the
chunk's logits, overwrites them in place with their gradient, and folds that straight into dx and
dW (the Liger-Kernel FLCE scheme), so peak extra memory is one (chunk, V) block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError, ShapeError
from torchnitro.kernels import reference
from torchnitro.kernels._common import autocast_inputs, check_float
from torchnitro.kernels._triton import LazyKernel, next_pow2
from torchnitro.kernels.dispatch import use_triton

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = [
    "cross_entropy", "CrossEntropyLoss", "cross_entropy_forward", "cross_entropy_backward",
    "CrossEntropyFunction", "fused_linear_cross_entropy", "FusedLinearCrossEntropyLoss",
    "FusedLinearCrossEntropyFunction",
]


def _ce_fwd_kernel(z_ptr, stride, t_ptr, loss_ptr, lse_ptr, V, ignore_index, eps, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    zb = z_ptr + row * stride
    target = tl.load(t_ptr + row)
    m = tl.full((), -float("inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    zsum = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        z = tl.load(zb + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        zsum += tl.sum(tl.where(cols < V, z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    in_range = (target >= 0) & (target < V)
    zt = tl.load(zb + tl.where(in_range, target, 0)).to(tl.float32)  # never read outside the row
    loss = (1.0 - eps) * (lse - zt) + eps * (lse - zsum / V)
    loss = tl.where(in_range, loss, float("nan"))  # a bad class index shows up as NaN, not garbage
    loss = tl.where(target == ignore_index, 0.0, loss)
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)


def _ce_bwd_kernel(z_ptr, stride, dz_ptr, dz_stride, t_ptr, lse_ptr, dloss_ptr, dloss_stride, V, ignore_index,
                   eps, BLOCK: constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(t_ptr + row)
    lse = tl.load(lse_ptr + row)
    dl = tl.load(dloss_ptr + row * dloss_stride).to(tl.float32)
    dl = tl.where(target == ignore_index, 0.0, dl)
    for start in range(0, V, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < V
        z = tl.load(z_ptr + row * stride + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(z - lse) - eps / V - tl.where(cols == target, 1.0 - eps, 0.0)
        tl.store(dz_ptr + row * dz_stride + cols, (g * dl).to(dz_ptr.dtype.element_ty), mask=mask)


_fwd = LazyKernel(_ce_fwd_kernel)
_bwd = LazyKernel(_ce_bwd_kernel)


def _block(V: int) -> int:
    return min(next_pow2(V), 4096)


def cross_entropy_forward(logits: Tensor, target: Tensor, ignore_index: int, eps: float) -> tuple[Tensor, Tensor]:
    """Per-row (loss, lse), both fp32 (N,). ``logits`` rows may be strided; columns contiguous."""
    N, V = logits.shape
    loss = torch.empty(N, device=logits.device, dtype=torch.float32)
    lse = torch.empty_like(loss)
    if N:
        _fwd[(N,)](logits, logits.stride(0), target, loss, lse, V, ignore_index, eps, BLOCK=_block(V), num_warps=8)
    return loss, lse


def cross_entropy_backward(logits: Tensor, target: Tensor, lse: Tensor, dloss: Tensor, ignore_index: int,
                           eps: float, out: Tensor | None = None) -> Tensor:
    """dlogits (N, V); ``dloss`` is per row (N,) or a broadcast scalar; ``out=logits`` works in place."""
    N, V = logits.shape
    dz = torch.empty_like(logits) if out is None else out
    dloss = dloss.float().reshape(-1)
    if N:
        _bwd[(N,)](logits, logits.stride(0), dz, dz.stride(0), target, lse, dloss, 0 if dloss.numel() == 1 else 1,
                   V, ignore_index, eps, BLOCK=_block(V), num_warps=8)
    return dz


def _mean_factor(target: Tensor, ignore_index: int, reduction: str) -> Tensor:
    """d reduced / d row loss as a device scalar (no host sync): 1 / #non-ignored for 'mean', else 1.
    With every target ignored the mean is NaN (as in torch) and the gradient 0."""
    if reduction != "mean":
        return torch.ones((), device=target.device, dtype=torch.float32)
    n = (target != ignore_index).sum().float()
    return torch.where(n > 0, 1.0 / n.clamp(min=1.0), 0.0)


def _reduce(loss: Tensor, target: Tensor, ignore_index: int, reduction: str) -> tuple[Tensor, Tensor]:
    """(reduced loss, factor d reduced / d row loss)."""
    factor = _mean_factor(target, ignore_index, reduction)
    if reduction == "none":
        return loss, factor
    if reduction == "sum":
        return loss.sum(), factor
    return loss.sum() / (target != ignore_index).sum(), factor


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, ignore_index: int, reduction: str, eps: float):  # type: ignore[override]
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        loss, lse = cross_entropy_forward(logits, target, ignore_index, eps)
        out, factor = _reduce(loss, target, ignore_index, reduction)
        ctx.save_for_backward(logits, target, lse, factor)
        ctx.args = (ignore_index, reduction, eps)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        logits, target, lse, factor = ctx.saved_tensors
        ignore_index, reduction, eps = ctx.args
        dloss = dout if reduction == "none" else dout * factor
        return cross_entropy_backward(logits, target, lse, dloss, ignore_index, eps), None, None, None, None


def _check_ce(op: str, logits: Tensor, target: Tensor, reduction: str, label_smoothing: float, ignore_index: int,
              V: int) -> None:
    if logits.dim() != 2 or target.dim() != 1 or target.shape[0] != logits.shape[0]:
        raise ShapeError(
            f"{op}: received input {tuple(logits.shape)} and target {tuple(target.shape)}; expected (N, {V}) and "
            "(N,); flatten batch and sequence first (x.view(-1, x.shape[-1]), target.view(-1))"
        )
    if target.dtype not in (torch.int64, torch.int32):
        raise InputError(f"{op}: target has dtype {target.dtype}; expected int64 class indices")
    if reduction not in ("mean", "sum", "none"):
        raise InputError(f"{op}: reduction={reduction!r}; expected 'mean', 'sum' or 'none'")
    if not 0.0 <= label_smoothing < 1.0:
        raise InputError(f"{op}: label_smoothing={label_smoothing}; expected a value in [0, 1)")
    if target.is_cuda:  # checking needs a device sync; the kernels turn a bad index into a NaN loss instead
        return
    bad = (target != ignore_index) & ((target < 0) | (target >= V))
    if target.numel() and bool(bad.any()):
        t = target[bad][0].item()
        raise InputError(f"{op}: target holds class {t}; expected 0 <= target < {V} or ignore_index={ignore_index}")


def cross_entropy(logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0) -> Tensor:
    """Cross-entropy of ``logits`` (N, V) against class indices ``target`` (N,); returns fp32."""
    check_float("cross_entropy", logits=logits)
    _check_ce("cross_entropy", logits, target, reduction, label_smoothing, ignore_index, logits.shape[-1])
    if use_triton(logits, op="cross_entropy"):
        return CrossEntropyFunction.apply(logits, target, ignore_index, reduction, float(label_smoothing))
    return reference.cross_entropy(logits, target, ignore_index, reduction, label_smoothing)


def _flce_chunks(x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,
                 reduction: str, eps: float, chunk_size: int, accum_dtype: torch.dtype | None,
                 need: tuple[bool, bool, bool]) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(summed row losses, dx, dW, db) for a loss gradient of 1, walking N in row chunks.

    Memory beyond the inputs: dx (N, D) and dW (V, D) (the outputs), one (chunk, V) logits block (its
    gradient overwrites it in place and it is freed before the next chunk's block exists) and O(chunk)
    fp32 row statistics. dx rows are written by the GEMM straight into dx (no (chunk, D) temporary).
    """
    N, D = x.shape
    V = weight.shape[0]
    need_x, need_w, need_b = need
    dx = torch.empty_like(x) if need_x else None
    acc = accum_dtype or weight.dtype  # weight dtype (Liger's choice) keeps dW at the size of W
    # the first chunk writes dW instead of adding to it: no (V, D) zero fill and one (V, D) read fewer
    dw = (torch.empty(V, D, device=x.device, dtype=acc) if N else torch.zeros(V, D, device=x.device, dtype=acc)
          ) if need_w else None
    db = torch.zeros(V, device=x.device, dtype=acc) if need_b else None
    total = torch.zeros((), device=x.device, dtype=torch.float32)
    scale = _mean_factor(target, ignore_index, reduction)  # device scalar: no host sync per step
    for s in range(0, N, chunk_size):
        xc, tc = x[s:s + chunk_size], target[s:s + chunk_size]
        logits = xc @ weight.t()  # (chunk, V): the only vocab-sized block alive
        if bias is not None:
            logits += bias
        loss, lse = cross_entropy_forward(logits, tc, ignore_index, eps)
        total += loss.sum()
        if need_x or need_w or need_b:
            cross_entropy_backward(logits, tc, lse, scale, ignore_index, eps, out=logits)  # in place
            if dx is not None:
                torch.mm(logits, weight, out=dx[s:s + chunk_size])  # rows of a contiguous dx: a valid out=
            if dw is not None:
                if dw.dtype == logits.dtype:
                    if s == 0:
                        torch.mm(logits.t(), xc, out=dw)
                    else:
                        dw.addmm_(logits.t(), xc)
                elif s == 0:  # fp32 accumulation of low-precision chunks: one (V, D) temporary per chunk
                    dw.copy_(logits.t() @ xc)
                else:
                    dw += (logits.t() @ xc).to(dw.dtype)
            if db is not None:
                db += logits.sum(0, dtype=torch.float32).to(db.dtype)
        del logits, loss, lse  # free this block before the next chunk allocates its own
    return total, dx, dw, db


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Loss and all gradients computed in forward, chunk by chunk; backward only scales them.

    Exactly one (V, D) gradient buffer exists at any time: backward scales it in place by the
    incoming loss gradient, drops the context's reference and returns it, so autograd either adds
    it into an existing ``weight.grad`` in place or takes it over as ``.grad`` without a copy (a
    tensor still held by the context would be cloned). A second backward through a retained graph
    (``retain_graph=True``) recomputes the gradients from the saved inputs, so it stays exact.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int,  # type: ignore[override]
                reduction: str, eps: float, chunk_size: int, accum_dtype: torch.dtype | None):
        need = (x.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
        args = (ignore_index, reduction, eps, chunk_size, accum_dtype)
        total, dx, dw, db = _flce_chunks(x, weight, target, bias, *args, need)
        ctx.grads = (dx, dw, db)  # a plain attribute, not saved_tensors: backward must be able to release it
        ctx.save_for_backward(x, weight, target, bias)  # inputs only (no new memory); for a retained graph
        ctx.args, ctx.need, ctx.w_dtype = args, need, weight.dtype
        return total / (target != ignore_index).sum() if reduction == "mean" else total

    @staticmethod
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        grads, ctx.grads = ctx.grads, None
        if grads is None:  # retained graph, second pass: the first pass handed its buffers to autograd
            x, weight, target, bias = ctx.saved_tensors
            grads = _flce_chunks(x, weight, target, bias, *ctx.args, ctx.need)[1:]
        dx, dw, db = grads
        del grads
        if bool(dout != 1):  # loss.backward() passes exactly 1: skip a pass over the (V, D) buffer
            for g in (dx, dw, db):
                if g is not None:
                    g.mul_(dout)  # fp32 scalar, computed in fp32, stored in g.dtype
        if dw is not None and dw.dtype != ctx.w_dtype:  # fp32 accumulation (opt-in) returns the weight dtype
            dw = dw.to(ctx.w_dtype)
        if db is not None and db.dtype != ctx.w_dtype:
            db = db.to(ctx.w_dtype)
        return dx, dw, None, db, None, None, None, None, None


_MIN_ROWS = 192  # ~the rows per chunk at which a chunk's (V, D) traffic hides under its GEMM FLOPs (_chunk_size)
_BLOCK_SHARE = 15 / 16  # logit block <= this share of the input's bytes, when that leaves >= _MIN_ROWS rows
_ROW_MULTIPLE = 16  # chunk rows stay a multiple of the GEMM tile granularity


def _chunk_size(N: int, V: int, D: int = 4096, itemsize: int = 2) -> int:
    """Rows per chunk: the logit block (rows, V) stays below the input's size, but not under 192 rows.

    Two costs pull apart. Peak memory beyond dW and dx is the (rows, V) logit block, so fewer rows
    is leaner. But every chunk moves the whole (V, D) weight three times whatever its row count (W
    read by the logits GEMM and by the dx GEMM, dW read and written by the accumulating GEMM: about
    4 V D itemsize bytes) for 6 rows V D FLOPs, i.e. 0.75 rows FLOP/byte at bf16. H100/H200 bf16
    tensor cores need roughly 150-200 FLOP/byte to stay busy (a roofline estimate, not a measurement),
    so below ~200 rows a chunk waits on memory and the op slows about in proportion to the number of
    chunks.

    Policy: rows = the largest multiple of 16 whose block is at most 15/16 of the input's bytes
    (N D itemsize), but at least 192. Liger-Kernel sizes its block to about the input's size (rows
    rounded up to a power of two), so for a large input this keeps the peak below Liger's at about
    the same GEMM efficiency: N=8192, V=128k, D=4096 gives 240 rows (58.7 MiB block) where Liger
    uses 256 (62.6 MiB) and the previous rule here 1024 (250 MiB); expected cost versus 1024 rows:
    35 instead of 8 passes over (V, D), mostly hidden under the GEMMs. For a small input the floor
    wins: N=2048 gives 192 rows (47 MiB) where Liger uses 64 (16 MiB), a peak ~31 MiB above
    Liger's (beside ~1 GiB of dW) for a third of its (V, D) traffic. These are expectations; the
    times come from benchmarks/kernels.py on a GPU.
    """
    rows = int(N * D * _BLOCK_SHARE) // max(1, V)
    rows -= rows % _ROW_MULTIPLE
    return max(1, min(N, max(rows, _MIN_ROWS)))


def fused_linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                               ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                               chunk_size: int | None = None, grad_accum_dtype: torch.dtype | None = None
                               ) -> Tensor:
    """cross_entropy(x @ weight.T + bias, target) without materialising the (N, V) logits.

    x (N, D), weight (V, D), target (N,). ``reduction`` is 'mean' or 'sum' (per-row losses need the
    full logits' gradients, so 'none' is not supported by the fused path). dW accumulates over row
    chunks in ``grad_accum_dtype`` (default: the weight's dtype; ``torch.float32`` is more exact for
    bf16 weights and costs one (V, D) temporary per chunk).
    """
    check_float("fused_linear_cross_entropy", x=x, weight=weight, bias=bias)
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ShapeError(
            f"fused_linear_cross_entropy: x {tuple(x.shape)} and weight {tuple(weight.shape)}; expected (N, D) "
            "and (V, D); flatten the batch first"
        )
    _check_ce("fused_linear_cross_entropy", x, target, reduction, label_smoothing, ignore_index, weight.shape[0])
    if reduction == "none":
        raise InputError("fused_linear_cross_entropy: reduction='none'; expected 'mean' or 'sum'; use "
                         "cross_entropy(F.linear(x, w), target, reduction='none') for per-token losses")
    if use_triton(x, op="fused_linear_cross_entropy"):
        x, weight, bias = autocast_inputs(x, weight, bias)
        cs = chunk_size or _chunk_size(x.shape[0], weight.shape[0], x.shape[1], x.element_size())
        return FusedLinearCrossEntropyFunction.apply(x, weight, target, bias, ignore_index, reduction,
                                                     float(label_smoothing), int(cs), grad_accum_dtype)
    return reference.fused_linear_cross_entropy(x, weight, target, bias, ignore_index, reduction, label_smoothing)


class CrossEntropyLoss(nn.Module):
    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index, self.reduction, self.label_smoothing = ignore_index, reduction, label_smoothing

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(logits, target, self.ignore_index, self.reduction, self.label_smoothing)


class FusedLinearCrossEntropyLoss(nn.Module):
    """``forward(x, weight, target, bias=None)``: the LM head and the loss in one chunked op."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 chunk_size: int | None = None):
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.chunk_size = label_smoothing, chunk_size

    def forward(self, x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None) -> Tensor:
        return fused_linear_cross_entropy(x, weight, target, bias, self.ignore_index, self.reduction,
                                          self.label_smoothing, self.chunk_size)
