from __future__ import annotations

import math

import pytest
import torch

from torchnitro.errors import ConfigError, InputError
from torchnitro.precision import E4M3, E5M2, Float8Config, ScaleState, amax_to_scale, fp8_max, quantize_dequantize, sqnr


def test_fp8_max_values():
    assert fp8_max(E4M3) == 448.0 and fp8_max(E5M2) == 57344.0
    with pytest.raises(InputError, match="float8_e4m3fn"):
        fp8_max(torch.float16)


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("amax,margin", [(1.0, 0), (3.5, 1), (1e-3, 2), (1234.5, 0)])
def test_scale_formula(dtype, amax, margin):
    s = amax_to_scale(torch.tensor(amax), dtype, margin)
    assert s.dtype == torch.float32
    assert s.item() == pytest.approx(fp8_max(dtype) / amax / 2 ** margin, rel=1e-6)


def test_scale_edge_cases():
    assert amax_to_scale(torch.tensor(0.0), E4M3).item() == 1.0  # all-zero tensor
    assert amax_to_scale(torch.tensor(math.inf), E4M3, previous=torch.tensor(7.0)).item() == 7.0
    assert amax_to_scale(torch.tensor(math.nan), E4M3, previous=torch.tensor(3.0)).item() == 3.0
    assert amax_to_scale(torch.tensor(math.nan), E5M2).item() == 1.0  # no previous: neutral
    assert math.isfinite(amax_to_scale(torch.tensor(1e-45), E4M3).item())  # subnormal amax: finite scale


@pytest.mark.parametrize("shape", [(128, 256), (5, 123)])
def test_cast_sqnr(shape):
    x = torch.randn(shape)
    for dtype, floor in ((E4M3, 25.0), (E5M2, 22.0)):
        q = quantize_dequantize(x, amax_to_scale(x.abs().amax(), dtype), dtype)
        assert q.dtype == x.dtype
        assert sqnr(x, q) >= floor, dtype
    # e4m3 (3 mantissa bits) is ~6 dB per extra bit better than e5m2 (2 bits)
    s4 = sqnr(x, quantize_dequantize(x, amax_to_scale(x.abs().amax(), E4M3), E4M3))
    s5 = sqnr(x, quantize_dequantize(x, amax_to_scale(x.abs().amax(), E5M2), E5M2))
    assert s4 > s5 + 3


def test_saturating_cast_no_nan():
    x = torch.tensor([1.0, 1e6, -1e6])
    q = quantize_dequantize(x, torch.tensor(1.0), E4M3)
    assert torch.isfinite(q).all() and q[1].item() == 448.0 and q[2].item() == -448.0


def test_dynamic_state_uses_current_amax():
    st = ScaleState(E4M3, Float8Config("dynamic"))
    for amax in (2.0, 8.0, 0.5):
        s = st.scale_for(torch.tensor([amax, -0.1]))
        assert s.item() == pytest.approx(448.0 / amax)


def test_delayed_max_and_most_recent():
    cfg = Float8Config("delayed", history_len=3, amax_compute="max", margin=1)
    st = ScaleState(E4M3, cfg)
    seen = [st.scale_for(torch.tensor([a])).item() for a in (4.0, 2.0, 1.0, 0.5, 0.25)]
    # step 0 bootstraps from itself; then max over the previous <= 3 amaxes
    assert seen == pytest.approx([448 / 4 / 2, 448 / 4 / 2, 448 / 4 / 2, 448 / 4 / 2, 448 / 2 / 2])
    rec = ScaleState(E4M3, Float8Config("delayed", history_len=3, amax_compute="most_recent"))
    seen = [rec.scale_for(torch.tensor([a])).item() for a in (4.0, 2.0, 1.0)]
    assert seen == pytest.approx([448 / 4, 448 / 4, 448 / 2])


def test_delayed_skips_non_finite_amax():
    st = ScaleState(E4M3, Float8Config("delayed", history_len=4))
    st.scale_for(torch.tensor([2.0]))
    s_bad = st.scale_for(torch.tensor([math.inf]))
    s_next = st.scale_for(torch.tensor([1.0]))
    assert st.skipped == 1
    assert s_bad.item() == pytest.approx(224.0) and s_next.item() == pytest.approx(224.0)
    assert torch.isfinite(st.history).all()


def test_config_errors():
    with pytest.raises(ConfigError, match="scaling"):
        Float8Config("static")
    with pytest.raises(ConfigError, match="amax_compute"):
        Float8Config("delayed", amax_compute="mean")
    with pytest.raises(ConfigError, match="margin"):
        Float8Config(margin=-1)
