"""``torchnitro.optimize`` on a Hugging Face ``pipeline`` as the user holds it: the example is what the
pipeline is called with, the result is called the same way and answers the same (labels equal, scores
and embeddings within the gate's tolerance) on texts the search never saw; save/load; bad input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import torchnitro  # noqa: E402
from torchnitro.autotune.pipelines import OptimizedPipeline, PipelineModel, is_pipeline  # noqa: E402
from torchnitro.errors import ArtifactError, InputError  # noqa: E402

_WORDS = ("the a model runs fast on this machine while every user waits for reply from server batch of sentences "
          "goes through layers attention heads look at each token and pooled vector describes meaning").split()
TEXTS = ["the model runs fast on this machine", "every user waits for a reply", "attention heads look at each token"]
HELD = ["a batch of sentences goes through layers", "the server waits", "pooled vector describes meaning of the batch"]
TASKS = {  # task -> transformers model class
    "text-classification": "BertForSequenceClassification",
    "feature-extraction": "BertModel",
    "fill-mask": "BertForMaskedLM",
    "token-classification": "BertForTokenClassification",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    import inspect

    from transformers import BertTokenizerFast

    vocab = tmp_path_factory.mktemp("tok") / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + sorted(set(_WORDS))) + "\n")
    arg = "vocab" if "vocab" in inspect.signature(BertTokenizerFast.__init__).parameters else "vocab_file"  # 5.x / 4.x
    tok = BertTokenizerFast(**{arg: str(vocab)})
    assert len(tok) == 5 + len(set(_WORDS)), len(tok)
    return tok


def _pipe(task: str, tokenizer):
    import transformers

    from torchnitro.hf import bert_config

    torch.manual_seed(0)
    cfg = bert_config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      max_position_embeddings=64, num_labels=3)
    model = getattr(transformers, TASKS[task])(cfg).eval()
    return transformers.pipeline(task, model=model, tokenizer=tokenizer, device="cpu")


def _masked(texts: list[str]) -> list[str]:
    return [t.replace(t.split()[1], "[MASK]", 1) for t in texts]


def _assert_same(task: str, got, ref) -> None:
    if task == "feature-extraction":  # (1, T, D) nested lists per text
        for g, r in zip(got, ref):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(r), rtol=1e-4, atol=1e-4)
        return
    for g, r in zip(got, ref):
        g, r = (g if isinstance(g, list) else [g]), (r if isinstance(r, list) else [r])
        assert len(g) == len(r)
        for a, b in zip(g, r):
            label = "entity" if task == "token-classification" else "token" if task == "fill-mask" else "label"
            assert a[label] == b[label], (a, b)
            assert abs(float(a["score"]) - float(b["score"])) < 1e-4, (a, b)


@pytest.mark.parametrize("task", list(TASKS))
def test_optimized_pipeline_answers_like_the_pipeline_on_held_out_texts(task, tokenizer, fast_cfg):
    pipe = _pipe(task, tokenizer)
    model_before = pipe.model
    texts, held = (TEXTS, HELD) if task != "fill-mask" else (_masked(TEXTS), _masked(HELD))
    opt = torchnitro.optimize(pipe, texts, fast_cfg(recipes=["torchscript"], min_speedup=0.0))
    assert isinstance(opt, OptimizedPipeline)
    assert pipe.model is model_before and not isinstance(pipe.model, PipelineModel)  # the user's pipe as it was
    assert isinstance(opt.pipeline.model, PipelineModel)
    ts = next(c for c in opt.report.candidates if c.recipe == "torchscript")
    assert opt.recipe == "torchscript", ts.reason  # min_speedup 0: the verified variant answers, not eager
    assert opt.report.inputs.startswith("int64[3x")  # the three texts padded into one batch
    got, ref = opt(held), pipe(held)
    _assert_same(task, got, ref)
    if task == "text-classification":  # the pipeline's own keywords pass through
        _assert_same(task, opt(held, top_k=None), pipe(held, top_k=None))


def test_the_optimized_model_answers_in_the_hf_output_class(tokenizer, fast_cfg):
    from transformers.modeling_outputs import SequenceClassifierOutput

    pipe = _pipe("text-classification", tokenizer)
    opt = torchnitro.optimize(pipe, "the model runs fast", fast_cfg(recipes=["torchscript"], min_speedup=0.0))
    pm = opt.pipeline.model
    assert pm.config is pipe.model.config  # attributes read from the HF model
    enc = tokenizer(HELD, padding=True, return_tensors="pt")
    out = pm(**enc, use_cache=False)
    assert isinstance(out, SequenceClassifierOutput)
    with torch.inference_mode():
        torch.testing.assert_close(out.logits, pipe.model(**enc).logits, rtol=1e-4, atol=1e-5)
    assert isinstance(pm._as_output((out.logits,)), SequenceClassifierOutput)  # a runtime's tuple is rebuilt


def test_a_tokenizer_dict_is_taken_as_the_example(tokenizer, fast_cfg):
    pipe = _pipe("feature-extraction", tokenizer)
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    opt = torchnitro.optimize(pipe, enc, fast_cfg(recipes=["torchscript"], min_speedup=0.0))
    assert opt.report.inputs.startswith(f"int64[3x{enc['input_ids'].shape[1]}]")
    _assert_same("feature-extraction", opt(HELD), pipe(HELD))


def test_held_out_batches_carry_the_example_dicts_keys(tokenizer):
    from torchnitro.autotune.pipelines import pipeline_workload

    pipe = _pipe("feature-extraction", tokenizer)
    enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
    _, inputs, info = pipeline_workload(pipe, {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    assert len(inputs) == 2 and len(info.make_inputs(2, 8, 0)) == 2  # no token_type_ids the example did not have
    _, inputs, info = pipeline_workload(pipe, {"input_ids": enc["input_ids"], "position_ids": enc["attention_mask"]})
    assert info.make_inputs is None  # a key the pipeline's preprocessing does not make: random_like instead


def test_example_rows_are_the_pipelines_own_preprocessing_padded(tokenizer):
    from torchnitro.autotune.pipelines import pipeline_workload

    pipe = _pipe("token-classification", tokenizer)
    model, inputs, info = pipeline_workload(pipe, ["the model", "every user waits for a reply"])
    assert model is pipe.model
    ids, mask, tt = inputs  # BertForTokenClassification.forward's order
    ref = tokenizer(["the model", "every user waits for a reply"], padding=True, return_tensors="pt")
    assert torch.equal(ids, ref["input_ids"]) and torch.equal(mask, ref["attention_mask"])
    assert torch.equal(tt, ref["token_type_ids"])
    assert info.dynamic_dims == {0: [0, 1], 1: [0, 1], 2: [0, 1]}
    held = info.make_inputs(4, 6, 1)
    assert held[0].shape == (4, 6) and held[1].shape == (4, 6)
    assert not torch.equal(held[0], info.make_inputs(4, 6, 2)[0])  # other sentences per seed
    fm = _pipe("fill-mask", tokenizer)
    _, _, fm_info = pipeline_workload(fm, "the [MASK] runs")
    assert all(int((row == tokenizer.mask_token_id).sum()) == 1 for row in fm_info.make_inputs(3, 40, 0)[0])


def test_save_and_load_the_pipeline(tokenizer, fast_cfg, tmp_path):
    from torchnitro.autotune.api import load_pipeline

    pipe = _pipe("text-classification", tokenizer)
    opt = torchnitro.optimize(pipe, TEXTS, fast_cfg(recipes=["torchscript"], min_speedup=0.0))
    path = opt.save(tmp_path / "art")
    assert (path / "pipeline" / "pipeline.json").is_file() and (path / "pipeline" / "config.json").is_file()
    om = torchnitro.load(path, model=pipe.model, trust_code=True)  # the optimized model itself
    assert isinstance(om, torchnitro.OptimizedModel)
    on_pipe = load_pipeline(path, pipe, trust_code=True)  # swapped into (a copy of) the user's pipeline
    _assert_same("text-classification", on_pipe(HELD), pipe(HELD))
    rebuilt = load_pipeline(path, trust_code=True)  # task, tokenizer and config from the artifact
    assert rebuilt.pipeline.tokenizer.get_vocab() == tokenizer.get_vocab()
    assert rebuilt.pipeline.model.config.num_labels == 3
    assert opt.optimized.candidate.standalone  # TorchScript: the answer comes from the artifact alone
    _assert_same("text-classification", rebuilt(HELD), pipe(HELD))
    with pytest.raises(ArtifactError, match=r"exists and is not a saved pipeline"):
        opt.save(tmp_path)  # holds other things: not overwritten
    (path / "pipeline" / "tokenizer.json").write_text("{}")
    with pytest.raises(ArtifactError, match=r"files changed or missing \['tokenizer.json'\]"):
        load_pipeline(path, trust_code=True)


def test_padding_free_encoder_behind_a_pipeline_and_its_weights_loaded_back(tokenizer, fast_cfg, tmp_path):
    from torchnitro.autotune.api import load_pipeline

    pipe = _pipe("feature-extraction", tokenizer)
    opt = torchnitro.optimize(pipe, TEXTS, fast_cfg(recipes=["bert-unpad"], min_speedup=0.0))
    assert opt.recipe == "bert-unpad", [(c.recipe, c.status, c.reason) for c in opt.report.candidates]
    _assert_same("feature-extraction", opt(HELD), pipe(HELD))  # one text per call: no padded positions
    path = opt.save(tmp_path / "art")
    assert not opt.optimized.candidate.standalone  # rebuilt from the eager model: the saved weights
    rebuilt = load_pipeline(path)  # random-init model from the saved config, then the artifact's weights
    _assert_same("feature-extraction", rebuilt(HELD), pipe(HELD))


def test_bad_pipeline_inputs_are_named(tokenizer):
    pipe = _pipe("feature-extraction", tokenizer)
    with pytest.raises(InputError, match=r"received an empty list; expected .* a string"):
        torchnitro.optimize(pipe, [])
    with pytest.raises(InputError, match=r"received NoneType; expected what the pipeline is called with"):
        torchnitro.optimize(pipe)
    with pytest.raises(InputError, match=r"received a list holding \['int'\]"):
        torchnitro.optimize(pipe, [1, 2])
    with pytest.raises(InputError, match=r"received an empty dict"):
        torchnitro.optimize(pipe, {})
    with pytest.raises(InputError, match=r"FillMaskPipeline.preprocess raised .* expected text this pipeline accepts"):
        torchnitro.optimize(_pipe("fill-mask", tokenizer), "no mask token here")


def test_unsupported_pipelines_are_named(tokenizer):
    import copy

    pipe = _pipe("feature-extraction", tokenizer)
    tf = copy.copy(pipe)
    tf.framework = "tf"
    with pytest.raises(InputError, match=r"framework 'tf' .* expected a PyTorch pipeline"):
        torchnitro.optimize(tf, "the model")

    from transformers import Pipeline

    class ImagePipeline(Pipeline):  # a non-text pipeline (no tokenizer, not a supported task)
        def _sanitize_parameters(self, **kw):
            return {}, {}, {}

        def preprocess(self, x):
            return x

        def _forward(self, x):
            return x

        def postprocess(self, x):
            return x

    img = ImagePipeline(model=pipe.model, task="image-classification", device="cpu")
    assert is_pipeline(img) and not is_pipeline(pipe.model)
    with pytest.raises(InputError, match=r"received a ImagePipeline \(task 'image-classification'\); expected one of"):
        torchnitro.optimize(img, "x")
