"""The fused oneDNN int8 Linear against its fp32 reference (CPU; needs VNNI/AMX like the search does)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear, onednn_int8_reason
from torchnitro.kernels.cpu_int8 import cpu_int8_reason

pytestmark = pytest.mark.skipif(onednn_int8_reason() is not None, reason=f"oneDNN int8: {onednn_int8_reason()}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _case(seed: int = 0, n: int = 300, k: int = 96, m: int = 80):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, m)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(m, k, generator=g) / k ** 0.5)
        lin.bias.copy_(torch.randn(m, generator=g))
    x = torch.randn(n, k, generator=g)
    return lin, x


def test_matches_fp32_linear_within_int8_error():
    lin, x = _case()
    with torch.inference_mode():
        ref, out = lin(x), OneDnnInt8Linear(lin)(x)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert _rel(out, ref) < 0.02  # 8-bit activations and weights: about 1% relative error on this data
    assert F.cosine_similarity(out.flatten(), ref.flatten(), 0) > 0.999


def test_fused_gelu_and_residual_match_the_unfused_ops():
    lin, x = _case(1)
    q = OneDnnInt8Linear(lin)
    res = torch.randn(x.shape[0], lin.out_features)
    with torch.inference_mode():
        plain = q(x)
        torch.testing.assert_close(q(x, gelu=True), F.gelu(plain), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(q(x, add=res), plain + res, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="either gelu or a residual"):
        q(x, gelu=True, add=res)


def test_smoothing_moves_outlier_channels_into_the_weights():
    lin, x = _case(2)
    x[:, :4] *= 50.0  # four outlier channels dominate the per-tensor range
    s = x.abs().amax(0) ** 0.75 / lin.weight.detach().abs().amax(0) ** 0.25  # SmoothQuant, alpha 0.75
    with torch.inference_mode():
        ref = lin(x)
        plain, smooth = OneDnnInt8Linear(lin)(x), OneDnnInt8Linear(lin, s)(x)
    assert _rel(smooth, ref) < 0.7 * _rel(plain, ref)


def _torch_quantiser(monkeypatch) -> None:
    """The Linear's torch-op path, as where the native quantiser cannot be built."""
    from torchnitro.autotune.recipes import onednn_int8

    monkeypatch.setattr(onednn_int8, "cpu_int8_reason", lambda: "native int8 quantiser unavailable: test")


def test_inplace_smoothing_overwrites_only_when_asked(monkeypatch):
    _torch_quantiser(monkeypatch)
    lin, x = _case(3)
    s = torch.rand(x.shape[1]) + 0.5
    q = OneDnnInt8Linear(lin, s)
    keep = x.clone()
    with torch.inference_mode():
        a = q(x)
        assert torch.equal(x, keep)
        q.inplace = True
        b = q(x)
    torch.testing.assert_close(b, a)
    torch.testing.assert_close(x, keep / s)  # the temporary now holds x / s


@pytest.mark.skipif(cpu_int8_reason() is not None, reason=f"{cpu_int8_reason()}")
def test_the_native_quantiser_never_writes_the_input():
    lin, x = _case(3)
    q = OneDnnInt8Linear(lin, torch.rand(x.shape[1]) + 0.5, outliers=torch.tensor([1, 5]))
    q.inplace = True  # allowed to, but smoothing and zeroing happen inside the quantiser's passes
    keep = x.clone()
    with torch.inference_mode():
        q(x), q(x, gelu=True)
    assert torch.equal(x, keep)


@pytest.mark.skipif(cpu_int8_reason() is not None, reason=f"{cpu_int8_reason()}")
@pytest.mark.parametrize("n,k,m", [(300, 96, 80), (5, 37, 23)])
def test_native_quantiser_and_torch_ops_give_the_same_result(monkeypatch, n, k, m):
    """Smoothing, outlier columns and the range in the kernel's two passes vs torch's multiply, index_fill,
    aminmax and quantize_per_tensor: the same uint8 activations, so the same output up to the fp32 outlier
    product's summation order."""
    lin, x = _case(10, n, k, m)
    x[:, 2] *= 30.0
    mods = {"smoothed": OneDnnInt8Linear(lin, torch.rand(k) + 0.5),
            "outliers": OneDnnInt8Linear(lin, torch.rand(k) + 0.5, outliers=torch.tensor([2, k - 1])),
            "plain": OneDnnInt8Linear(lin)}
    res = torch.randn(n, m)
    calls = ({}, {"gelu": True}, {"add": res})
    with torch.inference_mode():
        native = {(name, i): mod(x, **kw) for name, mod in mods.items() for i, kw in enumerate(calls)}
        _torch_quantiser(monkeypatch)
        for (name, i), got in native.items():
            torch.testing.assert_close(got, mods[name](x, **calls[i]), rtol=1e-5, atol=1e-5, msg=f"{name} {calls[i]}")


@pytest.mark.parametrize("outliers", [None, torch.tensor([0, 7])])
def test_accumulate_writes_the_sum_into_the_residual(outliers):
    lin, x = _case(11)
    q = OneDnnInt8Linear(lin, torch.rand(96) + 0.5, outliers=outliers)
    res = torch.randn(3, 100, 80)
    with torch.inference_mode():
        want = q(x, add=res.reshape(300, 80))
        acc = res.clone()
        got = q(x.reshape(3, 100, 96), add=acc, accumulate=True)
        assert got.data_ptr() == acc.data_ptr() and got.shape == (3, 100, 80)
        torch.testing.assert_close(got.reshape(300, 80), want, rtol=1e-5, atol=1e-5)
        strided = res.reshape(300, 80).t().contiguous().t()  # not contiguous: a new output, the residual kept
        keep = strided.clone()
        torch.testing.assert_close(q(x, add=strided, accumulate=True), want, rtol=1e-5, atol=1e-5)
        assert torch.equal(strided, keep)
        q.out_dtype = torch.bfloat16  # a bf16 output cannot accumulate into fp32: a new tensor
        acc = res.reshape(300, 80).clone()
        assert q(x, add=acc, accumulate=True).dtype == torch.bfloat16 and torch.equal(acc, res.reshape(300, 80))


def test_constant_and_zero_inputs_stay_finite():
    lin, _ = _case(4)
    q = OneDnnInt8Linear(lin)
    with torch.inference_mode():
        for x in (torch.zeros(5, 96), torch.full((5, 96), 3.0)):
            out = q(x)
            assert torch.isfinite(out).all()
            assert _rel(out, lin(x)) < 0.02  # only the weights' rounding is left


def test_deepcopy_shares_the_packed_weight_and_copies_the_rest():
    lin, x = _case(5)
    q = OneDnnInt8Linear(lin, torch.rand(96) + 0.5)
    c = copy.deepcopy(q)
    assert c.packed is q.packed and c.bias is not q.bias
    with torch.inference_mode():
        torch.testing.assert_close(c(x), q(x))


def test_bad_input_and_bad_scales_say_what_was_expected():
    lin, x = _case(6)
    with pytest.raises(TypeError, match="received torch.float64 input, expected torch.float32"):
        OneDnnInt8Linear(lin)(x.double())
    with pytest.raises(ValueError, match="finite and > 0"):
        OneDnnInt8Linear(lin, torch.zeros(96))


def test_leading_dimensions_are_kept():
    lin, x = _case(7, n=60)
    q = OneDnnInt8Linear(lin)
    x3 = x.reshape(3, 20, 96)
    res = torch.randn(3, 20, 80)
    with torch.inference_mode():
        out = q(x3)
        assert out.shape == (3, 20, 80)
        torch.testing.assert_close(out.reshape(60, 80), q(x))
        torch.testing.assert_close(q(x3, add=res), out + res, rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match=r"received input of shape \(60, 95\), expected \(\.\.\., 96\)"):
            q(x[:, :95])


def test_int8_module_engines_agree_and_unknown_engine_is_named():
    from torchnitro.autotune.recipes.int8_mixed import int8_module

    lin, x = _case(8)
    with torch.inference_mode():
        ref = lin(x)
        for engine in ("onednn", "fbgemm"):
            assert _rel(int8_module(lin, None, True, engine)(x), ref) < 0.02
    with pytest.raises(ValueError, match="int8 engine 'mkl'"):
        int8_module(lin, None, True, "mkl")


@pytest.mark.parametrize("n,k,m", [(300, 96, 80), (5, 37, 23)])
def test_bf16_output_is_the_fp32_output_rounded(n, k, m):
    lin, x = _case(9, n, k, m)
    q = OneDnnInt8Linear(lin, torch.rand(k) + 0.5)
    o = OneDnnInt8Linear(lin, torch.rand(k) + 0.5, outliers=torch.tensor([0, k - 1]))  # the fp32-outlier paths
    res = torch.randn(n, m)
    bf16 = dict(rtol=1e-2, atol=1e-2)  # one bf16 rounding of the same int8 result (8 mantissa bits)
    with torch.inference_mode():
        for mod in (q, o):
            plain, gelu, added = mod(x), mod(x, gelu=True), mod(x, add=res)
            mod.out_dtype = torch.bfloat16
            for kw, want in (({}, plain), ({"gelu": True}, gelu), ({"add": res}, added)):
                got = mod(x, **kw)
                assert got.dtype == torch.bfloat16, kw
                torch.testing.assert_close(got.float(), want, **bf16)
            assert mod(x.reshape(1, n, k)).shape == (1, n, m)
