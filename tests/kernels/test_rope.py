from __future__ import annotations

import importlib

import pytest
import torch

from kernel_checks import check_against_reference
from torchnitro.errors import ShapeError
from torchnitro.kernels import RotaryEmbedding, reference, rope
from torchnitro.nn.models import apply_rope, rope_cache

SHAPES = [(2, 2, 8, 64), (3, 3, 7, 34)]  # (B, H, T, D)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_matches_reference(triton_cpu, shape, dtype):
    B, H, T, D = shape
    cos, sin = rope_cache(T, D)
    x = torch.randn(shape).to(dtype)
    check_against_reference(lambda a: rope(a, cos, sin), lambda a: reference.rope(a, cos, sin), [x], dtype)


def test_rope_on_transposed_view_and_per_batch_tables(triton_cpu):
    B, T, H, D = 2, 7, 3, 16
    x = torch.randn(B, T, H, D)
    cos, sin = torch.randn(B, T, D // 2), torch.randn(B, T, D // 2)
    check_against_reference(lambda a: rope(a.transpose(1, 2), cos, sin),
                            lambda a: reference.rope(a.transpose(1, 2), cos, sin), [x], torch.float32)


def test_reference_matches_model_rope(triton_cpu):
    cos, sin = rope_cache(7, 16)
    x = torch.randn(2, 3, 7, 16)
    torch.testing.assert_close(rope(x, cos, sin), apply_rope(x, cos, sin), atol=1e-5, rtol=1e-5)


def test_rotary_module_offset_and_bounds(triton_cpu):
    rot = RotaryEmbedding(16, max_seq_len=10)
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 1, 4, 16)
    q2, _ = rot(q, k, offset=3)
    torch.testing.assert_close(q2, reference.rope(q, rot.cos[3:7], rot.sin[3:7]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ShapeError, match="max_seq_len=10"):
        rot(q, k, offset=8)


def test_bad_table_shape(triton_cpu):
    with pytest.raises(ShapeError, match="slice the tables"):
        rope(torch.randn(1, 1, 5, 8), torch.randn(6, 4), torch.randn(6, 4))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rope_gpu(dtype):
    cos, sin = rope_cache(123, 128, device="cuda")
    x = torch.randn(5, 4, 123, 128, device="cuda", dtype=dtype)
    check_against_reference(lambda a: rope(a, cos, sin), lambda a: reference.rope(a, cos, sin), [x], dtype)


def test_rope_loops_over_head_blocks(triton_cpu):
    B, H, T, D = 1, 6, 3, 2048  # 1024-wide halves: 4 heads per block, so two head blocks per position
    cos, sin = rope_cache(T, D)
    check_against_reference(lambda a: rope(a, cos, sin), lambda a: reference.rope(a, cos, sin),
                            [torch.randn(B, H, T, D)], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_rope_one_launch_matches_reference(triton_cpu, dtype):
    """q and k with different head counts (GQA), k a transposed view, rotated together fwd and bwd."""
    from torchnitro.kernels import apply_rope as fused_apply_rope

    B, Hq, Hk, T, D = 2, 5, 3, 9, 34
    cos, sin = rope_cache(T, D)
    q = torch.randn(B, Hq, T, D).to(dtype)
    k = torch.randn(B, T, Hk, D).to(dtype)
    check_against_reference(lambda a, b: fused_apply_rope(a, b.transpose(1, 2), cos, sin),
                            lambda a, b: (reference.rope(a, cos, sin), reference.rope(b.transpose(1, 2), cos, sin)),
                            [q, k], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_every_launch_config_is_correct(triton_cpu, dtype):
    _check_every_config("cpu", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_launch_config_is_correct_gpu(dtype):
    _check_every_config("cuda", dtype)


def _check_every_config(device, dtype):
    """Each candidate pick_config may choose on the device gives the reference rotation, both ways."""
    from torchnitro.kernels.rope import candidates, rope_qk_forward

    B, Hq, Hk, T, D = 2, 9, 3, 37, 34  # head counts and T not multiples of HEADS / BLOCK_T
    cos, sin = torch.randn(B, T, D // 2), torch.randn(B, T, D // 2)
    q, k = torch.randn(B, Hq, T, D).to(dtype), torch.randn(B, Hk, T, D).to(dtype)
    want_q, want_k = reference.rope(q.float(), cos, sin), reference.rope(k.float(), cos, sin)
    back_q = reference.rope(q.float(), cos, -sin)  # rotation by -theta
    q, k, cos, sin = (t.to(device) for t in (q, k, cos, sin))
    tol = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
    for cfg in candidates(D):
        got_q, got_k = rope_qk_forward(q, k, cos, sin, 1, config=cfg)
        torch.testing.assert_close(got_q.float().cpu(), want_q, atol=tol, rtol=tol, msg=lambda m: f"{cfg}: {m}")
        torch.testing.assert_close(got_k.float().cpu(), want_k, atol=tol, rtol=tol, msg=lambda m: f"{cfg}: {m}")
        got_b, none = rope_qk_forward(q, None, cos, sin, -1, config=cfg)
        assert none is None
        torch.testing.assert_close(got_b.float().cpu(), back_q, atol=tol, rtol=tol, msg=lambda m: f"{cfg}: {m}")


def test_batches_beyond_the_grid_limit_are_sliced(triton_cpu, monkeypatch):
    mod = importlib.import_module("torchnitro.kernels.rope")  # the package re-exports the function as `rope`
    monkeypatch.setattr(mod, "_MAX_GRID_Z", 2)
    B, Hq, Hk, T, D = 5, 2, 1, 3, 8
    cos, sin = torch.randn(B, T, D // 2), torch.randn(B, T, D // 2)
    q, k = torch.randn(B, Hq, T, D), torch.randn(B, Hk, T, D)
    got_q, got_k = mod.rope_qk_forward(q, k, cos, sin)
    torch.testing.assert_close(got_q, reference.rope(q, cos, sin), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, reference.rope(k, cos, sin), atol=1e-5, rtol=1e-5)
