"""The time limit of one candidate's in-process work (building it, preparing its program).

Below both ``evaluate`` and ``program``, which use it; a child process is limited from outside instead
(``evaluate.run_isolated`` kills it).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["CandidateTimeout", "time_limit", "timed_out"]


class CandidateTimeout(Exception):
    """The candidate ran past its time limit."""


def timed_out(exc: BaseException | None) -> CandidateTimeout | None:
    """The ``CandidateTimeout`` in ``exc``'s chain (``__cause__`` / ``__context__``), or None: a library that
    wraps what it catches (torch.onnx's dynamo exporter raises ConversionError from it) must not turn the
    time limit into a failure of the model's own."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CandidateTimeout):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class time_limit:
    """Raise CandidateTimeout in the main thread after ``seconds`` (no-op off the main thread)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.active = (threading.current_thread() is threading.main_thread() and seconds > 0
                       and hasattr(signal, "setitimer"))  # POSIX main thread only

    def _fire(self, signum: int, frame: Any) -> None:
        raise CandidateTimeout(f"ran past its {self.seconds:.0f} s limit")

    def __enter__(self) -> "time_limit":
        if self.active:
            self.old = signal.signal(signal.SIGALRM, self._fire)
            signal.setitimer(signal.ITIMER_REAL, self.seconds)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.old)
