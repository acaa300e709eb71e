"""Find the largest (or the fastest) batch size that fits, by real trials.

``find_batch_size(step_fn, FinderConfig(budget_bytes=..., mode=...))`` calls ``step_fn(batch_size)`` (one training
step at that batch size) and treats an out-of-memory error as "does not fit". Modes:

- ``"power"``: double from the start value until a trial fails; return the last that fit
  (Lightning's ``power`` mode).
- ``"binsearch"``: double (or halve) from the start until the limit is bracketed, then bisect until
  ``hi / lo - 1 <= margin``; returns the largest batch that fit. With a good start (the planner's),
  this takes a handful of trials; from 1 it takes at most ``2 * log2(max_val)``.
- ``"throughput"``: find the limit as in ``binsearch``, then time a ladder of batch sizes with
  ``torchnitro.bench`` and return the one with the most items per second.

Out of memory is a real ``torch.cuda.OutOfMemoryError`` / allocator error, a
``torchnitro.errors.OutOfMemoryError`` raised by the step (tests inject it that way), or, with
``budget_bytes``, a tracked peak above the budget (so the finder works on CPU, where nothing OOMs).
``is_oom`` replaces the detection. Model and optimizer state are snapshotted before the first
trial and restored after every trial, so the search leaves no trace on the weights.
"""

from __future__ import annotations

import copy
import gc
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from torchnitro.errors import BudgetError, InputError, OutOfMemoryError

if TYPE_CHECKING:
    from torchnitro.bench import TimingConfig

__all__ = ["find_batch_size", "FinderConfig", "FinderResult", "Trial", "default_is_oom", "MODES"]

MODES = ("power", "binsearch", "throughput")
_OOM_MESSAGES = ("out of memory", "can't allocate memory", "cudnn_status_not_supported",
                 "cublas_status_alloc_failed", "failed to allocate")


def default_is_oom(exc: BaseException) -> bool:
    """True for allocator failures on any device (the message patterns accelerate also checks)."""
    if isinstance(exc, (OutOfMemoryError, MemoryError)):
        return True
    if isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())) or isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _OOM_MESSAGES)


@dataclass
class Trial:
    batch_size: int
    fits: bool
    peak_bytes: int | None  # tracked/measured peak; None when not measured
    seconds: float
    reason: str = ""  # why it did not fit


@dataclass
class FinderResult:
    batch_size: int  # the answer: largest fitting batch (or the fastest, in throughput mode)
    mode: str
    max_fitting: int  # largest batch that fit in any trial
    trials: list[Trial] = field(default_factory=list)
    start: int = 1  # where the search began (the planner's estimate when given)
    throughput: dict[int, float] = field(default_factory=dict)  # batch -> items/s (throughput mode)

    @property
    def n_trials(self) -> int:
        return len(self.trials)

    def table(self) -> str:
        lines = [f"{'batch':>7} {'fits':>5} {'peak MiB':>10} {'s':>7}  reason"]
        for t in self.trials:
            pk = f"{t.peak_bytes / 2**20:10.2f}" if t.peak_bytes is not None else f"{'-':>10}"
            lines.append(f"{t.batch_size:7d} {'yes' if t.fits else 'no':>5} {pk} {t.seconds:7.2f}  {t.reason}")
        for b, ips in self.throughput.items():
            lines.append(f"throughput batch {b}: {ips:.1f} items/s")
        lines.append(f"-> batch {self.batch_size} ({self.mode}, {self.n_trials} trials, start {self.start})")
        return "\n".join(lines)


class _Snapshot:
    """Copies of model and optimizer state on the CPU, restored after every trial."""

    def __init__(self, model: nn.Module | None, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer
        self.msd = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if model else None
        self.osd = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None

    def restore(self) -> None:
        if self.model is not None and self.msd is not None:
            self.model.load_state_dict(self.msd)
            for p in self.model.parameters():
                p.grad = None
        if self.optimizer is not None and self.osd is not None:
            self.optimizer.state.clear()
            self.optimizer.load_state_dict(copy.deepcopy(self.osd))
            for g in self.optimizer.param_groups:
                for p in g["params"]:
                    p.grad = None


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _runs_on_cuda(model: nn.Module | None) -> bool:
    """Measure with the CUDA allocator when the model lives on a GPU (or, without a model, when one is visible)."""
    if not torch.cuda.is_available():
        return False
    if model is None:
        return True
    p = next(iter(model.parameters()), None)
    return p is None or p.device.type == "cuda"


def _owned_cuda_bytes(model: nn.Module | None, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of CUDA tensors the trial counts as its own: parameters, gradients, optimizer state."""
    seen: set[int] = set()
    total = 0

    def add(t: object) -> None:
        nonlocal total
        if isinstance(t, torch.Tensor) and t.is_cuda and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    if model is not None:
        for p in model.parameters():
            add(p)
            add(p.grad)
        for buf in model.buffers():
            add(buf)
    if optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                add(v)
    return total


def _start_from_estimate(estimate: Callable[[int], int], budget: int, max_val: int) -> int:
    if estimate(1) > budget:
        raise BudgetError(f"budget_bytes={budget:,} is smaller than the estimated peak at batch 1 "
                          f"({estimate(1):,} bytes); expected a budget above the model's own footprint. "
                          "Raise the budget, shrink the model, or use checkpointing / lower precision.")
    lo, hi = 1, max_val
    while lo < hi:  # largest b with estimate(b) <= budget
        mid = (lo + hi + 1) // 2
        if estimate(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class FinderConfig:
    """How ``find_batch_size`` searches: what counts as fitting, where it starts, when it stops."""

    budget_bytes: int | None = None  # a tracked peak above it does not fit (the only limit on CPU); None: OOM only
    mode: str = "binsearch"  # power, binsearch or throughput (module docstring)
    margin: float = 0.05  # binsearch stops once hi / lo - 1 <= margin: the answer's relative precision
    max_val: int = 4096  # largest batch tried: bounds the search on hardware that never fails
    init_val: int | None = None  # first batch tried; None: from the estimate and budget, else 1
    steps_per_trial: int = 2  # the second step's peak includes the optimizer state the first one created
    timing: TimingConfig | None = None  # throughput mode's timing; None: TimingConfig().quick()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"mode: received {self.mode!r}, expected one of {list(MODES)}")
        if not (isinstance(self.margin, (int, float)) and 0 < self.margin < 1):
            raise InputError(f"margin: received {self.margin!r}, expected a fraction in (0, 1), e.g. 0.05")
        if not isinstance(self.max_val, int) or self.max_val < 1:
            raise InputError(f"max_val: received {self.max_val!r}, expected a positive integer")
        b = self.budget_bytes
        if b is not None and (not isinstance(b, int) or b <= 0):
            raise InputError(f"budget_bytes: received {b!r}, expected a positive integer number of bytes")


def _check_model_fits(budget: int | None, model: nn.Module | None) -> None:
    if budget is None or model is None:
        return
    own = sum(p.numel() * p.element_size() for p in model.parameters())
    if own > budget:
        raise BudgetError(f"budget_bytes={budget:,} is smaller than the model's parameters "
                          f"({own:,} bytes); expected a budget above the model size. Raise the budget "
                          "or shrink the model (lower precision, fewer layers).")


def _start(cfg: FinderConfig, estimate: Callable[[int], int] | None) -> int:
    if cfg.init_val is not None:
        return max(1, min(int(cfg.init_val), cfg.max_val))
    if estimate is not None and cfg.budget_bytes is not None:
        return _start_from_estimate(estimate, cfg.budget_bytes, cfg.max_val)
    return 1


class _Trials:
    """Runs ``step_fn`` at one batch size, records a ``Trial`` and restores the snapshot; each size once."""

    def __init__(self, step_fn: Callable[[int], Any], cfg: FinderConfig, snap: _Snapshot,
                 detect: Callable[[BaseException], bool]) -> None:
        self.step_fn, self.cfg, self.snap, self.detect = step_fn, cfg, snap, detect
        self.on_cuda = _runs_on_cuda(snap.model)
        self.trials: list[Trial] = []
        self.results: dict[int, bool] = {}

    def _peak(self, b: int) -> int | None:
        """Run the trial's steps; the peak they reached, where it is measured."""
        model, optimizer = self.snap.model, self.snap.optimizer
        if self.cfg.budget_bytes is not None and not self.on_cuda:
            from torchnitro.memory.tracker import track

            with track(model, optimizer) as tr:
                for _ in range(self.cfg.steps_per_trial):
                    self.step_fn(b)
            return tr.peak_bytes
        if self.on_cuda:
            # the step's own peak: allocator peak minus what other objects in the process hold
            # (earlier models, cached data, the cuBLAS workspace), plus the model and optimizer
            foreign = torch.cuda.memory_allocated() - _owned_cuda_bytes(model, optimizer)
            torch.cuda.reset_peak_memory_stats()
        for _ in range(self.cfg.steps_per_trial):
            self.step_fn(b)
        return torch.cuda.max_memory_allocated() - max(0, foreign) if self.on_cuda else None

    def __call__(self, b: int) -> bool:
        if b in self.results:
            return self.results[b]
        t0, peak, reason, ok, budget = time.perf_counter(), None, "", True, self.cfg.budget_bytes
        try:
            peak = self._peak(b)
            if budget is not None and peak is not None and peak > budget:
                ok, reason = False, f"peak {peak:,} B > budget {budget:,} B"
        except BaseException as exc:  # noqa: BLE001 - classified right below
            if not self.detect(exc):
                self.snap.restore()
                raise
            ok, reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        finally:
            self.snap.restore()
            if not ok:
                _free()
        self.trials.append(Trial(b, ok, peak, time.perf_counter() - t0, reason))
        self.results[b] = ok
        return ok


def _search(trial: _Trials, start: int, cfg: FinderConfig) -> int | None:
    """The largest fitting batch (within ``margin`` in the bisecting modes), None if batch 1 fails."""
    # from a planner estimate the limit is near: step by 1 + 4*margin instead of doubling
    factor = 2.0 if (start == 1 or cfg.mode == "power") else 1.0 + 4 * cfg.margin
    lo, hi = _bracket(trial, start, cfg.max_val, factor)
    if cfg.mode != "power":
        while hi is not None and lo is not None and hi - lo > max(1, int(cfg.margin * lo)):
            mid = (lo + hi) // 2
            if trial(mid):
                lo = mid
            else:
                hi = mid
    return lo


def find_batch_size(
    step_fn: Callable[[int], Any],
    config: FinderConfig | None = None,
    *,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    estimate: Callable[[int], int] | None = None,
    is_oom: Callable[[BaseException], bool] | None = None,
) -> FinderResult:
    """Search the batch size for ``step_fn(batch_size)`` as ``config`` says; see the module docstring.

    ``model`` and ``optimizer`` are snapshotted and restored after every trial. ``estimate(batch) ->
    bytes`` (e.g. ``lambda b: plan(cfg, batch=b, seq=T).peak_bytes``) picks the start and rejects
    budgets the model cannot meet. ``is_oom`` replaces the out-of-memory detection.
    """
    cfg = config if config is not None else FinderConfig()
    if not isinstance(cfg, FinderConfig):
        raise InputError(f"config: received {type(cfg).__name__}, expected a memory.FinderConfig")
    _check_model_fits(cfg.budget_bytes, model)
    start = _start(cfg, estimate)
    snap = _Snapshot(model, optimizer)
    trial = _Trials(step_fn, cfg, snap, is_oom or default_is_oom)
    lo = _search(trial, start, cfg)
    if lo is None:
        raise BudgetError(f"batch size 1 does not fit ({trial.trials[-1].reason}); expected at least one batch "
                          "to fit. Raise the budget or reduce the model / sequence length.")
    result = FinderResult(lo, cfg.mode, lo, trial.trials, start)
    if cfg.mode == "throughput":
        result.throughput = _throughput(step_fn, lo, snap, cfg.timing)
        result.batch_size = max(result.throughput, key=result.throughput.__getitem__)
    return result


def _bracket(trial: Callable[[int], bool], start: int, max_val: int,
             factor: float) -> tuple[int | None, int | None]:
    """(largest fitting, smallest failing) found by growing or shrinking ``start`` by ``factor``."""
    if trial(start):
        lo, b = start, start
        while b < max_val:
            b = min(max_val, max(b + 1, int(b * factor)))
            if not trial(b):
                return lo, b
            lo = b
        return lo, None
    hi, b = start, start
    while b > 1:
        b = max(1, min(b - 1, int(b / factor)))
        if trial(b):
            return b, hi
        hi = b
    return None, hi


def _throughput(step_fn: Callable[[int], Any], limit: int, snap: _Snapshot,
                timing: TimingConfig | None) -> dict[int, float]:
    from torchnitro.bench import TimingConfig, measure

    ladder = sorted({2 ** k for k in range(int(math.log2(limit)) + 1)} | {limit})
    ladder = [b for b in ladder if b >= max(1, limit // 16)]
    cfg = timing or TimingConfig().quick()
    out: dict[int, float] = {}
    for b in ladder:
        try:
            t = measure(lambda b=b: step_fn(b), cfg, items_per_call=b)
            out[b] = t.throughput
        finally:
            snap.restore()
            _free()
    return out
