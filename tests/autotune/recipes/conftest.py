from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.recipe import BuildContext, get_recipe
from torchnitro.hardware import hardware_info


def build_in(root, name, model, inputs, dynamic_dims=None, device="cpu"):
    """Build recipe ``name`` on a copy of ``model`` in ``root / name``, one thread -> (recipe, Built, workdir)."""
    r = get_recipe(name)
    work = root / name
    work.mkdir(exist_ok=True)
    ctx = BuildContext(copy.deepcopy(model).eval(), tuple(inputs), hardware_info(), torch.device(device), work,
                       dynamic_dims or {}, OptimizeConfig(threads=1))
    return r, r.build(ctx), work


@pytest.fixture
def build(tmp_path):
    """build(name, model, inputs, dynamic_dims) -> (recipe, Built, workdir)."""

    def go(name, model, inputs, dynamic_dims=None, device="cpu"):
        return build_in(tmp_path, name, model, inputs, dynamic_dims, device)

    return go


@pytest.fixture(scope="module")
def built_once(tmp_path_factory):
    """built_once(name, make) -> (recipe, Built, workdir): recipe ``name`` built once per module on the model of
    ``make() -> (model, inputs, dynamic_dims, ...)``, shared by the tests that only read the build (``make`` must
    seed its model: each call gives the same weights)."""
    done: dict[tuple[str, Callable[..., Any]], Any] = {}

    def go(name, make):
        if (name, make) not in done:
            model, x, dyn = make()[:3]
            done[name, make] = build_in(tmp_path_factory.mktemp(name), name, model, x, dyn)
        return done[name, make]

    return go
