from __future__ import annotations

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.kernels import LayerNorm, layer_norm, reference

SHAPES = [(2, 8, 64), (3, 7, 33)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layer_norm_matches_reference(triton_cpu, shape, dtype):
    C = shape[-1]
    x = (torch.randn(shape) * 2 + 0.5).to(dtype)
    w, b = (1 + 0.1 * torch.randn(C)).to(dtype), (0.1 * torch.randn(C)).to(dtype)
    check_against_reference(lambda a, ww, bb: layer_norm(a, ww, bb), lambda a, ww, bb: reference.layer_norm(a, ww, bb),
                            [x, w, b], dtype)


def test_layer_norm_without_affine(triton_cpu):
    x = torch.randn(3, 7, 33)
    check_against_reference(lambda a: layer_norm(a), lambda a: reference.layer_norm(a, None, None), [x], torch.float32)


def test_module_loads_torch_layernorm_state(triton_cpu):
    ref = torch.nn.LayerNorm(33)
    torch.nn.init.normal_(ref.weight)
    torch.nn.init.normal_(ref.bias)
    m = LayerNorm(33)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(5, 33)
    torch.testing.assert_close(m(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_layer_norm_gpu(dtype):
    x = torch.randn(5, 123, 123, device="cuda", dtype=dtype)
    w, b = (torch.randn(123, device="cuda", dtype=dtype) for _ in range(2))
    check_against_reference(layer_norm, reference.layer_norm, [x, w, b], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_launch_config_is_correct(triton_cpu, dtype):
    _check_every_config("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_launch_config_is_correct_gpu(dtype):
    _check_every_config("cuda", dtype)


def _check_every_config(device, dtype):
    """Each candidate pick_config may choose on the device computes the reference result."""
    from torchnitro.kernels.layer_norm import (bwd_candidates, fwd_candidates, layer_norm_backward,
                                               layer_norm_forward)

    N, C = 37, 33  # rows not a multiple of ROWS, and more rows than programs (each loops)
    x = (torch.randn(N, C) * 2 + 0.5).to(dtype)
    w, b = (1 + 0.1 * torch.randn(C)).to(dtype), (0.1 * torch.randn(C)).to(dtype)
    dy = torch.randn(N, C).to(dtype)
    xr, wr, br = (t.float().requires_grad_() for t in (x, w, b))
    yr = reference.layer_norm(xr, wr, br)
    yr.backward(dy.float())
    x, w, b, dy = (t.to(device) for t in (x, w, b, dy))
    atol = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    for cfg in fwd_candidates(C):
        y, mean, rstd = layer_norm_forward(x, w, b, 1e-5, config=cfg)
        torch.testing.assert_close(y.float().cpu(), yr.detach(), atol=atol, rtol=atol, msg=lambda m: f"{cfg}: {m}")
    for cfg in bwd_candidates(C):
        dx, dw, db = layer_norm_backward(dy, x, w, mean, rstd, b.dtype, config=cfg)
        assert dw.dtype == w.dtype and db.dtype == b.dtype
        for got, want in ((dx, xr.grad), (dw, wr.grad), (db, br.grad)):
            torch.testing.assert_close(got.float().cpu(), want, atol=atol * 4, rtol=atol * 4, msg=lambda m: f"{cfg}: {m}")


def test_candidate_lists_start_with_the_default():
    from torchnitro.kernels.layer_norm import bwd_candidates, fwd_candidates

    for cands in (fwd_candidates(4096), bwd_candidates(4096)):
        assert cands[0]["ROWS"] == 1 and len(cands) > 3
        assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
