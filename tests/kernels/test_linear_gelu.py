from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import InputError, ShapeError
from torchnitro.kernels import FusedLinearGELU, linear_gelu, reference
from torchnitro.kernels.linear_gelu import linear_gelu_epilogue, linear_gelu_triton_gemm


@pytest.mark.parametrize("shape,N", [((2, 8, 64), 48), ((3, 7, 33), 20)])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("op", [linear_gelu, linear_gelu_triton_gemm])
def test_linear_gelu_matches_reference(triton_cpu, shape, N, approximate, bias, op):
    K = shape[-1]
    x, w = torch.randn(shape), torch.randn(N, K) / K ** 0.5
    inputs = [x, w] + ([torch.randn(N)] if bias else [])
    check_against_reference(lambda a, b, *c: op(a, b, *(c or [None]), approximate),
                            lambda a, b, *c: reference.linear_gelu(a, b, *(c or [None]), approximate), inputs,
                            torch.float32)


def test_linear_gelu_fp16_inference(triton_cpu):
    x, w, b = torch.randn(3, 7, 33).half(), (torch.randn(20, 33) / 6).half(), torch.randn(20).half()
    with torch.no_grad():
        torch.testing.assert_close(linear_gelu(x, w, b).float(), reference.linear_gelu(x.float(), w.float(), b.float()),
                                   atol=2e-2, rtol=2e-2)


def test_module_shares_linear_parameters(triton_cpu):
    lin = torch.nn.Linear(33, 20)
    m = FusedLinearGELU.from_linear(lin)
    assert m.weight is lin.weight and m.bias is lin.bias
    x = torch.randn(4, 33)
    torch.testing.assert_close(m(x), torch.nn.functional.gelu(lin(x)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ShapeError, match="expected x"):
        linear_gelu(torch.randn(4, 32), lin.weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("op", [linear_gelu, linear_gelu_triton_gemm])
def test_linear_gelu_gpu(dtype, op):
    x = torch.randn(5, 123, 256, device="cuda", dtype=dtype)
    w = (torch.randn(384, 256, device="cuda") / 16).to(dtype)
    b = torch.randn(384, device="cuda", dtype=dtype)
    check_against_reference(op, reference.linear_gelu, [x, w, b], dtype, tol_scale=2.0)
    with torch.no_grad():  # inference: GELU in place over the GEMM output (tanh: the cuBLASLt epilogue)
        for approximate in ("none", "tanh"):
            torch.testing.assert_close(op(x, w, b, approximate).float(),
                                       reference.linear_gelu(x.float(), w.float(), b.float(), approximate),
                                       atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_linear_gelu_epilogue_is_tanh_gelu_gpu():
    x = torch.randn(5, 123, 256, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(384, 256, device="cuda") / 16).to(torch.bfloat16)
    b = torch.randn(384, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = linear_gelu_epilogue(x, w, b).float()
    want = reference.linear_gelu(x.float(), w.float(), b.float(), "tanh")
    torch.testing.assert_close(y, want, atol=3e-2, rtol=3e-2)


def test_linear_gelu_follows_autocast(triton_cpu):
    lin = torch.nn.Linear(33, 20)
    x = torch.randn(3, 33, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.float16):
        y = linear_gelu(x, lin.weight, lin.bias)
        ref = torch.nn.functional.gelu(lin(x))
    assert y.dtype == ref.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref.float(), atol=2e-2, rtol=2e-2)
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_linear_gelu_epilogue_off_cuda_is_tanh_and_forward_only():
    x, w, b = torch.randn(4, 16), torch.randn(12, 16) / 4, torch.randn(12)
    with torch.no_grad():  # torch's CPU _addmm_activation would apply erf GELU: ours must stay tanh
        torch.testing.assert_close(linear_gelu_epilogue(x, w, b), reference.linear_gelu(x, w, b, "tanh"))
    with pytest.raises(InputError, match="no_grad"):
        linear_gelu_epilogue(x.requires_grad_(), w, b)
    with pytest.raises(InputError, match="bias is None"):
        linear_gelu_epilogue(x, w, None)


def test_linear_gelu_backward_reuses_the_preactivation_buffer(triton_cpu):
    """dz overwrites the saved z in place: backward allocates no (M, N) buffer (the old path allocated
    dz beside z, one activation-sized buffer more than eager at peak)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    M, K, N = 6, 16, 24
    x, w, b = torch.randn(M, K, requires_grad=True), (torch.randn(N, K) / 4).requires_grad_(), torch.randn(N)
    y = linear_gelu(x, w, b.requires_grad_())
    dy = torch.randn(M, N)

    class CountMN(TorchDispatchMode):
        made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else (out,)
            new_alloc = all(r.alias_info is None for r in func._schema.returns)  # not a view, in-place or out=
            CountMN.made += sum(isinstance(o, torch.Tensor) and tuple(o.shape) == (M, N) for o in outs) * new_alloc
            return out

    with CountMN():
        y.backward(dy)
    assert CountMN.made == 0, f"backward allocated {CountMN.made} (M, N) buffers; expected none"
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    reference.linear_gelu(xr, wr, br).backward(dy)
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad), (b.grad, br.grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_linear_gelu_retained_graph_backward_twice(triton_cpu):
    """The first backward spends z; a second one through the retained graph recomputes it."""
    x, w = torch.randn(5, 16, requires_grad=True), (torch.randn(12, 16) / 4).requires_grad_()
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y, yr = linear_gelu(x, w, None, "tanh"), reference.linear_gelu(xr, wr, None, "tanh")
    for _ in range(2):
        dy = torch.randn_like(y)
        y.backward(dy, retain_graph=True)
        yr.backward(dy, retain_graph=True)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w.grad, wr.grad, atol=1e-5, rtol=1e-4)


def test_linear_gelu_epilogue_failure_falls_back_with_one_warning(triton_cpu, monkeypatch):
    """tanh inference on CUDA tries the cuBLASLt epilogue; if torch refuses it, the GEMM + Triton GELU
    path answers instead (faked here: CPU tensors that claim to be CUDA, an epilogue that raises)."""
    import importlib

    lg = importlib.import_module("torchnitro.kernels.linear_gelu")

    def refuse(*a):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(lg, "_epilogue", refuse)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
    with pytest.warns(UserWarning, match="epilogue failed"), torch.no_grad():
        y = lg.linear_gelu(x, w, b, "tanh")
    monkeypatch.undo()
    torch.testing.assert_close(y, reference.linear_gelu(x, w, b, "tanh"), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_linear_gelu_peak_memory_not_above_eager_gpu():
    """fwd + bwd peak (deterministic allocator bytes, not a timing) is at most eager gelu(linear(x))'s:
    same GEMM outputs, and dz reuses z's buffer."""
    M, K, N = 1024, 1024, 4096

    def peak(op) -> int:
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(N, K, device="cuda") / 32).to(torch.bfloat16).requires_grad_()
        b = torch.zeros(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        op(x, w, b).backward(dy)  # warm-up: workspaces, kernels
        x.grad = w.grad = b.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        op(x, w, b).backward(dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    ours, eager = peak(linear_gelu), peak(reference.linear_gelu)
    assert ours <= eager, f"linear_gelu peak {ours / 2**20:.1f} MiB > eager {eager / 2**20:.1f} MiB"
