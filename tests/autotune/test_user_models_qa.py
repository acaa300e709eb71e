"""QA from a user's side (task E6): models and calls the recipes were not written around."""

from __future__ import annotations

import dataclasses
import sys
from typing import NamedTuple, Optional

import pytest
import torch
from torch import nn


class _Scaled(nn.Module):
    """A user's model with a defaulted non-tensor argument the example does not pass."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.act = lambda t: t * 2  # a lambda attribute, as scripts have

    def forward(self, x, mask=None, scale=1.0):
        y = self.act(self.lin(x)) * scale
        return y if mask is None else y * mask[..., None]


@pytest.mark.parametrize("n_inputs", [1, 2])
def test_onnx_export_keeps_defaulted_arguments_constant(tmp_path, n_inputs):
    """A defaulted forward argument that is not given (``scale=1.0``) must not become an ONNX graph input
    that no call feeds (it did: ORT failed with "Required inputs (['onnx::Cast_2']) are missing")."""
    pytest.importorskip("onnxruntime")
    from torchnitro.autotune.recipes.onnx import OrtRunner, export_onnx

    torch.manual_seed(0)
    model = _Scaled().eval()
    args = (torch.randn(3, 8), torch.ones(3))[:n_inputs]
    meta = export_onnx(model, args, tmp_path / "m.onnx", {i: [0] for i in range(n_inputs)})
    runner = OrtRunner(tmp_path / "m.onnx", meta, threads=1)
    held = (torch.randn(5, 8), torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0]))[:n_inputs]
    with torch.no_grad():
        torch.testing.assert_close(runner(*held), model(*held), rtol=1e-4, atol=1e-5)


class _Pair(NamedTuple):
    emb: torch.Tensor
    score: torch.Tensor


class _Outputs(nn.Module):
    """Returns what users' models return: ``how`` in ('namedtuple', 'none', 'hf')."""

    def __init__(self, how: str):
        super().__init__()
        self.how, self.lin = how, nn.Linear(8, 4)

    def forward(self, x):
        y = self.lin(x)
        if self.how == "namedtuple":
            return _Pair(y, y.sum(-1))
        if self.how == "none":
            return y, None, y.relu()
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=y)


@pytest.mark.parametrize("how", ["namedtuple", "none", "hf"])
def test_flat_runtimes_answer_in_the_models_output_type(tmp_path, how):
    """An ONNX Runtime (or OpenVINO, or loaded-program) variant rebuilds eager's own output type: an HF
    ModelOutput (read as ``out.logits``), a namedtuple, a tuple with None in its place (they came back as a
    plain dict, a plain tuple, and a shorter tuple: ``a, b, c = opt(x)`` failed)."""
    pytest.importorskip("onnxruntime")
    if how == "hf":
        pytest.importorskip("transformers")
    from torchnitro.autotune.recipes.onnx import OrtRunner, export_onnx

    torch.manual_seed(0)
    model = _Outputs(how).eval()
    x = torch.randn(3, 8)
    meta = export_onnx(model, (x,), tmp_path / "m.onnx", {0: [0]})
    got, ref = OrtRunner(tmp_path / "m.onnx", meta, threads=1)(x), model(x)
    assert type(got) is type(ref)
    if how == "none":
        assert got[1] is None and len(got) == 3
        got, ref = (got[0], got[2]), (ref[0], ref[2])
    torch.testing.assert_close(tuple(got.values()) if how == "hf" else tuple(got),
                               tuple(ref.values()) if how == "hf" else tuple(ref), rtol=1e-4, atol=1e-5)


def test_an_output_class_is_never_imported_by_name():
    """The recorded class is looked up among imported modules only: an artifact cannot make load import code."""
    from torchnitro.autotune.recipes._util import restructure

    kind = {"kind": "dict", "names": ["a"], "class": "some_module_never_imported_here:Evil"}
    assert type(restructure(kind, [torch.ones(1)])) is dict
    assert "some_module_never_imported_here" not in sys.modules


@pytest.mark.parametrize("how", ["namedtuple", "none"])
def test_torchscript_variant_keeps_the_output_type_and_loads_back(tmp_path, fast_cfg, how):
    """The TorchScript recipe on a namedtuple and a ``(y, None, z)`` output: chosen (forced), it answers in
    eager's type before and after save/load (the trace failed on the None and returned the namedtuple as a
    plain tuple)."""
    import torchnitro

    torch.manual_seed(0)
    model = _Outputs(how).eval()
    x = torch.randn(3, 8)
    om = torchnitro.optimize(model, (x,), config=fast_cfg(recipes=["torchscript"], min_speedup=0.0, finalists=1))
    assert om.recipe == "torchscript", [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    loaded = torchnitro.load(om.save(tmp_path / "a"), trust_code=True)  # a TorchScript archive is code
    ref = model(x)
    for got in (om(x), loaded(x)):
        assert type(got) is type(ref) and len(got) == len(ref)
        for g, r in zip(got, ref):
            assert (g is None and r is None) or torch.allclose(g, r, atol=1e-6)


def test_meta_tensors_are_named_before_the_search(fast_cfg):
    """An example or a model on device 'meta' (an empty-weights init) is refused up front with what was
    received (it failed deep in the search with "Tensor.item() cannot be called on meta tensors")."""
    import torchnitro
    from torchnitro.errors import InputError

    model = nn.Sequential(nn.Linear(8, 4)).eval()
    with pytest.raises(InputError, match=r"example_inputs: received tensor\(s\) \[0\] on device 'meta'"):
        torchnitro.optimize(model, torch.randn(2, 8, device="meta"), config=fast_cfg())
    with pytest.raises(InputError, match=r"model: received Sequential with 2 parameter.*'meta' \(e.g. '0.weight'\)"):
        torchnitro.optimize(model.to("meta"), {"input": torch.randn(2, 8)}, config=fast_cfg())


@dataclasses.dataclass
class _Emb:
    emb: torch.Tensor
    score: torch.Tensor
    extra: Optional[torch.Tensor] = None


class _DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, x):
        y = self.lin(x)
        return _Emb(y, y.sum(-1))


@pytest.mark.parametrize("recipe", ["eager", "onnxruntime"])
def test_a_dataclass_output_is_verified_and_given_back(fast_cfg, recipe):
    """A model returning its own dataclass of tensors is optimized (it was refused: "returned _Emb with no
    tensors") and the variant answers with that dataclass."""
    import torchnitro

    if recipe == "onnxruntime":
        pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model, x = _DataclassOut().eval(), torch.randn(3, 8)
    om = torchnitro.optimize(model, (x,), config=fast_cfg(recipes=[recipe], min_speedup=0.0, finalists=1))
    assert om.recipe == recipe, [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    got, ref = om(x), model(x)
    assert type(got) is _Emb and got.extra is None
    torch.testing.assert_close((got.emb, got.score), (ref.emb, ref.score), rtol=1e-4, atol=1e-5)


def test_openvino_variant_answers_in_the_models_output_class(fast_cfg):
    """OpenVINO builds in a child process that never imported the output's class: the structure it records
    must be the parent's (an HF ModelOutput came back as a plain dict)."""
    pytest.importorskip("transformers")
    import torchnitro
    from torchnitro.autotune.recipe import get_recipe
    from torchnitro.hardware import hardware_info

    why = get_recipe("openvino").unavailable_reason(hardware_info())
    if why:
        pytest.skip(f"openvino recipe unavailable here: {why}")
    from transformers.modeling_outputs import SequenceClassifierOutput

    torch.manual_seed(0)
    model, x = _Outputs("hf").eval(), torch.randn(3, 8)
    om = torchnitro.optimize(model, (x,), config=fast_cfg(recipes=["openvino"], min_speedup=0.0, finalists=1))
    assert om.recipe == "openvino", [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    got = om(x)
    assert type(got) is SequenceClassifierOutput
    torch.testing.assert_close(got.logits, model(x).logits, rtol=1e-4, atol=1e-5)


def test_saving_an_artifact_that_serve_cannot_load_warns(fast_cfg, tmp_path):
    """A script's model (no factory reference) under an in-process recipe: the artifact needs the model object
    to load, so ``torchnitro serve DIR`` failed at start-up; save() says so when it writes it."""
    import torchnitro

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(4, 16)
    om = torchnitro.optimize(model, (x,), config=fast_cfg(recipes=["dynamic-int8"], min_speedup=0.0, finalists=1))
    assert om.recipe == "dynamic-int8", [(c.recipe, c.status, c.reason) for c in om.report.candidates]
    with pytest.warns(UserWarning, match=r"`torchnitro serve DIR` cannot load it"):
        path = om.save(tmp_path / "a")
    torch.testing.assert_close(torchnitro.load(path, model=model)(x), om(x))  # the documented way still loads


def test_a_model_in_train_mode_is_optimized_in_eval_mode_and_the_report_says_so(fast_cfg):
    """``from_config`` gives an HF model in train mode: it is optimized in eval mode (dropout off), the user's
    object stays in train mode, and the report says so (it was switched silently)."""
    import torchnitro

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 4)).train()
    x = torch.randn(4, 8)
    om = torchnitro.optimize(model, (x,), config=fast_cfg(recipes=[]))
    assert model.training
    assert any("train mode" in n and "eval mode" in n for n in om.report.notes), om.report.notes
    torch.testing.assert_close(om(x), model.eval()(x))
