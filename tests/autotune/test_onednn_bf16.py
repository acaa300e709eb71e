"""The prepacked oneDNN bf16 Linear against F.linear in bf16, and the padding-free bf16 encoder built on it."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchnitro.autotune.recipes.onednn_bf16 import OneDnnBf16Linear, onednn_bf16_reason, prepack_bf16_

pytestmark = pytest.mark.skipif(onednn_bf16_reason() is not None, reason=f"oneDNN bf16: {onednn_bf16_reason()}")

BF16 = dict(rtol=2e-2, atol=2e-2)  # bf16 outputs: 8 mantissa bits, fp32 accumulation in both paths


def _case(n: int, k: int, m: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, m).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(m, k, generator=g) / k ** 0.5)
        lin.bias.copy_(torch.randn(m, generator=g))
    return lin, torch.randn(n, k, generator=g).to(torch.bfloat16)


def _encode(models: list, lens: list[int], t: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The same random sentences of lengths ``lens`` padded to ``t`` through each encoder: (mask, outputs)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (len(lens), t), generator=g)  # (B, T)
    mask = (torch.arange(t)[None] < torch.tensor(lens)[:, None]).long()  # (B, T), 1 on real tokens
    with torch.inference_mode():
        return mask, [m(input_ids=ids, attention_mask=mask).last_hidden_state for m in models]


def _min_cosine(out: torch.Tensor, ref: torch.Tensor, real: torch.Tensor) -> float:
    """The smallest cosine between the two outputs over real (unmasked) token rows."""
    return float(F.cosine_similarity(out[real].double(), ref[real].double(), dim=1).min())


@pytest.mark.parametrize("n,k,m", [(128, 64, 96), (5, 37, 23)])
def test_matches_bf16_linear_with_fused_gelu_and_add(n, k, m):
    lin, x = _case(n, k, m)
    res = torch.randn(n, m).to(torch.bfloat16)
    fast = OneDnnBf16Linear(lin)
    with torch.inference_mode():
        ref = lin(x)
        assert fast(x).dtype == torch.bfloat16
        torch.testing.assert_close(fast(x), ref, **BF16)
        torch.testing.assert_close(fast(x, gelu=True), F.gelu(ref), **BF16)
        torch.testing.assert_close(fast(x, add=res), ref + res, **BF16)
        assert fast(x.view(1, n, k)).shape == (1, n, m)  # leading dims kept


def test_no_bias_and_deepcopy_shares_the_packed_weight():
    lin = nn.Linear(16, 8, bias=False).to(torch.bfloat16)
    fast = OneDnnBf16Linear(lin)
    twin = copy.deepcopy(fast)
    assert twin.packed is fast.packed and twin.bias is None
    x = torch.randn(3, 16).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(twin(x), lin(x), **BF16)


def test_bad_input_says_what_was_expected():
    fast = OneDnnBf16Linear(nn.Linear(16, 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"received torch.float32 input of shape \(3, 16\), expected torch.bfloat16"):
        fast(torch.zeros(3, 16))
    with pytest.raises(ValueError, match=r"shape \(3, 12\), expected torch.bfloat16 \(\.\.\., 16\)"):
        fast(torch.zeros(3, 12, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="either gelu or a residual"):
        fast(torch.zeros(3, 16, dtype=torch.bfloat16), gelu=True, add=torch.zeros(3, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(4, 32), (5, 37)])
def test_prepacked_padding_free_bf16_encoder_matches_eager(shape):
    pytest.importorskip("transformers")
    from torchnitro.autotune.recipes.bert_unpad import unpad_model
    from torchnitro.autotune.recipes.hf_encoders import UnpaddedEncoder
    from torchnitro.hf import bert_config, random_hf_model

    eager = random_hf_model(bert_config()).encoder.eval()  # the HF BertModel itself
    plain = unpad_model(copy.deepcopy(eager), torch.bfloat16)
    fast = unpad_model(copy.deepcopy(eager), torch.bfloat16)
    assert isinstance(fast, UnpaddedEncoder)
    assert prepack_bf16_(fast) == 4 * len(fast.layers)
    b, t = shape
    lens = [1] + [t] * (b - 2) + [t // 2]  # one-token, full and half sentences
    mask, (ref, out, base) = _encode([eager, fast, plain], lens, t, seed=1)
    real = mask.bool()
    assert out.dtype == torch.float32
    assert torch.equal(out[~real], torch.zeros_like(out[~real]))  # zeros at masked positions, as documented
    assert _min_cosine(out, ref, real) > 0.999  # the bf16 gate
    torch.testing.assert_close(out, base, rtol=5e-2, atol=5e-2)  # same math as the unpacked bf16 Linears


def test_compute_linear_takes_and_hands_on_bf16():
    from torchnitro.autotune.recipes.onednn_bf16 import Bf16ComputeLinear

    g = torch.Generator().manual_seed(2)
    lin = nn.Linear(37, 23)
    x, res = torch.randn(5, 37, generator=g), torch.randn(5, 23, generator=g)
    fast = Bf16ComputeLinear(lin)
    with torch.inference_mode():
        ref = lin(x)
        y32 = fast(x, gelu=True)
        assert y32.dtype == torch.float32
        torch.testing.assert_close(y32, F.gelu(ref), **BF16)
        torch.testing.assert_close(fast(x.to(torch.bfloat16), gelu=True), y32)  # bf16 input: the same GEMM
        fast.out_dtype = torch.bfloat16
        yb = fast(x, gelu=True)
        assert yb.dtype == torch.bfloat16
        torch.testing.assert_close(yb, y32.to(torch.bfloat16))  # no fp32 round trip, the same bf16 values
        added = fast(x, add=res)
        assert added.dtype == torch.bfloat16
        torch.testing.assert_close(added.float(), ref + res, **BF16)
    with pytest.raises(TypeError, match="received torch.float64 input, expected torch.float32 or torch.bfloat16"):
        fast(x.double())


@pytest.mark.parametrize("shape", [(4, 32), (5, 37)])
def test_int8_encoder_with_bf16_kept_ffn_chains_bf16_and_matches_eager(shape):
    pytest.importorskip("transformers")
    from torchnitro.autotune.recipes.bert_unpad import _int8, unpad_model
    from torchnitro.autotune.recipes.int8_mixed import linear_names
    from torchnitro.autotune.recipes.onednn_bf16 import Bf16ComputeLinear
    from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear, onednn_int8_reason
    from torchnitro.hf import bert_config, random_hf_model

    if onednn_int8_reason() is not None:
        pytest.skip(f"oneDNN int8: {onednn_int8_reason()}")
    eager = random_hf_model(bert_config()).encoder.eval()
    base = unpad_model(copy.deepcopy(eager))
    names = linear_names(base)
    kept = ["layers.0.ffn_out", "layers.1.ffn_in", "layers.1.ffn_out"]  # int8 -> bf16 and bf16 -> bf16 FFNs
    assert set(kept) <= set(names)
    q = _int8(base, [n for n in names if n not in kept], {}, True, "onednn", None, bf16_rest=True)
    l0, l1 = q.layers[0], q.layers[1]
    assert isinstance(l0.ffn_in, OneDnnInt8Linear) and isinstance(l0.ffn_out, Bf16ComputeLinear)
    assert isinstance(l1.ffn_in, Bf16ComputeLinear) and isinstance(l1.ffn_out, Bf16ComputeLinear)
    assert l0.ffn_in.out_dtype == l1.ffn_in.out_dtype == torch.bfloat16  # chained
    assert l0.ffn_out.out_dtype == l1.ffn_out.out_dtype == torch.float32  # the residual stream stays fp32
    unchained = copy.deepcopy(q)
    for lay in unchained.layers:
        lay.ffn_in.out_dtype = torch.float32
    b, t = shape
    mask, (ref, out, old) = _encode([eager, q, unchained], [t] * (b - 1) + [t // 2], t, seed=3)
    real = mask.bool()
    assert out.dtype == torch.float32
    assert _min_cosine(out, ref, real) > 0.99  # the int8 gate
    torch.testing.assert_close(out, old, rtol=2e-2, atol=2e-2)  # the same bf16 values, written by the GEMM
