"""The final comparison of the search (``autotune.search`` step 4).

The ``finalists`` best search estimates plus any within ``NOISE_BAND`` of the best (one early sample each,
taken minutes apart, can be hit by load) are screened in a short interleaved run with eager when they
outnumber ``finalists``; the best ``finalists`` by that ratio are re-timed interleaved with eager
(``bench.compare``); the winner must beat eager by ``min_speedup`` and by more than the noise of its ratio
(``bench.ratio``: paired bootstrap over the rounds), otherwise eager. On the CPU eager and every finalist are
timed alone, each in its own fresh process, in both runs (``autotune.fair``: where a variant cannot be loaded
in a child it is timed here and its row says why; eager re-created from its torch.export program only
when that runs alone at eager's search-time speed); eager alone runs in ``eager_processes`` fresh processes,
every one in every round, and every speedup divides the median of their p50s (``autotune.fair_eager``);
each sample follows one untimed call (``fair.Steady``);
eager inside the comparison is checked against eager alone right before and right after it, by their mean, and
redone once when outside the band (``autotune.final_check``: two alone runs that differ say the machine changed);
every timing process runs under glibc's allocator setting (``bench.environment``: fixed thresholds, so fresh
processes agree), and the chosen variant and eager are then timed once more with glibc's defaults (both
reported; the setting stays in the artifact unless the defaults were faster), and the chosen variant with fewer
intra-op threads (recorded when faster beyond the noise: ``autotune.fair_threads``); both trials reuse the
comparison's processes and start their own fresh ones together, all ready before either times a sample
(``autotune.final_trials``). Every timing process runs the
OpenMP wait setting it is deployed with (nothing added), and every sample, in a child or here, is
gated (``bench.quiet``): it starts once the other timing processes are idle and is retaken when foreign CPU
ran beside it; the report's "timing environment" and "timing gate" notes say so, with the counts; its "final
phase time" note gives the wall time of each part of this phase. The phase runs against the search's
deadline (``autotune.final_budget``): the comparison's timing shrinks to fit before finalists are dropped (or
timed in this process instead of fresh ones: ``final_budget.fit_pool``), and the screen, eager's further processes,
eager alone after the comparison, the redo and each trial run only when their estimate fits the time left (else a
"skipped: budget" note; a skipped allocator trial leaves the setting the comparison ran under in the artifact, a
skipped thread trial the comparison's thread count).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchnitro.autotune import fair, fair_place
from torchnitro.autotune.fair_eager import EagerBaseline, is_copy, is_eager
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.final_budget import fit_pool
from torchnitro.autotune.final_check import DriftCheck, solo_timing
from torchnitro.autotune.final_trials import Phases, child_of, run_trials
from torchnitro.autotune.recipe import EAGER, Recipe, get_recipe
from torchnitro.autotune.report import CandidateResult, Report, Status
from torchnitro.bench.environment import GLIBC_DEFAULTS, describe_environment
from torchnitro.bench.isolated import ChildTimer, save_inputs
from torchnitro.bench.quiet import recording
from torchnitro.bench.timing import Timing, TimingConfig, compare
from torchnitro.errors import InputError, RecipeError

if TYPE_CHECKING:
    from torchnitro.autotune.search import _Search

__all__ = ["run_finalists", "finalist_pool", "pick_winner", "NOISE_BAND"]

NOISE_BAND = 2.0  # search-time samples are taken minutes apart; on a shared machine latency drifts ~2x in that time


def finalist_pool(ranked: list[CandidateResult], key: Callable[[CandidateResult], float],
                  k: int) -> list[CandidateResult]:
    """The candidates worth re-timing: the ``k`` best search estimates plus every one within
    ``NOISE_BAND`` of the best (its one early sample may have been hit by load), at most ``2k`` (min k + 2).
    ``ranked`` is sorted by ``key``, best first."""
    if not ranked or k <= 0:
        return []
    best = key(ranked[0])
    pool = [c for i, c in enumerate(ranked) if i < k or key(c) <= best * NOISE_BAND]
    return pool[: max(2 * k, k + 2)]


def _note(c: CandidateResult, text: str) -> None:
    c.notes = (c.notes + "; " if c.notes else "") + text


def _local(s: _Search, c: CandidateResult) -> Callable[[], Any] | None:
    """The in-process timing closure of ``c``; None (``c`` marked failed) when it cannot be reloaded."""
    try:
        fn = s.callable_for(get_recipe(c.recipe))
    except Exception as exc:  # noqa: BLE001
        c.status = Status.FAILED
        c.reason = f"reloading the built candidate failed: {type(exc).__name__}: {exc}"[:300]
        return None
    sets = s.wl.timing_sets
    return lambda: [fn(*x) for x in sets]


def _callables(s: _Search, report: Report, cands: list[CandidateResult],
               timers: dict[str, ChildTimer]) -> dict[str, Callable[..., Any]]:
    """What the comparison times, eager first, then ``cands`` in order: a ready ``ChildTimer`` (also put in
    ``timers``, for the caller to close) per variant timed alone, a closure per variant timed here. Each row
    of the report says which, and why."""
    places = fair_place.plan(s, cands)
    work = Path(s.tmp.name) / "_final"
    work.mkdir(parents=True, exist_ok=True)
    inputs = work / "_timing_inputs.pt"
    if any(p.kwargs is not None for p in places.values()):
        try:
            save_inputs(s.wl.timing_sets, inputs)
        except InputError as exc:
            places = {n: fair_place.Placement(None, f"timed in this process: {exc}"[:300]) for n in places}
    timers.update(fair_place.start_children(places, inputs, work, threads=torch.get_num_threads(), device=s.device.type))
    efn = s.callable_for(get_recipe(EAGER))
    first = s.wl.timing_sets[0]

    def eager_outputs() -> Any:
        with torch.inference_mode():
            return efn(*first)

    fallen = fair_place.ready_children(timers, places, EAGER, eager_outputs, s.cfg.tolerance("exact").get("rel", 1e-4))
    if EAGER in timers and ((places[EAGER].kwargs or {}).get("eager") or {}).get("how") == "program":
        why = _program_parity(s, report, timers[EAGER])
        if why is not None:
            for name in [n for n in timers if is_eager(n)]:  # its copies run the same program
                timers.pop(name).close()
            fallen[EAGER] = why
    fns: dict[str, Callable[..., Any]] = {}
    copies = [n for n in timers if is_copy(n)]
    for name in places:
        if is_copy(name):  # eager's further processes: no report row of their own
            if name in timers:
                fns[name] = _steady(s, timers[name])
            elif name in fallen and EAGER in timers:
                _note(report.get(EAGER), fallen[name])
            continue
        c = report.get(name)
        _note(c, "final comparison: " + fallen.get(name, places[name].why))
        if name == EAGER and name in timers and s.cfg.eager_processes > 1:
            _note(c, f"in {1 + len(copies)} fresh processes (eager_processes="
                     f"{s.cfg.eager_processes}): its p50 is the median of theirs")
        if name in timers:
            fns[name], c.alone = _steady(s, timers[name]), True
            continue
        fn = _local(s, c)
        if fn is not None:
            fns[name] = _steady(s, fn)
    return fns


def _program_parity(s: _Search, report: Report, timer: ChildTimer) -> str | None:
    """None when eager re-created from its torch.export program runs alone at eager's own speed: its solo p50
    within ``fair.check_eager``'s band of eager's search-time p50 (this process, before any candidate ran).
    Otherwise why eager is timed here instead: a program can drop Python work the model does, or take
    another kernel path (its shapes and masks fixed by tracing), and would not be eager's time."""
    tc = solo_timing(s.cfg.final_min_time_s, s.device.type)
    e = report.get(EAGER)
    if not e.p50_ms:
        return "timed in this process: eager has no search-time p50 to check its torch.export program against"
    # like with like: this process runs glibc's defaults, so the program is checked in a process that does too
    # (the comparison's own process runs under the allocator setting, as every timing process)
    probe = timer
    try:
        if fair.under_allocator_setting(timer):
            probe = timer.again(GLIBC_DEFAULTS)
        probe.wait_ready()
        t = compare({EAGER: fair.Steady(probe)}, tc)[EAGER]
    except RecipeError as exc:  # the child died: eager is timed here (its row says why)
        return f"timed in this process: its timing process (from the torch.export program) failed ({exc})"[:300]
    finally:
        if probe is not timer:
            probe.close()
    check = fair.check_eager(e.p50_ms, e.cv, t)
    text = (f"eager's torch.export program alone {t.median * 1e3:.3f} ms, eager in this process before any "
            f"candidate ran {e.p50_ms:.3f} ms ({check.drift:+.1%}; allowed ±{check.band:.1%})")
    if check.ok:
        report.notes.append(text + ": eager timed alone from the program")
        return None
    return f"timed in this process: {text}, so the program is not eager's speed"[:300]


def _steady(s: _Search, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Each sample follows one untimed call of the same variant (``fair.Steady``). On CUDA the sample is timed
    with CUDA events, ungated: the in-process rotation there (eager beside CUDA-graph replays) measured eager
    33.5% slower inside the comparison than alone (results/optimize_cuda_encoder_h200.md), the switch cost
    that the untimed call removed on the CPU; not yet measured on a GPU with it."""
    if s.device.type == "cpu":
        return fair.Steady(fn)
    return fair.Steady(fn, gate=None, cuda=True)


def _compare_finalists(s: _Search, report: Report, fns: dict[str, Callable[..., Any]],
                       tc: TimingConfig) -> dict[str, Timing]:
    """One interleaved run; a ``ChildTimer`` entry is timed by its own process.

    A candidate whose timing process dies is marked failed and dropped from ``fns``; a dead eager process is
    dropped (noted), its place under ``eager`` taken by another of eager's processes, or, when none is left,
    by eager in this process; the run restarts."""
    while True:
        try:
            with torch.inference_mode():
                return compare(fns, tc, items_per_call=s.wl.items_per_call, baseline=EAGER)
        except RecipeError:
            dead = [n for n, f in fns.items() if getattr(f, "failed", None)]
            if not dead:
                raise
            for n in dead:
                why = fns.pop(n).failed
                if is_eager(n):
                    _note(report.get(EAGER), f"eager's timing process {n} died mid-comparison ({why})"[:300])
                    continue
                c = report.get(n)
                c.status, c.reason = Status.FAILED, f"timing it alone failed: {why}"[:300]
            if EAGER not in fns:
                _replace_eager(s, report, fns)


def _replace_eager(s: _Search, report: Report, fns: dict[str, Callable[..., Any]]) -> None:
    """Eager's first process died: another of its processes takes the name, or (none left) eager in this process."""
    c = report.get(EAGER)
    spare = [n for n in fns if is_copy(n)]
    if spare:
        fns[EAGER] = fns.pop(spare[-1])
        _note(c, f"eager goes on in {len(spare)} process(es)")
        return
    local = _local(s, c)
    if local is None:
        raise RecipeError(f"eager's timing processes died and eager cannot be timed in this process: {c.reason}")
    fns[EAGER], c.alone = _steady(s, local), False
    _note(c, "timed in this process instead")


def _screen(s: _Search, report: Report, fns: dict[str, Callable[..., Any]], k: int) -> dict[str, Callable[..., Any]]:
    """A short interleaved run of eager (all its processes) and the whole pool; keeps eager and the ``k`` best by
    median ratio to eager (``fair_eager.EagerBaseline``).

    Ratios from one interleaved run survive load drift that the search-time samples do not."""
    cfg, fb = s.cfg, s.final_budget
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, min_time_s=cfg.final_min_time_s / 2,
                      max_time_s=max(3.0, cfg.final_min_time_s * 2), device=s.device.type)
    eagers = len([n for n in fns if is_eager(n)])  # the comparison after it must still fit at its floor
    tc, short = fb.fit(tc, len(fns), 1.0, fb.left() - fb.floor_s(k + eagers, 1.5))
    if short:
        report.notes.append(f"screen {short}")
    t0 = time.perf_counter()
    res = _compare_finalists(s, report, fns, tc)
    fb.learn_run(time.perf_counter() - t0, len(fns), tc.min_time_s)
    base = EagerBaseline.of(res)
    est = {n: base.ratio(t) for n, t in res.items() if not is_eager(n)}
    keep = sorted(est, key=lambda n: est[n].ratio, reverse=True)[:k]
    for name, e in est.items():
        c = report.get(name)
        _note(c, f"screen {e.text()} vs eager (short interleaved run)")
        if name not in keep:  # not re-timed again: the screen's interleaved numbers are its best estimate
            t = res[name]
            c.p50_ms, c.p99_ms, c.cv, c.throughput, c.speedup, c.noise, c.interleaved = (
                t.median * 1e3, t.p99 * 1e3, t.cv, t.throughput, e.ratio, e.noise, True)
            c.screened = True  # its row marks these as the screen's estimate (~), not the comparison's
    report.notes.append(f"{len(est)} candidates within {NOISE_BAND:g}x of the best search estimate were screened in "
                        f"a short interleaved run with eager; the best {len(keep)} went on to the final comparison")
    return {n: f for n, f in fns.items() if is_eager(n) or n in keep}


def run_finalists(s: _Search, report: Report) -> Recipe:
    """Compare the verified candidates of ``report`` with eager (see the module docstring); returns the winner."""
    cfg = s.cfg
    eager_res = report.get(EAGER)
    if eager_res.status != Status.VERIFIED:
        raise InputError(f"the eager model failed on its own inputs: {eager_res.reason}; expected a model that runs "
                         "deterministically in eval mode on the example inputs")
    verified = [c for c in report.candidates if c.status == Status.VERIFIED and c.recipe != EAGER]
    key = (lambda c: c.p99_ms) if cfg.percentile == "p99" else (lambda c: c.p50_ms)
    verified.sort(key=key)
    for c in verified:  # search-time estimate; finalists get the interleaved number below
        c.speedup = eager_res.p50_ms / c.p50_ms if c.p50_ms else None
    eager_res.speedup = 1.0
    if verified:
        report.notes.append(f"~: search-time estimate against eager's search-time p50 of {eager_res.p50_ms:.2f} ms "
                            "(one short measurement each; unmarked speedups come from the interleaved comparison)")
    report.notes.append(f"timing environment: {describe_environment()}")
    pool = finalist_pool(verified, key, cfg.finalists)
    if not pool:
        return get_recipe(EAGER)
    timers: dict[str, ChildTimer] = {}
    phases = Phases()
    with recording() as gate:
        try:
            return _run_pool(s, report, pool, timers, phases)
        finally:
            for timer in timers.values():
                timer.close()
            if gate.samples:
                report.notes.append(gate.text())
            if phases.seconds:
                report.notes.append(phases.text())


def _run_pool(s: _Search, report: Report, pool: list[CandidateResult], timers: dict[str, ChildTimer],
              phases: Phases) -> Recipe:
    """``run_finalists`` once the pool is known: screen, compare, check, pick, try the allocator setting and
    fewer threads."""
    cfg = s.cfg
    eager_res = report.get(EAGER)
    search_ms, search_cv = eager_res.p50_ms, eager_res.cv  # eager in this process, before any candidate ran
    pool = fit_pool(s, report, pool)
    if not pool:
        return get_recipe(EAGER)
    with phases("starting the comparison's processes"):
        t0 = time.perf_counter()
        fns = _callables(s, report, pool, timers)
        s.final_budget.learn_starts(time.perf_counter() - t0, len(timers))
    if not [n for n in fns if not is_eager(n)]:
        return get_recipe(EAGER)
    if len([n for n in fns if not is_eager(n)]) > cfg.finalists:
        with phases("screen"):
            fns = _screen(s, report, fns, cfg.finalists)
        used = {id(child_of(f)) for f in fns.values()}  # an eager copy may have taken eager's name
        for name in [n for n, t in timers.items() if id(t) not in used]:  # screened out (or dead): not needed
            timers.pop(name).close()
    with phases("final comparison"):
        res = DriftCheck(s, report, _compare_finalists, search_ms, search_cv).comparison(fns)
    best = pick_winner(res, report, cfg)
    base = EagerBaseline.of(res)
    if base.k > 1:
        report.notes.append(base.text())
    run_trials(s, report, best, fns, phases)
    rows = [n for n in res if not is_copy(n)]
    alone = [n for n in rows if report.get(n).alone]
    here = [n for n in rows if not report.get(n).alone]
    report.notes.append("finalists re-timed interleaved with eager, rounds alternating (A B A B)"
                        + (f"; each alone in its own fresh process: {', '.join(alone)}" if alone else "")
                        + (f"; in this process: {', '.join(here)} (each row says why)" if here else "")
                        + "; " + _bar_text(cfg))
    return get_recipe(EAGER) if best is None else get_recipe(best)


def _bar_text(cfg: OptimizeConfig) -> str:
    if cfg.min_speedup < 1:
        return f"a winner needs >= {cfg.min_speedup:.2f}x (below 1: a slower verified candidate is accepted)"
    return (f"a winner needs >= {cfg.min_speedup:.2f}x and a speedup whose noise (±: 95% paired bootstrap over the "
            "comparison's rounds) stays above 1")


def pick_winner(res: dict[str, Timing], report: Report, cfg: OptimizeConfig) -> str | None:
    """Fill each finalist's interleaved numbers, speedup and noise (``bench.ratio``; several eager processes in
    ``res``, ``eager-2``, ...: ``fair_eager.EagerBaseline``); return the fastest that reaches ``min_speedup``
    and is faster than eager by more than its noise, or None (eager).

    ``min_speedup < 1`` is a user accepting a slower verified candidate on purpose: no noise bar then."""
    q = 99.0 if cfg.objective == "latency" and cfg.percentile == "p99" else 50.0  # objective_stat's statistic
    base = EagerBaseline.of(res)  # eager's processes: the median of their statistics (``fair_eager``)
    base.fill(report.get(EAGER))
    best, best_speed = None, 0.0
    for name, t in res.items():
        if is_eager(name):
            continue
        c = report.get(name)
        c.p50_ms, c.p99_ms, c.cv, c.throughput = t.median * 1e3, t.p99 * 1e3, t.cv, t.throughput
        c.interleaved = True
        est = base.ratio(t, q)
        c.speedup, c.noise = est.ratio, est.noise
        clears = c.speedup >= cfg.min_speedup and (cfg.min_speedup < 1 or est.beats_noise)
        if clears and c.speedup > best_speed:
            best, best_speed = name, c.speedup
    return best
