"""The final phase's trials of the chosen variant (``autotune.final``, after the comparison), and its phase timer.

The chosen variant and eager are timed once more, each in a fresh process, with glibc's allocator defaults instead
of the setting every timing process runs under (``fair.tune_allocator``: both reported; the setting stays in the
artifact unless the defaults were faster), and the chosen variant with fewer intra-op threads
(``fair_threads.tune_threads``: recorded when faster beyond the noise). Both trials reuse the comparison's warm
processes and start their own fresh ones together, all ready before either times a sample (``_start_trials``).
Each runs only when its estimate fits the final phase's budget (``autotune.final_budget``); a skipped allocator
trial leaves the setting the comparison ran under in the artifact, a skipped thread trial the comparison's thread
count. ``Phases`` times the final phase's parts for the report's "final phase time" note.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, cast

import torch

from torchnitro.autotune import fair, fair_threads
from torchnitro.autotune.recipe import EAGER
from torchnitro.autotune.report import Report
from torchnitro.bench.environment import ALLOCATOR_SETTING
from torchnitro.bench.isolated import ChildTimer
from torchnitro.bench.timing import TimingConfig
from torchnitro.errors import RecipeError

if TYPE_CHECKING:
    from torchnitro.autotune.search import _Search

__all__ = ["run_trials", "Phases", "child_of", "TRIAL_SAMPLE_S"]


def child_of(fn: Callable[..., Any]) -> ChildTimer | None:
    """The ``ChildTimer`` behind a comparison entry, or None (timed in this process)."""
    inner = getattr(fn, "inner", fn) if isinstance(fn, fair.Steady) else fn
    return inner if isinstance(inner, ChildTimer) else None


@dataclasses.dataclass(frozen=True)
class _Chosen:
    """The variant the comparison chose (``name``; eager when none beat it) and the comparison's entries ``fns``
    (``child_of``: their processes), which the trials start from; ``s`` and ``report``: the search and its report."""

    s: _Search
    report: Report
    name: str
    fns: dict[str, Callable[..., Any]]

    def child(self) -> tuple[ChildTimer | None, str | None]:
        """The chosen variant's comparison process, which both trials start from; or None and why they cannot."""
        child = child_of(self.fns[self.name])
        if child is None:
            return None, "the chosen variant was timed in this process, not in a fresh one"
        if child.failed:
            return None, f"the chosen variant's timing process failed ({child.failed})"
        if self.s.where.get(self.name) is None:
            return None, "no files of the chosen variant were kept"
        return child, None

    def allocator_plan(self) -> tuple[dict[str, ChildTimer], str | None]:
        """The comparison's processes (under the setting, warm) whose variant the allocator trial times again with
        glibc's defaults: the chosen variant's and eager's; or why the trial cannot run."""
        from torchnitro.bench.environment import allocator_untunable

        child, why = self.child()
        why = allocator_untunable() or why
        if why is not None or child is None:
            return {}, why
        timers = {"the chosen variant": child}
        eager = child_of(self.fns[EAGER]) if self.name != EAGER and EAGER in self.fns else None
        if eager is not None and not eager.failed:
            timers["eager"] = eager
        return timers, None

    def threads_plan(self) -> tuple[ChildTimer | None, list[int], str | None]:
        """The chosen variant's comparison process and the fewer thread counts to try beside it; or why none."""
        child, why = self.child()
        if why is not None or child is None:
            return None, [], why
        threads = int(child.spec["threads"])
        options = fair_threads.thread_options(threads)
        if not options:
            return child, [], f"the comparison ran the chosen variant with {threads} thread: nothing fewer to try"
        return child, options, None


TRIAL_SAMPLE_S = 0.02  # a trial's sample repeats a fast variant's call up to this long (see ``_trial_tc``)


def _trial_tc(s: _Search) -> TimingConfig:
    """The trials' timing: the same measured time per entry as before, in samples of at least ``TRIAL_SAMPLE_S``.
    Each sample costs a fixed overhead besides its calls (the gate's idle wait, the request to the child, one
    untimed call): with one-call samples of the 1.5 ms ``mlp`` that overhead was the trial's wall time (the
    thread trial's 2 s of samples took 30.7 s under load, 27 Nov 08:05 UTC). Longer samples of back-to-back
    calls are what a server runs; both sides of each trial are sampled alike."""
    return TimingConfig(warmup=1, warmup_s=0.0, min_iters=5, min_time_s=s.cfg.final_min_time_s,
                        max_time_s=max(3.0, s.cfg.final_min_time_s * 2), min_sample_s=TRIAL_SAMPLE_S,
                        device=s.device.type)


@dataclasses.dataclass
class _Started:
    """The trials' fresh processes, started together and ready before either trial times a sample: their
    start-ups (interpreter, torch, the variant) overlap each other instead of running one trial after the other,
    and none runs beside a timed sample."""

    allocator: dict[str, ChildTimer] = dataclasses.field(default_factory=dict)  # trial name -> its process
    threads: dict[int, ChildTimer] = dataclasses.field(default_factory=dict)  # thread count -> its process

    def all(self) -> list[ChildTimer]:
        return [*self.allocator.values(), *self.threads.values()]


def _start_trials(alloc: dict[str, ChildTimer], child: ChildTimer | None, options: list[int]) -> _Started:
    """Start every trial process at once, then wait until each is ready (loaded, one untimed call). One that
    fails to start or load is left out: its trial starts it again itself, and notes a second failure."""
    got = _Started()
    for name, timer in alloc.items():
        try:
            got.allocator[name] = timer.again(fair.allocator_env(timer))
        except RecipeError:
            pass
    for k in options if child is not None else []:
        try:
            got.threads[k] = fair_threads.start_fewer(cast(ChildTimer, child), k)
        except RecipeError:
            pass
    for group in (got.allocator, got.threads):
        for key, timer in list(group.items()):
            try:
                timer.wait_ready()
            except RecipeError:  # closed by wait_ready's failure
                del group[key]  # type: ignore[arg-type]
    return got


def _tune_allocator(ch: _Chosen, started: dict[str, ChildTimer] | None = None) -> None:
    """The chosen variant and eager each in a fresh process with the other glibc allocator setting than their
    comparison processes (``fair.tune_allocator``; ``started``: those processes, already started and ready); the
    setting goes into the chosen variant's meta unless it lost there. The report gives both times of each, and the
    chosen variant against eager with glibc's defaults."""
    s, report, name = ch.s, ch.report, ch.name
    timers, why = ch.allocator_plan()
    if why is not None:
        report.notes.append(f"allocator setting not tried: {why}"[:300])
        return
    cf = s.where[name]
    try:
        # a dict of timers in gives a dict of trials out (fair.tune_allocator)
        trials = cast("dict[str, fair.AllocatorTrial]", fair.tune_allocator(  # type: ignore[call-overload]
            timers, _trial_tc(s), started=started))
    except RecipeError as exc:
        report.notes.append(f"allocator setting not tried: its timing process failed ({exc})"[:300])
        return
    trial = trials["the chosen variant"]
    report.notes.append(trial.text())
    if "eager" in trials:
        e = trials["eager"]
        deployed = trial.tuned_ms if trial.keep else trial.default_ms
        report.notes.append(e.text().split(": ", 1)[1].split(";")[0] + (
            f"; against eager with glibc's defaults (one fresh process: such processes differ by 10-20% where "
            f"page faults are many) the chosen variant as deployed is {e.default_ms / deployed:.2f}x"))
    if trial.keep:
        gain = {"default_ms": trial.default_ms, "tuned_ms": trial.tuned_ms, "ratio": trial.ratio, "noise": trial.noise}
        s.where[name] = dataclasses.replace(cf, meta={**cf.meta, "environment": dict(trial.setting),
                                                      "environment_gain": gain})


def _tune_threads(ch: _Chosen, started: dict[int, ChildTimer] | None = None) -> None:
    """The chosen variant with fewer intra-op threads in fresh processes (``fair_threads.tune_threads``;
    ``started``: those processes, already started and ready); the artifact's meta records a smaller count only
    when it was faster beyond the noise."""
    s, report, name = ch.s, ch.report, ch.name
    child, options, why = ch.threads_plan()
    if why is not None or child is None:
        report.notes.append(f"thread count not tried: {why}"[:300])
        return
    cf = s.where[name]
    try:
        trial = fair_threads.tune_threads(child, _trial_tc(s), started=started)
    except RecipeError as exc:
        report.notes.append(f"thread count not tried: its timing process failed ({exc})"[:300])
        return
    if trial is None:
        return
    report.notes.append(trial.text())
    if trial.chosen != trial.threads:
        meta = fair_threads.meta_with_threads(cf.meta, trial.chosen)
        meta["threads_trial"] = {str(k): ms for k, ms in trial.p50_ms.items()}
        s.where[name] = dataclasses.replace(cf, meta=meta)


def run_trials(s: _Search, report: Report, best: str | None, fns: dict[str, Callable[..., Any]],
                phases: Phases) -> None:
    """The allocator and thread trials of the chosen variant (``best``; None: eager), each only when its estimate
    (its processes' start-ups and timing) fits the budget left, their fresh processes started together first
    (``_start_trials``)."""
    cfg, fb = s.cfg, s.final_budget
    alloc = cfg.tune_allocator and s.device.type == "cpu"
    threads = cfg.tune_threads and s.device.type == "cpu"
    if threads and best is None:
        report.notes.append("thread count not tried: no variant beat eager, so there is no chosen variant to try")
        threads = False
    ch = _Chosen(s, report, best or EAGER, fns)  # the thread trial runs only for a variant that beat eager
    a_timers = ch.allocator_plan()[0] if alloc else {}
    t_child, t_options, _ = ch.threads_plan() if threads else (None, [], None)
    mt = _trial_tc(s).min_time_s
    a_need = fb.startup_s * len(a_timers) + fb.run_s(2 * len(a_timers), mt)
    t_need = fb.startup_s * len(t_options) + fb.run_s(1 + len(t_options), mt)
    why = fb.skip_reason("allocator trial", a_need) if a_timers else None
    if why is not None:
        _allocator_skipped(ch, why)
        alloc, a_timers, a_need = False, {}, 0.0
    why = fb.skip_reason("thread trial", t_need + a_need) if t_options else None
    if why is not None:
        threads_now = int(t_child.spec["threads"]) if t_child is not None else torch.get_num_threads()
        report.notes.append(f"{why}; the artifact keeps the comparison's {threads_now} thread(s)")
        threads, t_child, t_options = False, None, []
    if not alloc and not threads:
        return
    with phases("starting the trials' processes together"):
        t0 = time.perf_counter()
        started = _start_trials(a_timers, t_child, t_options)
        fb.learn_starts(time.perf_counter() - t0, len(a_timers) + len(t_options))
    try:
        if alloc:
            with phases("allocator trial"):
                _tune_allocator(ch, started.allocator)
        if threads:
            with phases("thread trial"):
                _tune_threads(ch, started.threads)
    finally:
        for timer in started.all():  # closed by their trial; any a trial did not reach
            timer.close()


def _allocator_skipped(ch: _Chosen, why: str) -> None:
    """The allocator trial did not fit the budget: the artifact keeps the setting its comparison process ran under
    (the speedups reported were measured with it), glibc's defaults untried."""
    s, report, name = ch.s, ch.report, ch.name
    child = child_of(ch.fns[name]) if name in ch.fns else None
    cf = s.where.get(name)
    if child is None or cf is None or not fair.under_allocator_setting(child):
        report.notes.append(f"{why}; nothing recorded")
        return
    s.where[name] = dataclasses.replace(cf, meta={**cf.meta, "environment": dict(ALLOCATOR_SETTING)})
    report.notes.append(f"{why}; the artifact keeps the allocator setting the comparison ran it under (glibc's "
                        "defaults untried)")


class Phases:
    """Wall time of the final phase's parts, for the report's "final phase time" note."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0

    def text(self) -> str:
        parts = ", ".join(f"{n} {sec:.1f} s" for n, sec in self.seconds.items())
        total = sum(self.seconds.values())
        return (f"final phase time: {total:.1f} s in all ({parts}); the rest of the search time built, verified "
                "and timed the candidates")
