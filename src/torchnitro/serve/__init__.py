"""torchnitro.serve."""

__all__: list[str] = []
