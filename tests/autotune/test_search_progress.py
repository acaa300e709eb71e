"""The search's progress bar shows on a terminal and in a Jupyter notebook, never in a file or pipe."""

from __future__ import annotations

import io
import sys

import pytest

from torchnitro.autotune.workload import SearchProgress


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("tty, jupyter, shown", [(True, False, True), (False, True, True), (False, False, False)])
def test_progress_shows_on_a_terminal_and_in_a_notebook(monkeypatch, tty, jupyter, shown):
    monkeypatch.setattr(sys, "stderr", _Stream(tty))
    monkeypatch.setattr("rich.console._is_jupyter", lambda: jupyter)
    monkeypatch.setattr("rich.progress.Progress.start", lambda self: None)  # no live display thread in the test
    p = SearchProgress(True, total=3)
    assert (p.p is not None) is shown
    p.step("building", advance=1)
    if shown:
        assert p.p.tasks[0].completed == 1 and p.p.tasks[0].description == "building"
    monkeypatch.setattr("rich.progress.Progress.stop", lambda self: None)
    p.close()
    assert SearchProgress(False, total=3).p is None  # progress=False: never
