"""torchnitro.optimize / load / OptimizedModel from Python."""

from __future__ import annotations

import pytest
import torch

import torchnitro
from torchnitro.errors import InputError


def test_spec_string_and_callable_result(fast_cfg, tmp_path):
    opt = torchnitro.optimize("mlp", config=fast_cfg(recipes=["torchscript"]))
    assert isinstance(opt, torchnitro.OptimizedModel) and opt.recipe in ("eager", "torchscript")
    x = torch.randn(5, 512)
    from torchnitro.nn.zoo import get_builtin

    torch.testing.assert_close(opt(x), get_builtin("mlp").build()(x), rtol=1e-4, atol=1e-5)
    assert opt.report.model == "mlp" and opt.numeric_class == "exact"
    assert "torchscript" in opt.report.to_markdown() and '"chosen"' in opt.report.to_json()


@pytest.mark.parametrize("bad,match", [({"config": {"budget_s": 3}}, "OptimizeConfig"),
                                       ({"example_inputs": "text"}, "expected a tensor"),
                                       ({"example_inputs": ()}, "received nothing")])
def test_bad_arguments(bad, match):
    kw = {"example_inputs": (torch.randn(2, 4),)}
    kw.update(bad)
    with pytest.raises(InputError, match=match):
        torchnitro.optimize(torch.nn.Linear(4, 2), **kw)
    with pytest.raises(InputError, match="nn.Module"):
        torchnitro.optimize(42, (torch.randn(2, 4),))


def test_training_mode_model_is_optimized_in_eval(fast_cfg):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    model.train()
    opt = torchnitro.optimize(model, (torch.randn(4, 8),), fast_cfg(recipes=[]))
    x = torch.randn(3, 8)
    torch.testing.assert_close(opt(x), opt(x))  # dropout is off
    assert model.training  # the user's module is left as it was


def test_two_input_hf_model_signature(fast_cfg, tmp_path):
    pytest.importorskip("transformers")
    from torchnitro.autotune.inputs import model_and_inputs

    model, inputs, info = model_and_inputs("hf-bert-tiny", batch=2, seq=16)
    opt = torchnitro.optimize(model, inputs, fast_cfg(recipes=["onnxruntime"], min_speedup=0.0), info=info)
    assert opt.recipe == "onnxruntime", opt.report
    names = [i["name"] for i in opt.signature["inputs"]]
    assert len(names) == 2 and all(i["shape"] == [-1, -1] for i in opt.signature["inputs"])
    loaded = torchnitro.load(opt.save(tmp_path / "bert"))
    x = info.make_inputs(3, 9, 5)
    torch.testing.assert_close(loaded(*x), model(*x), rtol=1e-4, atol=1e-4)
