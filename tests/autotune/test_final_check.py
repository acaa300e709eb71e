"""The drift check brackets the final comparison (``autotune.final_check``): eager alone before and after it, the
check against their mean, a machine that changed speed told apart from the comparison's error, the run after
skipped (and said so) when the budget has no room for it. Fakes only: no process starts, nothing is timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fake_recipes import eager_and_cand_report

from torchnitro.autotune import fair
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.final_budget import FinalBudget
from torchnitro.autotune.final_check import Alone, DriftCheck, bracket_check
from torchnitro.bench.isolated import ChildTimer
from torchnitro.bench.timing import Timing


class _Idle(ChildTimer):
    """Stands for eager's timing process: the check only asks whether eager has one (``final_trials.child_of``)."""

    def __init__(self) -> None:  # no process
        self.failed = None


class _Machine:
    """The fake interleaved run: a run of eager's processes alone takes the next of ``alone_ms``, a comparison the
    next of ``inside_ms`` for eager (the candidate 5 ms); ``advance_s`` moves ``clock`` after each comparison."""

    def __init__(self, alone_ms: list[float], inside_ms: list[float], clock: list[float] | None = None,
                 advance_s: float = 0.0):
        self.alone_ms, self.inside_ms, self.clock, self.advance_s = list(alone_ms), list(inside_ms), clock, advance_s
        self.log: list[str] = []

    def __call__(self, s, report, fns, tc) -> dict[str, Timing]:
        solo = all(n.startswith("eager") for n in fns)
        self.log.append("alone" if solo else "comparison")
        eager_ms = (self.alone_ms if solo else self.inside_ms).pop(0)
        if not solo and self.clock is not None:
            self.clock[0] += self.advance_s
        return {n: Timing([(eager_ms if n.startswith("eager") else 5.0) / 1e3] * 5) for n in fns}


def _check(machine: _Machine, budget: FinalBudget | None = None, eager=None):
    """Runs the check with ``machine``; returns the report."""
    s = SimpleNamespace(cfg=OptimizeConfig(final_min_time_s=1.0, final_min_iters=3), device=SimpleNamespace(type="cpu"),
                        final_budget=budget or FinalBudget.unlimited())
    report = eager_and_cand_report()
    fns = {"eager": fair.Steady(eager if eager is not None else _Idle()), "cand": lambda k: 5e-3}
    DriftCheck(s, report, machine, search_ms=10.0, search_cv=0.0).comparison(fns)
    return report


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch):
    monkeypatch.setattr(fair, "SETTLE_S", 0.0)


def _check_note(report) -> str:
    notes = [n for n in report.notes if n.startswith("eager p50 alone")]
    assert len(notes) == 1, report.notes
    return notes[0]


def test_an_eager_whose_speed_changes_between_before_and_after_is_machine_drift_not_the_comparisons_error():
    """Eager alone 10 ms before, 13 ms after (the machine slowed), 11.5 ms inside: against the run before only
    (the old check) that is +15% and a redo blamed on the comparison; against the mean it is 0%, and the note says
    the machine changed."""
    m = _Machine(alone_ms=[10.0, 13.0], inside_ms=[11.5])
    report = _check(m)
    assert m.log == ["alone", "comparison", "alone"]  # no redo
    note = _check_note(report)
    assert note.startswith("eager p50 alone (its own process, nothing else running) 11.500 ms, inside the comparison "
                           "11.500 ms (+0.0%; allowed ±5.0%)")
    assert "a solo run right before the comparison, 10.000 ms, and one right after it, 13.000 ms, +30.0% apart: more " \
           "than the band, so the machine changed speed while the comparison ran, which is not the comparison's " \
           "error" in note
    assert not any(n.startswith("final comparison redone") for n in report.notes)
    assert not report.get("eager").redone


def test_outside_the_band_with_a_changing_machine_the_note_does_not_blame_the_comparison():
    m = _Machine(alone_ms=[10.0, 13.0, 17.0], inside_ms=[16.0, 20.0])  # the machine keeps slowing
    report = _check(m)
    assert m.log == ["alone", "comparison", "alone", "comparison", "alone"]  # redone once: the chain goes on
    note = _check_note(report)
    assert "13.000 ms, and one right after it, 17.000 ms" in note and "machine changed speed" in note
    assert note.endswith("still outside the band after the redo, so the check cannot vouch for the comparison either "
                         "way (the speedups below are ratios inside one interleaved run, where a change of the "
                         "machine's speed hits eager and every finalist)")
    assert "carry that error" not in note


def test_a_steady_machine_and_a_disturbed_eager_is_the_comparisons_error_redone_between_the_next_two_alone_runs():
    """Eager alone 10 ms throughout, 13 ms inside the first comparison: the comparison's error (the alone runs
    agree), redone; the redo is checked between the run after the first comparison and a new one (three alone runs,
    not four)."""
    m = _Machine(alone_ms=[10.0, 10.0, 10.0], inside_ms=[13.0, 10.1])
    report = _check(m)
    assert m.log == ["alone", "comparison", "alone", "comparison", "alone"]
    redone = [n for n in report.notes if n.startswith("final comparison redone after a 0 s pause: first run's")]
    assert len(redone) == 1 and "inside the comparison 13.000 ms (+30.0%" in redone[0]
    assert "+0.0% apart, within the band" in redone[0] and "machine changed" not in redone[0]
    note = _check_note(report)
    assert "inside the comparison 10.100 ms (+1.0%; allowed ±5.0%)" in note and "within the band" in note
    assert report.get("eager").redone and report.get("cand").redone


def test_a_comparison_still_disturbed_after_the_redo_carries_its_error():
    report = _check(_Machine(alone_ms=[10.0, 10.0, 10.0], inside_ms=[13.0, 13.0]))
    assert _check_note(report).endswith("still outside the band after the redo, so the speedups below carry that "
                                        "error")


def test_no_room_for_the_run_after_falls_back_to_the_run_before_with_a_note():
    """100 s left at first; the comparison takes 99.9 of them: eager alone after it (half the comparison's 1 s
    measured, 0.5 s at the overhead the fakes leave, 1 wall s per measured s) does not fit, nor does a redo."""
    clock = [0.0]
    budget = FinalBudget(100.0, lambda: clock[0])
    m = _Machine(alone_ms=[10.0], inside_ms=[13.0], clock=clock, advance_s=99.9)
    report = _check(m, budget)
    assert m.log == ["alone", "comparison"]
    note = _check_note(report)
    assert note.startswith("eager p50 alone (its own process, nothing else running) 10.000 ms, inside the comparison "
                           "13.000 ms (+30.0%")
    assert "eager alone after the comparison skipped: budget (0 s left, needs ~0 s)" in note
    assert "so eager alone is the run before the comparison only" in note and "right after it" not in note
    assert "final comparison redo skipped: budget (0 s left" in note and note.endswith("carry that error")


def test_eager_timed_in_this_process_is_checked_against_its_search_time_p50_only():
    m = _Machine(alone_ms=[], inside_ms=[10.2])
    report = _check(m, eager=lambda k: 1e-2)
    assert m.log == ["comparison"]  # no solo run before or after: eager here has no process of its own
    note = _check_note(report)
    assert note == ("eager p50 alone (search time: this process, before any candidate ran) 10.000 ms, inside the "
                    "comparison 10.200 ms (+2.0%; allowed ±5.0%)")


def test_bracket_check_uses_the_mean_and_the_band_of_both_runs():
    res = {"eager": Timing([11e-3] * 5), "eager-2": Timing([12e-3] * 5), "eager-3": Timing([13e-3] * 5)}
    before = Alone(10.0, 0.02, "median of its 3 own processes' p50s, nothing else running", "9 / 10 / 11 ms")
    after = Alone(14.0, 0.06, "median of its 3 own processes' p50s, nothing else running", "13 / 14 / 15 ms")
    check = bracket_check(before, after, res)
    assert check.alone_ms == pytest.approx(12.0) and check.drift == pytest.approx(0.0)
    assert check.band == pytest.approx(0.08)  # 2 x the mean cv, 4%
    assert check.gap == pytest.approx(0.4) and check.machine_changed and check.ok
    assert check.where == ("(median of its 3 own processes' p50s, nothing else running: before 9 / 10 / 11 ms, after "
                           "13 / 14 / 15 ms)")
    single = bracket_check(before, None, res, "why")
    assert single.alone_ms == 10.0 and single.gap == 0.0 and not single.machine_changed
    assert single.text().endswith("; why") and "right after" not in single.text()
