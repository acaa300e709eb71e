"""Build, run and time one candidate: in this process, or in a child process that may crash.

``evaluate`` builds the candidate, calls it twice on every held-out input set (outputs are copied
after each call), times it with ``torchnitro.bench`` on the timing inputs (the first call at each
size is timed separately: that is where a recompiling recipe pays) and measures memory. The
verification verdict itself is given by the caller (``verify.judge``) so a user ``metric_fn`` never
has to cross a process boundary.

``run_isolated`` does the same in ``python -m torchnitro.autotune.evaluate PAYLOAD RESULT``. The
child gets tensors, plain config fields and the program the parent prepared (``autotune.program``):
it never unpickles an object and never imports the user's script or modules. A crash (segfault,
``os._exit``), an exception or a hang past the time limit becomes a ``Failure``.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from torchnitro.autotune.failure import Failure, last_stderr_line
from torchnitro.autotune.recipe import BuildContext, Built, CandidateFiles, Program, Recipe
from torchnitro.autotune.report import BUSY_NOTE
from torchnitro.autotune.verify import collect
from torchnitro.bench.quiet import process_cpu_ns
from torchnitro.bench.timing import TimingConfig, measure, synchronize

__all__ = ["Evaluation", "evaluate", "run_isolated", "BUSY_SHARE"]


@dataclass
class Evaluation:
    built: Built | None  # None when evaluated in a child process
    outputs: list[tuple[Any, Any, Any, Any]]  # per held-out set: first copy, second copy, raw (or None), later copy
    timing: dict[str, Any]  # Timing.to_dict() of the timing closure
    build_s: float
    first_call_ms: dict[str, float] = field(default_factory=dict)
    shape_ms: dict[str, float] = field(default_factory=dict)
    peak_mem_mb: float | None = None
    candidate: CandidateFiles = field(default_factory=CandidateFiles)  # in the candidate's workdir
    notes: str = ""


def _size_label(inputs: tuple[Any, ...]) -> str:
    t = next((x for x in inputs if isinstance(x, Tensor)), None)
    return "x".join(map(str, t.shape)) if t is not None else "-"


def _rss_mb() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except Exception:  # noqa: BLE001
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _RssPeak:
    """Highest resident-set size seen by a 5 ms sampler thread while active (CPU peak memory).

    Stopped before timing, so the sampler never competes with the measured calls."""

    def __init__(self) -> None:
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_mb())

    def __enter__(self) -> "_RssPeak":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


# Search-time timing is one short, ungated measurement (the final comparison's samples go through bench.quiet's
# gate). With more runnable threads than cores, torch's OpenMP threads wait for a CPU at every parallel region's
# barrier and such a measurement is inflated tens to hundreds of times (a 2-core machine at load 8). Above this share
# of the measurement's wall time spent waiting for a CPU (per torch thread), the row says its search-time timing is
# unreliable.
BUSY_SHARE = 0.25


def _run_queue_delay_ns() -> int:
    """Nanoseconds this process's threads have waited for a CPU (schedstat; 0 where /proc is missing)."""
    return process_cpu_ns(os.getpid(), field_index=1)


class _RunQueueDelay:
    """How long this process's threads waited for a CPU while active, per torch thread, as a share of wall time."""

    def __enter__(self) -> "_RunQueueDelay":
        self.threads = max(1, torch.get_num_threads())
        self.share = 0.0
        self._d0, self._t0 = _run_queue_delay_ns(), time.perf_counter_ns()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter_ns() - self._t0
        delay = max(0, _run_queue_delay_ns() - self._d0)
        self.share = delay / (wall * self.threads) if wall > 0 else 0.0

    def note(self) -> str:
        if self.share <= BUSY_SHARE:
            return ""
        return (f"{BUSY_NOTE}: its {self.threads} torch thread(s) waited for a CPU {self.share:.0%} of the "
                "measurement's wall time, so its search-time timing is unreliable")


def evaluate(recipe: Recipe, ctx: BuildContext, held_out: Sequence[tuple[Any, ...]],
             timing_sets: Sequence[tuple[Any, ...]], timing: TimingConfig, items_per_call: int,
             keep_raw: bool = True) -> Evaluation:
    cuda = ctx.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rss0 = _rss_mb()
    with _RssPeak() as rss:
        t0 = time.perf_counter()
        built = recipe.build(ctx)
        fn = built.fn
        with torch.inference_mode():
            fn(*ctx.example_inputs)  # lazy compilation is part of building
        synchronize(str(ctx.device))
        build_s = time.perf_counter() - t0
        outputs = [(f, s, r if keep_raw else None, later) for f, s, r, later in collect(fn, held_out)]
    with torch.inference_mode():
        first_ms: dict[str, float] = {}
        for inputs in timing_sets[1:]:  # first call at each new size: recompilation shows here
            t = time.perf_counter()
            fn(*inputs)
            synchronize(str(ctx.device))
            first_ms[_size_label(inputs)] = (time.perf_counter() - t) * 1e3
        sets = list(timing_sets)
        with _RunQueueDelay() as busy:
            tm = measure(lambda: [fn(*s) for s in sets], timing, items_per_call=items_per_call)
        shape_ms = {}
        if len(sets) > 1:
            quick = timing.quick()
            for s in sets:
                shape_ms[_size_label(s)] = measure(lambda s=s: fn(*s), quick).median * 1e3
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else max(0.0, max(rss.peak, _rss_mb()) - rss0)
    notes = "; ".join(n for n in (built.notes, busy.note()) if n)
    return Evaluation(built, outputs, tm.to_dict(), build_s, first_ms, shape_ms, peak, built.files_in(ctx.workdir),
                      notes)


# ---- isolation ------------------------------------------------------------------------------------

_STARTUP_S = 120.0  # longest start-up (interpreter, torch import, program load) granted on a busy machine


def _plain(obj: Any) -> dict[str, Any] | None:
    """A config dataclass as plain fields. Functions (a user's metric_fn) stay here: the parent applies them."""
    if obj is None or not dataclasses.is_dataclass(obj):
        return None
    values = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {k: (None if callable(v) else v) for k, v in values.items()}


def run_isolated(recipe: Recipe, ctx: BuildContext, held_out: Sequence[tuple[Any, ...]],
                 timing_sets: Sequence[tuple[Any, ...]], timing: TimingConfig, items_per_call: int,
                 timeout_s: float, start_budget_s: float = _STARTUP_S) -> Evaluation | Failure:
    """Evaluate in a child process that gets ``ctx.program`` and tensors, never ``ctx.model``.

    The child's start-up is not part of the recipe's ``timeout_s``; it must finish within
    ``start_budget_s`` (the search's remaining budget), or the result is a ``Failure`` with ``budget``
    set. Returns the Evaluation, or the Failure (the child's own exception where it wrote one)."""
    cls = type(recipe)
    prog = ctx.program
    payload = {
        "recipe": [cls.__module__, cls.__qualname__], "example_inputs": ctx.example_inputs,
        "program": None if prog is None else {"kind": prog.kind, "path": str(prog.path), "meta": prog.meta},
        "device": str(ctx.device), "workdir": str(ctx.workdir), "dynamic_dims": ctx.dynamic_dims,
        "config": _plain(ctx.config), "held_out": list(held_out), "timing_sets": list(timing_sets),
        "timing": _plain(timing), "items": items_per_call, "threads": torch.get_num_threads(),
    }
    ppath, rpath, started = ctx.workdir / "_payload.pt", ctx.workdir / "_result.pt", ctx.workdir / "_started"
    torch.save(payload, ppath)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([p for p in sys.path if p] + [env.get("PYTHONPATH", "")])  # recipe modules
    errlog = ctx.workdir / "_stderr.txt"
    start_s = min(_STARTUP_S, max(0.0, start_budget_s))
    try:
        with open(errlog, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-m", "torchnitro.autotune.evaluate", str(ppath), str(rpath)],
                                    stdout=subprocess.DEVNULL, stderr=err, env=env, start_new_session=True)
            rc, did_start = _wait(proc, started, timeout_s, start_s)
            if rc is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if not did_start and start_s < _STARTUP_S:
                    return Failure("", f"budget: the child process had not started after the {start_s:.1f} s left "
                                       "of the search budget (raise budget_s)", budget=True)
                if not did_start:
                    return Failure("", f"the child process had not started after {start_s:.0f} s (process killed)")
                return Failure("", f"ran past its {timeout_s:.0f} s limit (process killed)")
    finally:
        ppath.unlink(missing_ok=True)
        started.unlink(missing_ok=True)
    stderr = errlog.read_text(errors="replace") if errlog.exists() else ""
    errlog.unlink(missing_ok=True)
    res = torch.load(rpath, weights_only=True) if rpath.exists() else None
    rpath.unlink(missing_ok=True)
    if res is not None and "error" in res:
        return Failure.from_dict(res["error"])
    if rc != 0 or res is None:
        return _death(rc, stderr)
    outs = [(list(zip(names, f)), list(zip(names, s)), None, list(zip(names, l))) for names, f, s, l in res["outputs"]]
    files = CandidateFiles(ctx.workdir, res["files"], res["meta"], res["standalone"])
    return Evaluation(None, outs, res["timing"], res["build_s"], res["first_call_ms"], res["shape_ms"],
                      res["peak_mem_mb"], files, res["notes"])


def _death(rc: int, stderr: str) -> Failure:
    """A child that died without writing its error: the exit status and its last stderr line."""
    if rc < 0:
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = str(-rc)
        why = f"process crashed with signal {sig}"
    else:
        why = f"process exited with code {rc}" + ("" if rc else " without writing its result")
    last = last_stderr_line(stderr)
    return Failure("", why + (f": {last}" if last else ""))


def _wait(proc: subprocess.Popen, started: Path, timeout_s: float, start_s: float) -> tuple[int | None, bool]:
    """Wait for the child: ``start_s`` for its start-up, then the recipe's ``timeout_s`` from the
    moment it signalled it had started. Returns (exit code or None when it ran out of time, started)."""
    deadline = time.monotonic() + start_s
    t_started = None
    while True:
        rc = proc.poll()
        if rc is not None:
            return rc, t_started is not None or started.exists()
        now = time.monotonic()
        if t_started is None and started.exists():
            t_started = now
            deadline = now + timeout_s
        if now >= deadline:
            return None, t_started is not None
        time.sleep(0.02)


def _child(ppath: str, rpath: str) -> None:
    """The child's whole life: load tensors and the program (no pickled objects: ``weights_only``),
    signal start-up done, evaluate, write the result (or the structured error) atomically."""
    from torchnitro.autotune.config import OptimizeConfig
    from torchnitro.autotune.program import load_program
    from torchnitro.hardware import hardware_info

    try:
        payload = torch.load(ppath, weights_only=True)
        torch.set_num_threads(payload["threads"])
        mod_name, qual = payload["recipe"]
        obj: Any = importlib.import_module(mod_name)
        for part in qual.split("."):
            obj = getattr(obj, part)
        recipe = obj()
        program = None if payload["program"] is None else Program(
            payload["program"]["kind"], Path(payload["program"]["path"]), payload["program"]["meta"])
        model = load_program(program) if program is not None else None
        cfg = OptimizeConfig(**payload["config"]) if payload["config"] is not None else None
        ctx = BuildContext(model, payload["example_inputs"], hardware_info(), torch.device(payload["device"]),
                           Path(payload["workdir"]), payload["dynamic_dims"], cfg, program)
        Path(payload["workdir"], "_started").touch()
        ev = evaluate(recipe, ctx, payload["held_out"], payload["timing_sets"], TimingConfig(**payload["timing"]),
                      payload["items"], keep_raw=False)
        outs = [([n for n, _ in f], [t for _, t in f], [t for _, t in s], [t for _, t in later])
                for f, s, _, later in ev.outputs]
        result: dict[str, Any] = {
            "outputs": outs, "timing": ev.timing, "build_s": ev.build_s, "first_call_ms": ev.first_call_ms,
            "shape_ms": ev.shape_ms, "peak_mem_mb": ev.peak_mem_mb, "meta": ev.candidate.meta,
            "files": ev.candidate.files, "standalone": ev.candidate.standalone, "notes": ev.notes}
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as the reason
        result = {"error": Failure.from_exception(exc).to_dict()}
    tmp = Path(rpath + ".tmp")
    torch.save(result, tmp)
    tmp.replace(rpath)  # the parent sees a whole result or none


if __name__ == "__main__":  # pragma: no cover - exercised through run_isolated
    _child(sys.argv[1], sys.argv[2])
