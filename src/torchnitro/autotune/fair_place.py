"""Where the final comparison times each variant, and the timing processes that do it (``autotune.fair``'s rules).

``plan`` places eager (and its further processes, ``fair_eager``) and every finalist of a search;
``place`` decides per variant, under the search's ``PlaceRules``: its own fresh child process (a standalone
artifact, or an artifact rebuilt from the eager model re-created there, ``fair.ChildModel``) or this process,
with the report's reason.
``start_children`` starts one ``ChildTimer`` per placed variant, all at once; ``ready_children`` waits for
them, checks the first outputs of eager's child (and of its further copies, ``fair_eager``) against this
process's eager (``outputs_differ``) and moves every child that failed, or that was rebuilt from an
unchecked eager, back to this process (a failed eager copy is dropped: eager goes on with the others).
``memory_fits`` keeps the number of processes that each hold a copy of the model within available memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from torchnitro.autotune.fair import ChildModel, child_model, runs_alone
from torchnitro.autotune.fair_eager import process_names
from torchnitro.autotune.recipe import EAGER, Recipe, get_recipe
from torchnitro.bench.isolated import ChildTimer

if TYPE_CHECKING:
    from torchnitro.autotune.report import CandidateResult
    from torchnitro.autotune.search import _Search

__all__ = ["Placement", "PlaceRules", "place", "plan", "memory_fits", "outputs_differ", "start_children",
           "ready_children"]

_CHILD_RUNTIME_BYTES = 400 << 20  # an interpreter with torch imported, before the model


@dataclass
class Placement:
    """Where the final comparison times one variant: a child's loader arguments, or why this process."""

    kwargs: dict[str, Any] | None = None  # load_variant's arguments (None: timed in this process)
    why: str = ""  # the report's words: how the child loads it, or why it is timed here
    needs_eager: bool = False  # the child re-creates the eager model (checked through eager's own child)
    outputs: Path | None = None  # where the child writes its first outputs (eager: checked against this process)


@dataclass(frozen=True)
class PlaceRules:
    """What decides every variant's place in one search's final comparison (``plan``, then ``place`` per variant)."""

    eager: ChildModel  # how a timing process re-creates the eager model, or why it cannot
    device: str  # the search's device type: on CUDA only own-runtime candidates get a process of their own
    all_alone: bool  # ``OptimizeConfig.final_alone``: on the CPU eager and every finalist get one too
    budget_here: bool = False  # the final phase turned final_alone off: the budget left no time for the processes


def place(recipe: Recipe, files: Any, rules: PlaceRules) -> Placement:
    """Where ``recipe``'s variant (``files``: its ``CandidateFiles``; None for eager) is timed under ``rules``."""
    cls = type(recipe)
    qual = f"{cls.__module__}:{cls.__qualname__}"
    standalone = bool(files is not None and files.standalone)
    eager = rules.eager
    if not (runs_alone(recipe, standalone) or (rules.all_alone and rules.device == "cpu")):
        why = "on CUDA only own-runtime candidates are timed in their own process" if rules.all_alone else \
            "the budget left no time for a timing process of its own: see the notes" if rules.budget_here else \
            "final_alone=False: eager and in-process candidates are timed in this process"
        return Placement(None, f"timed in this process ({why})")
    if files is None:  # eager
        if eager.kwargs is None:
            return Placement(None, f"timed in this process: {eager.text}")
        return Placement({"recipe": None, "directory": None, "meta": {}, "eager": eager.kwargs},
                         f"alone in its own process ({eager.text})", needs_eager=True)
    if cls.__module__ == "__main__":
        return Placement(None, "timed in this process: its recipe class is defined in the running script, which a "
                               "child process does not import")
    if standalone:
        return Placement({"recipe": qual, "directory": str(files.dir), "meta": files.meta, "eager": None},
                         "alone in its own process (loaded from its standalone artifact)")
    if eager.kwargs is None:
        return Placement(None, f"timed in this process: its artifact is rebuilt from the eager model, and {eager.text}")
    if not eager.rebuilds:
        return Placement(None, "timed in this process: its artifact is rebuilt from the eager model object, which a "
                               "child cannot re-create (eager itself is timed alone from its torch.export program)")
    return Placement({"recipe": qual, "directory": str(files.dir), "meta": files.meta, "eager": eager.kwargs},
                     "alone in its own process (its artifact rebuilt from the re-created eager model)",
                     needs_eager=True)


def plan(s: _Search, cands: list[CandidateResult]) -> dict[str, Placement]:
    """Where the final comparison times eager and each of ``cands`` (``autotune.fair``), eager first, then
    eager's further processes (``OptimizeConfig.eager_processes``, ``fair_eager``) when eager runs alone.
    When the copies of the model do not fit in memory, eager's further processes go first."""
    cfg, device = s.cfg, s.device.type
    if cfg.final_alone and device == "cpu":
        try:
            limit = s.cfg.candidate_timeout_s  # usually prepared already, for an isolated candidate
            eager = child_model(s.model, s.info.spec, s.info.extra, Path(s.tmp.name) / "_final",
                                program=lambda: s.programs.get("exported", limit, limit)[0])
        except Exception as exc:  # noqa: BLE001 - e.g. a full disk: time here, say why
            eager = ChildModel(None, f"preparing the eager model for a child failed ({type(exc).__name__}: "
                                     f"{exc})"[:200])
    else:
        eager = ChildModel(None, "")
    here = bool(getattr(getattr(s, "final_budget", None), "moved_here", False))
    rules = PlaceRules(eager, device, cfg.final_alone, budget_here=here)
    places = {EAGER: place(get_recipe(EAGER), None, rules)}
    first = places[EAGER]
    copies = process_names(cfg.eager_processes)[1:] if first.kwargs is not None else []
    for name in copies:  # eager's further processes, loaded the same way (``fair_eager``)
        places[name] = Placement(dict(first.kwargs), first.why, needs_eager=True)  # type: ignore[arg-type]
    for c in cands:
        cf = s.where.get(c.recipe)
        places[c.recipe] = place(get_recipe(c.recipe), cf, rules) if cf is not None else \
            Placement(None, "timed in this process: no files of it were kept")
    heavy = [n for n, p in places.items() if p.needs_eager]
    too_big = memory_fits(s.model, len(heavy)) if heavy else None
    if too_big and copies:  # fewer copies of the model first: eager from one process
        for n in copies:
            del places[n]
        first.why += f"; in one process, not {len(copies) + 1}: {too_big}"
        heavy = [n for n in heavy if n not in copies]
        too_big = memory_fits(s.model, len(heavy))
    for n in heavy if too_big else []:
        places[n] = Placement(None, f"timed in this process: {too_big}")
    return places


def memory_fits(model: nn.Module, children: int) -> str | None:
    """None when ``children`` timing processes that each hold a copy of ``model`` fit in available memory."""
    need = children * (_CHILD_RUNTIME_BYTES + 2 * sum(t.numel() * t.element_size()
                                                      for t in [*model.parameters(), *model.buffers()]))
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        avail = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None  # not Linux: no estimate, no limit
    if need <= 0.7 * avail:
        return None
    return f"{children} processes holding a copy of the model need ~{need >> 20} MiB, {avail >> 20} MiB are available"


def outputs_differ(path: Path, reference: Any, rel: float) -> str | None:
    """None when the tensors a child wrote to ``path`` match ``reference`` (norm-relative error <= ``rel``)."""
    ref = [t for t in torch.utils._pytree.tree_leaves(reference) if isinstance(t, torch.Tensor)]
    try:
        got = torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - missing or unreadable: the child never wrote them
        return f"its outputs could not be read ({type(exc).__name__})"
    if len(got) != len(ref) or any(a.shape != b.shape for a, b in zip(got, ref)):
        return (f"its outputs have shapes {[tuple(a.shape) for a in got]}, this process's "
                f"{[tuple(b.shape) for b in ref]}")
    for i, (a, b) in enumerate(zip(got, ref)):
        a, b = a.double(), b.detach().cpu().double()
        err = float((a - b).norm() / b.norm().clamp_min(1e-30))
        if not err <= rel:  # NaN is a difference too
            return f"its output {i} differs from this process's eager by {err:.2e} (norm-relative; allowed {rel:g})"
    return None


def start_children(places: dict[str, Placement], inputs: Path, work: Path, *, threads: int,
                   device: str) -> dict[str, ChildTimer]:
    """Start one timing process per placed variant (all at once: they load side by side, before anything is
    timed). Eager's child also writes its first outputs, for ``ready_children`` to check. A process that cannot
    be started leaves its placement saying so (timed in this process)."""
    timers = {}
    for name, p in places.items():
        if p.kwargs is None:
            continue
        if p.kwargs["recipe"] is None:
            p.outputs = work / f"_outputs_{name}.pt"
        try:
            timers[name] = ChildTimer("torchnitro.autotune.fair:load_variant", p.kwargs, inputs, threads=threads,
                                      device=device, log=work / f"_timing_{name}.log", outputs=p.outputs)
        except OSError as exc:  # no process could be started (memory, process limit): timed here
            p.kwargs, p.why = None, f"timed in this process: its timing process could not start ({exc})"[:300]
    return timers


def ready_children(timers: dict[str, ChildTimer], places: dict[str, Placement], eager: str,
                   eager_outputs: Callable[[], Any], rel: float) -> dict[str, str]:
    """Wait for every child; returns name -> why it is timed in this process after all (its timer closed and
    removed from ``timers``). When eager's child fails or its outputs differ from ``eager_outputs()`` (this
    process's eager on the first timing set), every child that re-created the eager model is dropped too.
    Eager's further copies (placements with no recipe besides ``eager``) are checked the same way; a copy
    that fails is dropped alone (its reason returned under its name), all of them when eager's own fails."""
    fallen: dict[str, str] = {}
    reference: list[Any] = []  # this process's eager outputs, computed once

    def drop(name: str, why: str) -> None:
        timers.pop(name).close()
        fallen[name] = why

    def differs(name: str) -> str | None:
        try:
            timers[name].wait_ready()
            if not reference:
                reference.append(eager_outputs())
            return outputs_differ(places[name].outputs, reference[0], rel)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - RecipeError from the child, or this process's eager failing
            return str(exc)

    copies = [n for n in timers if n != eager and (places[n].kwargs or {}).get("recipe", "") is None]
    if eager in timers:
        why = differs(eager)
        if why is not None:
            drop(eager, f"timed in this process: eager re-created in a child failed ({why})"[:300])
    for name in copies:
        why = differs(name) if eager in timers else "eager itself is timed in this process (see eager's row)"
        if why is not None:
            drop(name, f"eager's timing process {name} was dropped: {why}"[:300])
    if eager not in timers:  # the re-created eager was not checked: nothing rebuilt from it is trusted
        for name in [n for n in timers if places[n].needs_eager]:
            drop(name, "timed in this process: the eager model it is rebuilt from could not be re-created "
                       "in a child (see eager's row)")
    for name in list(timers):
        try:
            timers[name].wait_ready()
        except Exception as exc:  # noqa: BLE001 - the child failed to load or start
            drop(name, f"timed in this process: its own timing process failed ({exc})"[:300])
    return fallen
