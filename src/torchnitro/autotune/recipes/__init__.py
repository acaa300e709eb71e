"""Built-in recipes. Importing this package registers them all: every module in this folder is
imported once, in name order, and registers its recipes with ``@register_recipe``.

A module that fails to import (a missing optional dependency, a broken install) costs only its own
recipes: the failure is kept in ``BROKEN`` and reported with one warning, and the others still load.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings

__all__ = ["BROKEN"]

BROKEN: dict[str, str] = {}  # module name -> why it failed to import


def _load_all(paths: list[str], package: str) -> None:
    for info in sorted(pkgutil.iter_modules(paths), key=lambda i: i.name):
        try:
            importlib.import_module(f"{package}.{info.name}")
        except Exception as exc:  # noqa: BLE001 - one broken recipe module must not disable the others
            BROKEN[info.name] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"recipe module {package}.{info.name} failed to import ({BROKEN[info.name]}); "
                          "its recipes are unavailable", stacklevel=2)


_load_all(list(__path__), __name__)
