"""Guards the public names: every name in __all__ resolves, in the package and in each module."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import torchnitro

OPTIONAL = {"torchnitro.hf", "torchnitro.serve.server"}  # need extras; tested where installed


def _modules():
    for info in pkgutil.walk_packages(torchnitro.__path__, "torchnitro."):
        if info.name.endswith("__main__") or (info.name + ".").startswith("torchnitro.xla."):
            continue  # xla modules import jax, which only tests/xla/ may import (tests/xla/test_public.py)
        yield info.name


@pytest.mark.parametrize("name", torchnitro.__all__)
def test_top_level_names_resolve(name):
    assert getattr(torchnitro, name) is not None


@pytest.mark.parametrize("modname", sorted(_modules()))
def test_every_module_declares_all(modname):
    try:
        mod = importlib.import_module(modname)
    except ImportError as exc:
        if modname in OPTIONAL:
            pytest.skip(f"{modname} needs an optional extra: {exc}")
        raise
    assert hasattr(mod, "__all__"), f"{modname} has no __all__"
    for n in mod.__all__:
        assert hasattr(mod, n), f"{modname}.__all__ lists {n!r} but it is not defined"
