"""torchnitro.memory."""

__all__: list[str] = []
