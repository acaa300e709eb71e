"""CUDA graphs (and the other GPU recipes): GPU only (skipped on CPU by the gpu marker)."""

from __future__ import annotations

import pytest
import torch

from torchnitro.autotune.recipe import get_recipe
from torchnitro.hardware import hardware_info
from torchnitro.nn.zoo import get_builtin


def test_gpu_recipes_say_why_on_cpu():
    hw = hardware_info()
    for name in ("cuda-graphs", "compile-reduce-overhead", "fp16", "tensorrt"):
        why = get_recipe(name).unavailable_reason(hw)
        assert (why is None) == hw.has_gpu or name == "tensorrt"
        if not hw.has_gpu:
            assert "GPU" in why


@pytest.mark.gpu
def test_cuda_graphs_replay_and_copies(build):
    from torchnitro.autotune.verify import collect, judge

    b = get_builtin("encoder")
    model = b.build().cuda()
    x = tuple(t.cuda() for t in b.inputs(2, 16, 0))
    _, built, _ = build("cuda-graphs", model, x, device="cuda")
    sets = [tuple(t.cuda() for t in b.inputs(2, 16, s)) for s in (1, 2)]
    ref = [f for f, *_ in collect(model, sets)]
    gate = judge(collect(built.fn, sets), ref, {"rel": 1e-4})
    assert gate.passed, gate.reason
    assert len(built.fn.graphs) == 1
    built.fn(*tuple(t.cuda() for t in b.inputs(4, 8, 3)))
    assert len(built.fn.graphs) == 2
