"""The candidate search.

1. Eager runs first and gives the references (held-out inputs) and the baseline timing.
2. Each selected recipe is skipped (unavailable here, not applicable, budget spent), or built,
   run twice on every held-out set and timed: in this process with a time limit, or in a child
   process when the recipe is ``isolate=True`` (native code) or ``isolate_all`` is set; the child
   gets a program prepared here (``autotune.program``), never the model object. An exception, hang or
   crash marks that candidate ``failed`` (one clean line, ``autotune.failure``) and the search goes on.
   A candidate starts only within the budget (a child's start-up counts against it; one that cannot
   start is ``skipped``) and then has its whole limit: a search ends by its budget plus one limit.
3. The gate (``verify.judge``) marks each ``verified`` or ``rejected`` (with its error numbers).
4. Finalists: the ``finalists`` best search estimates plus any within ``NOISE_BAND`` of the best (one
   early sample each, taken minutes apart, can be hit by load) are screened in a short interleaved
   run with eager when they outnumber ``finalists``; the best ``finalists`` by that ratio are re-timed
   interleaved with eager (``bench.compare``); the winner must beat eager by ``min_speedup`` and by
   more than the noise of its ratio (``bench.ratio``: paired bootstrap over the rounds), otherwise eager. Candidates with their own runtime (``isolate=True``,
   standalone artifact) are timed alone in their own process in both runs (``autotune.fair``), and
   eager inside the comparison is checked against eager alone (redone once when it drifted).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.cache import CACHE_VERSION, CandidateCache, function_id, make_key, model_hash
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.evaluate import Evaluation, evaluate, run_isolated
from torchnitro.autotune.failure import Failure, clean_line
from torchnitro.autotune.inputs import ModelInfo, input_signature
from torchnitro.autotune.limits import CandidateTimeout, time_limit
from torchnitro.autotune.program import Programs, isolation
from torchnitro.autotune.recipe import EAGER, BuildContext, CandidateFiles, Recipe
from torchnitro.autotune.recipes._util import restructure
from torchnitro.autotune.report import CandidateResult, Report, Status
from torchnitro.autotune.verify import gate_options, judge
from torchnitro.autotune.workload import (SearchOutcome, SearchProgress, Workload, objective_text,
                                          prepare_workload, select_recipes)
from torchnitro.autotune import fair
from torchnitro.bench.environment import describe_environment
from torchnitro.bench.isolated import ChildTimer, save_inputs, shared_process
from torchnitro.bench.ratio import paired_ratio
from torchnitro.bench.timing import Timing, TimingConfig, compare
from torchnitro.errors import InputError, RecipeError
from torchnitro.hardware import hardware_info

__all__ = ["search", "resolve_device", "finalist_pool", "pick_winner", "NOISE_BAND"]



def resolve_device(cfg: OptimizeConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        from torchnitro.errors import BackendUnavailableError

        raise BackendUnavailableError(f"device={cfg.device!r} was requested but no CUDA GPU is visible; "
                                      "use device='cpu' or 'auto'")
    return torch.device(cfg.device)


class _Search:
    def __init__(self, model: nn.Module, info: ModelInfo, cfg: OptimizeConfig, wl: Workload, device: torch.device):
        self.model, self.info, self.cfg, self.wl, self.device = model, info, cfg, wl, device
        self.hw = hardware_info()
        self.tmp = tempfile.TemporaryDirectory(prefix="torchnitro-")
        self.cache = CandidateCache(cfg.resolved_cache_dir()) if cfg.cache else None
        self.mhash = model_hash(model) if cfg.cache else ""
        self.fns: dict[str, Callable[..., Any]] = {}  # in-process candidates, kept for the final comparison
        self.where: dict[str, CandidateFiles] = {}  # verified candidates' files by recipe name
        self.notes: set[str] = set()
        self.programs = Programs(model, wl.example_inputs, dict(wl.dynamic_dims), Path(self.tmp.name) / "_programs")
        self.p50: dict[str, float] = {}  # search-time p50 of live in-process candidates
        self.timing = TimingConfig(warmup=1, warmup_s=0.0, min_iters=cfg.timing_min_iters,
                                   min_time_s=cfg.timing_min_time_s, max_time_s=max(2.0, cfg.timing_min_time_s * 4),
                                   device=device.type)

    def base_key(self) -> dict[str, Any]:
        return {"v": CACHE_VERSION, "model": self.mhash, "inputs": [input_signature(s) for s in self.wl.timing_sets],
                "held": [input_signature(h) for h in self.wl.held_out], "hw": self.hw.fingerprint,
                "device": str(self.device), "threads": torch.get_num_threads(), "seed": self.cfg.seed}

    def cand_key(self, r: Recipe) -> str:
        return make_key(**self.base_key(), recipe=r.name, rv=r.version, cls=f"{type(r).__module__}.{type(r).__qualname__}",
                        tol=self.cfg.tolerance(r.numeric_class.value),
                        metric=function_id(self.cfg.metric_fn), thr=self.cfg.metric_threshold,
                        gate=[self.cfg.padding_mask, self.cfg.compare_padding, self.cfg.classifier])

    def ctx(self, r: Recipe, isolated: bool) -> BuildContext:
        work = Path(self.tmp.name) / r.name
        work.mkdir(parents=True, exist_ok=True)
        model = None if isolated else copy.deepcopy(self.model)  # an isolated child gets a program instead
        return BuildContext(model, self.wl.example_inputs, self.hw, self.device, work,  # type: ignore[arg-type]
                            dict(self.wl.dynamic_dims), self.cfg)

    def run_one(self, r: Recipe, limit_s: float, remaining_s: float = math.inf) -> CandidateResult:
        """Evaluate ``r`` under its ``limit_s``; an isolated child must also start within ``remaining_s``
        (the search budget left), else the candidate is skipped for the budget."""
        res = CandidateResult(r.name, r.numeric_class.value, Status.FAILED)
        key = self.cand_key(r) if self.cache else None
        if key and r.name != EAGER:
            hit = self.cache.get_candidate(key)
            if hit is not None:
                entry, d = hit
                res = CandidateResult(**entry["record"])
                res.cached, res.speedup = True, None
                if res.status == Status.VERIFIED:
                    self.where[r.name] = CandidateFiles(d, entry["files"], entry["meta"], entry["standalone"])
                return res
        isolated, note = isolation(r, self.cfg.isolate_all)
        if note:
            self.notes.add(note)
        ctx = self.ctx(r, isolated)
        res.isolated = isolated
        try:
            if isolated:
                ev = self._in_child(r, ctx, limit_s, remaining_s)
            else:
                with time_limit(limit_s):
                    ev = evaluate(r, ctx, self.wl.held_out, self.wl.timing_sets, self.timing, self.wl.items_per_call)
        except CandidateTimeout as exc:
            ev = Failure("", str(exc))
        except Exception as exc:  # noqa: BLE001 - one candidate never takes the search down
            ev = Failure.from_exception(exc)
        if isinstance(ev, Failure):
            res.status = Status.SKIPPED if ev.budget else Status.FAILED
            res.reason, res.notes = ev.reason, ev.notes
            return res
        self._fill(res, r, ev)
        if res.status == Status.VERIFIED:
            if ev.built is not None:
                self.fns[r.name] = ev.built.fn
                self.p50[r.name] = res.p50_ms or 0.0
                self._trim()
            self.where[r.name] = ev.candidate
        if key and r.name != EAGER:
            cf = ev.candidate
            stored = self.cache.put_candidate(key, {"record": res.to_dict(), "meta": cf.meta,
                                                    "standalone": cf.standalone}, ctx.workdir, cf.files)
            if stored is not None and r.name in self.where:
                self.where[r.name] = dataclasses.replace(cf, dir=stored)
        return res

    def _in_child(self, r: Recipe, ctx: BuildContext, limit_s: float, remaining_s: float) -> Evaluation | Failure:
        """``r`` in a child process fed the program it declares (prepared once, shared); preparing
        and the child's start-up count against the budget, not against the recipe's limit."""
        t0 = time.perf_counter()
        program, prep_s = self.programs.get(r.isolated_input, limit_s, remaining_s)
        if isinstance(program, Failure):
            return program
        ctx.program = program
        ev = run_isolated(r, ctx, self.wl.held_out, self.wl.timing_sets, self.timing, self.wl.items_per_call,
                          limit_s, remaining_s - (time.perf_counter() - t0))
        if isinstance(ev, Evaluation):  # the child never saw the model itself: say what it built from
            how = f"built from the {program.kind} program ({prep_s:.1f} s to prepare, shared)" + (
                f"; torch.export failed: {program.meta['export_error']}" if "export_error" in program.meta else "")
            ev.notes = f"{ev.notes}; {how}" if ev.notes else how
        return ev

    def _trim(self) -> None:
        """Keep live only the in-process candidates that can still be finalists (each may hold a model
        copy); the others are rebuilt with ``recipe.load`` if they are needed after all."""
        ranked = sorted((n for n in self.fns if n != EAGER), key=lambda n: self.p50[n])
        k = self.cfg.finalists
        for name in ranked[max(2 * k, k + 2):]:  # the largest finalist pool (finalist_pool)
            del self.fns[name]

    def _fill(self, res: CandidateResult, r: Recipe, ev: Evaluation) -> None:
        kind = self.wl.output_kind
        gate = judge(ev.outputs, self.wl.references, self.cfg.tolerance(r.numeric_class.value),
                     metric_fn=self.cfg.metric_fn, metric_threshold=self.cfg.metric_threshold,
                     reference_raw=self.wl.reference_raw, rebuild=lambda flat: restructure(kind, flat),
                     **gate_options(self.cfg, self.model, self.wl.held_out))
        t = ev.timing
        res.status = Status.VERIFIED if gate.passed else Status.REJECTED
        res.reason = gate.reason
        res.build_s, res.p50_ms, res.p99_ms, res.cv = ev.build_s, t["median_s"] * 1e3, t["p99_s"] * 1e3, t["cv"]
        res.throughput = t["throughput_per_s"]
        res.peak_mem_mb = ev.peak_mem_mb
        res.max_abs, res.max_rel, res.norm_rel, res.min_cosine, res.metric = (
            gate.max_abs, gate.max_rel, gate.norm_rel, gate.min_cosine, gate.metric)
        res.shape_ms, res.first_call_ms, res.notes = ev.shape_ms, ev.first_call_ms, ev.notes
        res.notes = "; ".join(n for n in (res.notes, gate.note) if n)  # top-1 agreement of class logits
        if gate.compared:
            self.notes.add(gate.compared)  # masked rows left out: the same for every candidate

    def callable_for(self, r: Recipe) -> Callable[..., Any]:
        if r.name in self.fns:
            return self.fns[r.name]
        fn = self.where[r.name].load(r, self.model)
        self.fns[r.name] = fn
        return fn


def _not_here(r: Recipe, hw: Any, device: torch.device) -> str | None:
    """Why ``r`` cannot run on this machine/device, or None."""
    why = r.unavailable_reason(hw)
    if why is None and r.gpu_only and device.type != "cuda":
        why = "needs a CUDA device; this search runs on the CPU"
    return why


def search(model: nn.Module, example_inputs: tuple[Any, ...], info: ModelInfo, cfg: OptimizeConfig) -> SearchOutcome:
    """Run the search (see the module docstring) and return the chosen variant with the report."""
    t_start = _clock()
    device = resolve_device(cfg)
    recipes = select_recipes(cfg)
    for r in recipes if cfg.recipes is not None else []:  # explicitly requested: unable to run here is an error
        why = _not_here(r, hardware_info(), device) if r.name in cfg.recipes else None
        if why is not None:
            from torchnitro.errors import BackendUnavailableError

            raise BackendUnavailableError(
                f"recipe {r.name!r} was requested but cannot run here: {why}. Remove it from the recipe list "
                "(or leave the list empty to try every recipe that can run here)")
    model = copy.deepcopy(model).eval().to(device)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(cfg.resolved_threads())
    try:
        wl = prepare_workload(model, example_inputs, info, cfg, device)
        s = _Search(model, info, cfg, wl, device)
        with shared_process():  # eager and in-process candidates are timed here: no runtime pool may spin
            return _run(s, recipes, t_start)
    finally:
        torch.set_num_threads(old_threads)


_clock = time.perf_counter  # the budget's clock (tests replace it to put a candidate at the budget's edge)


def _run(s: _Search, recipes: list[Recipe], t_start: float) -> SearchOutcome:
    cfg, hw = s.cfg, s.hw
    report = Report(model=s.info.name, inputs=input_signature(s.wl.example_inputs),
                    objective=objective_text(cfg, s.wl), hardware=_hw_text(hw, s.device))
    prog = SearchProgress(cfg.progress, len(recipes) + 1)
    try:
        for r in recipes:
            prog.step(f"{r.name}: building")
            remaining = cfg.budget_s - (_clock() - t_start)
            try:
                why = _not_here(r, hw, s.device) or r.inapplicable_reason(s.model, s.wl.example_inputs)
            except Exception as exc:  # noqa: BLE001 - a buggy check costs only its own recipe
                why = clean_line(f"its applicability check raised {type(exc).__name__}: {exc}")
            if why is None and r.name != EAGER and remaining < 1.0:
                why = f"budget: the search's {cfg.budget_s:.0f} s are spent (raise budget_s)"
            if why is not None and r.name != EAGER:
                report.candidates.append(CandidateResult(r.name, r.numeric_class.value, Status.SKIPPED, why))
            else:  # one that starts within the budget gets its whole limit: a search ends by budget + one limit
                limit = max(cfg.candidate_timeout_s, 60.0) if r.name == EAGER else cfg.candidate_timeout_s
                report.candidates.append(s.run_one(r, limit, remaining))
            prog.step(r.name, advance=1)
        prog.step("comparing finalists with eager")
        chosen = _finalists(s, report)
        report.notes.extend(sorted(s.notes))
    finally:
        prog.close()
    report.chosen = chosen.name
    report.search_s = _clock() - t_start
    for c in report.candidates:
        if c.recipe == chosen.name:
            c.status = Status.CHOSEN
    return SearchOutcome(report, chosen, s.callable_for(chosen), s.where.get(chosen.name, CandidateFiles()), s.wl,
                         s.tmp)


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
    from torchnitro.autotune.recipe import get_recipe

    try:
        fn = s.callable_for(get_recipe(c.recipe))
    except Exception as exc:  # noqa: BLE001
        c.status = Status.FAILED
        c.reason = f"reloading the built candidate failed: {type(exc).__name__}: {exc}"[:300]
        return None
    sets = s.wl.timing_sets
    return lambda: [fn(*x) for x in sets]


def _places(s: _Search, cands: list[CandidateResult]) -> dict[str, fair.Placement]:
    """Where the comparison times eager and each of ``cands`` (``autotune.fair``), eager first."""
    from torchnitro.autotune.recipe import get_recipe

    cfg, device = s.cfg, s.device.type
    if cfg.final_alone and device == "cpu":
        eager = fair.child_model(s.model, s.info.spec, s.info.extra, Path(s.tmp.name) / "_final")
    else:
        eager = fair.ChildModel(None, "")
    places = {EAGER: fair.place(get_recipe(EAGER), None, eager, device=device, all_alone=cfg.final_alone)}
    for c in cands:
        cf = s.where.get(c.recipe)
        places[c.recipe] = fair.place(get_recipe(c.recipe), cf, eager, device=device, all_alone=cfg.final_alone) \
            if cf is not None else fair.Placement(None, "timed in this process: no files of it were kept")
    heavy = [n for n, p in places.items() if p.needs_eager]
    too_big = fair.memory_fits(s.model, len(heavy)) if heavy else None
    for n in heavy if too_big else []:
        places[n] = fair.Placement(None, f"timed in this process: {too_big}")
    return places


def _callables(s: _Search, report: Report, cands: list[CandidateResult],
               timers: dict[str, ChildTimer]) -> dict[str, Callable[..., Any]]:
    """What the comparison times, eager first, then ``cands`` in order: a ready ``ChildTimer`` (also put in
    ``timers``, for the caller to close) per variant timed alone, a closure per variant timed here. Each row
    of the report says which, and why."""
    from torchnitro.autotune.recipe import get_recipe

    places = _places(s, cands)
    work = Path(s.tmp.name) / "_final"
    work.mkdir(parents=True, exist_ok=True)
    inputs = work / "_timing_inputs.pt"
    if any(p.kwargs is not None for p in places.values()):
        try:
            save_inputs(s.wl.timing_sets, inputs)
        except InputError as exc:
            places = {n: fair.Placement(None, f"timed in this process: {exc}"[:300]) for n in places}
    timers.update(fair.start_children(places, inputs, work, threads=torch.get_num_threads(), device=s.device.type))
    efn = s.callable_for(get_recipe(EAGER))
    first = s.wl.timing_sets[0]

    def eager_outputs() -> Any:
        with torch.inference_mode():
            return efn(*first)

    fallen = fair.ready_children(timers, places, EAGER, eager_outputs, s.cfg.tolerance("exact").get("rel", 1e-4))
    fns: dict[str, Callable[..., Any]] = {}
    for name in places:
        c = report.get(name)
        _note(c, "final comparison: " + fallen.get(name, places[name].why))
        if name in timers:
            fns[name], c.alone = timers[name], True
            continue
        fn = _local(s, c)
        if fn is not None:
            fns[name] = fn
    return fns


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
                    fns[n], c.alone = _local(s, c), False  # type: ignore[assignment]
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
    if not isinstance(eager_fn, ChildTimer):
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
    why = allocator_untunable() or (None if isinstance(fn, ChildTimer) and not fn.failed else
                                    "the chosen variant was timed in this process, not in a fresh one")
    if cf is None or why is not None:
        report.notes.append(f"allocator setting not tried: {why or 'no files of the chosen variant were kept'}")
        return
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=5, min_time_s=s.cfg.final_min_time_s,
                      max_time_s=max(3.0, s.cfg.final_min_time_s * 2), device=s.device.type)
    try:
        trial = fair.tune_allocator(fn, tc)  # type: ignore[arg-type]
    except RecipeError as exc:
        report.notes.append(f"allocator setting not tried: its timing process failed ({exc})"[:300])
        return
    report.notes.append(trial.text())
    if trial.keep:
        gain = {"default_ms": trial.default_ms, "tuned_ms": trial.tuned_ms, "ratio": trial.ratio, "noise": trial.noise}
        s.where[name] = dataclasses.replace(cf, meta={**cf.meta, "environment": dict(trial.setting),
                                                      "environment_gain": gain})


def _finalists(s: _Search, report: Report) -> Recipe:
    from torchnitro.autotune.recipe import get_recipe

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
    search_ms, search_cv = eager_res.p50_ms, eager_res.cv  # eager in this process, before any candidate ran
    timers: dict[str, ChildTimer] = {}
    try:
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
    finally:
        for timer in timers.values():
            timer.close()
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


def _hw_text(hw: Any, device: torch.device) -> str:
    if device.type == "cuda" and hw.gpu_name:
        return f"{hw.gpu_name} (sm_{hw.gpu_capability[0]}{hw.gpu_capability[1]})"
    flags = [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni") if f in hw.cpu_flags]
    return f"{hw.cpu_name}, {hw.cpu_cores} cores, {torch.get_num_threads()} threads" + (f", {' '.join(flags)}" if flags else "")
