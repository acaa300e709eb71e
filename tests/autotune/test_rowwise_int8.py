"""The per-token int8 Linear against its fp32 reference (CPU; needs VNNI/AMX like the search does)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear, onednn_int8_reason
from torchnitro.autotune.recipes.rowwise_int8 import RowwiseInt8Linear, quantize_rows, rowwise_int8_reason

pytestmark = pytest.mark.skipif(rowwise_int8_reason() is not None, reason=f"rowwise int8: {rowwise_int8_reason()}")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _case(n: int, k: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, m)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(m, k, generator=g) / k ** 0.5)
        lin.bias.copy_(torch.randn(m, generator=g))
    return lin, torch.randn(n, k, generator=g)


@pytest.mark.parametrize("n,k,m", [(256, 128, 96), (5, 37, 23), (1, 16, 8)])
def test_matches_fp32_linear_within_int8_error(n, k, m):
    lin, x = _case(n, k, m)
    with torch.inference_mode():
        ref, out = lin(x), RowwiseInt8Linear(lin)(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert _rel(out, ref) < 0.02  # int8 x int8 with per-row / per-channel scales


def test_quantize_rows_is_symmetric_per_row_and_exact_on_the_grid():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [300.0, 1.0, -3.0]])
    q, s = quantize_rows(x)
    assert q.dtype == torch.int8 and s.shape == (3, 1)
    assert q.abs().amax(1).tolist() == [127, 0, 127]  # every row uses its own full range
    torch.testing.assert_close(s[:, 0], torch.tensor([2.0 / 127, 1e-8 / 127, 300.0 / 127]))
    torch.testing.assert_close(q.float() * s, x, atol=float(s.max()) / 2, rtol=0)


def test_each_row_is_independent_of_the_others_in_the_batch():
    # one outlier token must not cost the other tokens their resolution: a per-tensor activation scale
    # (the oneDNN kernel) does, and its error on the ordinary rows grows a lot
    lin, x = _case(64, 96, 80, seed=1)
    loud = x.clone()
    loud[7] *= 300.0  # an outlier row, as BERT's [SEP] rows and long text produce
    rowwise = RowwiseInt8Linear(lin)
    with torch.inference_mode():
        alone = rowwise(x[:7])
        torch.testing.assert_close(rowwise(loud)[:7], alone, rtol=0, atol=0)  # bit-identical
        ordinary = torch.cat([torch.arange(7), torch.arange(8, 64)])
        err_row = _rel(rowwise(loud)[ordinary], lin(loud)[ordinary])
        assert err_row < 0.02
        if onednn_int8_reason() is None:
            err_tensor = _rel(OneDnnInt8Linear(lin)(loud)[ordinary], lin(loud)[ordinary])
            assert err_tensor > 5 * err_row


def test_fused_gelu_and_residual_match_the_unfused_ops():
    lin, x = _case(50, 64, 64, seed=2)
    res = torch.randn(50, 64)
    q = RowwiseInt8Linear(lin)
    with torch.inference_mode():
        plain = q(x)
        torch.testing.assert_close(q(x, gelu=True), F.gelu(plain), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(q(x, add=res), plain + res, rtol=1e-5, atol=1e-6)
        assert q(x.view(5, 10, 64)).shape == (5, 10, 64)  # leading dims kept


def test_smoothing_matches_the_unsmoothed_math_and_inplace_only_when_asked():
    lin, x = _case(40, 48, 32, seed=3)
    x[:, 5] *= 50.0  # an outlier channel: SmoothQuant moves it into the weights
    s = x.abs().amax(0).clamp(min=1e-5) ** 0.5
    q = RowwiseInt8Linear(lin, s)
    with torch.inference_mode():
        ref = lin(x)
        keep = x.clone()
        out = q(x)
        assert torch.equal(x, keep)  # not in place by default
        assert _rel(out, ref) < 0.02
        q.inplace = True
        torch.testing.assert_close(q(x), out)
        assert not torch.equal(x, keep)  # the temporary was overwritten


def test_zero_rows_and_no_bias_stay_finite():
    lin = nn.Linear(16, 8, bias=False)
    q = RowwiseInt8Linear(lin)
    with torch.inference_mode():
        out = q(torch.zeros(3, 16))
        assert torch.equal(out, torch.zeros(3, 8))
        assert q(torch.zeros(0, 16)).shape == (0, 8)


def test_bad_input_and_bad_scales_say_what_was_expected():
    lin = nn.Linear(16, 8)
    with pytest.raises(ValueError, match=r"received input of shape \(3, 12\), expected \(\.\.\., 16\)"):
        RowwiseInt8Linear(lin)(torch.zeros(3, 12))
    with pytest.raises(TypeError, match="received torch.bfloat16 input, expected torch.float32"):
        RowwiseInt8Linear(lin)(torch.zeros(3, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="finite and > 0"):
        RowwiseInt8Linear(lin, torch.zeros(16))
    with pytest.raises(ValueError, match="either gelu or a residual"):
        RowwiseInt8Linear(lin)(torch.zeros(3, 16), gelu=True, add=torch.zeros(3, 8))
