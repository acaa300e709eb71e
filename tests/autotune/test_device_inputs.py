"""A variant called with tensors on another device than the one it runs on.

``device='auto'`` optimizes onto the GPU where one is visible, while a model from ``from_pretrained`` and its
tokenizer's tensors stay on the CPU: the call ``opt(**tokenizer(texts))`` used to fail deep in the model
("Expected all tensors to be on the same device", seen on an H200 machine). It now runs: inputs are copied to the
variant's device, the outputs back, with one warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import torchnitro
from torchnitro.autotune.api import OptimizedModel
from torchnitro.autotune.recipe import CandidateFiles


class _Seen:
    """A variant that records the devices it was called with and answers on the CPU."""

    def __init__(self):
        self.devices: list[str] = []

    def __call__(self, x, mask):
        self.devices += [x.device.type, mask.device.type]
        return {"y": torch.ones(2, 3), "n": 7}


def _om(fn, device):
    return OptimizedModel(fn, "eager", None, {}, CandidateFiles(), device=device)  # no report: not used by a call


def test_inputs_on_another_device_are_moved_there_and_outputs_back_with_one_warning():
    fn = _Seen()
    # 'meta' stands in for the GPU here: a device type other than the inputs' (a CPU machine has no second one)
    om = _om(fn, torch.device("meta"))
    x, mask = torch.randn(2, 4), torch.ones(2, 4, dtype=torch.long)
    with pytest.warns(UserWarning, match=r"runs on meta .* received inputs on cpu"):
        out = om(x, mask)
    assert fn.devices == ["meta", "meta"]  # without the fix: ['cpu', 'cpu'] (the variant's device error)
    assert out["y"].device.type == "cpu" and out["n"] == 7
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per optimized model
        om(x, mask)
    assert fn.devices[2:] == ["meta", "meta"]


def test_inputs_already_there_are_passed_as_they_are():
    fn = _Seen()
    om = _om(fn, torch.device("cpu"))
    x = torch.randn(2, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        om(x, torch.ones(2, 4))
    assert fn.devices == ["cpu", "cpu"]


def test_optimize_records_the_device_the_variant_runs_on(fast_cfg):
    opt = torchnitro.optimize(torch.nn.Linear(8, 4), (torch.randn(4, 8),), fast_cfg(recipes=[], device="cpu"))
    assert opt.device == torch.device("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a CPU-held model optimized onto it")
def test_cpu_held_model_optimized_onto_the_gpu_answers_cpu_calls(fast_cfg):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(4, 8)
    opt = torchnitro.optimize(model, (x,), fast_cfg(recipes=[], device="cuda"))
    with pytest.warns(UserWarning, match="received inputs on cpu"):
        out = opt(torch.randn(6, 8))
    assert out.device.type == "cpu"
    y = torch.randn(5, 8)
    torch.testing.assert_close(opt(y), model(y), rtol=1e-4, atol=1e-4)
