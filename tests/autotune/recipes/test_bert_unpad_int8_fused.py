"""bert-unpad-int8's fused residual paths: SmoothQuant left to the int8 Linear's quantiser (``fold_smoothing(...,
norms=False)``), residual sums written into the layer's own temporaries (``accumulate``), no concatenation of
the FFN's row blocks, and the layer's input untouched unless the caller hands it over."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from torchnitro.autotune.recipes._unpad import PackedLayer, pack_tokens  # noqa: E402
from torchnitro.autotune.recipes.bert_unpad import UnpaddedBert, _int8, fold_smoothing  # noqa: E402
from torchnitro.autotune.recipes.int8_mixed import activation_absmax, linear_names, smooth_scales  # noqa: E402
from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear, onednn_int8_reason  # noqa: E402
from torchnitro.hf import bert_config, random_hf_model  # noqa: E402


def _ragged(batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1024, (batch, seq), generator=g)
    lens = torch.randint(1, seq + 1, (batch,), generator=g)
    lens[-1] = seq
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    return ids * mask, mask


@pytest.fixture(scope="module")
def setup():
    bert = random_hf_model(bert_config())
    base = UnpaddedBert(bert).eval()
    x = _ragged(5, 37, seed=8)
    scales = smooth_scales(base, activation_absmax(base, [x], linear_names(base)), 0.75)
    return bert, base, x, scales


def test_fold_smoothing_without_norms_leaves_the_layernorms_and_is_exact(setup):
    bert, base, x, scales = setup
    folded, left = fold_smoothing(base, scales, norms=False)
    # the attention output's scale still goes into V; qkv's and ffn_in's stay for the Linears to apply
    assert sorted(left) == sorted(n for n in scales if not n.endswith(".out"))
    assert all(layer.res_in is None and layer.res_mid is None for layer in folded.layers)
    for a, b in zip(folded.layers, base.layers):
        assert torch.equal(a.ln1.weight, b.ln1.weight) and torch.equal(a.ln2.weight, b.ln2.weight)
    with torch.inference_mode():
        torch.testing.assert_close(folded(*x), base(*x), rtol=1e-4, atol=1e-5)


needs_onednn = pytest.mark.skipif(onednn_int8_reason() is not None, reason=f"oneDNN int8: {onednn_int8_reason()}")


def _no_accumulate(m: torch.nn.Module) -> torch.nn.Module:
    m = copy.deepcopy(m)
    for mod in m.modules():
        if isinstance(mod, OneDnnInt8Linear):
            mod.takes_accumulate = False  # the instance attribute hides the class's: a new output per call
    return m


@needs_onednn
@pytest.mark.parametrize("rows", [7, 1024])  # several FFN row blocks with a ragged last one; one block
def test_accumulated_residuals_give_the_same_result(setup, rows):
    bert, base, x, scales = setup
    q = _int8(base, linear_names(base), scales, True, "onednn", {"layers.1.ffn_out": torch.tensor([3, 9])})
    for layer in q.layers:
        layer.ffn_rows = rows
    ref = _no_accumulate(q)
    with torch.inference_mode():
        torch.testing.assert_close(q(*x), ref(*x), rtol=1e-5, atol=1e-5)
        assert torch.nn.functional.cosine_similarity(q(*x), bert(*x)).min() > 0.99


@needs_onednn
def test_the_ffn_row_blocks_are_summed_in_place_and_not_concatenated(setup, monkeypatch):
    bert, base, x, scales = setup
    q = _int8(base, linear_names(base), scales, True, "onednn")
    layer = q.layers[0]
    layer.ffn_rows = 7
    h = torch.randn(30, layer.ffn_in.in_features)
    keep = h.clone()

    def no_cat(*a, **k):
        raise AssertionError("the row blocks were concatenated")

    with torch.inference_mode():
        want = _no_accumulate(layer)._ffn_residual(keep.clone())
        monkeypatch.setattr(torch, "cat", no_cat)
        got = layer._ffn_residual(h)
    assert got.data_ptr() == h.data_ptr()  # the sum lives in the block input's own rows
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_layer_keeps_its_input_unless_the_caller_hands_it_over(setup):
    bert, base, x, scales = setup
    q = _int8(base, linear_names(base), scales, True, "onednn")
    layer: PackedLayer = q.layers[0]
    p = pack_tokens(x[1], 1)
    h = torch.randn(p.idx.numel(), layer.ln1.normalized_shape[0])
    keep = h.clone()
    with torch.inference_mode():
        a = layer(h, p.buckets)
        assert torch.equal(h, keep)
        b = layer(h, p.buckets, owned=True)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_the_quantiser_is_recorded_and_an_artifact_loads_without_it(setup, tmp_path, monkeypatch):
    from torchnitro.autotune.config import OptimizeConfig
    from torchnitro.autotune.recipe import BuildContext, get_recipe
    from torchnitro.autotune.recipes import bert_unpad, onednn_int8
    from torchnitro.hardware import hardware_info
    from torchnitro.kernels.cpu_int8 import cpu_int8_reason

    bert, base, x, scales = setup
    recipe = get_recipe("bert-unpad-int8")
    ctx = BuildContext(model=copy.deepcopy(bert), example_inputs=_ragged(8, 32, seed=6), hardware=hardware_info(),
                       device=torch.device("cpu"), workdir=tmp_path, dynamic_dims={0: [0, 1], 1: [0, 1]},
                       config=OptimizeConfig())
    built = recipe.build(ctx)
    if built.meta["engine"] != "onednn":
        pytest.skip(f"the plan chose {built.meta['engine']}")
    native = cpu_int8_reason() is None
    assert built.meta["quantiser"] == ("native" if native else "torch")
    assert ("activation quantiser: native" if native else "activation quantiser: torch (") in built.notes
    if not native:
        return
    for mod in (bert_unpad, onednn_int8):
        monkeypatch.setattr(mod, "cpu_int8_reason", lambda: "native int8 quantiser unavailable: no compiler")
    with pytest.warns(UserWarning, match="not available here .*no compiler"):
        fn = recipe.load(tmp_path, built.meta, bert)
    held = _ragged(6, 24, seed=7)
    with torch.inference_mode():
        a, b = built.fn(*held), fn(*held)
    assert torch.nn.functional.cosine_similarity(a.flatten(1), b.flatten(1)).min() > 0.999
