"""torchnitro.hrr."""

__all__: list[str] = []
