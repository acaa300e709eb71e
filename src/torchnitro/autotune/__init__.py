"""torchnitro.autotune: the engine behind ``torchnitro.optimize`` (recipes, gate, search, artifacts).

The package is not named ``optimize`` so that ``torchnitro.optimize`` stays the function.
"""

__all__: list[str] = []
