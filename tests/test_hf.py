from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from torchnitro.errors import InputError  # noqa: E402
from torchnitro.hf import (bert_config, gpt2_config, llama_config, load_hf, minilm_inputs, random_hf_model,  # noqa: E402
                           sample_sentences, tokenize)
from torchnitro.nn.zoo import get_builtin, list_builtins  # noqa: E402


def test_builtins_registered():
    names = list_builtins()
    for n in ("minilm", "hf-bert-tiny", "hf-gpt2-tiny", "hf-llama-tiny"):
        assert n in names


def test_sample_sentences_deterministic_and_varied():
    a, b = sample_sentences(6, seed=1), sample_sentences(6, seed=1)
    assert a == b and sample_sentences(6, seed=2) != a
    assert len({len(s.split()) for s in a}) > 1


def test_minilm_inputs_shape_and_determinism():
    ids, mask = minilm_inputs(4, 32, seed=0)
    assert ids.shape == mask.shape == (4, 32) and ids.dtype == mask.dtype == torch.int64
    assert torch.equal(ids, minilm_inputs(4, 32, seed=0)[0])
    assert (ids[:, 0] == 101).all()  # [CLS]
    assert ((ids == 0) == (mask == 0)).all()  # padding is exactly the masked positions
    short = tokenize(["hi"], "minilm", 8)
    assert short[1].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0]]  # [CLS] hi [SEP] + padding


def test_minilm_matches_sentence_transformers_pooling():
    """The wrapper is mean pooling over the mask + L2 norm of the BERT output (sentence-transformers)."""
    b = get_builtin("minilm")
    model = b.build()
    ids, mask = b.inputs(3, 24, 5)
    with torch.inference_mode():
        emb = model(ids, mask)
        hidden = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    expect = torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=1)
    assert emb.shape == (3, 384) and emb.dtype == torch.float32
    torch.testing.assert_close(emb, expect)
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(3))
    # semantics sanity check with real weights: paraphrases are closer than unrelated sentences
    x = tokenize(["How do I bake bread?", "What is the way to make bread?", "The stock market fell today."],
                 "minilm", 16)
    with torch.inference_mode():
        e = model(*x)
    assert (e[0] @ e[1]) > (e[0] @ e[2]) + 0.2


@pytest.mark.parametrize("cfg,expect_dim", [(bert_config, 64), (gpt2_config, 1024), (llama_config, 1024)])
def test_random_hf_architectures(cfg, expect_dim):
    from transformers import AutoModel, AutoModelForCausalLM

    model = random_hf_model(cfg())
    ids = torch.randint(1, 1024, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: pooling and attention (causal too) must respect the mask
    with torch.inference_mode():
        out = model(ids, mask)
    assert isinstance(out, torch.Tensor) and out.shape[-1] == expect_dim and torch.isfinite(out).all()
    again = random_hf_model(cfg())
    with torch.inference_mode():
        torch.testing.assert_close(again(ids, mask), out)  # seeded weights
    # values: transformers' own model on the same seed, eager attention, pooled by hand here
    decoder = expect_dim == 1024
    torch.manual_seed(0)
    hf = (AutoModelForCausalLM if decoder else AutoModel).from_config(cfg(), attn_implementation="eager").eval()
    with torch.inference_mode():
        ho = hf(input_ids=ids, attention_mask=mask, use_cache=False)
    if decoder:  # logits (B, T, V); padded positions are not compared
        keep = mask.bool()
        torch.testing.assert_close(out[keep], ho.logits[keep], rtol=1e-4, atol=1e-4)
    else:  # sentence embedding: mean over real tokens, then L2 norm
        m = mask.unsqueeze(-1).float()
        pooled = (ho.last_hidden_state * m).sum(1) / m.sum(1)
        torch.testing.assert_close(out, pooled / pooled.norm(dim=1, keepdim=True), rtol=1e-4, atol=1e-4)


def test_load_hf_local_folder(tmp_path):
    model = random_hf_model(bert_config(vocab_size=30522), sentence_embedding=False)  # MiniLM tokenizer ids
    model.model.save_pretrained(tmp_path)
    import shutil

    from torchnitro.hf import minilm_path

    shutil.copy(minilm_path() / "tokenizer.json", tmp_path / "tokenizer.json")
    m, inputs, info = load_hf(tmp_path, text="a test sentence", batch=3, seq=12)
    assert inputs[0].shape == (3, 12) and info["model_type"] == "bert" and not info["sentence_embedding"]
    with torch.inference_mode():
        out = m(*inputs)
    assert out.shape == (3, 12, 64)
    json.dumps({k: v for k, v in info.items() if k != "make_inputs"})
    assert info["make_inputs"](2, 8, 1)[0].shape == (2, 8)


def test_load_hf_errors(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_hf(tmp_path / "missing")
    with pytest.raises(InputError, match="no config.json"):
        load_hf(tmp_path)
    with pytest.raises(InputError, match="expected a non-empty list"):
        tokenize("just a string", "minilm", 8)


def test_loading_a_model_sets_offline_mode(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    get_builtin("hf-bert-tiny").build()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"
