"""The search's budget across its two phases (``autotune.search``, ``autotune.final``).

``budget_s`` covers the whole search, the final phase included. Before the first candidate the final phase's
share is reserved from a plan of what it must do (``plan_final``: its timing processes' start-ups, the
comparison's measured time per entry times the wall seconds each measured second costs, the trials), at most
``MAX_SHARE`` of the budget; candidates start only before ``budget_s`` minus that share. The final phase then runs
against a deadline (``FinalBudget``): ``budget_s`` from the start, or its reserved share from its own start when the
last candidate ran into it (that candidate had its whole limit), never later than ``budget_s`` plus one candidate's
limit. Inside it the comparison's timing shrinks (measured time per entry, rounds) before finalists are dropped
(``fit_pool``: the screen, eager's further processes and the timing processes go first); each optional step (the
screen, eager's further processes, eager alone after the comparison, the redo, the allocator trial, the thread trial)
runs only when its estimate fits the time left, otherwise it is skipped with a note naming the budget. Estimates
start from the guesses below and are replaced by what the phase measures as it goes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import TYPE_CHECKING, Callable

from torchnitro.autotune import fair
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.recipe import get_recipe
from torchnitro.bench.timing import TimingConfig

if TYPE_CHECKING:
    from torchnitro.autotune.report import CandidateResult, Report
    from torchnitro.autotune.search import _Search

__all__ = ["FinalBudget", "FinalPlan", "plan_final", "final_deadline", "fit_pool", "STARTUP_GUESS_S", "OVERHEAD_GUESS",
           "MAX_SHARE", "MIN_TIME_FLOOR_S", "MIN_ROUNDS"]

STARTUP_GUESS_S = 3.0  # one timing process's start-up (interpreter, torch, the variant) on an idle machine ...
OVERHEAD_GUESS = 3.0  # wall s per measured s of an interleaved run (untimed call before each sample, the gate's waits)
MAX_SHARE = 0.5  # the final phase reserves at most this part of the budget: the candidates keep the rest
MIN_TIME_FLOOR_S = 0.05  # a shortened comparison measures at least this long per entry ...
MIN_ROUNDS = 5  # ... and at least this many rounds (its ratio's noise is a bootstrap over them, reported as is)


def startup_guess() -> float:
    """``STARTUP_GUESS_S`` times the run queue per core (a loaded 2-core machine, load 12, took 11.5 s a process,
    27 Nov): the phase's own start-ups replace it once measured."""
    try:
        load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
    except OSError:  # not available on this platform
        load = 1.0
    return STARTUP_GUESS_S * max(1.0, load)


@dataclasses.dataclass
class FinalPlan:
    """What the final phase is expected to cost, in wall seconds, before any candidate ran."""

    processes: int  # timing processes started for the comparison
    starts_s: float
    comparison_s: float  # eager alone before and after + the interleaved comparison
    trials_s: float  # the allocator and thread trials, their processes included

    @property
    def total_s(self) -> float:
        return self.starts_s + self.comparison_s + self.trials_s

    def text(self) -> str:
        return (f"{self.processes} process start(s) ~{self.starts_s:.0f} s, comparison ~{self.comparison_s:.0f} s, "
                f"trials ~{self.trials_s:.0f} s")


def plan_final(cfg: OptimizeConfig, device_type: str, threads: int, startup_s: float | None = None,
               overhead: float = OVERHEAD_GUESS) -> FinalPlan:
    """The final phase's cost for ``cfg.finalists`` finalists on ``device_type`` with ``threads`` intra-op threads."""
    startup_s = startup_guess() if startup_s is None else startup_s
    cpu = device_type == "cpu"
    alone = cfg.final_alone and cpu
    e = cfg.eager_processes if alone else 1
    n = cfg.finalists
    mt = cfg.final_min_time_s
    comparison = overhead * mt * ((e if alone else 0) + n + e)  # eager alone before and after it: half each
    trials = 0.0
    if cpu and alone and cfg.tune_allocator:
        trials += 2 * startup_s + overhead * mt * 4  # chosen + eager, each against a fresh process
    if cpu and alone and cfg.tune_threads and threads > 1:
        k = 2 if threads > 2 else 1  # fair_threads.thread_options: half the threads and one
        trials += k * startup_s + overhead * mt * (1 + k)
    procs = (n + e) if alone else 0
    return FinalPlan(procs, procs * startup_s, comparison, trials)


def final_deadline(t_start: float, now: float, budget_s: float, reserve_s: float, limit_s: float) -> float:
    """When the final phase must end: ``budget_s`` after ``t_start``, or ``reserve_s`` after ``now`` when the last
    candidate ran into the reserve, never later than ``budget_s`` plus one candidate's ``limit_s``."""
    return max(t_start + budget_s, min(now + reserve_s, t_start + budget_s + limit_s))


@dataclasses.dataclass
class FinalBudget:
    """The final phase's deadline on ``clock`` and the estimates its steps are checked against."""

    deadline: float
    clock: Callable[[], float] = time.perf_counter
    startup_s: float = dataclasses.field(default_factory=startup_guess)  # per process; measured once started
    overhead: float = OVERHEAD_GUESS  # wall s per measured s, measured by the phase's first timed run
    moved_here: bool = False  # the phase turned final_alone off: no time for eager's and in-process finalists' processes

    @classmethod
    def unlimited(cls) -> "FinalBudget":
        return cls(float("inf"))

    def left(self) -> float:
        return self.deadline - self.clock()

    def run_s(self, entries: int, min_time_s: float) -> float:
        """Wall seconds of an interleaved run of ``entries`` measuring ``min_time_s`` each."""
        return self.overhead * entries * min_time_s

    def skip_reason(self, what: str, need_s: float) -> str | None:
        """None when ``need_s`` fits the time left; else the note: "<what> skipped: budget (12 s left, needs ~20 s)"."""
        left = self.left()
        if need_s <= left:
            return None
        return f"{what} skipped: budget ({max(0.0, left):.0f} s left, needs ~{need_s:.0f} s)"

    def learn_starts(self, wall_s: float, processes: int) -> None:
        if processes > 0 and wall_s > 0:
            self.startup_s = wall_s / processes

    def learn_run(self, wall_s: float, entries: int, min_time_s: float) -> None:
        planned = entries * min_time_s
        if planned > 0 and wall_s > 0:
            self.overhead = max(1.0, wall_s / planned)

    def fit(self, tc: TimingConfig, entries: int, share: float, left_s: float | None = None,
            ) -> tuple[TimingConfig, str | None]:
        """``tc`` for ``entries`` entries in ``share`` measured-time units per entry (eager alone before and after +
        comparison: up to 2 of the comparison's own), shortened to fit the time left: its measured time per entry first (not below
        ``MIN_TIME_FLOOR_S``) and its rounds (not below ``MIN_ROUNDS``; at the floor exactly that many, whatever
        each sample costs); with a note when shortened."""
        left = self.left() if left_s is None else left_s
        need = self.run_s(entries, tc.min_time_s) * share
        if need <= left:
            return tc, None
        mt = max(MIN_TIME_FLOOR_S, left / (self.overhead * entries * share))
        rounds = min(tc.min_iters, MIN_ROUNDS)
        short = dataclasses.replace(tc, min_time_s=mt, min_iters=rounds, max_time_s=max(mt, min(tc.max_time_s, mt * 3)),
                                    max_iters=rounds if mt <= MIN_TIME_FLOOR_S else tc.max_iters)
        return short, (f"shortened for the budget: {mt:.2f} s measured per entry instead of {tc.min_time_s:.2f} s "
                       f"({max(0.0, left):.0f} s left; its noise below is that of the shorter run)")

    def floor_s(self, entries: int, share: float) -> float:
        """Wall seconds of a comparison of ``entries`` shortened to the floor."""
        return self.run_s(entries, MIN_TIME_FLOOR_S) * share


def fit_pool(s: _Search, report: Report, pool: list[CandidateResult]) -> list[CandidateResult]:
    """``pool`` cut to what the budget left can start and compare (``s.final_budget``): the screen, then eager's
    further processes, then the timing processes of eager and in-process candidates (timed here instead) are skipped
    before finalists are dropped (the last first); the comparison counts at its shortest. Each skip leaves a note
    naming the budget; a dropped finalist keeps its search-time estimate (``~``)."""
    cfg, fb = s.cfg, s.final_budget
    alone, k = cfg.final_alone and s.device.type == "cpu", cfg.finalists
    e = cfg.eager_processes if alone else 1

    def own(c: CandidateResult) -> bool:  # timed in its own process wherever the others are timed
        return fair.runs_alone(get_recipe(c.recipe), bool(getattr(s.where.get(c.recipe), "standalone", False)))

    def need(cands: list[CandidateResult], screen: bool = False, here: bool = False) -> float:
        n = len(cands)
        procs = (n + e) if alone and not here else len([c for c in cands if own(c)])
        return (fb.startup_s * procs + fb.floor_s(min(n, k) + e, 1.5)
                + (fb.run_s(n + e, cfg.final_min_time_s / 2) if screen else 0))

    if len(pool) > k:
        why = fb.skip_reason(f"screen of {len(pool)} candidates", need(pool, screen=True))
        if why is not None:
            report.notes.append(f"{why}; the best {k} search estimates go on to the final comparison")
            pool = pool[:k]
    if e > 1:
        why = fb.skip_reason(f"eager's {e - 1} further timing process(es)", need(pool))
        if why is not None:
            report.notes.append(f"{why}; eager is timed in one process")
            s.cfg, e = dataclasses.replace(s.cfg, eager_processes=1), 1  # read by fair_place.plan and the notes
    if alone:
        why = fb.skip_reason("timing processes for eager and the finalists", need(pool))
        if why is not None and min(need([c], here=True) for c in pool) <= fb.left():
            report.notes.append(f"{why}; eager and in-process finalists are timed in this process (final_alone "
                                "turned off for the budget: a candidate with its own runtime is still timed alone)")
            s.cfg, alone, e = dataclasses.replace(s.cfg, final_alone=False, eager_processes=1), False, 1  # fair_place
            fb.moved_here = True  # the rows say why (fair_place.place)
    pool = list(pool)
    while pool:
        why = fb.skip_reason(f"final comparison of {len(pool)} finalist(s)", need(pool))
        if why is None:
            break
        # timed here, a finalist that needs a process of its own goes first (the last of them)
        c = next((c for c in reversed(pool) if own(c)), pool[-1]) if not alone else pool[-1]
        pool.remove(c)
        c.notes = "; ".join(n for n in (c.notes, f"not compared with eager: {why}; its speedup is the search-time "
                                                  "estimate") if n)
        if not pool:
            report.notes.append(f"{why}: eager kept (no verified candidate could be compared with it in the budget; "
                                "raise budget_s)")
    return pool
