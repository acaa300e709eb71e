from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import ShapeError
from torchnitro.kernels import RMSNorm, reference, rms_norm

SHAPES = [(2, 8, 64), (3, 7, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_matches_reference(triton_cpu, shape, dtype):
    x, w = torch.randn(shape).to(dtype), (1 + 0.1 * torch.randn(shape[-1])).to(dtype)
    check_against_reference(lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: reference.rms_norm(a, b, 1e-6), [x, w],
                            dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_fused_residual(triton_cpu, shape):
    x, r, w = torch.randn(shape), torch.randn(shape), torch.randn(shape[-1])
    check_against_reference(lambda a, b, c: rms_norm(a, c, 1e-6, residual=b),
                            lambda a, b, c: reference.rms_norm(a, c, 1e-6, residual=b), [x, r, w], torch.float32)


def test_rms_norm_without_weight(triton_cpu):
    x = torch.randn(3, 7, 33)
    check_against_reference(lambda a: rms_norm(a, None), lambda a: reference.rms_norm(a, None), [x], torch.float32)


def test_module_matches_torch_rmsnorm(triton_cpu):
    ref = torch.nn.RMSNorm(33, eps=1e-6)
    torch.nn.init.normal_(ref.weight)
    m = RMSNorm(33, eps=1e-6)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(4, 33)
    torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)


def test_bad_weight_shape(triton_cpu):
    with pytest.raises(ShapeError, match=r"\(32,\).*expected \(33,\)"):
        rms_norm(torch.randn(2, 33), torch.randn(32))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rms_norm_gpu(dtype):
    x, r = (torch.randn(5, 123, 123, device="cuda", dtype=dtype) for _ in range(2))
    w = torch.randn(123, device="cuda", dtype=dtype)
    check_against_reference(lambda a, b, c: rms_norm(a, c, residual=b),
                            lambda a, b, c: reference.rms_norm(a, c, residual=b), [x, r, w], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_launch_config_is_correct(triton_cpu, dtype):
    _check_every_config("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_launch_config_is_correct_gpu(dtype):
    _check_every_config("cuda", dtype)


def _check_every_config(device, dtype):
    """Each candidate pick_config may choose on the device computes the reference result (with residual)."""
    from torchnitro.kernels.rms_norm import bwd_candidates, fwd_candidates, rms_norm_backward, rms_norm_forward

    N, C = 37, 33  # rows not a multiple of ROWS, and more rows than programs (each loops)
    x, r = torch.randn(N, C).to(dtype), torch.randn(N, C).to(dtype)
    w = (1 + 0.1 * torch.randn(C)).to(dtype)
    dy, dh = torch.randn(N, C).to(dtype), torch.randn(N, C).to(dtype)
    xr, rr, wr = (t.float().requires_grad_() for t in (x, r, w))
    yr, hr = reference.rms_norm(xr, wr, 1e-6, rr)
    torch.autograd.backward([yr, hr], [dy.float(), dh.float()])
    x, r, w, dy, dh = (t.to(device) for t in (x, r, w, dy, dh))
    atol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    for cfg in fwd_candidates(C):
        y, h, rstd = rms_norm_forward(x, w, 1e-6, r, config=cfg)
        torch.testing.assert_close(y.float().cpu(), yr.detach(), atol=atol, rtol=atol, msg=lambda m: f"{cfg}: {m}")
        torch.testing.assert_close(h.float().cpu(), hr.detach(), atol=atol, rtol=atol, msg=lambda m: f"{cfg}: {m}")
    for cfg in bwd_candidates(C):
        dx, dw = rms_norm_backward(dy, dh, h, w, rstd, config=cfg)
        assert dw.dtype == w.dtype
        for got, want in ((dx, xr.grad), (dw, wr.grad)):
            torch.testing.assert_close(got.float().cpu(), want, atol=atol * 4, rtol=atol * 4, msg=lambda m: f"{cfg}: {m}")
