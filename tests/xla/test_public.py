"""Every name in the xla modules' ``__all__`` resolves (tests/test_public_api.py leaves xla to us: jax)."""

from __future__ import annotations

import importlib

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: pip install 'torchnitro[xla]'")

import torchnitro.xla as xla  # noqa: E402


@pytest.mark.parametrize("name", xla.__all__)
def test_xla_names_resolve(name):
    assert getattr(xla, name) is not None


@pytest.mark.parametrize("mod", xla._SUBMODULES)
def test_every_xla_module_declares_all(mod):
    m = importlib.import_module(f"torchnitro.xla.{mod}")
    for n in m.__all__:
        assert hasattr(m, n), f"torchnitro.xla.{mod}.__all__ lists {n!r} but it is not defined"
