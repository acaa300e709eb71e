from __future__ import annotations

import pytest
import torch

from torchnitro.autotune.recipe import get_recipe
from torchnitro.hardware import hardware_info
from torchnitro.nn.zoo import get_builtin


def test_bf16_availability_follows_cpu_flags():
    hw = hardware_info()
    why = get_recipe("bf16").unavailable_reason(hw)
    assert (why is None) == (hw.cpu_bf16 or hw.has_gpu)
    assert get_recipe("fp16").gpu_only


@pytest.mark.parametrize("name", ["mlp", "encoder"])
def test_bf16_outputs_fp32_and_close(build, name):
    b = get_builtin(name)
    model = b.build()
    x = b.inputs(2, 16, 0)
    _, built, _ = build("bf16", model, x)
    y, ref = built.fn(*x), model(*x)
    assert y.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(y.flatten(), ref.flatten(), dim=0) > 0.999
    assert not torch.equal(y, ref)


@pytest.mark.gpu
def test_fp16_on_gpu(build):
    b = get_builtin("mlp")
    model = b.build().cuda()
    x = tuple(t.cuda() for t in b.inputs(8, 0, 0))
    _, built, _ = build("fp16", model, x, device="cuda")
    y, ref = built.fn(*x), model(*x)
    assert y.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(y.flatten(), ref.flatten(), dim=0) > 0.999
