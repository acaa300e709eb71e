from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import InputError, ShapeError
from torchnitro.kernels import cross_entropy, fused_linear_cross_entropy, reference


@pytest.mark.parametrize("N,V", [(16, 64), (7, 33)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cross_entropy_matches_reference(triton_cpu, N, V, reduction, dtype):
    logits = (2 * torch.randn(N, V)).to(dtype)
    target = torch.randint(0, V, (N,))
    target[1] = -100
    check_against_reference(lambda z: cross_entropy(z, target, reduction=reduction, label_smoothing=0.1),
                            lambda z: reference.cross_entropy(z, target, reduction=reduction, label_smoothing=0.1),
                            [logits], dtype, out_dtype=torch.float32)  # documented: the loss is fp32


@pytest.mark.parametrize("N,D,V", [(16, 32, 64), (7, 13, 33)])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_cross_entropy_matches_reference(triton_cpu, N, D, V, bias):
    x, w = torch.randn(N, D), torch.randn(V, D) / D ** 0.5
    b = torch.randn(V) if bias else None
    target = torch.randint(0, V, (N,))
    target[0] = -100
    inputs = [x, w] + ([b] if bias else [])
    check_against_reference(lambda *a: fused_linear_cross_entropy(a[0], a[1], target, *a[2:], chunk_size=3),
                            lambda *a: reference.fused_linear_cross_entropy(a[0], a[1], target, *a[2:]),
                            inputs, torch.float32, out_dtype=torch.float32)


def test_cross_entropy_bad_input(triton_cpu):
    with pytest.raises(InputError, match="target holds class 40"):
        cross_entropy(torch.randn(2, 33), torch.tensor([0, 40]))
    with pytest.raises(ShapeError, match="flatten"):
        cross_entropy(torch.randn(2, 3, 33), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(InputError, match="reduction='none'"):
        fused_linear_cross_entropy(torch.randn(2, 4), torch.randn(8, 4), torch.zeros(2, dtype=torch.long),
                                   reduction="none")


@pytest.mark.gpu
def test_fused_linear_cross_entropy_gpu_bf16():
    x = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(32000, 128, device="cuda", dtype=torch.bfloat16) / 11
    t = torch.randint(0, 32000, (256,), device="cuda")
    check_against_reference(lambda a, b: fused_linear_cross_entropy(a, b, t),
                            lambda a, b: reference.fused_linear_cross_entropy(a, b, t), [x, w], torch.bfloat16,
                            out_dtype=torch.float32)


@pytest.mark.parametrize("accum", [None, torch.float32])
def test_fused_linear_cross_entropy_fp16_grad_accumulation(triton_cpu, accum):
    N, D, V = 12, 16, 40
    x, w = torch.randn(N, D).half(), (torch.randn(V, D) / 4).half()
    target = torch.randint(0, V, (N,))
    check_against_reference(
        lambda a, b: fused_linear_cross_entropy(a, b, target, chunk_size=4, grad_accum_dtype=accum),
        lambda a, b: reference.fused_linear_cross_entropy(a, b, target), [x, w], torch.float16,
        out_dtype=torch.float32)


def test_loss_modules_match_torch(triton_cpu):
    from torchnitro.kernels import CrossEntropyLoss, FusedLinearCrossEntropyLoss

    x, w, t = torch.randn(10, 16), torch.randn(40, 16), torch.randint(0, 40, (10,))
    ref = torch.nn.CrossEntropyLoss(label_smoothing=0.05)(x @ w.t(), t)
    torch.testing.assert_close(CrossEntropyLoss(label_smoothing=0.05)(x @ w.t(), t), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(FusedLinearCrossEntropyLoss(label_smoothing=0.05, chunk_size=4)(x, w, t), ref,
                               atol=1e-5, rtol=1e-5)


def test_all_targets_ignored_gives_nan_like_torch(triton_cpu):
    z, t = torch.randn(4, 9), torch.full((4,), -100)
    assert torch.isnan(cross_entropy(z, t)) and torch.isnan(torch.nn.functional.cross_entropy(z, t))


def test_fused_linear_cross_entropy_follows_autocast(triton_cpu):
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(40, 16, requires_grad=True)
    t = torch.randint(0, 40, (8,))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = fused_linear_cross_entropy(x, w, t, chunk_size=3)
        ref = torch.nn.functional.cross_entropy(torch.nn.functional.linear(x, w).float(), t)
    torch.testing.assert_close(loss, ref, atol=2e-2, rtol=2e-2)
    loss.backward()
    assert w.grad.dtype == torch.float32 and torch.isfinite(w.grad).all()


def test_kernel_turns_bad_class_into_nan_without_reading_out_of_row(triton_cpu):
    import importlib

    ce = importlib.import_module("torchnitro.kernels.cross_entropy")
    z = torch.randn(3, 10)
    loss, _ = ce.cross_entropy_forward(z, torch.tensor([1, 10, -100]), -100, 0.0)  # 10 is out of range
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and loss[2] == 0


@pytest.mark.parametrize("grad_exists", [False, True])
def test_fused_linear_cross_entropy_keeps_one_vocab_sized_gradient_buffer(triton_cpu, grad_exists):
    """Backward scales dW in place and hands it to autograd: no (V, D) copy is made, whether autograd
    takes it over as .grad or adds it into an existing .grad (a buffer the context still held would
    be cloned, doubling peak memory at LM-head sizes)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    N, D, V = 8, 16, 40
    x = torch.randn(N, D, requires_grad=True)
    w = (torch.randn(V, D) / D ** 0.5).requires_grad_()
    t = torch.randint(0, V, (N,))
    if grad_exists:
        w.grad = torch.zeros(V, D)

    class CountVD(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            new_alloc = all(r.alias_info is None for r in func._schema.returns)  # not a view, in-place or out=
            CountVD.made += sum(isinstance(o, torch.Tensor) and tuple(o.shape) == (V, D) for o in outs) * new_alloc
            return out

    want = torch.func.grad(lambda w_: reference.fused_linear_cross_entropy(x.detach(), w_, t) * 0.37)(w.detach())
    with CountVD():
        (fused_linear_cross_entropy(x, w, t, chunk_size=3) * 0.37).backward()
    assert CountVD.made == 1, f"{CountVD.made} (V, D) buffers allocated; expected only dW"
    torch.testing.assert_close(w.grad, want, atol=1e-5, rtol=1e-4)


def test_fused_linear_cross_entropy_retained_graph_backward_twice(triton_cpu):
    """The first backward hands its buffers to autograd; a second one through a retained graph
    recomputes them, so the accumulated gradients are exactly twice the reference's."""
    N, D, V = 7, 13, 33
    x, w = torch.randn(N, D, requires_grad=True), (torch.randn(V, D) / D ** 0.5).requires_grad_()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    t = torch.randint(0, V, (N,))
    loss = fused_linear_cross_entropy(x, w, t, chunk_size=3)
    ref = reference.fused_linear_cross_entropy(xr, wr, t)
    for g in (torch.tensor(0.5), torch.tensor(-2.0)):
        loss.backward(g, retain_graph=True)
        ref.backward(g, retain_graph=True)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("grad_exists", [False, True])
def test_fused_linear_cross_entropy_peak_memory_gpu(grad_exists):
    """fwd + bwd holds at most dW + dx + one (chunk, V) logits block (+ 8 MiB of row statistics and
    allocator rounding) beyond the inputs and existing grads; the eager op holds the (N, V) logits in
    fp32 several times. Memory is deterministic, so this is an exact budget, not a timing."""
    N, D, V, chunk = 1024, 1024, 32768, 256
    x = torch.randn(N, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, D, device="cuda") / 32).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda")
    fused_linear_cross_entropy(x, w, t, chunk_size=chunk).backward()  # warm-up: cuBLAS workspaces, kernels
    x.grad = w.grad = None
    if grad_exists:
        x.grad, w.grad = torch.zeros_like(x), torch.zeros_like(w)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fused_linear_cross_entropy(x, w, t, chunk_size=chunk)
    loss.backward(torch.tensor(0.5, device="cuda"))  # not 1: the in-place scaling path
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    budget = 2 * (V * D + N * D + chunk * V) + (8 << 20)
    assert extra <= budget, f"peak {extra / 2**20:.1f} MiB above the inputs; budget {budget / 2**20:.1f} MiB"


def test_flce_chunk_policy_keeps_the_block_below_liger_for_large_inputs():
    """x(8192, 4096) W(128256, 4096) bf16: the logit block is below Liger's (256 rows, its rule: the next power of
    two of N / ceil(V / D)) and stays >= 192 rows; small inputs keep the 192-row floor; never more rows than N."""
    from torchnitro.kernels.cross_entropy import _chunk_size

    N, V, D = 8192, 128256, 4096
    liger_rows = 1 << (-(-N // -(-V // D)) - 1).bit_length()
    assert liger_rows == 256
    rows = _chunk_size(N, V, D, 2)
    assert 192 <= rows < liger_rows and rows % 16 == 0
    assert _chunk_size(2048, V, D, 2) == 192
    assert _chunk_size(16384, V, D, 2) < 512  # Liger: 512 rows
    assert _chunk_size(5, V, D, 2) == 5
