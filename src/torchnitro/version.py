"""The package version, in a module of the lowest layer: modules that report it (servers, artifact manifests)
import it from here rather than from the ``torchnitro`` facade."""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"  # keep equal to pyproject.toml's [project] version (tests/test_public_api.py checks)
