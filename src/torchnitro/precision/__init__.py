"""torchnitro.precision."""

__all__: list[str] = []
