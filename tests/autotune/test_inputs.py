"""Model and input specs: built-ins, factories, files, and their errors."""

from __future__ import annotations

import pytest
import torch

from torchnitro.autotune.inputs import parse_input_spec, random_like, rebuild_model, model_and_inputs, signature_of
from torchnitro.errors import InputError


@pytest.mark.parametrize("text,shape,dtype", [
    ("32x128:int64", (32, 128), torch.int64), ("8x3x224x224", (8, 3, 224, 224), torch.float32),
    ("4x16:bf16", (4, 16), torch.bfloat16), ("2x5:int64:10-20", (2, 5), torch.int64),
])
def test_parse_input_spec(text, shape, dtype):
    s = parse_input_spec(text)
    assert s.shape == shape and s.dtype == dtype
    t = s.make(0)
    assert t.shape == shape and t.dtype == dtype
    if text.endswith("10-20"):
        assert int(t.min()) >= 10 and int(t.max()) < 20


@pytest.mark.parametrize("bad,match", [("32x", "not an input spec"), ("axb", "not an input spec"),
                                       ("4x0", "zero"), ("4x4:int7", "unknown dtype"), ("4:int64:5-5", "empty")])
def test_bad_input_specs(bad, match):
    with pytest.raises(InputError, match=match):
        parse_input_spec(bad)


def test_builtin_and_sizes():
    model, inputs, info = model_and_inputs("encoder", batch=2, seq=16)
    assert inputs[0].shape == (2, 16) and info.spec == "encoder" and info.dynamic_dims == {0: [0, 1]}
    assert not model.training
    with pytest.raises(InputError, match="unknown built-in"):
        model_and_inputs("no-such-model")
    with pytest.raises(InputError, match="--input"):
        model_and_inputs("mlp", ["4x512"])


def test_factory_file_and_module(tmp_path, monkeypatch):
    f = tmp_path / "mymodels.py"
    f.write_text("import torch\n"
                 "def build():\n    return torch.nn.Linear(8, 2)\n"
                 "def with_inputs():\n    return torch.nn.Linear(8, 2), (torch.randn(3, 8),)\n"
                 "def not_a_model():\n    return 3\n")
    model, inputs, info = model_and_inputs(f"{f}:build", ["5x8"])
    assert inputs[0].shape == (5, 8) and model(inputs[0]).shape == (5, 2)
    monkeypatch.syspath_prepend(str(tmp_path))
    _, inputs, info = model_and_inputs("mymodels:with_inputs")
    assert inputs[0].shape == (3, 8) and info.spec == "mymodels:with_inputs"
    assert isinstance(rebuild_model("mymodels:build"), torch.nn.Linear)
    with pytest.raises(InputError, match="no example inputs"):
        model_and_inputs("mymodels:build")
    with pytest.raises(InputError, match="returned int"):
        model_and_inputs("mymodels:not_a_model")
    with pytest.raises(InputError, match="no callable"):
        model_and_inputs("mymodels:missing")
    with pytest.raises(InputError, match="cannot import"):
        model_and_inputs("no_such_module_xyz:build")
    with pytest.raises(InputError, match="does not exist"):
        model_and_inputs(f"{tmp_path}/nope.py:build")
    with pytest.raises(InputError, match="does not exist"):
        model_and_inputs(f"hf:{tmp_path}/no-folder")


def test_random_like_keeps_ranges_and_signature():
    ids = torch.randint(5, 9, (4, 6))
    x = torch.randn(4, 3) * 10 + 3
    rid, rx = random_like((ids, x), seed=1)
    assert rid.dtype == torch.int64 and int(rid.min()) >= 5 and int(rid.max()) <= 8
    assert rx.shape == x.shape and not torch.equal(rx, x)
    sig = signature_of(torch.nn.Linear(3, 2), (x,), [("output", torch.zeros(4, 2))], {0: [0]}, [[("output", torch.zeros(2, 2))]])
    assert sig == {"inputs": [{"name": "input", "dtype": "float32", "shape": [-1, 3]}],
                   "outputs": [{"name": "output", "dtype": "float32", "shape": [-1, 2]}]}


def test_random_like_keeps_attention_masks_right_padded_and_fills_feature_dicts():
    lens = torch.tensor([3, 8, 1, 5])
    mask = (torch.arange(8)[None] < lens[:, None]).long()  # (B, T) right padding
    ids = torch.randint(1, 50, (4, 8)) * mask
    new_ids, new_mask = random_like((ids, mask), seed=3)
    assert new_mask.dtype == mask.dtype and bool((new_mask[:, 0] == 1).all())  # every sentence has a first token
    assert bool((new_mask[:, 1:] <= new_mask[:, :-1]).all()) and not torch.equal(new_mask, mask)
    (feats,) = random_like(({"input_ids": ids, "attention_mask": mask, "modality": "text"},), seed=3)
    assert feats["modality"] == "text" and torch.equal(feats["attention_mask"], new_mask)
    assert not torch.equal(feats["input_ids"], ids)
    real = set(ids[mask != 0].tolist())  # held-out token ids: the example's own tokens, padded with its pad id
    assert set(new_ids[new_mask != 0].tolist()) <= real and bool((new_ids[new_mask == 0] == 0).all())
    zeros = torch.zeros(4, 8, dtype=torch.long)  # token_type_ids of single sentences: not a mask
    assert torch.equal(random_like((zeros,), seed=3)[0], zeros)


class _FeatureModel(torch.nn.Module):
    """A model called with one feature dict, as sentence-transformers calls its modules."""

    def forward(self, features: dict) -> torch.Tensor:
        return features["input_ids"].float().mean(1)


@pytest.mark.parametrize("dims", [{0: [0, 1]}, {}], ids=["batch-and-sequence", "none-declared"])
def test_signature_records_the_tensors_inside_a_feature_dict(dims):
    from torchnitro.autotune.inputs import input_signature

    feats = {"input_ids": torch.ones(3, 7, dtype=torch.int64), "attention_mask": torch.ones(3, 7, dtype=torch.int32),
             "lengths": torch.full((3,), 7), "modality": "text"}
    out = torch.zeros(3)
    sig = signature_of(_FeatureModel(), (feats,), [("out", out)], dims)
    seq = -1 if dims else 7  # a tensor in a dict varies in its input's declared dims, else in the batch only
    assert sig["inputs"] == [] and sig["input_fields"] == [
        {"name": "features['input_ids']", "path": ["features", "input_ids"], "dtype": "int64", "shape": [-1, seq]},
        {"name": "features['attention_mask']", "path": ["features", "attention_mask"], "dtype": "int32",
         "shape": [-1, seq]},
        {"name": "features['lengths']", "path": ["features", "lengths"], "dtype": "int64", "shape": [-1]}]
    assert input_signature((feats,)) == ("dict(input_ids: int64[3x7], attention_mask: int32[3x7], "
                                         "lengths: int64[3], modality: str)")
    assert "input_fields" not in signature_of(_FeatureModel(), (torch.ones(3, 7),), [("out", out)], dims)
