"""Guards the public names: every name in __all__ resolves, in the package and in each module."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

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


def test_every_subpackage_is_a_top_level_name():
    """Each subpackage is ``torchnitro.<name>`` after a plain ``import torchnitro`` (README's entry points)."""
    root = Path(torchnitro.__file__).parent
    subpackages = {d.name for d in root.iterdir() if (d / "__init__.py").is_file()}
    assert {"distributed", "xla", "serve", "profile"} <= subpackages
    missing = subpackages - set(torchnitro.__all__)
    assert not missing, f"subpackages not in torchnitro.__all__: {sorted(missing)}"


def test_subpackages_resolve_lazily_without_jax():
    """``torchnitro.distributed`` and ``torchnitro.xla`` resolve as attributes; neither ``import torchnitro`` nor
    ``torchnitro.xla`` imports jax (or jaxlib: the TPU path costs nothing to users who do not use it), and
    ``import torchnitro`` alone imports neither torch nor a subpackage."""
    code = ("import sys, torchnitro\n"
            "eager = sorted(m for m in sys.modules if m.startswith('torchnitro.'))\n"
            "torch_loaded = 'torch' in sys.modules\n"
            "d, x = torchnitro.distributed, torchnitro.xla\n"
            "print(eager, torch_loaded, d.__name__, x.__name__, 'jax' in sys.modules, 'MeshConfig' in dir(x), "
            "'jax' in sys.modules or 'jaxlib' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['torchnitro._lazy',", "'torchnitro.version']", "False", "torchnitro.distributed", "torchnitro.xla", "False",
                                  "True", "False"], out.stdout + out.stderr


def test_unknown_top_level_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="'torchnitro' has no attribute 'nope'"):
        torchnitro.nope  # noqa: B018


def test_lazy_names_import_on_first_read_and_cache_in_the_package():
    from torchnitro._lazy import lazy_names
    from torchnitro.errors import InputError

    ns: dict = {"__name__": "torchnitro"}
    names, getattr_, dir_ = lazy_names(ns, {"InputError": "torchnitro.errors"}, ["hardware"], eager=["__version__"])
    assert names == dir_() == ["InputError", "__version__", "hardware"]
    assert getattr_("InputError") is InputError and ns["InputError"] is InputError
    assert getattr_("hardware").__name__ == "torchnitro.hardware" and "hardware" in ns
    with pytest.raises(AttributeError, match="module 'torchnitro' has no attribute 'hard'"):
        getattr_("hard")


def test_version_matches_pyproject():
    tomllib = pytest.importorskip("tomllib", reason="Python < 3.11 has no tomllib")
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    assert torchnitro.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]
