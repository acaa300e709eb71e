"""Lazy public names for a package ``__init__`` (PEP 562), shared by ``torchnitro`` and ``torchnitro.xla``.

A package lists its names as data: ``exports`` maps a public name to the module that defines it, and
``submodules`` names its subpackages. Nothing is imported until a name is first read; the value is then
stored in the package's namespace, so later reads skip ``__getattr__``. This module imports only the
standard library: ``import torchnitro`` must stay cheap (no torch, no jax).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable, Mapping

__all__ = ["lazy_names"]


def lazy_names(namespace: dict[str, Any], exports: Mapping[str, str], submodules: Iterable[str],
               eager: Iterable[str] = ()) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for the package whose ``globals()`` is ``namespace``.

    ``eager`` names are defined in the package itself (``__version__``) and only join ``__all__``.
    """
    package = namespace["__name__"]
    subs = frozenset(submodules)
    names = sorted({*exports, *subs, *eager})

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
        elif name in subs:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return names

    return names, __getattr__, __dir__
