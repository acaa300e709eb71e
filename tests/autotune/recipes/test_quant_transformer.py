"""The int8 and bf16 recipes on PyTorch's own ``nn.TransformerEncoder`` / ``nn.Transformer``: in eval under
no_grad its layers take a fused fast path that reads ``linear1/linear2.weight`` as float tensors, and a padded
batch runs as a nested tensor whose padded positions come back as zeros."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchnitro.autotune.config import DEFAULT_TOLERANCES
from torchnitro.autotune.recipe import get_recipe
from torchnitro.autotune.recipes.quant import slow_path_transformer_layers_
from torchnitro.autotune.verify import compare_outputs, flatten_outputs
from torchnitro.hardware import hardware_info


def _encoder(norm: bool = False) -> nn.TransformerEncoder:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(32) if norm else None).eval()


class _Masked(nn.Module):
    """An encoder called with a key padding mask (bool True / float -inf at the pads)."""

    def __init__(self, norm: bool = False):
        super().__init__()
        self.enc = _encoder(norm)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.enc(x, src_key_padding_mask=pad)


def _pad_mask(float_mask: bool = False) -> torch.Tensor:
    pad = torch.zeros(4, 16, dtype=torch.bool)  # (B, T), True: padding
    pad[1, 12:] = True
    pad[3, 5:] = True
    return torch.zeros(4, 16).masked_fill(pad, float("-inf")) if float_mask else pad


def _cases() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    torch.manual_seed(1)
    x = torch.randn(4, 16, 32)  # (B, T, D)
    return {"plain": (_encoder(), (x,)),
            "padded": (_Masked().eval(), (x, _pad_mask())),
            "padded-float-mask-norm": (_Masked(norm=True).eval(), (x, _pad_mask(float_mask=True)))}


def _worst_cosine(ref: object, out: object) -> float:
    errs = compare_outputs(flatten_outputs(ref), flatten_outputs(out))
    assert not isinstance(errs, str), errs
    return min(e.cosine for e in errs)


@pytest.mark.parametrize("case", ["plain", "padded", "padded-float-mask-norm"])
@pytest.mark.parametrize("recipe", ["dynamic-int8", "int8-mixed", "bf16"])
def test_recipe_on_a_transformer_encoder_matches_fp32(build, recipe, case):
    """dynamic-int8 raised "'function' object has no attribute 'device'" (the layer's fast path read a packed
    int8 Linear's weight), int8-mixed "'NoneType' object has no attribute 'device'"; padded, the variant's
    padded positions were the slow path's values where eager's nested path gives zeros (cosine 0 there)."""
    model, x = _cases()[case]
    r = get_recipe(recipe)
    why = r.unavailable_reason(hardware_info())
    if why is not None:
        pytest.skip(f"{recipe} does not run here: {why}")
    _, built, _ = build(recipe, model, x)
    with torch.no_grad():  # eval + no_grad: where PyTorch takes the fused path
        ref, out = model(*x), built.fn(*x)
    assert _worst_cosine(ref, out) >= DEFAULT_TOLERANCES[r.numeric_class.value]["cosine"]
    if len(x) > 1:  # padded positions as eager's nested path returns them
        pad = _pad_mask()
        torch.testing.assert_close(out[pad], ref[pad], rtol=0, atol=1e-5)


def test_only_layers_with_swapped_feed_forward_leave_the_fast_path():
    enc = _encoder()
    assert slow_path_transformer_layers_(enc) == 0  # plain float Linears: the fused path stays
    assert enc.use_nested_tensor and all(layer.activation_relu_or_gelu for layer in enc.layers)
    assert slow_path_transformer_layers_(enc, ["layers.1.linear2"]) == 1  # to be swapped in place later
    assert enc.layers[0].activation_relu_or_gelu and not enc.layers[1].activation_relu_or_gelu
    assert not enc.use_nested_tensor


def test_dynamic_int8_on_encoder_decoder_and_attention_alone(build):
    """nn.Transformer's encoder layers take the fast path too (its decoder has none); MultiheadAttention
    alone has no nn.Linear to quantise (its out_proj is a NonDynamicallyQuantizableLinear)."""
    torch.manual_seed(0)
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=64,
                           batch_first=True).eval()
    x = (torch.randn(4, 16, 32), torch.randn(4, 8, 32))
    _, built, _ = build("dynamic-int8", model, x)
    with torch.no_grad():
        assert _worst_cosine(model(*x), built.fn(*x)) >= DEFAULT_TOLERANCES["int8"]["cosine"]
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    assert get_recipe("dynamic-int8").inapplicable_reason(mha, (x[0], x[0], x[0])) == "no nn.Linear layers"
