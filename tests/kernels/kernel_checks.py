"""Shared checks for the kernel tests: fused op vs its PyTorch reference, forward and gradients."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}  # (atol, rtol)
GRAD_SCALE = {torch.float32: 10.0, torch.float16: 2.0, torch.bfloat16: 2.0}  # grads accumulate more rounding


def _as_tuple(y):
    return y if isinstance(y, tuple) else (y,)


def check_against_reference(fn: Callable, ref: Callable, inputs: Sequence, dtype: torch.dtype,
                            grad: bool = True, tol_scale: float = 1.0,
                            out_dtype: torch.dtype | None = None) -> None:
    """Forward outputs and input gradients of ``fn`` match ``ref`` run in fp32 on the same values.

    Every output of ``fn`` must have ``out_dtype`` (default: the dtype of the first floating-point
    input, unless the op documents another) and the reference's shape.
    """
    atol, rtol = (t * tol_scale for t in TOL[dtype])
    xs = [x.detach().clone().requires_grad_(grad and x.is_floating_point()) if isinstance(x, torch.Tensor) else x
          for x in inputs]
    xr = [x.detach().float().clone().requires_grad_(grad and x.is_floating_point())
          if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs]
    want = out_dtype or next(x.dtype for x in inputs if isinstance(x, torch.Tensor) and x.is_floating_point())
    ys, yr = _as_tuple(fn(*xs)), _as_tuple(ref(*xr))
    assert len(ys) == len(yr), f"the fused op returned {len(ys)} outputs, the reference {len(yr)}"
    for i, (a, b) in enumerate(zip(ys, yr)):
        assert a.dtype == want, f"output {i}: dtype {a.dtype}, expected {want}"
        assert a.shape == b.shape, f"output {i}: shape {tuple(a.shape)}, expected {tuple(b.shape)}"
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)
    if not grad:
        return
    gs = [torch.randn_like(b) for b in yr]
    torch.autograd.backward(ys, [g.to(a.dtype) for a, g in zip(ys, gs)])
    torch.autograd.backward(yr, gs)
    g = GRAD_SCALE[dtype]
    checked = 0
    for a, b in zip(xs, xr):
        if isinstance(a, torch.Tensor) and a.requires_grad:
            assert a.grad is not None, "the fused op produced no gradient for an input that needs one"
            torch.testing.assert_close(a.grad.float(), b.grad.float(), atol=atol * g, rtol=rtol * g)
            checked += 1
    assert checked > 0
