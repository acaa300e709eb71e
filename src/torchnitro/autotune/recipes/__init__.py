"""Built-in recipes. Importing this package registers them all: every module in this folder is
imported once, in name order, and registers its recipes with ``@register_recipe``."""

from __future__ import annotations

import importlib
import pkgutil

__all__: list[str] = []

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
    importlib.import_module(f"{__name__}.{_info.name}")
