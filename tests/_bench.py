"""Loads a script from benchmarks/ as a module, for the tests of that script (benchmarks/ is not a package).

Imported by the test files as ``from _bench import load_benchmark``: tests/ is on sys.path because pytest puts the
folder of tests/conftest.py there (the default ``prepend`` import mode).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: the memory test's fresh interpreter loads this module bare
    import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

__all__ = ["BENCHMARKS", "load_benchmark"]


def load_benchmark(name: str, monkeypatch: pytest.MonkeyPatch | None = None, *, module_name: str | None = None,
                   on_path: bool = False) -> ModuleType:
    """A fresh module made from ``benchmarks/<name>.py``.

    With ``monkeypatch`` the module is registered in ``sys.modules`` under ``module_name`` (default ``name``) while it
    runs and until the test ends: the scripts whose dataclasses, pickles or timing children look the module up by
    name need it there. ``on_path`` also puts benchmarks/ first on ``sys.path`` for the test, for scripts that import
    a helper module beside them.
    """
    path = BENCHMARKS / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
        raise FileNotFoundError(f"no benchmark script {path}; expected one of: {', '.join(known)}")
    if on_path and monkeypatch is None:
        raise TypeError(f"load_benchmark({name!r}, on_path=True) needs the test's monkeypatch to undo the sys.path "
                        "change; received monkeypatch=None")
    module_name = module_name or name
    spec = importlib.util.spec_from_file_location(module_name, path)
    assert spec is not None and spec.loader is not None, path  # a .py file always has a source loader
    mod = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        if on_path:
            monkeypatch.syspath_prepend(str(BENCHMARKS))
        monkeypatch.setitem(sys.modules, module_name, mod)
    spec.loader.exec_module(mod)
    return mod
