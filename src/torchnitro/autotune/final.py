"""The final comparison of the search (``autotune.search`` step 4).

The ``finalists`` best search estimates plus any within ``NOISE_BAND`` of the best (one early sample each,
taken minutes apart, can be hit by load) are screened in a short interleaved run with eager when they
outnumber ``finalists``; the best ``finalists`` by that ratio are re-timed interleaved with eager
(``bench.compare``); the winner must beat eager by ``min_speedup`` and by more than the noise of its ratio
(``bench.ratio``: paired bootstrap over the rounds), otherwise eager. On the CPU eager and every finalist are
timed alone, each in its own fresh process, in both runs (``autotune.fair``: where a variant cannot be loaded
in a child it is timed here and its row says why; eager re-created from its torch.export program only
when that runs alone at eager's search-time speed); each sample follows one untimed call (``fair.Steady``);
eager inside the comparison is checked against eager alone (both measured again, once, when it drifted);
the chosen variant is then tried under glibc's allocator setting. Every timing process runs the OpenMP wait
setting it is deployed with (``bench.environment``: nothing added), and every sample, in a child or here, is
gated (``bench.quiet``): it starts once the other timing processes are idle and is retaken when foreign CPU
ran beside it; the report's "timing environment" and "timing gate" notes say so, with the counts.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchnitro.autotune import fair, fair_place
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.recipe import EAGER, Recipe, get_recipe
from torchnitro.autotune.report import CandidateResult, Report, Status
from torchnitro.bench.environment import describe_environment
from torchnitro.bench.isolated import ChildTimer, save_inputs
from torchnitro.bench.quiet import recording
from torchnitro.bench.ratio import paired_ratio
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


def _places(s: _Search, cands: list[CandidateResult]) -> dict[str, fair_place.Placement]:
    """Where the comparison times eager and each of ``cands`` (``autotune.fair``), eager first."""
    cfg, device = s.cfg, s.device.type
    if cfg.final_alone and device == "cpu":
        try:
            limit = s.cfg.candidate_timeout_s  # usually prepared already, for an isolated candidate
            eager = fair.child_model(s.model, s.info.spec, s.info.extra, Path(s.tmp.name) / "_final",
                                     program=lambda: s.programs.get("exported", limit, limit)[0])
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: time here, say why
            eager = fair.ChildModel(None, f"preparing the eager model for a child failed ({type(exc).__name__}: "
                                          f"{exc})"[:200])
    else:
        eager = fair.ChildModel(None, "")
    places = {EAGER: fair_place.place(get_recipe(EAGER), None, eager, device=device, all_alone=cfg.final_alone)}
    for c in cands:
        cf = s.where.get(c.recipe)
        places[c.recipe] = fair_place.place(get_recipe(c.recipe), cf, eager, device=device, all_alone=cfg.final_alone) \
            if cf is not None else fair_place.Placement(None, "timed in this process: no files of it were kept")
    heavy = [n for n, p in places.items() if p.needs_eager]
    too_big = fair_place.memory_fits(s.model, len(heavy)) if heavy else None
    for n in heavy if too_big else []:
        places[n] = fair_place.Placement(None, f"timed in this process: {too_big}")
    return places


def _callables(s: _Search, report: Report, cands: list[CandidateResult],
               timers: dict[str, ChildTimer]) -> dict[str, Callable[..., Any]]:
    """What the comparison times, eager first, then ``cands`` in order: a ready ``ChildTimer`` (also put in
    ``timers``, for the caller to close) per variant timed alone, a closure per variant timed here. Each row
    of the report says which, and why."""
    places = _places(s, cands)
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
            timers.pop(EAGER).close()
            fallen[EAGER] = why
    fns: dict[str, Callable[..., Any]] = {}
    for name in places:
        c = report.get(name)
        _note(c, "final comparison: " + fallen.get(name, places[name].why))
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
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, min_time_s=s.cfg.final_min_time_s / 2,
                      max_time_s=max(2.0, s.cfg.final_min_time_s), device=s.device.type)
    e = report.get(EAGER)
    if not e.p50_ms:
        return "timed in this process: eager has no search-time p50 to check its torch.export program against"
    try:
        t = compare({EAGER: fair.Steady(timer)}, tc)[EAGER]
    except RecipeError as exc:  # the child died: eager is timed here (its row says why)
        return f"timed in this process: its timing process (from the torch.export program) failed ({exc})"[:300]
    check = fair.check_eager(e.p50_ms, e.cv, t)
    text = (f"eager's torch.export program alone {t.median * 1e3:.3f} ms, eager in this process before any "
            f"candidate ran {e.p50_ms:.3f} ms ({check.drift:+.1%}; allowed ±{check.band:.1%})")
    if check.ok:
        report.notes.append(text + ": eager timed alone from the program")
        return None
    return f"timed in this process: {text}, so the program is not eager's speed"[:300]


def _steady(s: _Search, fn: Callable[..., Any]) -> Callable[..., Any]:
    """On the CPU each sample follows one untimed call (``fair.Steady``); CUDA keeps bench's event timing."""
    return fair.Steady(fn) if s.device.type == "cpu" else fn


def _child(fn: Callable[..., Any]) -> ChildTimer | None:
    """The ``ChildTimer`` behind a comparison entry, or None (timed in this process)."""
    inner = getattr(fn, "inner", fn) if isinstance(fn, fair.Steady) else fn
    return inner if isinstance(inner, ChildTimer) else None


def _compare_finalists(s: _Search, report: Report, fns: dict[str, Callable[..., Any]],
                       tc: TimingConfig) -> dict[str, Timing]:
    """One interleaved run; a ``ChildTimer`` entry is timed by its own process.

    A candidate whose timing process dies is marked failed and dropped from ``fns``; eager's is replaced by eager
    in this process (noted); the run restarts."""
    while True:
        try:
            with torch.inference_mode():
                return compare(fns, tc, items_per_call=s.wl.items_per_call, baseline=EAGER)
        except RecipeError:
            dead = [n for n, f in fns.items() if getattr(f, "failed", None)]
            if not dead:
                raise
            for n in dead:
                c, why = report.get(n), fns[n].failed
                if n == EAGER:
                    local = _local(s, c)
                    fns[n], c.alone = (_steady(s, local) if local else local), False  # type: ignore[assignment]
                    _note(c, f"its timing process died mid-comparison ({why}); timed in this process instead"[:300])
                    continue
                del fns[n]
                c.status, c.reason = Status.FAILED, f"timing it alone failed: {why}"[:300]


def _screen(s: _Search, report: Report, fns: dict[str, Callable[..., Any]], k: int) -> dict[str, Callable[..., Any]]:
    """A short interleaved run of eager and the whole pool; keeps eager and the ``k`` best by median ratio to eager.

    Ratios from one interleaved run survive load drift that the search-time samples do not."""
    cfg = s.cfg
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, min_time_s=cfg.final_min_time_s / 2,
                      max_time_s=max(3.0, cfg.final_min_time_s * 2), device=s.device.type)
    res = _compare_finalists(s, report, fns, tc)
    est = {n: paired_ratio(res[EAGER], t) for n, t in res.items() if n != EAGER}
    keep = sorted(est, key=lambda n: est[n].ratio, reverse=True)[:k]
    for name, e in est.items():
        c = report.get(name)
        _note(c, f"screen {e.text()} vs eager (short interleaved run)")
        if name not in keep:  # not re-timed again: the screen's interleaved numbers are its best estimate
            t = res[name]
            c.p50_ms, c.p99_ms, c.cv, c.throughput, c.speedup, c.noise, c.interleaved = (
                t.median * 1e3, t.p99 * 1e3, t.cv, t.throughput, e.ratio, e.noise, True)
    report.notes.append(f"{len(est)} candidates within {NOISE_BAND:g}x of the best search estimate were screened in "
                        f"a short interleaved run with eager; the best {len(keep)} went on to the final comparison")
    return {n: f for n, f in fns.items() if n == EAGER or n in keep}


def _eager_alone(s: _Search, eager_fn: Callable[..., Any], search_ms: float,
                 search_cv: float | None) -> tuple[float, float | None, str]:
    """Eager alone for the drift check: a short solo run of eager's own timing process (nothing else runs),
    or, for eager timed in this process, its search-time p50 (measured before any candidate ran)."""
    if _child(eager_fn) is None:
        return search_ms, search_cv, "(search time: this process, before any candidate ran)"
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, min_time_s=s.cfg.final_min_time_s / 2,
                      max_time_s=max(2.0, s.cfg.final_min_time_s), device=s.device.type)
    t = compare({EAGER: eager_fn}, tc)[EAGER]
    return t.median * 1e3, t.cv, "(its own process, nothing else running)"


def _checked_comparison(s: _Search, report: Report, fns: dict[str, Callable[..., Any]], search_ms: float,
                        search_cv: float | None) -> dict[str, Timing]:
    """The final comparison; redone once after ``fair.SETTLE_S`` when eager inside it differs from eager alone."""
    cfg = s.cfg
    iters = max(cfg.final_min_iters, 30) if cfg.percentile == "p99" else cfg.final_min_iters  # a p99 needs samples
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=iters, min_time_s=cfg.final_min_time_s,
                      max_time_s=max(5.0, cfg.final_min_time_s * 3), device=s.device.type)
    alone_ms, alone_cv, where = _eager_alone(s, fns[EAGER], search_ms, search_cv)
    res = _compare_finalists(s, report, fns, tc)
    check = fair.check_eager(alone_ms, alone_cv, res[EAGER], where)
    if not check.ok:
        report.notes.append(f"final comparison redone after a {fair.SETTLE_S:g} s pause: first run's {check.text()}")
        time.sleep(fair.SETTLE_S)
        # eager alone again too: between it and the comparison the machine may have changed, not only the
        # comparison (a fixed reference from before a load change can never be matched by a redo)
        alone_ms, alone_cv, where = _eager_alone(s, fns[EAGER], search_ms, search_cv)
        res = _compare_finalists(s, report, fns, tc)
        check = fair.check_eager(alone_ms, alone_cv, res[EAGER], where)
        for name in res:
            report.get(name).redone = True
    report.notes.append(check.text() + ("" if check.ok else ": still outside the band after the redo, so the "
                                        "speedups below carry that error"))
    return res


def _tune_allocator(s: _Search, report: Report, name: str, fn: Callable[..., Any]) -> None:
    """The chosen variant under glibc's allocator setting in a fresh process (``fair.tune_allocator``); the
    setting goes into its files' meta when it helped."""
    from torchnitro.bench.environment import allocator_untunable

    cf = s.where.get(name)
    child = _child(fn)
    why = allocator_untunable() or (None if child is not None and not child.failed else
                                    "the chosen variant was timed in this process, not in a fresh one")
    if cf is None or why is not None:
        report.notes.append(f"allocator setting not tried: {why or 'no files of the chosen variant were kept'}")
        return
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=5, min_time_s=s.cfg.final_min_time_s,
                      max_time_s=max(3.0, s.cfg.final_min_time_s * 2), device=s.device.type)
    try:
        trial = fair.tune_allocator(child, tc)  # type: ignore[arg-type]
    except RecipeError as exc:
        report.notes.append(f"allocator setting not tried: its timing process failed ({exc})"[:300])
        return
    report.notes.append(trial.text())
    if trial.keep:
        gain = {"default_ms": trial.default_ms, "tuned_ms": trial.tuned_ms, "ratio": trial.ratio, "noise": trial.noise}
        s.where[name] = dataclasses.replace(cf, meta={**cf.meta, "environment": dict(trial.setting),
                                                      "environment_gain": gain})


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
    with recording() as gate:
        try:
            return _run_pool(s, report, pool, timers)
        finally:
            for timer in timers.values():
                timer.close()
            if gate.samples:
                report.notes.append(gate.text())


def _run_pool(s: _Search, report: Report, pool: list[CandidateResult], timers: dict[str, ChildTimer]) -> Recipe:
    """``run_finalists`` once the pool is known: screen, compare, check, pick, try the allocator setting."""
    cfg = s.cfg
    eager_res = report.get(EAGER)
    search_ms, search_cv = eager_res.p50_ms, eager_res.cv  # eager in this process, before any candidate ran
    fns = _callables(s, report, pool, timers)
    if len(fns) == 1:
        return get_recipe(EAGER)
    if len(fns) > cfg.finalists + 1:
        fns = _screen(s, report, fns, cfg.finalists)
        for name in [n for n in timers if n not in fns]:  # screened out: its process is no longer needed
            timers.pop(name).close()
    res = _checked_comparison(s, report, fns, search_ms, search_cv)
    best = pick_winner(res, report, cfg)
    if cfg.tune_allocator and s.device.type == "cpu":
        _tune_allocator(s, report, best or EAGER, fns[best or EAGER])
    alone = [n for n in res if report.get(n).alone]
    here = [n for n in res if not report.get(n).alone]
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
    """Fill each finalist's interleaved numbers, speedup and noise (``bench.ratio``); return the fastest
    that reaches ``min_speedup`` and is faster than eager by more than its noise, or None (eager).

    ``min_speedup < 1`` is a user accepting a slower verified candidate on purpose: no noise bar then."""
    q = 99.0 if cfg.objective == "latency" and cfg.percentile == "p99" else 50.0  # objective_stat's statistic
    best, best_speed = None, 0.0
    for name, t in res.items():
        c = report.get(name)
        c.p50_ms, c.p99_ms, c.cv, c.throughput = t.median * 1e3, t.p99 * 1e3, t.cv, t.throughput
        c.interleaved = True
        if name == EAGER:
            c.speedup = 1.0
            continue
        est = paired_ratio(res[EAGER], t, q)
        c.speedup, c.noise = est.ratio, est.noise
        clears = c.speedup >= cfg.min_speedup and (cfg.min_speedup < 1 or est.beats_noise)
        if clears and c.speedup > best_speed:
            best, best_speed = name, c.speedup
    return best
