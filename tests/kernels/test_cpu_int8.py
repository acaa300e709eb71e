"""The native activation quantiser (kernels/cpu_int8.c via ctypes): bit for bit torch.quantize_per_tensor of
``x * col_scale`` over its own range, on contiguous and strided rows; checks its inputs; says why where it cannot
be built."""

from __future__ import annotations

import shutil

import pytest
import torch

from torchnitro.kernels import cpu_attention as ca
from torchnitro.kernels import cpu_int8 as ci

pytestmark = pytest.mark.skipif(shutil.which(ca.COMPILER) is None,
                                reason=f"no C compiler ({ca.COMPILER!r} not on PATH): the kernel cannot be built")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """The kernel, compiled once for this module into a private cache directory."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path_factory.mktemp("tn_cache")))
    ci._state.clear()
    assert ci.cpu_int8_reason() is None, ci.cpu_int8_reason()
    yield
    mp.undo()
    ci._state.clear()


def _case(n: int, k: int, seed: int, scaled: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * 3 + 0.5
    if not scaled:
        return x, None
    s = torch.rand(k, generator=g) + 0.25
    s[::7] = 0.0  # columns computed elsewhere (outliers)
    return x, s


def _assert_same(x: torch.Tensor, s: torch.Tensor | None) -> None:
    q, scale, zp = ci.quantize_u8(x, s)
    qr, scale_r, zp_r = ci.quantize_u8_reference(x, s)
    assert q.dtype == torch.uint8 and q.shape == x.shape and q.is_contiguous()
    assert (scale, zp) == (scale_r, zp_r)
    assert torch.equal(q, qr)


@pytest.mark.parametrize("n,k", [(256, 512), (5, 123), (1, 7), (300, 1536)])
@pytest.mark.parametrize("scaled", [False, True])
def test_matches_torch_quantize_per_tensor_bit_for_bit(kernel, n, k, scaled):
    _assert_same(*_case(n, k, n + k, scaled))


def test_a_row_stride_wider_than_the_row_is_read_as_rows(kernel):
    x, s = _case(40, 160, 1, True)
    _assert_same(x[:, :96], s[:96])  # (40, 96) at row stride 160


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_range_holds_zero_and_constant_rows_stay_exact(kernel, sign):
    x = torch.full((8, 33), 2.5 * sign)
    _assert_same(x, None)
    q, scale, zp = ci.quantize_u8(torch.zeros(3, 20))
    assert torch.equal(q, torch.full((3, 20), zp, dtype=torch.uint8)) and scale > 0


def test_thread_counts_agree(kernel):
    x, s = _case(1000, 384, 3, True)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ci.quantize_u8(x, s)
        torch.set_num_threads(max(2, old))
        many = ci.quantize_u8(x, s)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one[0], many[0]) and one[1:] == many[1:]


@pytest.mark.parametrize("call,match", [
    (lambda: ci.quantize_u8(torch.randn(4, 8).double()), "2-D float32 CPU tensor"),
    (lambda: ci.quantize_u8(torch.randn(2, 4, 8)), r"2-D float32 CPU tensor \(N, K\), received .*\(2, 4, 8\)"),
    (lambda: ci.quantize_u8(torch.randn(8, 4).t()), "rows must be contiguous"),
    (lambda: ci.quantize_u8(torch.randn(4, 8), torch.ones(7)), r"col_scale must be .* shape \(8,\)"),
    (lambda: ci.quantize_u8(torch.tensor([[1.0, float("inf")]])), "not finite"),
    (lambda: ci.quantize_u8(torch.tensor([[1.0, float("nan")]])), "not finite"),
])
def test_bad_input_is_named(kernel, call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_missing_compiler_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ca, "COMPILER", "no-such-cc-torchnitro")
    try:
        why = ci.cpu_int8_reason()
        assert why is not None and "native int8 quantiser unavailable" in why and "no-such-cc-torchnitro" in why
        with pytest.raises(RuntimeError, match="no-such-cc-torchnitro"):
            ci.quantize_u8(torch.randn(4, 8))
    finally:
        monkeypatch.undo()
        ci._state.clear()


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="builds for baseline x86-64")
def test_the_portable_path_matches_torch(monkeypatch, tmp_path):
    """The loop without AVX512, as a CPU without it compiles the file: built here for baseline x86-64."""
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ca, "_FLAGS", ("-O3", "-march=x86-64", "-fPIC", "-std=c11"))
    ci._state.clear()
    try:
        for n, k, scaled in ((64, 200, True), (3, 17, False)):
            _assert_same(*_case(n, k, 7, scaled))
    finally:
        monkeypatch.undo()
        ci._state.clear()
