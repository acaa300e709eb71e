"""The drift check around the final comparison (``autotune.final``): eager alone before and after it.

Eager alone is a short solo run of eager's own timing processes (nothing else is timed; with several, the median of
their p50s, as inside the comparison). One runs right before the comparison and one right after it, and eager's p50
inside the comparison is checked against the mean of the two (``fair.check_eager``'s band): a drift of the machine's
speed linear across the comparison cancels, as in the chain of alone sets of ``benchmarks/timing_fairness.py``. Two
alone runs that differ by more than the band themselves say the machine changed speed while the comparison ran,
which is not the comparison's error; the note says so instead of blaming the comparison
(``fair.EagerCheck.machine_changed``). Outside the band the comparison is redone once after ``fair.SETTLE_S`` and
followed by one more alone run: the redo is checked between the run after the first comparison and that one (the
chain goes on). Eager timed in this process is checked against its search-time p50 only (measured before any
candidate ran; timed here after the comparison it would carry the pools the candidates left behind). The run after
a comparison runs only when it fits the final phase's budget (``FinalBudget``); otherwise the check uses the run
before alone, and its note says why.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable

from torchnitro.autotune import fair
from torchnitro.autotune.fair_eager import EagerBaseline, is_eager
from torchnitro.autotune.final_trials import child_of
from torchnitro.autotune.recipe import EAGER
from torchnitro.autotune.report import Report
from torchnitro.bench.timing import Timing, TimingConfig

if TYPE_CHECKING:
    from torchnitro.autotune.search import _Search

__all__ = ["Alone", "DriftCheck", "bracket_check", "solo_timing"]

# One interleaved run of ``fns`` (``final._compare_finalists``: a dead timing process is dropped from ``fns``)
Run = Callable[[Any, Report, dict[str, Callable[..., Any]], TimingConfig], dict[str, Timing]]


@dataclasses.dataclass(frozen=True)
class Alone:
    """One measurement of eager alone."""

    ms: float  # p50 (several processes: the median of their p50s)
    cv: float | None
    how: str  # how it was measured, for the report: "its own process", "median of its 3 own processes' p50s", ...
    per_process: str = ""  # every process's p50 when there are several
    own: bool = True  # a solo run of eager's own timing processes; False: its search-time p50 in this process

    def where(self) -> str:
        return f"({self.how}{': ' + self.per_process if self.per_process else ''})"


def bracket_check(before: Alone, after: Alone | None, res: dict[str, Timing], single: str = "") -> fair.EagerCheck:
    """Eager inside the comparison ``res`` (the median of its processes' p50s) against the mean of eager alone
    ``before`` and ``after`` it, or against ``before`` only (``after`` None; ``single`` says why, for the report)."""
    base = EagerBaseline.of(res)
    inside = f"(median of the same {base.k} processes' p50s: {base.per_process_text()})" if base.k > 1 else ""
    if after is None:
        return dataclasses.replace(fair.check_eager(before.ms, before.cv, base, before.where(), inside), single=single)
    cv = statistics.fmean([before.cv or 0.0, after.cv or 0.0])
    per = f"before {before.per_process}, after {after.per_process}" if before.per_process else ""
    where = dataclasses.replace(before, per_process=per).where()
    check = fair.check_eager((before.ms + after.ms) / 2, cv, base, where, inside)
    return dataclasses.replace(check, before_ms=before.ms, after_ms=after.ms)


def solo_timing(min_time_s: float, device: str) -> TimingConfig:
    """A short solo run's timing: half the comparison's measured time ``min_time_s`` per entry, a few rounds."""
    return TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, min_time_s=min_time_s / 2, max_time_s=max(2.0, min_time_s),
                        device=device)


def _eagers(fns: dict[str, Callable[..., Any]]) -> int:
    return len([n for n in fns if is_eager(n)])


@dataclasses.dataclass
class DriftCheck:
    """The final comparison of ``s`` with eager alone around it; ``run`` times one interleaved run."""

    s: _Search
    report: Report
    run: Run
    search_ms: float  # eager's search-time p50: this process, before any candidate ran
    search_cv: float | None

    def alone(self, fns: dict[str, Callable[..., Any]], min_time_s: float) -> Alone:
        """Eager alone: a short solo run of eager's own timing processes (half ``min_time_s`` each), or, for eager
        timed in this process, its search-time p50. A process that dies is dropped from ``fns`` as in the
        comparison."""
        here = Alone(self.search_ms, self.search_cv, "search time: this process, before any candidate ran", own=False)
        if child_of(fns[EAGER]) is None:
            return here
        tc = solo_timing(min_time_s, self.s.device.type)
        solo = {n: f for n, f in fns.items() if is_eager(n)}
        res = self._timed(solo, tc)
        for n in [n for n in fns if is_eager(n) and n not in solo]:
            del fns[n]
        fns[EAGER] = solo[EAGER]
        if child_of(solo[EAGER]) is None:  # every eager process died: eager is timed here now
            return here
        base = EagerBaseline.of(res)
        if base.k == 1:
            return Alone(base.median * 1e3, base.cv, "its own process, nothing else running")
        return Alone(base.median * 1e3, base.cv, f"median of its {base.k} own processes' p50s, nothing else running",
                     base.per_process_text())

    def after(self, fns: dict[str, Callable[..., Any]], min_time_s: float) -> tuple[Alone | None, str]:
        """Eager alone right after a comparison, or None and why not ("" for eager timed in this process, whose
        reference is its search-time p50 by design)."""
        if child_of(fns[EAGER]) is None:
            return None, ""
        need = self.s.final_budget.run_s(_eagers(fns), min_time_s / 2)
        why = self.s.final_budget.skip_reason("eager alone after the comparison", need)
        if why is not None:
            return None, f"{why}, so eager alone is the run before the comparison only"
        got = self.alone(fns, min_time_s)
        if not got.own:
            return None, ("eager's timing processes died in the run after the comparison, so eager alone is the run "
                          "before it only")
        return got, ""

    def comparison(self, fns: dict[str, Callable[..., Any]]) -> dict[str, Timing]:
        """Eager alone, the final comparison shortened to the budget left (``FinalBudget.fit``), eager alone again,
        the check; redone once after ``fair.SETTLE_S`` when eager inside is outside the band and the redo fits."""
        s, report = self.s, self.report
        cfg, fb = s.cfg, s.final_budget
        iters = max(cfg.final_min_iters, 30) if cfg.percentile == "p99" else cfg.final_min_iters  # a p99 needs samples
        tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=iters, min_time_s=cfg.final_min_time_s,
                          max_time_s=max(5.0, cfg.final_min_time_s * 3), device=s.device.type)
        first, _ = fb.fit(tc, len(fns), 1.0 + 2 * self._solo_share(fns))  # alone before and after, the comparison
        before = self.alone(fns, first.min_time_s)
        share = 1.0 + self._solo_share(fns)  # what is left: the comparison and the alone run after it
        tc, short = fb.fit(tc, len(fns), share)  # with the overhead eager alone measured
        if short:
            report.notes.append(f"final comparison {short}")
        res, after, check = self._bracketed(fns, tc, before)
        skipped = None
        if not check.ok:
            skipped = fb.skip_reason("final comparison redo", fair.SETTLE_S + fb.run_s(len(fns), tc.min_time_s) * share)
        if not check.ok and skipped is None:
            report.notes.append(f"final comparison redone after a {fair.SETTLE_S:g} s pause: first run's {check.text()}")
            time.sleep(fair.SETTLE_S)
            # the chain goes on: the run after the first comparison is the one before the redo
            before = after if after is not None else self.alone(fns, tc.min_time_s)
            res, after, check = self._bracketed(fns, tc, before)
            for name in res:
                report.get(EAGER if is_eager(name) else name).redone = True
        report.notes.append(_verdict(check, skipped))
        return res

    def _timed(self, fns: dict[str, Callable[..., Any]], tc: TimingConfig) -> dict[str, Timing]:
        """One interleaved run of ``fns``, its wall time taught to the final budget (``FinalBudget.learn_run``)."""
        t0 = time.perf_counter()
        res = self.run(self.s, self.report, fns, tc)  # drops a dead timing process from fns, as before
        self.s.final_budget.learn_run(time.perf_counter() - t0, len(fns), tc.min_time_s)
        return res

    def _solo_share(self, fns: dict[str, Callable[..., Any]]) -> float:
        """One alone run in units of the comparison's time: half the time per eager process, none for eager here."""
        return _eagers(fns) / (2 * len(fns)) if child_of(fns[EAGER]) is not None else 0.0

    def _bracketed(self, fns: dict[str, Callable[..., Any]], tc: TimingConfig,
                   before: Alone) -> tuple[dict[str, Timing], Alone | None, fair.EagerCheck]:
        """One comparison, eager alone after it, and the check against both."""
        res = self._timed(fns, tc)
        after, single = self.after(fns, tc.min_time_s) if before.own else (None, "")
        return res, after, bracket_check(before, after, res, single)


def _verdict(check: fair.EagerCheck, skipped: str | None) -> str:
    """The report's note on the (last) check: within the band, or outside it and whose error that is."""
    if check.ok:
        return check.text()
    tail = ("the check cannot vouch for the comparison either way (the speedups below are ratios inside one "
            "interleaved run, where a change of the machine's speed hits eager and every finalist)"
            if check.machine_changed else "the speedups below carry that error")
    if skipped is not None:
        return f"{check.text()}: {skipped}, so {tail}"
    return f"{check.text()}: still outside the band after the redo, so {tail}"
