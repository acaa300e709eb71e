"""Fused paths against their unfused references (torch backend, and Triton under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.hrr._interpreted import run_interpreted
from torchnitro.errors import BackendUnavailableError, InputError, ShapeError
from torchnitro.hrr import fused, mkl_fft
from torchnitro.hrr import ops as h

TOL = {torch.float32: 2e-5, torch.float64: 1e-12}


def _pairs(batch, k, d, dtype=torch.float32, seed=0):
    return h.random((2, *batch, k), d, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.fixture(params=["mkl", "torch.fft"])
def transforms(request, monkeypatch):
    """The CPU spectral sum through MKL's kept descriptors (where this build has them) and through torch.fft."""
    if request.param == "mkl" and not mkl_fft.mkl_available():
        pytest.skip(f"no MKL DFTI here: {mkl_fft._library()[1]}")
    if request.param == "torch.fft":
        monkeypatch.setattr(mkl_fft, "mkl_available", lambda: False)
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [((3,), 4, 64), ((2, 5), 3, 63), ((), 1, 17)])
@pytest.mark.parametrize("normalized", [False, True])
def test_bind_superpose_torch_matches_reference(dtype, shape, normalized, transforms):
    batch, k, d = shape
    keys, values = _pairs(batch, k, d, dtype)
    w = torch.rand(*batch, k, dtype=dtype)
    for weights in (None, w):
        got = fused.bind_superpose(keys, values, weights, normalized=normalized, backend="torch")
        want = fused.bind_superpose_reference(keys, values, weights, normalized=normalized)
        assert got.shape == (*batch, d)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("s1,s2", [((3, 4), (4,)), ((1, 4), (5, 1)), ((), (2, 3)), ((0, 3), (1, 3)), ((2, 3), (3, 3)),
                                   ((2, 1, 4), (3, 1))])
def test_broadcast_matches_torch(s1, s2):
    try:
        want = torch.broadcast_shapes(s1, s2)
    except RuntimeError:
        want = None
    assert fused._broadcast(torch.Size(s1), torch.Size(s2)) == want


def test_shared_roles_broadcast_over_batch():
    roles = h.unitary(4, 32, generator=torch.Generator().manual_seed(1))  # (k, d)
    fillers = h.random((6, 4), 32, generator=torch.Generator().manual_seed(2))  # (B, k, d)
    got = fused.bind_superpose(roles, fillers)
    torch.testing.assert_close(got, h.bind(roles, fillers).sum(-2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [64, 33])
def test_bind_normalize(dtype, d):
    a, b = h.random((2, 5), d, generator=torch.Generator().manual_seed(3), dtype=dtype)
    got = fused.bind_normalize(a, b, backend="torch")
    torch.testing.assert_close(got, h.normalize(h.bind(a, b)), atol=TOL[dtype], rtol=0)
    torch.testing.assert_close(fused._parseval_norm(torch.fft.rfft(a), d).squeeze(-1), a.norm(dim=-1))


_INTERPRETED = r"""
import torch
from torchnitro.hrr import fused, ops as h
for batch, k, d in [((3,), 4, 64), ((2,), 3, 63), ((1,), 2, 2100)]:  # 2100: two 1024-bin blocks
    keys, values = h.random((2, *batch, k), d, generator=torch.Generator().manual_seed(4))
    w = torch.rand(*batch, k)
    for normalized in (False, True):
        got = fused.bind_superpose(keys, values, w, normalized=normalized, backend="triton")
        want = fused.bind_superpose_reference(keys, values, w, normalized=normalized)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    roles = keys[0]  # (k, d) shared across the batch: stride-0 broadcast in the kernel
    got = fused.bind_superpose(roles, values, backend="triton")
    torch.testing.assert_close(got, h.bind(roles, values).sum(-2), atol=2e-5, rtol=0)
    a, b = keys[..., 0, :], values[..., 0, :]
    torch.testing.assert_close(fused.bind_normalize(a, b, backend="triton"), h.normalize(h.bind(a, b)),
                               atol=2e-5, rtol=0)
print("ok")
"""


def test_triton_kernel_matches_reference_interpreted():
    run_interpreted(_INTERPRETED)


def test_backend_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    keys, values = _pairs((2,), 3, 16)
    with pytest.raises(BackendUnavailableError, match="backend='auto'"):
        fused.bind_superpose(keys, values, backend="triton")
    with pytest.raises(InputError, match="'cuda-fast'"):
        fused.bind_superpose(keys, values, backend="cuda-fast")
    with pytest.raises(ShapeError, match=r"expected \(\.\.\., 3\)"):
        fused.bind_superpose(keys, values, torch.ones(2))
    with pytest.raises(ShapeError, match="do not broadcast"):
        fused.bind_superpose(keys, h.random((3, 3), 16))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [1024, 1023])
def test_triton_on_gpu_matches_torch(d):
    keys, values = _pairs((100,), 8, d, seed=5)
    keys, values = keys.cuda(), values.cuda()
    for normalized in (False, True):
        got = fused.bind_superpose(keys, values, normalized=normalized, backend="triton")
        want = fused.bind_superpose(keys, values, normalized=normalized, backend="torch")
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(fused.bind_normalize(keys[:, 0], values[:, 0], backend="triton"),
                               h.normalize(h.bind(keys[:, 0], values[:, 0])), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("normalized", [False, True])
def test_blocked_cpu_path_matches_reference(monkeypatch, dtype, normalized, transforms):
    monkeypatch.setattr(fused, "_BLOCK_BYTES", 2048)  # force many small blocks
    keys, values = _pairs((2, 7), 3, 65, dtype, seed=6)  # two batch dims, odd d
    w = torch.rand(2, 7, 3, dtype=dtype)
    assert fused._blocked_applies(keys, values, torch.Size((2, 7, 3)), kept=False)
    for k_in, weights in ((keys, w), (keys[0, 0], None), (keys[0, 0], torch.rand(3, dtype=dtype))):
        got = fused.bind_superpose(k_in, values, weights, normalized=normalized, backend="torch")
        want = fused.bind_superpose_reference(k_in, values, weights, normalized=normalized)
        assert got.shape == (2, 7, 65)
        torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=0)


def test_kept_descriptors_block_even_small_batches(monkeypatch, transforms):
    calls = []
    real = fused._blocked_spectral_sum
    monkeypatch.setattr(fused, "_blocked_spectral_sum", lambda *a: calls.append(a[3]) or real(*a))
    keys, values = _pairs((3,), 4, 64, seed=9)
    got = fused.bind_superpose(keys, values, backend="torch")
    torch.testing.assert_close(got, fused.bind_superpose_reference(keys, values), atol=TOL[torch.float32], rtol=0)
    # through torch.fft a block costs a descriptor commit per call, so only large batches are blocked
    assert calls == ([torch.Size((3, 4))] if transforms == "mkl" else [])


@pytest.mark.parametrize("blocked", [False, True])
def test_bind_superpose_gradients_take_torch_fft(monkeypatch, blocked):
    # MKL's transforms have no backward: with any input requiring grad the spectral sum uses torch.fft
    if blocked:
        monkeypatch.setattr(fused, "_BLOCK_BYTES", 256)
    keys, values = (x.requires_grad_() for x in _pairs((6,), 2, 9, torch.float64, seed=8))
    w = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    assert fused._blocked_applies(keys, values, torch.Size((6, 2)), kept=False) == blocked
    fn = lambda k, v, w_: fused.bind_superpose(k, v, w_, normalized=True, backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (keys, values, w), fast_mode=True)
    only_w = lambda w_: fused.bind_superpose(keys.detach(), values.detach(), w_, backend="torch")  # noqa: E731
    assert torch.autograd.gradcheck(only_w, (w,), fast_mode=True)


def test_auto_takes_triton_only_for_large_cuda_work(monkeypatch):
    import types

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(fused, "triton_importable", lambda: True)
    gpu = types.SimpleNamespace(is_cuda=True, dtype=torch.float32)
    assert fused._pick_backend("auto", gpu, pairs=fused.TRITON_MIN_PAIRS) == "triton"
    assert fused._pick_backend("auto", gpu, pairs=100 * 16) == "torch"  # measured slower there
    assert fused._pick_backend("auto", gpu) == "torch"  # no pair count given
    assert fused._pick_backend("auto", types.SimpleNamespace(is_cuda=True, dtype=torch.float64), pairs=10**6) == "torch"
    assert fused._pick_backend("auto", types.SimpleNamespace(is_cuda=False, dtype=torch.float32), pairs=10**6) == "torch"
