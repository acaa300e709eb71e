from __future__ import annotations

import copy

import pytest
import torch

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.recipe import BuildContext, get_recipe
from torchnitro.hardware import hardware_info


@pytest.fixture
def build(tmp_path):
    """build(name, model, inputs, dynamic_dims) -> (recipe, Built, workdir)."""

    def go(name, model, inputs, dynamic_dims=None, device="cpu"):
        r = get_recipe(name)
        work = tmp_path / name
        work.mkdir(exist_ok=True)
        ctx = BuildContext(copy.deepcopy(model).eval(), tuple(inputs), hardware_info(), torch.device(device), work,
                           dynamic_dims or {}, OptimizeConfig(threads=1))
        return r, r.build(ctx), work

    return go
