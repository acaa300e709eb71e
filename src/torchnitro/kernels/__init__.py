"""torchnitro.kernels."""

__all__: list[str] = []
