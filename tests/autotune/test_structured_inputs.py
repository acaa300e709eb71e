"""Models called with a feature dict (sentence-transformers style) through the graph runtimes, the int8
calibration of such models, and the int8 Linears' fp32 outlier channels (issue 15)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchnitro.autotune.recipe import BuildContext
from torchnitro.autotune.recipes._layout import FlatProgram, InputLayout, input_layout
from torchnitro.errors import InputError
from torchnitro.hardware import hardware_info


class DictModel(nn.Module):
    """Like a SentenceTransformer: one feature dict in, its outputs written into that same dict, which is
    returned (token states laid out like the mask, and a pooled embedding)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(50, 16)
        self.lin = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)  # eval mode: must stay off in every exported program

    def forward(self, features: dict) -> dict:
        h = self.drop(self.lin(self.emb(features["input_ids"])))  # (B, T, D)
        m = features["attention_mask"].unsqueeze(-1).float()
        features["token_embeddings"] = h
        features["sentence_embedding"] = (h * m).sum(1) / m.sum(1).clamp(min=1)
        return features


def _features(batch: int, seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    return {"input_ids": torch.randint(1, 50, (batch, seq), generator=g) * mask, "attention_mask": mask}


def _mutated_example() -> tuple[nn.Module, dict]:
    model = DictModel().eval()
    f = _features(4, 8, 0)
    with torch.no_grad():
        model(f)  # as in a search: eager ran on the example, which now also holds the outputs
    return model, f


def _close(out: dict, ref: dict) -> None:
    for k in ("token_embeddings", "sentence_embedding"):
        torch.testing.assert_close(out[k], ref[k], rtol=1e-5, atol=1e-5)


def test_layout_leaves_out_the_keys_the_model_writes():
    model, f = _mutated_example()
    assert "token_embeddings" in f
    layout, out = input_layout(model, (f,))
    assert layout.paths == [[0, "input_ids"], [0, "attention_mask"]]
    assert set(out) >= {"token_embeddings", "sentence_embedding"}
    flat = FlatProgram(model, layout)
    assert not flat.training  # follows the model: an exporter traces dropout by the root's mode
    g = _features(3, 8, 1)
    with torch.no_grad():
        got = flat(*layout.take((g,)))
        ref = model(dict(g))
    torch.testing.assert_close(got[-1], ref["sentence_embedding"])
    assert list(g) == ["input_ids", "attention_mask"]  # the call wrote into its own fresh dict


def test_layout_names_a_missing_key():
    layout = InputLayout([[0, "input_ids"], [0, "attention_mask"]])
    with pytest.raises(InputError, match="attention_mask"):
        layout.take(({"input_ids": torch.zeros(2, 3)},))


def test_onnx_runtime_runs_a_dict_model_at_another_batch_size(tmp_path):
    pytest.importorskip("onnxruntime")
    from torchnitro.autotune.recipes.onnx import OrtRunner, export_onnx

    model, f = _mutated_example()
    meta = export_onnx(model, (f,), tmp_path / "m.onnx", {})
    assert meta["input_layout"] == [[0, "input_ids"], [0, "attention_mask"]]
    runner = OrtRunner(tmp_path / "m.onnx", meta, threads=1)
    g = _features(6, 8, 2)  # batch 6: the batch dim of a dict's tensors is dynamic
    with torch.no_grad():
        ref = model(dict(g))
    _close(runner({**g, "unused": torch.zeros(1)}), ref)  # keys the model does not read are ignored


def test_exported_program_of_a_dict_model_is_called_like_the_model(tmp_path):
    from torchnitro.autotune.program import load_program, prepare_program

    model, f = _mutated_example()
    program = prepare_program("exported", model, (f,), {}, tmp_path)
    assert program.kind == "exported", program.meta.get("export_error")
    loaded = load_program(program)
    g = _features(4, 8, 3)
    with torch.no_grad():
        _close(loaded(g), model(dict(g)))  # dropout stayed off (the program was traced in eval mode)


def test_openvino_converts_a_dict_model(tmp_path):
    pytest.importorskip("openvino")
    from torchnitro.autotune.config import OptimizeConfig
    from torchnitro.autotune.recipe import get_recipe

    model, f = _mutated_example()
    recipe = get_recipe("openvino")
    assert recipe.inapplicable_reason(model, (f,)) is None
    ctx = BuildContext(model=copy.deepcopy(model), example_inputs=(f,), hardware=hardware_info(),
                       device=torch.device("cpu"), workdir=tmp_path, dynamic_dims={}, config=OptimizeConfig())
    built = recipe.build(ctx)
    g = _features(4, 8, 4)
    with torch.no_grad():
        _close(built.fn(g), model(dict(g)))
        _close(recipe.load(tmp_path, built.meta, None)(g), model(dict(g)))  # the standalone artifact


# ---- int8 calibration of a model that returns its input dict ----------------------------------------

class DictMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, features: dict) -> dict:
        features["out"] = self.b(torch.relu(self.a(features["x"])))
        return features


def test_int8_plan_compares_against_a_copy_of_the_reference():
    """The model returns the very dict it was given: a reference kept by reference is overwritten by the
    candidate's call, and the plan would score int8 against itself (cosine exactly 1)."""
    from torchnitro.autotune.recipes.int8_mixed import plan_mixed_int8

    calib = [({"x": torch.randn(32, 16, generator=torch.Generator().manual_seed(k))},) for k in range(2)]
    plan = plan_mixed_int8(DictMLP().eval(), calib, target=0.9)
    assert plan["int8"] and plan["cosine"] < 1.0 - 1e-9, plan["cosine"]


def test_varied_calibration_finds_the_mask_inside_a_feature_dict(tmp_path):
    from torchnitro.autotune.recipes.int8_mixed import varied_calibration_inputs

    f = _features(8, 12, 5)
    ctx = BuildContext(model=DictModel().eval(), example_inputs=(f,), hardware=hardware_info(),
                       device=torch.device("cpu"), workdir=tmp_path, dynamic_dims={})
    sets = varied_calibration_inputs(ctx)
    assert len(sets) == 3
    assert not torch.equal(sets[1][0]["attention_mask"], f["attention_mask"])  # other sentence lengths


# ---- fp32 outlier channels beside the int8 GEMM ----------------------------------------------------------

def _outlier_input(n: int = 64, k: int = 48, channel: int = 5, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    x[:, channel] *= 60.0  # one channel an order of magnitude above the rest (MiniLM's FFN down-projection)
    return x


def test_outlier_channels_picks_the_channel_far_above_the_median():
    from torchnitro.autotune.recipes.int8_mixed import outlier_channels

    x = _outlier_input()
    got = outlier_channels({"l": x.abs().amax(0)})
    assert got["l"].tolist() == [5]
    assert outlier_channels({"l": torch.randn(64, 48).abs().amax(0)}) == {}


@pytest.mark.parametrize("engine", ["onednn", "rowwise"])
@pytest.mark.parametrize("epilogue", ["none", "gelu", "add"])
def test_outlier_channels_in_fp32_cut_the_int8_error(engine, epilogue):
    from torchnitro.autotune.recipes.int8_mixed import int8_module
    from torchnitro.autotune.recipes.onednn_int8 import onednn_int8_reason
    from torchnitro.autotune.recipes.rowwise_int8 import rowwise_int8_reason

    why = onednn_int8_reason() if engine == "onednn" else rowwise_int8_reason()
    if why is not None:
        pytest.skip(why)
    torch.manual_seed(1)
    lin = nn.Linear(48, 32)
    x = _outlier_input()
    res = torch.randn(64, 32)
    kw = {"gelu": True} if epilogue == "gelu" else {"add": res} if epilogue == "add" else {}
    with torch.no_grad():
        ref = lin(x)
        ref = torch.nn.functional.gelu(ref) if epilogue == "gelu" else ref + res if epilogue == "add" else ref
        plain = int8_module(lin, None, True, engine)
        split = int8_module(lin, None, True, engine, torch.tensor([5]))
        x_before = x.clone()
        e_plain = (plain(x, **kw) - ref).norm() / ref.norm()
        e_split = (split(x, **kw) - ref).norm() / ref.norm()
    torch.testing.assert_close(x, x_before)  # not a temporary: the caller's input is left alone
    assert e_split < 0.25 * e_plain, (float(e_split), float(e_plain))
    assert e_split < 0.02


# ---- the Linears an int8 plan keeps out of int8, in bf16 ---------------------------------------------------

def test_bf16_compute_linear_matches_fp32_with_its_epilogues():
    from torchnitro.autotune.recipes.onednn_bf16 import Bf16ComputeLinear, onednn_bf16_reason

    if onednn_bf16_reason() is not None:
        import pytest as _pytest

        _pytest.skip(onednn_bf16_reason())
    torch.manual_seed(2)
    lin, x, res = nn.Linear(48, 32), torch.randn(10, 48), torch.randn(10, 32)
    m = Bf16ComputeLinear(lin)
    with torch.no_grad():
        for got, ref in ((m(x), lin(x)), (m(x, gelu=True), torch.nn.functional.gelu(lin(x))),
                         (m(x, add=res), lin(x) + res)):
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)  # bf16 rounding, fp32 accumulation


def test_bf16_compute_swaps_only_the_packed_layers_fp32_linears():
    pytest.importorskip("transformers")
    from transformers import AutoModel

    from torchnitro.autotune.recipes.bert_unpad import unpad_model
    from torchnitro.autotune.recipes.onednn_bf16 import Bf16ComputeLinear, bf16_compute_, onednn_bf16_reason
    from torchnitro.hf import bert_config

    if onednn_bf16_reason() is not None:
        pytest.skip(onednn_bf16_reason())
    torch.manual_seed(0)
    hf = AutoModel.from_config(bert_config(hidden_size=32, intermediate_size=64), attn_implementation="sdpa").eval()
    fast = unpad_model(copy.deepcopy(hf))
    names = bf16_compute_(fast)
    assert len(names) == 4 * len(fast.layers) and isinstance(fast.layers[0].ffn_out, Bf16ComputeLinear)
    ids = torch.randint(5, 1000, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, 7:] = 0
    with torch.inference_mode():
        ref, out = hf(ids, mask).last_hidden_state, fast(ids, mask).last_hidden_state
        # an unmirrored call runs the original fp32 module, which the swap left alone
        torch.testing.assert_close(fast(ids, mask, output_hidden_states=True).last_hidden_state, ref)
    real = mask.bool()
    assert float(torch.nn.functional.cosine_similarity(out[real], ref[real]).min()) > 0.999
