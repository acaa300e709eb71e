"""The candidate search.

1. Eager runs first and gives the references (held-out inputs) and the baseline timing.
2. Each selected recipe is skipped (unavailable here, not applicable, budget spent), or built,
   run twice on every held-out set and timed: in this process with a time limit, or in a child
   process when the recipe is ``isolate=True`` (native code) or ``isolate_all`` is set; the child
   gets a program prepared here (``autotune.program``), never the model object. An exception, hang or
   crash marks that candidate ``failed`` (one clean line, ``autotune.failure``) and the search goes on.
   A candidate starts only within the candidates' part of the budget (a child's start-up counts against it;
   one that cannot start is ``skipped``) and then has its whole limit. The budget covers the whole search:
   the final phase's share is reserved first (``autotune.final_budget``), and the final phase runs against
   its own deadline, so a search ends within its budget plus one candidate's limit.
3. The gate (``verify.judge``) marks each ``verified`` or ``rejected`` (with its error numbers).
4. Finalists: the best verified candidates are compared with eager, each timed as it will run
   (``autotune.final``, ``autotune.fair``), and the winner is chosen.
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
from torchnitro.autotune.limits import time_limit, timed_out
from torchnitro.autotune.program import Programs, isolation
from torchnitro.autotune.recipe import EAGER, BuildContext, CandidateFiles, Recipe
from torchnitro.autotune.recipes._util import restructure
from torchnitro.autotune.report import CandidateResult, Report, Status
from torchnitro.autotune.verify import gate_options, judge
from torchnitro.autotune.workload import (SearchOutcome, SearchProgress, Workload, objective_text,
                                          prepare_workload, select_recipes)
from torchnitro.autotune import final, final_budget
from torchnitro.bench.isolated import shared_process
from torchnitro.bench.timing import TimingConfig
from torchnitro.hardware import hardware_info

__all__ = ["search", "resolve_device"]



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
        self.final_budget = final_budget.FinalBudget.unlimited()  # the final phase's deadline (set by ``_run``)
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
        except Exception as exc:  # noqa: BLE001 - one candidate never takes the search down
            limit = timed_out(exc)  # a recipe may have wrapped the timeout in an error of its own
            ev = Failure.from_exception(exc) if limit is None else Failure("", str(limit))
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
    plan = final_budget.plan_final(cfg, s.device.type, torch.get_num_threads())
    reserve = min(plan.total_s, cfg.budget_s * final_budget.MAX_SHARE)
    cand_budget = cfg.budget_s - reserve  # candidates start only before this; the final phase has the rest
    try:
        for r in recipes:
            prog.step(f"{r.name}: building")
            remaining = cand_budget - (_clock() - t_start)
            try:
                why = _not_here(r, hw, s.device) or r.inapplicable_reason(s.model, s.wl.example_inputs)
            except Exception as exc:  # noqa: BLE001 - a buggy check costs only its own recipe
                why = clean_line(f"its applicability check raised {type(exc).__name__}: {exc}")
            if why is None and r.name != EAGER and remaining < 1.0:
                why = (f"budget: the candidates' {cand_budget:.0f} s of the search's {cfg.budget_s:.0f} s are spent "
                       f"({reserve:.0f} s are kept for the final comparison; raise budget_s)")
            if why is not None and r.name != EAGER:
                report.candidates.append(CandidateResult(r.name, r.numeric_class.value, Status.SKIPPED, why))
            else:  # one that starts within the budget gets its whole limit: a search ends by budget + one limit
                limit = max(cfg.candidate_timeout_s, 60.0) if r.name == EAGER else cfg.candidate_timeout_s
                report.candidates.append(s.run_one(r, limit, remaining))
            prog.step(r.name, advance=1)
        prog.step("comparing finalists with eager")
        now = _clock()
        s.final_budget = final_budget.FinalBudget(
            final_budget.final_deadline(t_start, now, cfg.budget_s, reserve, cfg.candidate_timeout_s), _clock)
        report.notes.append(f"budget: {cfg.budget_s:.0f} s for the whole search; the final phase was planned at "
                            f"~{plan.total_s:.0f} s ({plan.text()}), {reserve:.0f} s kept for it; it started at "
                            f"{now - t_start:.0f} s with {s.final_budget.left():.0f} s left")
        chosen = final.run_finalists(s, report)
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


def _hw_text(hw: Any, device: torch.device) -> str:
    if device.type == "cuda" and hw.gpu_name:
        return f"{hw.gpu_name} (sm_{hw.gpu_capability[0]}{hw.gpu_capability[1]})"
    flags = [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni") if f in hw.cpu_flags]
    return f"{hw.cpu_name}, {hw.cpu_cores} cores, {torch.get_num_threads()} threads" + (f", {' '.join(flags)}" if flags else "")
