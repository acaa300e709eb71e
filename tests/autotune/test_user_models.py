"""Models as users hold them: an HF ``AutoModel`` given directly, wrapped in a class of the test's own,
called with a tokenizer's dict; the padding-free recipes find the encoder inside, keep the output
type, and the gate compares real (unmasked) positions."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from torchnitro.autotune.recipe import BuildContext, get_recipe  # noqa: E402
from torchnitro.autotune.recipes.bert_unpad import bert_inapplicable_reason, unpad_model  # noqa: E402
from torchnitro.autotune.recipes.hf_encoders import UnpaddedEncoder, find_encoders  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402
from torchnitro.hf import bert_config  # noqa: E402


def _auto(cfg) -> nn.Module:
    from transformers import AutoModel

    torch.manual_seed(0)
    return AutoModel.from_config(cfg, attn_implementation="sdpa").float().eval()


def _tiny_bert() -> nn.Module:
    return _auto(bert_config(hidden_size=32, intermediate_size=64))


def _roberta() -> nn.Module:
    from transformers import RobertaConfig

    return _auto(RobertaConfig(vocab_size=1024, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=80, pad_token_id=1))


def _distilbert() -> nn.Module:
    from transformers import DistilBertConfig

    return _auto(DistilBertConfig(vocab_size=1024, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                  max_position_embeddings=80))


def _ragged(batch: int, seq: int, seed: int, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1024, (batch, seq), generator=g)
    lens = torch.randint(1, seq + 1, (batch,), generator=g)
    lens[-1] = seq
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    return ids * mask + pad_id * (1 - mask), mask


class ScriptEncoder(nn.Module):
    """What a user writes in a script: their own class around ``AutoModel``, mean pooling over the mask."""

    def __init__(self, bert: nn.Module):
        super().__init__()
        self.bert = bert

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, D)
        m = mask.unsqueeze(-1).float()
        return (h * m).sum(1) / m.sum(1).clamp(min=1)


def _ctx(model: nn.Module, inputs, tmp_path) -> BuildContext:
    return BuildContext(model=copy.deepcopy(model), example_inputs=inputs, hardware=hardware_info(),
                        device=torch.device("cpu"), workdir=tmp_path, dynamic_dims={0: [0, 1], 1: [0, 1]})


@pytest.mark.parametrize("make", [_tiny_bert, _roberta, _distilbert], ids=["bert", "roberta", "distilbert"])
@pytest.mark.parametrize("shape", [(4, 16), (5, 23)])
def test_automodel_given_directly_keeps_its_output_type_and_matches_eager_on_real_tokens(make, shape):
    model = make()
    pad = int(model.config.pad_token_id or 0)
    ids, mask = _ragged(*shape, seed=1, pad_id=pad)
    fast = unpad_model(copy.deepcopy(model))
    assert isinstance(fast, UnpaddedEncoder)
    with torch.inference_mode():
        ref, out = model(ids, mask), fast(ids, mask)
    assert type(out) is type(ref) and list(out.keys()) == list(ref.keys())
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], rtol=1e-4, atol=1e-5)
    assert bool((out.last_hidden_state[~real] == 0).all())  # documented: zeros at masked positions
    if "pooler_output" in ref:
        torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-4, atol=1e-5)


def test_token_type_ids_keyword_call_and_tuple_return_are_mirrored():
    model = _tiny_bert()
    ids, mask = _ragged(3, 12, seed=2)
    tt = (torch.arange(12)[None] >= 6).long().expand(3, -1)  # sentence pairs
    fast = unpad_model(copy.deepcopy(model))
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, token_type_ids=tt, return_dict=False)
        out = fast(input_ids=ids, attention_mask=mask, token_type_ids=tt, return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(ref) == 2
    real = mask.bool()
    torch.testing.assert_close(out[0][real], ref[0][real], rtol=1e-4, atol=1e-5)


def test_calls_the_fast_path_does_not_mirror_run_the_original_module():
    model = _tiny_bert()
    ids, mask = _ragged(3, 10, seed=3)
    mask[1] = mask[1].flip(0)  # left padding: the pooler reads a padded position
    fast = unpad_model(copy.deepcopy(model))
    with torch.inference_mode():
        ref = model(ids, mask, output_hidden_states=True)
        out = fast(ids, mask, output_hidden_states=True)
        assert len(out.hidden_states) == len(ref.hidden_states)
        torch.testing.assert_close(fast(ids, mask).last_hidden_state, model(ids, mask).last_hidden_state)


def test_encoder_found_inside_a_wrapper_and_a_task_head():
    from transformers import BertForSequenceClassification

    wrapped = ScriptEncoder(_tiny_bert())
    assert [f.name for f in find_encoders(wrapped)] == ["bert"]
    assert bert_inapplicable_reason(wrapped) is None
    head = BertForSequenceClassification(bert_config(hidden_size=32, intermediate_size=64)).eval()
    assert [f.name for f in find_encoders(head)] == ["bert"]
    assert bert_inapplicable_reason(nn.Sequential(nn.Linear(4, 4))).startswith("no HF encoder of the BERT family")


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2Model

    reason = bert_inapplicable_reason(GPT2Model(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=100)))
    assert reason is not None and "not supported yet: GPT2Model" in reason


def build_in_script_class(name: str, encoder: nn.Module, example: tuple, held: tuple,
                          tmp_path) -> tuple[nn.Module, Any]:
    """Recipe ``name`` built on ``ScriptEncoder(encoder)`` (skipped where it cannot run here): the user's class runs
    the padding-free encoder, matches eager on ``held`` at its numeric class's floor and reloads as the same
    variant. Returns (the user's model, the Built)."""
    recipe = get_recipe(name)
    if recipe.unavailable_reason(hardware_info()) is not None:
        pytest.skip(recipe.unavailable_reason(hardware_info()))
    model = ScriptEncoder(encoder)
    built = recipe.build(_ctx(model, example, tmp_path))
    assert type(built.fn) is ScriptEncoder and isinstance(built.fn.bert, UnpaddedEncoder)  # the user's class runs
    with torch.inference_mode():
        ref, out = model(*held), built.fn(*held)
        again = recipe.load(tmp_path, built.meta, model)(*held)
    assert out.dtype == torch.float32
    floor = {"exact": 0.99999, "reduced": 0.999, "int8": 0.98}[recipe.numeric_class.value]
    assert float(torch.nn.functional.cosine_similarity(ref, out).min()) >= floor
    torch.testing.assert_close(again, out)  # the artifact rebuilds the same variant
    return model, built


@pytest.mark.parametrize("name", ["bert-unpad", "bert-unpad-int8", "bert-unpad-bf16"])
def test_recipes_apply_to_a_script_wrapper_in_place(tmp_path, name):
    model, _ = build_in_script_class(name, _tiny_bert(), _ragged(8, 24, seed=4), _ragged(6, 20, seed=5), tmp_path)
    assert isinstance(model.bert, type(_tiny_bert()))  # load() left the user's model alone


def test_int8_fallback_in_place_still_matches_eager(tmp_path):
    recipe = get_recipe("bert-unpad-int8")
    if recipe.unavailable_reason(hardware_info()) is not None:
        pytest.skip(recipe.unavailable_reason(hardware_info()))
    model = _tiny_bert()
    built = recipe.build(_ctx(model, _ragged(8, 24, seed=4), tmp_path))
    ids, mask = _ragged(3, 10, seed=6)
    with torch.inference_mode():  # an unmirrored call: the original fp32 module, untouched by int8 planning
        torch.testing.assert_close(built.fn(ids, mask, output_hidden_states=True).last_hidden_state,
                                   model(ids, mask).last_hidden_state)


# ---- optimize() on models as users hold them ------------------------------------------------------

def _tokenizer_output(batch: int = 6, seq: int = 20, seed: int = 7) -> dict[str, torch.Tensor]:
    ids, mask = _ragged(batch, seq, seed)
    return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}  # a tokenizer's order


@pytest.mark.parametrize("held", ["automodel", "wrapper"])
def test_optimize_applies_bert_unpad_and_verifies_on_real_positions(fast_cfg, held):
    import torchnitro

    bert = _tiny_bert()
    if held == "automodel":
        model, inputs = bert, _tokenizer_output()  # (c) dict inputs, AutoModel given directly
    else:
        enc = _tokenizer_output()
        model, inputs = ScriptEncoder(bert), (enc["input_ids"], enc["attention_mask"])
    om = torchnitro.optimize(model, inputs, fast_cfg(recipes=["bert-unpad"], min_speedup=0.0))
    cand = next(c for c in om.report.candidates if c.recipe == "bert-unpad")
    assert cand.status in ("verified", "chosen"), cand.reason
    assert om.recipe == "bert-unpad"
    if held == "automodel":
        assert any("gate compared real positions only" in n for n in om.report.notes)  # last_hidden_state masked
        enc = _tokenizer_output(seed=9)
        out, ref = om(**enc), bert(**enc)  # keyword call, as the tokenizer's output is used
        assert type(out) is type(ref)
        real = enc["attention_mask"].bool()
        torch.testing.assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(out.pooler_output, ref.pooler_output, rtol=1e-4, atol=1e-5)
    else:
        assert not any("real positions only" in n for n in om.report.notes)  # (B, D) sentences: compared whole
        assert om._fn.bert.fallback_calls == 0  # the gate ran the padding-free path, not the original module


def test_dict_inputs_map_to_forward_arguments_and_bad_keys_are_named():
    from torchnitro.autotune.inputs import inputs_from_mapping
    from torchnitro.errors import InputError

    bert = _tiny_bert()
    enc = _tokenizer_output()
    ids, tt, mask = enc["input_ids"], enc["token_type_ids"], enc["attention_mask"]
    got = inputs_from_mapping(bert, enc)
    assert got[0] is ids and got[1] is mask and got[2] is tt and len(got) == 3  # forward's order, not the dict's
    with pytest.raises(InputError, match=r"\['pixel_values'\] cannot be passed"):
        inputs_from_mapping(bert, {"input_ids": ids, "pixel_values": ids})

    class Features(nn.Module):  # sentence-transformers style: one dict argument
        def forward(self, features):
            return features["input_ids"]

    assert inputs_from_mapping(Features(), enc) == (enc,)


def test_hf_conv1d_is_quantised_by_the_int8_recipes(tmp_path):
    from transformers import AutoModelForCausalLM

    from torchnitro.autotune.recipes._util import is_hf_conv1d, linear_view
    from torchnitro.hf import gpt2_config

    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(gpt2_config(n_embd=32, n_layer=2, use_cache=False)).eval()
    n_conv = sum(1 for m in gpt2.modules() if is_hf_conv1d(m))
    assert n_conv == 8  # c_attn, c_proj, mlp.c_fc, mlp.c_proj per layer
    ids = torch.randint(0, 1024, (2, 12))
    with torch.inference_mode():
        torch.testing.assert_close(linear_view(gpt2)(ids).logits, gpt2(ids).logits, rtol=1e-4, atol=1e-5)
    for name in ("dynamic-int8", "int8-mixed"):
        recipe = get_recipe(name)
        if recipe.unavailable_reason(hardware_info()) is not None:
            continue
        built = recipe.build(BuildContext(model=copy.deepcopy(gpt2), example_inputs=(ids,), hardware=hardware_info(),
                                          device=torch.device("cpu"), workdir=tmp_path, dynamic_dims={0: [0]}))
        quantised = [n for n, m in built.fn.named_modules()
                     if "quantized" in type(m).__module__ or type(m).__name__ in ("OneDnnInt8Linear", "SmoothedInt8Linear")]
        assert sum(".mlp." in n or ".attn." in n for n in quantised) >= n_conv // 2, (name, quantised)  # not only lm_head


def test_use_cache_output_is_dropped_for_the_optimization(fast_cfg):
    from transformers import AutoModelForCausalLM

    import torchnitro
    from torchnitro.hf import gpt2_config

    torch.manual_seed(0)
    gpt2 = AutoModelForCausalLM.from_config(gpt2_config(n_embd=32, n_layer=1)).eval()
    assert gpt2.config.use_cache
    om = torchnitro.optimize(gpt2, (torch.randint(0, 1024, (2, 8)),), fast_cfg(recipes=["torchscript"], min_speedup=0.0))
    assert any("use_cache=False" in n for n in om.report.notes)
    assert gpt2.config.use_cache  # the user's model is left as it was
    ts = next(c for c in om.report.candidates if c.recipe == "torchscript")
    assert ts.status in ("verified", "chosen"), ts.reason


def _tiny_sentence_transformer(tmp_path, config=None) -> nn.Module:
    """A sentence-transformers model (Transformer -> mean Pooling -> Normalize) around a tiny random encoder
    of hidden size 32 (``config``; a BertModel's by default), with all-MiniLM-L6-v2's tokenizer files (no
    download)."""
    import shutil

    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers import models
    from transformers import AutoModel

    from torchnitro.hf import minilm_path

    torch.manual_seed(0)
    if config is None:
        config = bert_config(vocab_size=30522, hidden_size=32, intermediate_size=64)
    AutoModel.from_config(config).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        if (minilm_path() / f).exists():
            shutil.copy(minilm_path() / f, tmp_path / f)
    modules = [models.Transformer(str(tmp_path), model_kwargs={"local_files_only": True}),
               models.Pooling(32, "mean"), models.Normalize()]
    return st.SentenceTransformer(modules=modules, device="cpu").eval()


def test_sentence_transformer_as_it_is_with_its_feature_dict(tmp_path, fast_cfg):
    import torchnitro
    from torchnitro.hf import sample_sentences

    model = _tiny_sentence_transformer(tmp_path / "st")
    feats = model.preprocess(sample_sentences(6, 0, max_words=10))
    om = torchnitro.optimize(model, feats, fast_cfg(recipes=["bert-unpad", "bert-unpad-int8"], min_speedup=0.0))
    by = {c.recipe: c for c in om.report.candidates}
    assert by["bert-unpad"].status in ("verified", "chosen"), by["bert-unpad"].reason
    assert any("of 'token_embeddings'" in n for n in om.report.notes)  # token rows masked, sentences compared whole
    int8 = by["bert-unpad-int8"]
    if int8.status != "failed":  # the dict the model wrote its outputs into is reused: still the fast path
        assert int8.norm_rel > 0, "int8 ran the original fp32 module"
    held = model.preprocess(sample_sentences(4, 5, max_words=20))
    with torch.inference_mode():
        ref = model(dict(held))["sentence_embedding"]
    out = om(dict(held))["sentence_embedding"]
    assert float(torch.nn.functional.cosine_similarity(out, ref).min()) > 0.98


@pytest.mark.parametrize("make", [_roberta, _distilbert], ids=["roberta", "distilbert"])
def test_sentence_encoder_around_roberta_and_distilbert_gets_the_fused_variant(make):
    from torchnitro.autotune.recipes.bert_unpad import UnpaddedBert
    from torchnitro.hf import SentenceEncoder

    model = SentenceEncoder(make()).eval()
    assert bert_inapplicable_reason(model) is None
    fast = unpad_model(copy.deepcopy(model))
    assert isinstance(fast, UnpaddedBert)
    ids, mask = _ragged(5, 19, seed=8, pad_id=int(model.encoder.config.pad_token_id or 0))
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids, mask), model(ids, mask), rtol=1e-4, atol=1e-5)
