"""Linear + bias + GELU, three ways:
    z = x W^T + b;  y = gelu(z)     (x (M, K), W (N, K), b (N,))

``linear_gelu`` (the default, fwd + bwd): cuBLAS GEMM with the bias in its epilogue (``addmm``),
then one Triton GELU pass; backward is one Triton GELU-backward pass that overwrites z with dz in
place, then cuBLAS for dx = dz W, dW = dz^T x, db = sum dz. Same kernels as eager
``gelu(linear(x))`` but a faster elementwise pass and one (M, N) buffer less in backward.
``linear_gelu_triton_gemm``: a Triton GEMM whose epilogue adds the bias and applies GELU (one
kernel forward, also writes z for backward). It saves the (M, N) round trip but its GEMM is slower
than cuBLAS at LLM shapes (results/kernels_nvidia_h200.md: 0.90x eager), so it is not the default.
``linear_gelu_epilogue``: forward only, tanh GELU, one cuBLASLt kernel
(``torch._addmm_activation(..., use_gelu=True)`` uses CUBLASLT_EPILOGUE_GELU_BIAS, the tanh
approximation); ``linear_gelu`` uses it for inference with ``approximate='tanh'`` on CUDA.
Triton tile loop and grouped program order follow the Triton matmul tutorial (L2 reuse).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from torchnitro.errors import InputError, ShapeError
from torchnitro.kernels import reference
from torchnitro.kernels._common import autocast_inputs, check_approximate, check_float
from torchnitro.kernels._triton import LazyKernel, cdiv
from torchnitro.kernels.dispatch import use_triton
from torchnitro.kernels.gelu import gelu_backward, gelu_forward

if TYPE_CHECKING:  # kernels get `tl` when first jitted (LazyKernel), so importing this module stays cheap
    import triton.language as tl
    from triton.language import constexpr

__all__ = ["linear_gelu", "FusedLinearGELU", "linear_gelu_forward", "linear_gelu_backward", "LinearGeluFunction",
           "linear_gelu_triton_gemm", "LinearGeluTritonGemmFunction", "linear_gelu_epilogue"]


def _linear_gelu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, z_ptr, M, N, K, sxm, sxk, swn, swk, sym,
                        HAS_BIAS: constexpr, APPROX: constexpr, STORE_Z: constexpr, PREC: constexpr,
                        BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_K: constexpr, GROUP_M: constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * sxm + kk[None, :] * sxk,
                    mask=(offs_m[:, None] < M) & (kk[None, :] < K), other=0.0)
        bt = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * swn + kk[:, None] * swk,
                     mask=(offs_n[None, :] < N) & (kk[:, None] < K), other=0.0)  # (BLOCK_K, BLOCK_N) = W^T tile
        acc = tl.dot(a, bt, acc, input_precision=PREC)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    out = offs_m[:, None].to(tl.int64) * sym + offs_n[None, :]
    omask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if STORE_Z:
        tl.store(z_ptr + out, acc.to(z_ptr.dtype.element_ty), mask=omask)
    if APPROX:
        t = 2.0 / (1.0 + tl.exp(tl.minimum(-1.5957691216057308 * (acc + 0.044715 * acc * acc * acc), 80.0))) - 1.0
        y = 0.5 * acc * (1.0 + t)
    else:
        y = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
    tl.store(y_ptr + out, y.to(y_ptr.dtype.element_ty), mask=omask)


def _configs() -> list:
    """Autotune configs (called on first launch, so triton is imported only when a kernel runs)."""
    import triton

    shapes = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 32, 4, 4),
              (64, 64, 32, 4, 5), (256, 128, 64, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_warps=w, num_stages=s)
            for m, n, k, w, s in shapes]


_kernel = LazyKernel(_linear_gelu_kernel, _configs, key=["M", "N", "K"],
                     interpret_kwargs={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2})


def linear_gelu_forward(x2: Tensor, weight: Tensor, bias: Tensor | None, approximate: str, store_z: bool
                        ) -> tuple[Tensor, Tensor | None]:
    """x2 (M, K) -> (y (M, N), z (M, N) or None)."""
    M, K = x2.shape
    N = weight.shape[0]
    y = torch.empty(M, N, device=x2.device, dtype=x2.dtype)
    z = torch.empty_like(y) if store_z else None
    if M and N:
        grid = lambda meta: (cdiv(M, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
        _kernel[grid](x2, weight, bias if bias is not None else x2, y, z if z is not None else y, M, N, K,
                      x2.stride(0), x2.stride(1), weight.stride(0), weight.stride(1), y.stride(0),
                      HAS_BIAS=bias is not None, APPROX=approximate == "tanh", STORE_Z=store_z,
                      PREC="ieee" if x2.dtype == torch.float32 else "tf32")
    return y, z


def linear_gelu_backward(dy: Tensor, x2: Tensor, weight: Tensor, z: Tensor, approximate: str, need_bias: bool
                         ) -> tuple[Tensor, Tensor, Tensor | None]:
    dz = gelu_backward(dy, z, approximate)  # (M, N)
    dx = dz @ weight
    dw = dz.t() @ x2
    db = dz.sum(0) if need_bias else None  # accumulates in fp32 inside, like eager addmm backward: no fp32 (N,) buffer
    return dx, dw, db


class LinearGeluTritonGemmFunction(torch.autograd.Function):
    """The single-kernel Triton GEMM + bias + GELU forward (stores z); backward as ``linear_gelu_backward``."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str) -> Tensor:  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        y, z = linear_gelu_forward(x2, weight, bias, approximate, store_z=True)
        ctx.save_for_backward(x2, weight, z)
        ctx.approximate, ctx.has_bias, ctx.x_shape = approximate, bias is not None, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x2, weight, z = ctx.saved_tensors
        dx, dw, db = linear_gelu_backward(dy.reshape(z.shape).contiguous(), x2, weight, z, ctx.approximate,
                                          ctx.has_bias)
        return dx.view(ctx.x_shape), dw, db, None


def _gemm_bias(x2: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """z = x2 W^T + b as one cuBLAS call (the bias rides in the GEMM epilogue)."""
    return torch.addmm(bias, x2, weight.t()) if bias is not None else x2 @ weight.t()  # (M, N)


class LinearGeluFunction(torch.autograd.Function):
    """cuBLAS GEMM + bias, Triton GELU; backward turns the saved z into dz in place.

    A second backward through a retained graph finds z spent and recomputes it (one more GEMM).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str) -> Tensor:  # type: ignore[override]
        x2 = x.reshape(-1, x.shape[-1])
        z = _gemm_bias(x2, weight, bias).contiguous()  # (M, N) pre-activation, kept for backward
        y = gelu_forward(z, approximate)
        ctx.save_for_backward(x2, weight, bias, z)
        ctx.approximate, ctx.x_shape, ctx.z_spent = approximate, x.shape, False
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: Tensor):  # type: ignore[override]
        x2, weight, bias, z = ctx.saved_tensors
        if ctx.z_spent:  # an earlier backward of this retained graph overwrote z with its dz
            z = _gemm_bias(x2, weight, bias).contiguous()
        ctx.z_spent = True
        dz = gelu_backward(dy.reshape(z.shape), z, ctx.approximate, out=z)  # (M, N) written over z: no new buffer
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        dx = (dz @ weight).view(ctx.x_shape) if need_x else None
        dw = dz.t() @ x2 if need_w else None
        db = dz.sum(0) if need_b else None  # fp32 accumulation inside the reduction, as eager; no fp32 copy
        return dx, dw, db, None


def _check(op: str, x: Tensor, weight: Tensor, bias: Tensor | None, approximate: str) -> None:
    check_float(op, x=x, weight=weight, bias=bias)
    check_approximate(op, approximate)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1] or (bias is not None and bias.shape != weight.shape[:1]):
        raise ShapeError(
            f"{op}: x {tuple(x.shape)}, weight {tuple(weight.shape)}, bias "
            f"{None if bias is None else tuple(bias.shape)}; expected x (..., K), weight (N, K), bias (N,)"
        )


def _needs_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _epilogue(x2: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    return torch._addmm_activation(bias, x2, weight.t(), use_gelu=True)  # tanh GELU in the cuBLASLt epilogue


def linear_gelu(x: Tensor, weight: Tensor, bias: Tensor | None = None, approximate: str = "none") -> Tensor:
    """gelu(x @ weight.T + bias); x (..., K), weight (N, K). cuBLAS GEMM with the bias in its epilogue,
    then Triton GELU (in place when no gradient is needed; tanh inference on CUDA: one cuBLASLt kernel)."""
    _check("linear_gelu", x, weight, bias, approximate)
    if not use_triton(x, op="linear_gelu"):
        return reference.linear_gelu(x, weight, bias, approximate)
    x, weight, bias = autocast_inputs(x, weight, bias)
    if _needs_grad(x, weight, bias):
        return LinearGeluFunction.apply(x, weight, bias, approximate)
    x2 = x.reshape(-1, x.shape[-1])
    out_shape = (*x.shape[:-1], weight.shape[0])
    if approximate == "tanh" and bias is not None and x.is_cuda:
        try:
            return _epilogue(x2, weight, bias).view(out_shape)
        except RuntimeError as e:  # an auto-chosen fast path: fall back, once loudly, never crash the model
            warnings.warn(f"linear_gelu: the cuBLASLt GELU epilogue failed ({e}); using GEMM + Triton GELU",
                          stacklevel=2)
    z = _gemm_bias(x2, weight, bias).contiguous()
    return gelu_forward(z, approximate, out=z).view(out_shape)


def linear_gelu_triton_gemm(x: Tensor, weight: Tensor, bias: Tensor | None = None, approximate: str = "none"
                            ) -> Tensor:
    """``linear_gelu`` as one Triton GEMM with bias + GELU in its epilogue (benchmark variant; slower than
    cuBLAS at large shapes, see the module docstring). Falls back to the reference where Triton is off."""
    _check("linear_gelu_triton_gemm", x, weight, bias, approximate)
    if not use_triton(x, op="linear_gelu"):
        return reference.linear_gelu(x, weight, bias, approximate)
    x, weight, bias = autocast_inputs(x, weight, bias)
    if _needs_grad(x, weight, bias):
        return LinearGeluTritonGemmFunction.apply(x, weight, bias, approximate)
    y, _ = linear_gelu_forward(x.reshape(-1, x.shape[-1]), weight, bias, approximate, store_z=False)
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_gelu_epilogue(x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """Forward-only gelu_tanh(x @ weight.T + bias) as one cuBLASLt GEMM with a GELU+bias epilogue.

    The epilogue computes the tanh approximation only, and torch gives it no backward: call it under
    ``torch.no_grad()`` (``linear_gelu`` chooses it by itself for tanh inference on CUDA). On CUDA torch
    runs CUBLASLT_EPILOGUE_GELU_BIAS or, where cuBLASLt is off, ``gelu_(approximate='tanh')``; off CUDA
    this is the reference with ``approximate='tanh'``.
    """
    _check("linear_gelu_epilogue", x, weight, bias, "tanh")
    if bias is None:
        raise InputError("linear_gelu_epilogue: bias is None; expected a (N,) bias (the epilogue adds it); "
                         "use linear_gelu for a bias-free layer")
    if _needs_grad(x, weight, bias):
        raise InputError("linear_gelu_epilogue: an input requires grad; expected inference (the cuBLASLt "
                         "epilogue has no backward); wrap the call in torch.no_grad() or use linear_gelu")
    if not x.is_cuda:  # torch's CPU kernel of the same op applies exact (erf) GELU: keep the tanh meaning
        return reference.linear_gelu(x, weight, bias, "tanh")
    x, weight, bias = autocast_inputs(x, weight, bias)
    return _epilogue(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


class FusedLinearGELU(nn.Linear):
    """``nn.Linear`` followed by GELU, as one fused op; same parameters as ``nn.Linear`` (loads its state dict)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, approximate: str = "none",
                 device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        check_approximate("FusedLinearGELU", approximate)
        self.approximate = approximate

    @classmethod
    def from_linear(cls, linear: nn.Linear, approximate: str = "none") -> FusedLinearGELU:
        """Wrap an existing Linear, sharing its parameters."""
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        m.in_features, m.out_features, m.approximate = linear.in_features, linear.out_features, approximate
        m.weight, m.bias = linear.weight, linear.bias
        return m

    def forward(self, x: Tensor) -> Tensor:
        return linear_gelu(x, self.weight, self.bias, self.approximate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, approximate={self.approximate!r}"
