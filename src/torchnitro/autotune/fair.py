"""Timing the finalists the way they will run: the rules the final comparison follows.

- On the CPU, eager and every finalist are timed alone, each in its own fresh child process that loads
  the variant as a deployed artifact would (``load_variant``): a standalone artifact from its files
  (``Recipe.load(dir, meta, None)``: TorchScript, ONNX Runtime, OpenVINO), eager and every artifact that
  is rebuilt from the eager model from a re-created eager model (``ChildModel``: the model's factory and
  the search's weights, else a pickle of the model object when its classes are importable, else, for a
  model whose classes live in the running script or a notebook, the ``torch.export`` program the search
  built from it in this process, kept only where its solo p50 matches eager's search-time p50
  (``final._program_parity``): eager itself is then timed in its own process, and only the artifacts
  rebuilt from the model object stay here). Rounds
  alternate between the processes (A B A B); the search process only waits, so no runtime pool, warm
  arena or allocator history of the search's own process is in any number. A variant that cannot be
  loaded in a child (its recipe class defined in ``__main__``, a model with no factory that does not
  pickle, a child that fails to start, a re-created eager whose outputs differ) is timed in the search
  process, and its report row says why (``Placement.why``). On CUDA only own-runtime candidates
  (``isolate=True``) are timed in their own process.
- On the CPU every timed sample follows one untimed call of the same variant in the same process
  (``Steady``): in rotation a process can find its weights evicted from the shared cache by the others'
  samples (the built-in encoder's 21 MiB against a 32 MiB L3) and its threads asleep, so a sample's first
  call measured the switch, not the variant as a server runs it back to back; git show
  b08112a:results/timing_fairness.md shows the effect: eager solo 43 ms, the same eager in rotation 51-57 ms,
  whatever ran beside it.
  Every sample, in a child or in this process, is gated (``bench.quiet``): it starts once the other timing
  processes are idle (a torch-based child's libgomp team spins ~3 ms after its own sample, its deployed
  default) and is retaken when foreign CPU ran beside it; the report's "timing gate" note has the counts.
- Eager timed alone runs in ``OptimizeConfig.eager_processes`` fresh processes, every one in every round;
  its p50 for every speedup is the median of the per-process p50s (``autotune.fair_eager``: why every
  process in every round, and how the bootstrap pairs rounds then).
- Eager's p50 inside the comparison must match eager alone within ``max(5%, 2 x eager's cv)``, at most
  25% (``check_eager``). Eager alone is a short solo run of eager's own timing processes right before the
  comparison and another right after it (nothing else timed; with several, the median of their p50s, as
  inside; sampled like the comparison, ``Steady``), checked by their mean; two alone runs that differ by more
  than the band say the machine changed speed meanwhile, not the comparison (``EagerCheck.machine_changed``).
  For eager timed in this process it is its search-time p50. Outside the band the comparison is redone once
  after ``SETTLE_S`` (``autotune.final_check``) and the report says so.
- Every timing process runs under glibc's ``ALLOCATOR_SETTING`` (``bench.environment.timing_process_env``):
  with glibc's default thresholds, fresh processes of the same eager differed by 10-20% (page faults of
  returned memory, a different number in each process; results/eager_spread.md), more than any check here
  allows. The chosen variant and eager are then each timed once more in a fresh process with glibc's
  defaults, interleaved with their processes under the setting (``tune_allocator``): the report gives both,
  with the page faults per call, and the setting goes into the artifact's meta (``environment``) unless the
  defaults were faster by more than the noise; ``torchnitro.load`` / ``serve`` apply it
  (``bench.environment.apply_allocator``). Where the environment chooses the allocator itself (a
  threshold variable or tunable, a malloc replacement in ``LD_PRELOAD``; ``bench.environment.allocator_untunable``),
  timing processes inherit it and the optimizer runs no trial (``final_trials._tune_allocator`` notes why);
  ``tune_allocator`` given such a timer starts the setting and keeps it only when it won beyond the noise.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from torchnitro.autotune.fair_eager import EagerBaseline
from torchnitro.autotune.recipe import Recipe
from torchnitro.bench.environment import ALLOCATOR_SETTING, GLIBC_DEFAULTS
from torchnitro.bench.isolated import ChildTimer
from torchnitro.bench.quiet import Gate, GateConfig
from torchnitro.bench.ratio import paired_ratio
from torchnitro.bench.timing import Timing, TimingConfig, compare

__all__ = ["Steady", "runs_alone", "start_alone", "load_standalone", "load_variant", "ChildModel", "child_model",
           "EagerCheck", "check_eager", "AllocatorTrial", "tune_allocator", "under_allocator_setting",
           "allocator_env", "apply_recorded_allocator", "recorded_meta", "SETTLE_S",
           "MIN_BAND", "MAX_BAND", "MIN_ALLOCATOR_GAIN"]

SETTLE_S = 2.0  # pause before redoing a comparison whose eager drifted (let a burst of other load pass)
MIN_BAND = 0.05  # eager inside the comparison may differ from eager alone by this much, or 2 x its cv
MAX_BAND = 0.25  # ... but never more: past that, eager alone was too noisy to vouch for the comparison
MIN_ALLOCATOR_GAIN = 1.03  # the allocator setting is kept when it is this much faster and beyond the noise


class Steady:
    """``timer(k)`` -> seconds per call of one sample of ``k`` calls taken right after one untimed call of
    the same function (a ``ChildTimer``: in its own process, in the same request), so each sample is the steady
    state a server running only this variant sees, not the first call after another process had the cores and
    caches. A function timed in this process is gated like a child's sample (``bench.quiet``: every timing
    process started from here idle before it, retaken when foreign CPU ran beside it; ``gate`` None: ungated).
    Other attributes (``failed``, ``close``, ``again``) are the wrapped timer's. ``cuda``: a function timed in
    this process is timed with CUDA events around its ``k`` calls (the untimed call is enqueued before the start
    event), as ``bench.compare`` times it on CUDA; a child times itself on its own device either way."""

    times_itself = True

    def __init__(self, fn: Callable[..., Any], gate: GateConfig | None = GateConfig(), cuda: bool = False):
        self.inner = fn
        self.gate = Gate(gate) if gate is not None else None
        self.cuda = cuda
        self._events: tuple[Any, Any] | None = None

    def __call__(self, k: int) -> float:
        fn = self.inner
        if isinstance(fn, ChildTimer):
            return fn.sample(k, warm=1)  # untimed: the child's caches and thread pool take the sample's switch
        if getattr(fn, "times_itself", False):
            fn(1)
            return fn(k)
        if self.gate is None:
            return self._here(k)
        return self.gate.sample(os.getpid(), lambda: self._here(k))

    def _here(self, k: int) -> float:
        fn = self.inner
        fn()
        if self.cuda:
            if self._events is None:
                self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            start, end = self._events
            start.record()
            for _ in range(k):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / k
        t0 = time.perf_counter_ns()
        for _ in range(k):
            fn()
        return (time.perf_counter_ns() - t0) / 1e9 / k

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "gate", "cuda", "_events"):
            raise AttributeError(name)
        return getattr(self.inner, name)


def runs_alone(recipe: Recipe, standalone: bool) -> bool:
    """Whether this candidate has its own runtime and a standalone artifact (timed alone on every device)."""
    return bool(recipe.isolate) and standalone


def _recipe_class(path: str) -> type[Recipe]:
    mod, _, qual = path.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def load_standalone(recipe: str, directory: str, meta: dict[str, Any]) -> Callable[..., Any]:
    """Child side: ``module:qualname`` of the recipe class -> its artifact loaded without the user's model."""
    return _recipe_class(recipe)().load(Path(directory), meta, None)


def load_variant(recipe: str | None, directory: str | None, meta: dict[str, Any],
                 eager: dict[str, Any] | None) -> Callable[..., Any]:
    """Child side: the variant as a deployed artifact loads it. ``recipe`` None: the re-created eager model
    itself; ``eager`` (``ChildModel.kwargs``): how to re-create the eager model a non-standalone artifact
    is rebuilt from (None for a standalone one)."""
    model = _eager_in_child(**eager) if eager is not None else None
    if recipe is None:
        if model is None:
            raise ValueError("load_variant: received recipe=None and eager=None; expected the eager model's source")
        return model
    return _recipe_class(recipe)().load(Path(directory or "."), meta, model)


def _eager_in_child(how: str, **kw: Any) -> nn.Module:
    if how == "factory":
        from safetensors.torch import load_model

        from torchnitro.autotune.inputs import rebuild_model

        model = rebuild_model(kw["spec"], kw.get("extra"))
        load_model(model, kw["weights"], strict=True)
        return model.eval()
    if how == "pickle":  # written by the search process from the model object it was given (``child_model``)
        return torch.load(kw["path"], weights_only=False).eval()
    if how == "program":  # the search's torch.export program of the model: no class of the user's is imported
        from torchnitro.autotune.program import load_program
        from torchnitro.autotune.recipe import Program

        module = load_program(Program(kw["kind"], Path(kw["path"]), dict(kw.get("meta") or {})))
        if module is None:
            raise ValueError(f"eager source: program kind {kw['kind']!r} has no module; expected 'exported'")
        return module  # exported in eval mode; an exported module refuses .eval()
    raise ValueError(f"eager source: received how={how!r}, expected 'factory', 'pickle' or 'program'")


@dataclass(frozen=True)
class ChildModel:
    """How a timing process re-creates the eager model: the loader's ``eager`` argument, or why it cannot."""

    kwargs: dict[str, Any] | None  # None: eager cannot be re-created in a child
    text: str  # for the report: where the child's eager model comes from, or why there is none
    rebuilds: bool = True  # artifacts rebuilt from the eager model can be loaded on it (not on a program)


def child_model(model: nn.Module, spec: str | None, extra: dict[str, Any], directory: Path,
                program: Callable[[], Any] | None = None) -> ChildModel:
    """Prepare the eager model for timing processes in ``directory`` (private to the search).

    A factory reference (built-in name, ``module:function``, ``hf:`` folder) is rebuilt there and given the
    search's weights (safetensors), as ``torchnitro.load`` rebuilds a non-standalone artifact. Without one,
    the model object is pickled by this process into ``directory`` and loaded there with its own classes:
    only a file this search wrote from the object it was handed is ever unpickled. A model whose classes a
    child cannot import (defined in ``__main__`` or a notebook) or that does not pickle is re-created from
    ``program()`` (the search's ``torch.export`` program of it, built here: a ``Program``, or anything else
    when there is none): eager is then timed alone like every other variant, the same ATen ops without the
    user's Python classes, and the child's first outputs are checked against eager here (``ready_children``).
    Artifacts rebuilt from the model object are not loaded on a program (``rebuilds=False``)."""
    directory.mkdir(parents=True, exist_ok=True)
    if spec:
        from safetensors.torch import save_model

        path = directory / "eager.safetensors"
        try:
            save_model(model, str(path))
        except Exception as exc:  # noqa: BLE001 - e.g. a tensor safetensors cannot hold: try the pickle
            why = f"its weights could not be saved as safetensors ({type(exc).__name__})"
        else:
            return ChildModel({"how": "factory", "spec": spec, "extra": dict(extra or {}), "weights": str(path)},
                              f"eager re-created from its factory {spec!r} and the search's weights")
    else:
        why = "the model has no factory reference"
    in_main = sorted({type(m).__qualname__ for m in model.modules() if type(m).__module__ == "__main__"})
    if in_main:
        why = (f"{why}, and its class(es) {', '.join(in_main[:3])} are defined in the running script, which a "
               "child process does not import")
        return _from_program(program, why)
    path = directory / "eager.pt"
    try:
        torch.save(model, path)
    except Exception as exc:  # noqa: BLE001 - lambdas, open handles, ...
        path.unlink(missing_ok=True)
        why = f"{why}, and the model object does not pickle ({type(exc).__name__}: {exc})"[:300]
        return _from_program(program, why)
    return ChildModel({"how": "pickle", "path": str(path)},
                      f"eager re-created from a pickle of the model object ({why})")


def _from_program(program: Callable[[], Any] | None, why: str) -> ChildModel:
    """Eager re-created from the search's ``torch.export`` program, or (none) the reason it stays here."""
    from torchnitro.autotune.recipe import Program

    got = None
    if program is not None:
        try:
            got = program()
        except Exception as exc:  # noqa: BLE001 - no program: eager is timed here, the row says why
            got = f"{type(exc).__name__}: {exc}"
    if program is None:
        return ChildModel(None, f"{why}; no torch.export program of it was offered")
    if isinstance(got, Program) and got.kind != "exported":  # a TorchScript trace runs another executor
        return ChildModel(None, f"{why}; torch.export failed on it (a {got.kind} program is not eager)"[:300])
    if not isinstance(got, Program):
        return ChildModel(None, f"{why}; it has no torch.export program ({str(getattr(got, 'reason', got))[:120]})"[:300])
    kw = {"how": "program", "kind": got.kind, "path": str(got.path), "meta": dict(got.meta)}
    return ChildModel(kw, f"eager re-created from the search's torch.export program of the model ({why})"[:300],
                      rebuilds=False)


def start_alone(recipe: Recipe, directory: Path, meta: dict[str, Any], inputs: Path, *, threads: int,
                device: str) -> ChildTimer:
    """Start the child process that times ``recipe``'s standalone artifact in ``directory`` (returns at once)."""
    cls = type(recipe)
    return ChildTimer("torchnitro.autotune.fair:load_standalone",
                      {"recipe": f"{cls.__module__}:{cls.__qualname__}", "directory": str(directory), "meta": meta},
                      inputs, threads=threads, device=device, log=inputs.parent / f"_timing_{recipe.name}.log")


@dataclass(frozen=True)
class EagerCheck:
    """Eager alone against eager inside the comparison."""

    alone_ms: float  # eager alone: solo runs of its own processes around the comparison, or its search-time p50
    inside_ms: float  # eager's p50 inside the comparison (several processes: the median of their p50s)
    band: float  # allowed relative difference
    where: str = ""  # how eager alone was measured, for the report
    inside_where: str = ""  # how eager inside was summarised (several processes: their p50s), for the report
    before_ms: float | None = None  # bracketed: eager alone right before the comparison ...
    after_ms: float | None = None  # ... and right after it; ``alone_ms`` is their mean
    single: str = ""  # why eager alone was measured only before the comparison, for the report

    @property
    def drift(self) -> float:
        return self.inside_ms / self.alone_ms - 1.0

    @property
    def ok(self) -> bool:
        return abs(self.drift) <= self.band

    @property
    def gap(self) -> float:
        """Eager alone after the comparison against before it (0 unless bracketed)."""
        if self.before_ms is None or self.after_ms is None:
            return 0.0
        return self.after_ms / self.before_ms - 1.0

    @property
    def machine_changed(self) -> bool:
        """The two alone runs around the comparison differ by more than the band: the machine's speed changed
        while the comparison ran, so a difference inside is no sign of the comparison's own error."""
        return abs(self.gap) > self.band

    def text(self) -> str:
        where = f" {self.where}" if self.where else ""
        inside = f" {self.inside_where}" if self.inside_where else ""
        text = (f"eager p50 alone{where} {self.alone_ms:.3f} ms, inside the comparison{inside} {self.inside_ms:.3f} "
                f"ms ({self.drift:+.1%}; allowed ±{self.band:.1%})")
        if self.before_ms is not None and self.after_ms is not None:
            text += (f"; eager alone is the mean of a solo run right before the comparison, {self.before_ms:.3f} ms, "
                     f"and one right after it, {self.after_ms:.3f} ms, {self.gap:+.1%} apart")
            text += (": more than the band, so the machine changed speed while the comparison ran, which is not the "
                     "comparison's error" if self.machine_changed else ", within the band")
        if self.single:
            text += f"; {self.single}"
        return text


def check_eager(alone_ms: float, alone_cv: float | None, inside: Timing | EagerBaseline, where: str = "",
                inside_where: str = "") -> EagerCheck:
    """Compare eager's p50 inside the comparison (``inside.median``: one process's p50, or the median of its
    processes' p50s) with eager alone; the band is ``max(5%, 2 x cv)`` of eager alone, at most 25%."""
    if not alone_ms or alone_ms <= 0:
        from torchnitro.errors import InputError

        raise InputError(f"eager's p50 alone must be a positive number of ms; received {alone_ms!r}")
    return EagerCheck(alone_ms, inside.median * 1e3, min(MAX_BAND, max(MIN_BAND, 2.0 * (alone_cv or 0.0))), where,
                      inside_where)


@dataclass
class AllocatorTrial:
    """A variant in a fresh process with glibc's defaults against one with ``ALLOCATOR_SETTING``."""

    default_ms: float
    tuned_ms: float
    ratio: float  # default / tuned (> 1: the setting made it faster)
    noise: float
    keep: bool  # recorded in the artifact (see ``tune_allocator``)
    setting: dict[str, str] = field(default_factory=lambda: dict(ALLOCATOR_SETTING))
    default_faults: float | None = None  # minor page faults per call, median over the samples
    tuned_faults: float | None = None
    compared_under: bool = False  # True: the comparison's processes ran under the setting
    label: str = "the chosen variant"

    def text(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.setting.items())

        def faults(f: float | None) -> str:
            return "" if f is None else f", {f:,.0f} page faults per call"

        if not self.compared_under:
            verdict = "kept in the artifact (meta 'environment'; torchnitro.load and serve apply it)" if self.keep \
                else f"not kept (needs >= {MIN_ALLOCATOR_GAIN:.2f}x beyond the noise)"
        else:
            verdict = ("the comparison timed every process under it; kept in the artifact (meta 'environment'; "
                       "torchnitro.load and serve apply it)") if self.keep else \
                ("the comparison timed every process under it, but glibc's defaults were faster beyond the noise: "
                 "not kept in the artifact")
        return (f"allocator setting {env}: {self.label} alone in a fresh process {self.default_ms:.3f} ms with "
                f"glibc's defaults{faults(self.default_faults)}, {self.tuned_ms:.3f} ms with the setting"
                f"{faults(self.tuned_faults)} ({self.ratio:.2f}x ±{self.noise:.2f}); {verdict}")


def _faults(timer: Any) -> float | None:
    got = getattr(timer, "faults", None)
    if not got:
        return None
    ordered = sorted(got)
    return ordered[len(ordered) // 2]


def under_allocator_setting(timer: Any) -> bool:
    """Whether a timing process was started under ``ALLOCATOR_SETTING`` (its ``env``: what it added)."""
    env = getattr(timer, "env", None) or {}
    return all(env.get(k) == v for k, v in ALLOCATOR_SETTING.items())


def allocator_env(timer: Any) -> dict[str, str | None]:
    """The extra environment of ``timer``'s allocator trial process: glibc's defaults for a timer under
    ``ALLOCATOR_SETTING``, the setting otherwise (``tune_allocator``)."""
    return dict(GLIBC_DEFAULTS) if under_allocator_setting(timer) else dict(ALLOCATOR_SETTING)


def tune_allocator(timers: dict[str, ChildTimer] | ChildTimer, tc: TimingConfig,
                   started: dict[str, ChildTimer] | None = None) -> dict[str, AllocatorTrial] | AllocatorTrial:
    """Each timer's variant against the same variant in a fresh process with the other allocator setting: glibc's
    defaults when the timer runs under ``ALLOCATOR_SETTING`` (every timing process does unless the environment
    chooses the allocator), the setting otherwise; all interleaved in one run. ``keep``: under the setting, the
    setting stays unless the defaults were faster by ``MIN_ALLOCATOR_GAIN`` beyond the noise (the comparison's
    numbers were taken under it); otherwise it is kept when it was that much faster. ``timers``: name -> timer
    (one ``ChildTimer`` alone: its trial alone). ``started``: name -> that trial process, already started by the
    caller (``timer.again(allocator_env(timer))``, so that its start-up ran beside other trials' start-ups, not
    beside timed samples); closed here like the ones started here. Raises ``RecipeError`` when a second process
    fails (the caller notes it and goes on)."""
    single = not isinstance(timers, dict)
    named: dict[str, ChildTimer] = {"the chosen variant": timers} if single else dict(timers)  # type: ignore[dict-item]
    others: dict[str, ChildTimer] = dict(started or {})
    try:
        for name, timer in named.items():
            if name not in others:
                others[name] = timer.again(allocator_env(timer))
        for other in others.values():
            other.wait_ready()
        fns: dict[str, Any] = {}
        for name, timer in named.items():
            under = under_allocator_setting(timer)
            fns[f"{name}/default"] = Steady(others[name] if under else timer)
            fns[f"{name}/tuned"] = Steady(timer if under else others[name])
        res = compare(fns, tc)
    finally:
        for other in others.values():
            other.close()
    trials = {}
    for name, timer in named.items():
        under = under_allocator_setting(timer)
        default, tuned = res[f"{name}/default"], res[f"{name}/tuned"]
        est = paired_ratio(default, tuned)
        back = paired_ratio(tuned, default)  # > 1: glibc's defaults were the faster
        faster_default = back.ratio >= MIN_ALLOCATOR_GAIN and back.beats_noise
        keep = not faster_default if under else (est.ratio >= MIN_ALLOCATOR_GAIN and est.beats_noise)
        trials[name] = AllocatorTrial(
            default.median * 1e3, tuned.median * 1e3, est.ratio, est.noise, keep,
            default_faults=_faults(others[name] if under else timer),
            tuned_faults=_faults(timer if under else others[name]), compared_under=under, label=name)
    return trials["the chosen variant"] if single else trials


def apply_recorded_allocator(source: str | Path | dict[str, Any]) -> dict[str, str]:
    """Apply the allocator setting an artifact records (meta ``environment``) before anything is loaded from it,
    so processes started from here on (serve's workers) read it at their start. ``source``: the artifact's
    directory (its manifest is read and verified here: ``ArtifactError`` for a damaged artifact, as loading it
    would raise) or its meta, already read from a verified manifest (``torchnitro serve`` reads it once).
    Returns what ``mallopt`` set in this process."""
    from torchnitro.bench.environment import apply_allocator

    return apply_allocator(recorded_meta(source).get("environment") or {})


def recorded_meta(source: str | Path | dict[str, Any]) -> dict[str, Any]:
    """An artifact's meta: ``source`` itself when it is one (a dict), else read from the verified manifest of the
    directory ``source`` (``artifact.read_manifest``: every file's SHA-256 checked)."""
    if isinstance(source, dict):
        return source
    if not isinstance(source, (str, Path)):
        from torchnitro.errors import InputError

        raise InputError(f"artifact: received {type(source).__name__}; expected its directory (str or Path) or "
                         "its meta (a dict read from its manifest)")
    from torchnitro.autotune.artifact import read_manifest

    return dict(read_manifest(source).get("meta") or {})
