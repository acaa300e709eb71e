"""The time limit of one candidate's in-process work (building it, preparing its program).

Below both ``evaluate`` and ``program``, which use it; a child process is limited from outside instead
(``evaluate.run_isolated`` kills it).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

__all__ = ["CandidateTimeout", "time_limit"]


class CandidateTimeout(Exception):
    """The candidate ran past its time limit."""


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
