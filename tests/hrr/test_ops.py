"""HRR ops: algebraic identities, Plate's (1995) statistics, unbinding quality, input errors.

Statistical tests are seeded. Each compares a sample mean/variance to its expected value with a
tolerance of 5 standard errors computed from the sample itself (SE of a mean = s / sqrt(n); SE of a
variance = sqrt((m4 - s^4) / n), m4 the 4th central moment), so a correct implementation fails with
probability < 1e-6 per check, and a wrong constant (e.g. variance 1/d instead of 2/d) fails surely.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from torchnitro.errors import InputError, ShapeError
from torchnitro.hrr import backend
from torchnitro.hrr import ops as h

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _circconv_reference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = a.shape[-1]
    out = np.zeros_like(a)
    for i in range(d):
        for j in range(d):
            out[..., i] += a[..., j] * b[..., (i - j) % d]
    return out


def _check_mean_var(x: torch.Tensor, mean: float, var: float, name: str) -> None:
    x = x.double().flatten()
    n = x.numel()
    mu, s2 = x.mean().item(), x.var().item()
    m4 = ((x - x.mean()) ** 4).mean().item()
    se_mu, se_var = math.sqrt(s2 / n), math.sqrt(max(m4 - s2 * s2, 0.0) / n)
    assert abs(mu - mean) < 5 * se_mu, f"{name}: mean {mu:.5f}, expected {mean} +- {5 * se_mu:.5f}"
    assert abs(s2 - var) < 5 * se_var, f"{name}: variance {s2:.6g}, expected {var:.6g} +- {5 * se_var:.3g}"
    assert 5 * se_var < 0.06 * var, "too few trials for a few-percent check"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d", [8, 13])
def test_bind_matches_direct_circular_convolution(dtype, d):
    a, b = h.random((2, 3), d, generator=_gen(1), dtype=dtype)
    ref = _circconv_reference(a.double().numpy(), b.double().numpy())
    out = h.bind(a, b)
    assert out.shape == (3, d) and out.dtype == dtype
    np.testing.assert_allclose(out.double().numpy(), ref, atol=TOL[dtype] * 10)


@pytest.mark.parametrize("shape", [(2, 128, 512), (5, 7, 123)])
def test_odd_and_even_lengths_kept_and_broadcast(shape):
    a = h.random(shape[:-1], shape[-1], generator=_gen(2))
    b = h.random(1, shape[-1], generator=_gen(3))[0]  # one vector, broadcast
    for out in (h.bind(a, b), h.unbind(a, b), h.unbind(a, b, "exact"), h.unbind(a, b, "projected"),
                h.project(a), h.exact_inverse(a), h.inverse(a)):
        assert out.shape == shape


def test_commutative_associative_and_identity():
    a, b, c = h.random(3, 101, generator=_gen(4), dtype=torch.float64)
    torch.testing.assert_close(h.bind(a, b), h.bind(b, a), atol=1e-12, rtol=0)
    torch.testing.assert_close(h.bind(h.bind(a, b), c), h.bind(a, h.bind(b, c)), atol=1e-12, rtol=0)
    e = torch.zeros(101, dtype=torch.float64)
    e[0] = 1.0
    torch.testing.assert_close(h.bind(a, e), a, atol=1e-12, rtol=0)


def test_inverse_is_involution_and_exact_inverse_is_exact():
    a, b = h.random(2, 64, generator=_gen(5), dtype=torch.float64)
    torch.testing.assert_close(h.inverse(h.inverse(a)), a)
    assert h.inverse(a)[0] == a[0] and h.inverse(a)[1] == a[-1]
    torch.testing.assert_close(h.bind(a, h.inverse(b)), h.unbind(a, b), atol=1e-12, rtol=0)
    e = h.bind(a, h.exact_inverse(a))
    assert abs(e[0].item() - 1.0) < 1e-9 and e[1:].abs().max().item() < 1e-9


def _unbind_oracle(c: np.ndarray, a: np.ndarray, method: str) -> np.ndarray:
    C, A = np.fft.fft(c), np.fft.fft(a)
    inv = {"involution": np.conj(A), "exact": np.conj(A) / np.abs(A) ** 2, "projected": np.conj(A) / np.abs(A)}[method]
    return np.fft.ifft(C * inv).real


@pytest.mark.parametrize("method", ["involution", "exact", "projected"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shapes", [((3, 16), (3, 16)), ((4, 2, 15), (15,)), ((15,), (4, 15))])
def test_unbind_matches_fourier_oracle_and_leaves_inputs_alone(method, dtype, shapes):
    c = h.random(shapes[0][:-1], shapes[0][-1], generator=_gen(30), dtype=dtype)
    a = h.random(shapes[1][:-1], shapes[1][-1], generator=_gen(31), dtype=dtype)
    c0, a0 = c.clone(), a.clone()
    out = h.unbind(c, a, method)
    ref = _unbind_oracle(*np.broadcast_arrays(c.double().numpy(), a.double().numpy()), method)
    assert out.dtype == dtype and out.shape == ref.shape
    np.testing.assert_allclose(out.double().numpy(), ref, atol=TOL[dtype] * 50)
    assert torch.equal(c, c0) and torch.equal(a, a0)


@pytest.mark.parametrize("d", [64, 63])
def test_unitary_vectors_preserve_norm_and_invert_exactly(d):
    u = h.unitary(4, d, generator=_gen(6), dtype=torch.float64)
    x = h.random(4, d, generator=_gen(7), dtype=torch.float64)
    torch.testing.assert_close(torch.fft.rfft(u).abs(), torch.ones(4, d // 2 + 1, dtype=torch.float64))
    torch.testing.assert_close(u.norm(dim=-1), torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(h.bind(u, x).norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(h.unbind(h.bind(u, x), u), x)
    torch.testing.assert_close(h.project(u), u)


def test_random_is_deterministic_and_float32_matches_float64():
    a = h.random(3, 50, generator=_gen(8))
    b = h.random(3, 50, generator=_gen(8))
    c = h.random(3, 50, generator=_gen(8), dtype=torch.float64)
    assert torch.equal(a, b)
    torch.testing.assert_close(a.double(), c, atol=1e-7, rtol=0)
    torch.testing.assert_close(h.bind(a, a).double(), h.bind(c, c), atol=1e-6, rtol=0)


def test_plate_table_d512():
    """Plate (1995), table 3.1: dot-product statistics for d = 512, elements N(0, 1/d)."""
    d, n = 512, 20_000
    a, b, c = h.random((3, n), d, generator=_gen(9))
    ab, ac = h.bind(a, b), h.bind(a, c)
    _check_mean_var((a * a).sum(-1), 1.0, 2 / d, "a.a")
    _check_mean_var((a * b).sum(-1), 0.0, 1 / d, "a.b")
    _check_mean_var((ab * ab).sum(-1), 1.0, (6 * d + 4) / d**2, "(a*b).(a*b)")
    _check_mean_var((ab * ac).sum(-1), 0.0, (2 * d + 2) / d**2, "(a*b).(a*c)")


def _unbind_cos(k: int, keys: str, method: str, n: int = 600, d: int = 1024) -> torch.Tensor:
    g = _gen(10 + k)
    make = h.random if keys == "gaussian" else h.unitary
    key = make((n, k), d, generator=g)
    val = h.random((n, k), d, generator=g)
    trace = h.bind(key, val).sum(-2)  # (n, d): k pairs superposed
    return h.cosine(h.unbind(trace, key[:, 0], method), val[:, 0]).double()


def _close_to(x: torch.Tensor, expected: float, d: int = 1024) -> None:
    # 5 standard errors plus 2/d: 1/sqrt(k+1) is the large-d limit; the ratio has an O(1/d) bias.
    tol = 5 * x.std().item() / math.sqrt(x.numel()) + 2 / d
    assert abs(x.mean().item() - expected) < tol, f"mean {x.mean().item():.4f}, expected {expected:.4f} +- {tol:.4f}"


def test_single_pair_unbind_quality():
    cos = _unbind_cos(1, "gaussian", "involution")
    _close_to(cos, 1 / math.sqrt(2))
    assert abs(cos.std().item() - 0.021) < 0.004  # Plate: 0.708 +- 0.021 at d = 1024
    assert torch.allclose(_unbind_cos(1, "gaussian", "exact"), torch.ones(1, dtype=torch.float64), atol=1e-5)


@pytest.mark.parametrize("k", [2, 4, 8])
def test_k_pairs_unbind_quality(k):
    _close_to(_unbind_cos(k, "gaussian", "involution"), 1 / math.sqrt(k + 1))
    _close_to(_unbind_cos(k, "unitary", "involution"), 1 / math.sqrt(k))
    exact = _unbind_cos(k, "gaussian", "exact").mean().item()
    assert exact < 1 / math.sqrt(k + 1) - 0.1, f"exact inverse ({exact:.3f}) should be worse than the involution"


def test_superpose_weights_and_normalization():
    v = h.random(3, 256, generator=_gen(11), dtype=torch.float64)
    s = h.superpose(v)
    torch.testing.assert_close(s.norm(), torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(h.superpose(v, normalized=False), v.sum(0))
    w = torch.tensor([1.0, 0.0, 2.0])
    torch.testing.assert_close(h.superpose(v, w, normalized=False), v[0] + 2 * v[2])
    batched = torch.stack([v, 2 * v])  # (2, 3, d)
    out = h.superpose(batched, torch.tensor([[1.0, 0, 0], [0, 0, 1.0]]), normalized=False)
    torch.testing.assert_close(out, torch.stack([v[0], 2 * v[2]]))
    cos = h.cosine(s.expand(3, -1), v)
    assert (cos > 0.4).all()  # each member is recognisable in a 3-bundle (~1/sqrt(3))


def test_permute_roundtrip_and_properties():
    x = h.random(4, 33, generator=_gen(12))
    p = h.permutation(33, generator=_gen(13))
    for perm in (None, p):
        torch.testing.assert_close(h.unpermute(h.permute(x, 3, perm=perm), 3, perm=perm), x)
        assert not torch.allclose(h.permute(x, 1, perm=perm), x)
    torch.testing.assert_close(h.permute(x, 2, perm=p), h.permute(h.permute(x, perm=p), perm=p))
    a, b = x[0], x[1]
    torch.testing.assert_close(h.permute(h.bind(a, b)), h.bind(h.permute(a), b), atol=1e-6, rtol=0)


def test_cosine_broadcasts():
    a = h.random((2, 3), 16, generator=_gen(14))
    c = h.cosine(a, a[0:1])
    assert c.shape == (2, 3)
    torch.testing.assert_close(c[0], torch.ones(3))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: h.bind(torch.zeros(4), torch.zeros(5)), "dimension 4"),
        (lambda: h.bind(torch.zeros(4), torch.zeros(4, dtype=torch.float64)), "float32"),
        (lambda: h.bind(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)), "int64"),
        (lambda: h.bind([1.0], torch.zeros(1)), "list"),
        (lambda: h.unbind(torch.zeros(4), torch.zeros(4), method="bogus"), "bogus"),
        (lambda: h.superpose(torch.zeros(4)), r"\(4,\)"),
        (lambda: h.superpose(torch.zeros(2, 4), [1.0, 2.0, 3.0]), r"\(3,\)"),
        (lambda: h.random(2, 0), "d=0"),
        (lambda: h.permute(torch.zeros(4), perm=torch.arange(3)), "length 4"),
    ],
)
def test_bad_input_raises_clear_errors(call, match):
    with pytest.raises((InputError, ShapeError), match=match):
        call()


def test_half_precision_computes_in_float32_on_cpu():
    a, b = h.random(2, 64, generator=_gen(15))
    out = h.bind(a.half(), b.half())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), h.bind(a.half().float(), b.half().float()), atol=2e-3, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_and_gpu_agree(dtype):
    g = _gen(16)
    a, b = h.random((2, 100), 1024, generator=g, dtype=dtype)
    cpu = h.unbind(h.bind(a, b), a)
    gpu = h.unbind(h.bind(a.cuda(), b.cuda()), a.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=1e-5, rtol=0)
    gpu_rand = h.random(3, 64, generator=_gen(17), device="cuda", dtype=dtype)
    assert torch.equal(gpu_rand.cpu(), h.random(3, 64, generator=_gen(17), dtype=dtype))


@pytest.mark.gpu
def test_fp16_on_gpu_native_fft():
    a, b = h.random(2, 1024, generator=_gen(18))
    out = h.bind(a.cuda().half(), b.cuda().half())
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), h.bind(a, b), atol=5e-3, rtol=0)


@pytest.mark.parametrize("stack_limit", [None, 0])
def test_gradients_flow_through_bind_and_every_unbind(stack_limit, monkeypatch):
    # spectra are modified in place inside bind/unbind: autograd must still see the originals
    if stack_limit is not None:
        monkeypatch.setattr(backend, "STACK_MAX_NUMEL", stack_limit)
    a, b = (x.requires_grad_() for x in h.random((2, 2), 7, generator=_gen(40), dtype=torch.float64))
    assert torch.autograd.gradcheck(h.bind, (a, b), fast_mode=True)
    for method in ("involution", "exact", "projected"):
        assert torch.autograd.gradcheck(lambda c, k: h.unbind(c, k, method), (a, b), fast_mode=True)


@pytest.mark.parametrize("shape", [(1, 64), (8, 512), (30, 1024), (3, 5, 7)])
def test_small_inputs_share_one_transform_call_without_changing_results(shape, monkeypatch):
    a, b = h.random((2, *shape[:-1]), shape[-1], generator=_gen(41))
    calls = []
    real = backend.rfft
    monkeypatch.setattr(backend, "rfft", lambda x: calls.append(x.shape) or real(x))
    got = (h.bind(a, b, backend="torch"), h.unbind(a, b, backend="torch"), h.unbind(a, b, "exact", backend="torch"))
    assert calls == [(2, *shape)] * 3  # one transform of the stacked pair per call
    monkeypatch.setattr(backend, "STACK_MAX_NUMEL", 0)
    want = (h.bind(a, b, backend="torch"), h.unbind(a, b, backend="torch"), h.unbind(a, b, "exact", backend="torch"))
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, atol=1e-6, rtol=0)
