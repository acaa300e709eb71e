"""The candidate search.

1. Eager runs first and gives the references (held-out inputs) and the baseline timing.
2. Each selected recipe is skipped (unavailable here, not applicable, budget spent), or built,
   run twice on every held-out set and timed: in this process with a time limit, or in a child
   process when the recipe is ``isolate=True`` (native code) or ``isolate_all`` is set. An
   exception, hang or crash marks that candidate ``failed`` and the search goes on.
3. The gate (``verify.judge``) marks each ``verified`` or ``rejected`` (with its error numbers).
4. Finalists: the ``finalists`` best search estimates plus any within ``NOISE_BAND`` of the best (one
   early sample each, taken minutes apart, can be hit by load) are screened in a short interleaved
   run with eager when they outnumber ``finalists``; the best ``finalists`` by that ratio are re-timed
   interleaved with eager (``bench.compare``); the winner must beat eager by ``min_speedup`` and by
   eager's own noise, otherwise eager is chosen.
"""

from __future__ import annotations

import copy
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.cache import CACHE_VERSION, CandidateCache, function_id, make_key, model_hash
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.evaluate import CandidateTimeout, Evaluation, evaluate, run_isolated, time_limit
from torchnitro.autotune.inputs import ModelInfo, input_signature
from torchnitro.autotune.recipe import BuildContext, Recipe
from torchnitro.autotune.recipes._util import restructure
from torchnitro.autotune.report import CandidateResult, Report, Status
from torchnitro.autotune.verify import judge
from torchnitro.autotune.workload import (SearchOutcome, SearchProgress, Workload, objective_stat, objective_text,
                                          preload_modules, prepare_workload, select_recipes)
from torchnitro.bench.timing import TimingConfig, compare
from torchnitro.hardware import hardware_info

__all__ = ["search", "resolve_device", "finalist_pool", "NOISE_BAND"]



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
        self.where: dict[str, tuple[Path, dict[str, Any], list[str], bool]] = {}  # name -> dir, meta, files, standalone
        self.notes: set[str] = set()
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
                        metric=function_id(self.cfg.metric_fn), thr=self.cfg.metric_threshold)

    def ctx(self, r: Recipe) -> BuildContext:
        work = Path(self.tmp.name) / r.name
        work.mkdir(parents=True, exist_ok=True)
        return BuildContext(copy.deepcopy(self.model), self.wl.example_inputs, self.hw, self.device, work,
                            dict(self.wl.dynamic_dims), self.cfg)

    def run_one(self, r: Recipe, limit_s: float) -> CandidateResult:
        res = CandidateResult(r.name, r.numeric_class.value, Status.FAILED)
        key = self.cand_key(r) if self.cache else None
        if key and r.name != "eager":
            hit = self.cache.get_candidate(key)
            if hit is not None:
                entry, d = hit
                res = CandidateResult(**entry["record"])
                res.cached, res.speedup = True, None
                if res.status == Status.VERIFIED:
                    self.where[r.name] = (d, entry["meta"], entry["files"], entry["standalone"])
                return res
        ctx = self.ctx(r)
        isolated = (r.isolate or self.cfg.isolate_all) and r.name != "eager"
        preload = preload_modules(self.info, self.model)
        if isolated and preload is None:
            isolated = False
            self.notes.add("the model's classes are defined interactively, so risky candidates ran in this process "
                           "(no crash isolation); define the model in a .py file to isolate them")
        res.isolated = isolated
        try:
            if isolated:
                ev = run_isolated(r, ctx, self.wl.held_out, self.wl.timing_sets, self.timing, self.wl.items_per_call,
                                  limit_s, preload or [])
                if isinstance(ev, str):
                    res.reason = ev
                    return res
            else:
                with time_limit(limit_s):
                    ev = evaluate(r, ctx, self.wl.held_out, self.wl.timing_sets, self.timing, self.wl.items_per_call)
        except CandidateTimeout as exc:
            res.reason = str(exc)
            return res
        except Exception as exc:  # noqa: BLE001 - one candidate never takes the search down
            res.reason = f"{type(exc).__name__}: {exc}".strip()[:400]
            res.notes = traceback.format_exc(limit=-2)[-400:]
            return res
        self._fill(res, r, ev)
        if res.status == Status.VERIFIED:
            if ev.built is not None:
                self.fns[r.name] = ev.built.fn
                self.p50[r.name] = res.p50_ms or 0.0
                self._trim()
            self.where[r.name] = (ctx.workdir, ev.meta, ev.files, ev.standalone)
        if key and r.name != "eager":
            stored = self.cache.put_candidate(key, {"record": res.to_dict(), "meta": ev.meta,
                                                    "standalone": ev.standalone}, ctx.workdir, ev.files)
            if stored is not None and r.name in self.where:
                self.where[r.name] = (stored, ev.meta, ev.files, ev.standalone)
        return res

    def _trim(self) -> None:
        """Keep live only the in-process candidates that can still be finalists (each may hold a model
        copy); the others are rebuilt with ``recipe.load`` if they are needed after all."""
        ranked = sorted((n for n in self.fns if n != "eager"), key=lambda n: self.p50[n])
        k = self.cfg.finalists
        for name in ranked[max(2 * k, k + 2):]:  # the largest finalist pool (finalist_pool)
            del self.fns[name]

    def _fill(self, res: CandidateResult, r: Recipe, ev: Evaluation) -> None:
        kind = self.wl.output_kind
        gate = judge(ev.outputs, self.wl.references, self.cfg.tolerance(r.numeric_class.value),
                     metric_fn=self.cfg.metric_fn, metric_threshold=self.cfg.metric_threshold,
                     reference_raw=self.wl.reference_raw, rebuild=lambda flat: restructure(kind, flat))
        t = ev.timing
        res.status = Status.VERIFIED if gate.passed else Status.REJECTED
        res.reason = gate.reason
        res.build_s, res.p50_ms, res.p99_ms, res.cv = ev.build_s, t["median_s"] * 1e3, t["p99_s"] * 1e3, t["cv"]
        res.throughput = t["throughput_per_s"]
        res.peak_mem_mb = ev.peak_mem_mb
        res.max_abs, res.max_rel, res.norm_rel, res.min_cosine, res.metric = (
            gate.max_abs, gate.max_rel, gate.norm_rel, gate.min_cosine, gate.metric)
        res.shape_ms, res.first_call_ms, res.notes = ev.shape_ms, ev.first_call_ms, ev.notes

    def callable_for(self, r: Recipe) -> Callable[..., Any]:
        if r.name in self.fns:
            return self.fns[r.name]
        d, meta, _, standalone = self.where[r.name]
        fn = r.load(d, meta, None if standalone else copy.deepcopy(self.model))
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
    t_start = time.perf_counter()
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
        return _run(s, recipes, t_start)
    finally:
        torch.set_num_threads(old_threads)


def _run(s: _Search, recipes: list[Recipe], t_start: float) -> SearchOutcome:
    cfg, hw = s.cfg, s.hw
    report = Report(model=s.info.name, inputs=input_signature(s.wl.example_inputs),
                    objective=objective_text(cfg, s.wl), hardware=_hw_text(hw, s.device))
    prog = SearchProgress(cfg.progress, len(recipes) + 1)
    try:
        for r in recipes:
            prog.step(f"{r.name}: building")
            remaining = cfg.budget_s - (time.perf_counter() - t_start)
            try:
                why = _not_here(r, hw, s.device) or r.inapplicable_reason(s.model, s.wl.example_inputs)
            except Exception as exc:  # noqa: BLE001 - a buggy check costs only its own recipe
                why = f"its applicability check raised {type(exc).__name__}: {exc}"[:300]
            if why is None and r.name != "eager" and remaining < 1.0:
                why = f"time budget of {cfg.budget_s:.0f} s spent (raise budget_s)"
            if why is not None and r.name != "eager":
                report.candidates.append(CandidateResult(r.name, r.numeric_class.value, Status.SKIPPED, why))
            else:
                limit = max(cfg.candidate_timeout_s, 60.0) if r.name == "eager" else min(cfg.candidate_timeout_s, remaining)
                report.candidates.append(s.run_one(r, limit))
            prog.step(r.name, advance=1)
        prog.step("comparing finalists with eager")
        chosen = _finalists(s, report)
        report.notes.extend(sorted(s.notes))
    finally:
        prog.close()
    report.chosen = chosen.name
    report.search_s = time.perf_counter() - t_start
    for c in report.candidates:
        if c.recipe == chosen.name:
            c.status = Status.CHOSEN
    d, meta, files, standalone = s.where.get(chosen.name, (None, {}, [], False))
    return SearchOutcome(report, chosen, s.callable_for(chosen), meta, files, d, standalone, s.wl, s.tmp)


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


def _callables(s: _Search, cands: list[CandidateResult]) -> dict[str, Callable[[], Any]]:
    from torchnitro.autotune.recipe import get_recipe

    fns: dict[str, Callable[[], Any]] = {}
    sets = s.wl.timing_sets
    for c in cands:
        try:
            fn = s.callable_for(get_recipe(c.recipe))
        except Exception as exc:  # noqa: BLE001
            c.status = Status.FAILED
            c.reason = f"reloading the built candidate failed: {type(exc).__name__}: {exc}"[:300]
            continue
        fns[c.recipe] = lambda fn=fn: [fn(*x) for x in sets]
    return fns


def _screen(s: _Search, report: Report, eager_fn: Callable[[], Any], fns: dict[str, Callable[[], Any]],
            k: int) -> dict[str, Callable[[], Any]]:
    """A short interleaved run of eager and the whole pool; keeps the ``k`` best by median ratio to eager.

    Ratios from one interleaved run survive load drift that the search-time samples do not."""
    cfg = s.cfg
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, min_time_s=cfg.final_min_time_s / 2,
                      max_time_s=max(3.0, cfg.final_min_time_s * 2), device=s.device.type)
    with torch.inference_mode():
        res = compare({"eager": eager_fn, **fns}, tc, items_per_call=s.wl.items_per_call, baseline="eager")
    ratio = {n: res["eager"].median / t.median for n, t in res.items() if n != "eager"}
    keep = sorted(ratio, key=ratio.get, reverse=True)[:k]
    for name, r in ratio.items():
        c = report.get(name)
        c.notes = (c.notes + "; " if c.notes else "") + f"screen {r:.2f}x vs eager (short interleaved run)"
        if name not in keep:  # not re-timed again: the screen's interleaved numbers are its best estimate
            t = res[name]
            c.p50_ms, c.p99_ms, c.cv, c.throughput, c.speedup, c.interleaved = (
                t.median * 1e3, t.p99 * 1e3, t.cv, t.throughput, r, True)
    report.notes.append(f"{len(fns)} candidates within {NOISE_BAND:g}x of the best search estimate were screened in "
                        f"a short interleaved run with eager; the best {len(keep)} went on to the final comparison")
    return {n: fns[n] for n in keep}


def _finalists(s: _Search, report: Report) -> Recipe:
    from torchnitro.autotune.recipe import get_recipe

    cfg = s.cfg
    eager = get_recipe("eager")
    eager_res = report.get("eager")
    if eager_res.status != Status.VERIFIED:
        from torchnitro.errors import InputError

        raise InputError(f"the eager model failed on its own inputs: {eager_res.reason}; expected a model that runs "
                         "deterministically in eval mode on the example inputs")
    verified = [c for c in report.candidates if c.status == Status.VERIFIED and c.recipe != "eager"]
    key = (lambda c: c.p99_ms) if cfg.percentile == "p99" else (lambda c: c.p50_ms)
    verified.sort(key=key)
    for c in verified:  # search-time estimate; finalists get the interleaved number below
        c.speedup = eager_res.p50_ms / c.p50_ms if c.p50_ms else None
    eager_res.speedup = 1.0
    if verified:
        report.notes.append(f"~: search-time estimate against eager's search-time p50 of {eager_res.p50_ms:.2f} ms "
                            "(one short measurement each; unmarked speedups come from the interleaved comparison)")
    fns = _callables(s, finalist_pool(verified, key, cfg.finalists))
    if not fns:
        return eager
    efn = s.callable_for(eager)
    sets = s.wl.timing_sets
    eager_fn = lambda: [efn(*x) for x in sets]  # noqa: E731
    if len(fns) > cfg.finalists:
        fns = _screen(s, report, eager_fn, fns, cfg.finalists)
    fns = {"eager": eager_fn, **fns}
    iters = max(cfg.final_min_iters, 30) if cfg.percentile == "p99" else cfg.final_min_iters  # a p99 needs samples
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=iters, min_time_s=cfg.final_min_time_s,
                      max_time_s=max(5.0, cfg.final_min_time_s * 3), device=s.device.type)
    with torch.inference_mode():
        res = compare(fns, tc, items_per_call=s.wl.items_per_call, baseline="eager")
    base = objective_stat(res["eager"], cfg)
    # below 1 the user accepts a slower verified candidate on purpose (forcing a recipe); else beat the noise too
    required = cfg.min_speedup if cfg.min_speedup < 1 else max(cfg.min_speedup, 1.0 + min(res["eager"].cv, 0.10))
    best, best_speed = eager, 0.0  # eager unless some candidate clears the bar
    for name, t in res.items():
        c = report.get(name)
        c.p50_ms, c.p99_ms, c.cv, c.throughput = t.median * 1e3, t.p99 * 1e3, t.cv, t.throughput
        c.speedup = base / objective_stat(t, cfg)
        c.interleaved = True
        if name != "eager" and c.speedup >= required and c.speedup > best_speed:
            best, best_speed = get_recipe(name), c.speedup
    report.notes.append(f"finalists re-timed interleaved with eager; a winner needs >= {required:.2f}x")
    return best


def _hw_text(hw: Any, device: torch.device) -> str:
    if device.type == "cuda" and hw.gpu_name:
        return f"{hw.gpu_name} (sm_{hw.gpu_capability[0]}{hw.gpu_capability[1]})"
    flags = [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni") if f in hw.cpu_flags]
    return f"{hw.cpu_name}, {hw.cpu_cores} cores, {torch.get_num_threads()} threads" + (f", {' '.join(flags)}" if flags else "")
