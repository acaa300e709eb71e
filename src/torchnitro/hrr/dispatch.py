"""Where an HRR operation runs: ``device="auto"`` keeps small batches on the CPU, sends large ones to
the accelerator, and falls back to the CPU (with one warning) when the accelerator fails.

The CPU/GPU crossover is measured, not guessed, separately for each kind of work (``OPS``):

* ``"bind"`` (FFT-shaped, memory bound): bind on the CPU against "pinned copy in, bind on the GPU,
  copy out";
* ``"cleanup"`` (GEMM-shaped, compute bound, so it crosses over at a different batch): top-1 cleanup
  against a codebook already resident on each device, so only the queries travel, for a codebook
  size bucket (the next power of two of the item count, at least 1024).

``calibrate()`` takes the smallest batch from which the GPU round trip keeps winning and caches the
answer on disk keyed by the hardware fingerprint (``torchnitro.hardware``), the op, ``d`` and (for
cleanup) the size bucket, so each machine measures each case once.

Failures are injectable: ``Dispatcher(fault=fn)`` calls ``fn(device)`` before every accelerator
run; a test makes it raise ``OutOfMemoryError`` to exercise the fallback without a GPU, and can name
``accelerator="cpu"`` to stand in for a second device.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from torchnitro.errors import BackendUnavailableError, InputError, OutOfMemoryError
from torchnitro.hrr import ops
from torchnitro.hrr.backend import to_device, to_host, topk_chunked

__all__ = [
    "Calibration", "calibrate", "calibration_path", "Dispatcher", "is_device_failure", "items_bucket",
    "CALIBRATION_VERSION", "OPS",
]

# raised whenever what a calibration times changes (a new bind path on either side moves the
# crossover); cache files of another version are re-measured. What each version changed: docs/hrr.md
CALIBRATION_VERSION = 4
OPS = ("bind", "cleanup")
_DEFAULT_BATCHES = (1, 4, 16, 64, 256, 1024, 4096)
_CLEANUP_MEASURE_BYTES = 64 << 20  # largest codebook the cleanup calibration builds (per device)


def items_bucket(n_items: int) -> int:
    """Codebook-size bucket of a cleanup calibration: the next power of two, at least 1024."""
    return max(1024, 1 << max(0, int(n_items) - 1).bit_length())


@dataclass(frozen=True)
class Calibration:
    """Measured CPU/accelerator crossover of one op at dimension ``d``."""

    fingerprint: str  # hardware fingerprint the numbers belong to
    accelerator: str | None  # "cuda", or None when there is none (everything stays on the CPU)
    d: int  # vector dimension the crossover was measured at
    threshold: int | None  # smallest batch where the accelerator round trip wins; None: never
    timings: dict[str, dict[str, float]] = field(default_factory=dict)  # batch -> {"cpu_s", "accel_s"}
    version: int = CALIBRATION_VERSION  # cache format version
    op: str = "bind"  # which work was timed: the crossover differs between FFT- and GEMM-shaped ops
    n_items: int | None = None  # cleanup: codebook size bucket the threshold is for


def _cache_dir() -> Path:
    root = os.environ.get("TORCHNITRO_CACHE_DIR") or os.path.join(Path.home(), ".cache", "torchnitro")
    return Path(root)


def calibration_path(fingerprint: str, d: int, accelerator: str, op: str = "bind", n_items: int | None = None) -> Path:
    """Cache file of one calibration."""
    tail = f"-n{items_bucket(n_items)}" if op == "cleanup" and n_items is not None else ""
    return _cache_dir() / f"hrr-calibration-{fingerprint}-{accelerator}-{op}-d{d}{tail}.json"


def is_device_failure(exc: BaseException) -> bool:
    """True for errors that mean "the accelerator could not do it" (OOM, device errors)."""
    if isinstance(exc, (OutOfMemoryError, torch.OutOfMemoryError)):
        return True
    accel_error = getattr(torch, "AcceleratorError", None)
    if accel_error is not None and isinstance(exc, accel_error):
        return True
    if isinstance(exc, RuntimeError) and not isinstance(exc, InputError):
        msg = str(exc).lower()
        return any(s in msg for s in ("cuda", "cublas", "cufft", "device-side", "out of memory", "hip"))
    return False


def _measure_crossover(d: int, batches: tuple[int, ...], accel: torch.device) -> dict[str, dict[str, float]]:
    from torchnitro.bench import TimingConfig, compare

    cfg = TimingConfig(device=accel.type).quick()
    out: dict[str, dict[str, float]] = {}
    for b in batches:
        x, y = ops.random((2, b), d, generator=torch.Generator().manual_seed(b))
        x, y = x.pin_memory() if accel.type == "cuda" else x, y.pin_memory() if accel.type == "cuda" else y

        def on_accel(x=x, y=y) -> torch.Tensor:
            return to_host(ops.bind(to_device(x, accel), to_device(y, accel)))

        res = compare({"cpu": lambda x=x, y=y: ops.bind(x, y), "accel": on_accel}, cfg)
        out[str(b)] = {"cpu_s": res["cpu"].median, "accel_s": res["accel"].median}
    return out


def _measure_cleanup_crossover(d: int, n_items: int, batches: tuple[int, ...],
                               accel: torch.device) -> dict[str, dict[str, float]]:
    """Top-1 cleanup of ``b`` queries, CPU vs accelerator (codebook resident on each side).

    The codebook is ``n_items`` random unit rows, capped at ~64 MiB: past the cap the CPU side is
    underestimated, so the threshold errs towards the CPU. Batches are measured in increasing order
    and the measurement stops after the accelerator wins twice in a row (GEMM work grows with the
    batch on both sides, so a larger batch only widens the accelerator's lead); this keeps the CPU
    side from multiplying 4096 queries against a large codebook just to confirm it.
    """
    from torchnitro.bench import TimingConfig, compare

    n = max(1, min(n_items, _CLEANUP_MEASURE_BYTES // (4 * d)))
    g = torch.Generator().manual_seed(n)
    book = ops.normalize(ops.random(n, d, generator=g))
    book_dev = to_device(book, accel)
    cfg = TimingConfig(device=accel.type).quick()
    out: dict[str, dict[str, float]] = {}
    streak = 0
    for b in batches:
        q = ops.random(b, d, generator=g)
        q = q.pin_memory() if accel.type == "cuda" else q

        def on_accel(q=q) -> tuple[torch.Tensor, torch.Tensor]:
            v, i = topk_chunked(to_device(q, accel), book_dev, 1)
            return to_host(v), to_host(i)

        res = compare({"cpu": lambda q=q: topk_chunked(q, book, 1), "accel": on_accel}, cfg)
        out[str(b)] = {"cpu_s": res["cpu"].median, "accel_s": res["accel"].median}
        streak = streak + 1 if res["accel"].median < res["cpu"].median else 0
        if streak >= 2:
            break
    return out


def calibrate(
    d: int = 1024,
    *,
    op: str = "bind",
    n_items: int | None = None,
    accelerator: str | None = None,
    batches: tuple[int, ...] = _DEFAULT_BATCHES,
    force: bool = False,
) -> Calibration:
    """Measure (or read from the cache) the batch size above which the accelerator pays off.

    ``op``: ``"bind"`` (default) or ``"cleanup"``; cleanup needs ``n_items``, the codebook size (the
    threshold is measured for its bucket, ``items_bucket(n_items)``). Without an accelerator (none
    given and no CUDA) it returns ``threshold=None`` at once: everything stays on the CPU. ``force``
    re-measures and overwrites the cache.
    """
    from torchnitro.hardware import hardware_info

    if op not in OPS:
        raise InputError(f"calibrate: received op={op!r}, expected one of {OPS}")
    if op == "cleanup" and (not isinstance(n_items, int) or n_items < 1):
        raise InputError(f"calibrate: op='cleanup' received n_items={n_items!r}, expected the codebook size "
                         "(an int >= 1), e.g. calibrate(d, op='cleanup', n_items=len(memory))")
    bucket = items_bucket(n_items) if op == "cleanup" and n_items is not None else None
    fp = hardware_info().fingerprint
    accel = accelerator or ("cuda" if torch.cuda.is_available() else None)
    if accel is None:
        return Calibration(fingerprint=fp, accelerator=None, d=d, threshold=None, op=op, n_items=bucket)
    if accel.startswith("cuda") and not torch.cuda.is_available():
        raise BackendUnavailableError(f"calibrate: accelerator {accel!r} requested but CUDA is not available")
    path = calibration_path(fp, d, accel.replace(":", ""), op, n_items)
    if path.is_file() and not force:
        try:
            data = json.loads(path.read_text())
            if data.get("version") == CALIBRATION_VERSION and data.get("fingerprint") == fp and data.get("op") == op:
                return Calibration(**data)
        except (OSError, ValueError, TypeError):
            pass  # unreadable cache: measure again and overwrite it
    if op == "cleanup" and bucket is not None:
        timings = _measure_cleanup_crossover(d, bucket, tuple(sorted(batches)), torch.device(accel))
    else:
        timings = _measure_crossover(d, tuple(sorted(batches)), torch.device(accel))
    wins = [int(b) for b, t in timings.items() if t["accel_s"] < t["cpu_s"]]
    # the threshold is the start of the run of wins that reaches the largest batch
    threshold = None
    for b in sorted((int(b) for b in timings), reverse=True):
        if b not in wins:
            break
        threshold = b
    cal = Calibration(fingerprint=fp, accelerator=accel, d=d, threshold=threshold, timings=timings, op=op,
                      n_items=bucket)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cal), indent=2))
    tmp.replace(path)
    return cal


class Dispatcher:
    """Runs a function of tensors on the CPU or the accelerator, with fallback to the CPU.

    device: ``"auto"`` (by batch size against the calibrated threshold), ``"cpu"``, or an
    accelerator such as ``"cuda"`` (always there; raises at construction if it is unavailable).
    ``op`` picks which calibration "auto" uses (``"bind"`` or ``"cleanup"``); a cleanup dispatcher
    follows ``n_items`` (set it when the codebook grows or shrinks) and keeps one threshold per
    size bucket. A fixed ``threshold`` skips calibration.
    """

    def __init__(
        self,
        device: str = "auto",
        *,
        accelerator: str | None = None,
        threshold: int | None = None,
        d: int = 1024,
        op: str = "bind",
        n_items: int | None = None,
        fault: Callable[[torch.device], None] | None = None,
    ) -> None:
        if not isinstance(device, str) or not (device in ("auto", "cpu") or device.startswith("cuda")):
            raise InputError(f"device: received {device!r}, expected 'auto', 'cpu' or 'cuda[:N]'")
        if op not in OPS:
            raise InputError(f"Dispatcher: received op={op!r}, expected one of {OPS}")
        if device.startswith("cuda") and not torch.cuda.is_available() and accelerator is None:
            raise BackendUnavailableError(
                f"device={device!r} was requested but no CUDA GPU is visible; use device='auto' or 'cpu'")
        self.device = device
        if accelerator is None:
            accelerator = device if device.startswith("cuda") else ("cuda" if torch.cuda.is_available() else None)
        self.accelerator = torch.device(accelerator) if accelerator is not None else None
        self._threshold, self._d, self.fault = threshold, d, fault
        self.op, self.n_items = op, n_items
        self._measured: dict[int | None, int] = {}  # size bucket -> threshold (-1: accelerator never wins)
        self.fallbacks = 0  # how many calls fell back to the CPU
        self._warned = False

    @property
    def threshold(self) -> int | None:
        """Batch size from which "auto" uses the accelerator (measured on first use, per size bucket)."""
        if self._threshold is not None:
            return None if self._threshold < 0 else self._threshold
        if self.accelerator is None or self.device != "auto":
            return None
        n = max(1, self.n_items or 1) if self.op == "cleanup" else None
        key = items_bucket(n) if n is not None else None
        if key not in self._measured:
            t = calibrate(self._d, op=self.op, n_items=n, accelerator=str(self.accelerator)).threshold
            self._measured[key] = -1 if t is None else t  # -1: measured, the accelerator never wins here
        t = self._measured[key]
        return None if t < 0 else t

    def uses_accelerator(self, batch: int) -> bool:
        """Whether a batch of ``batch`` items goes to the accelerator."""
        if self.device == "cpu" or self.accelerator is None:
            return False
        if self.device != "auto":
            return True
        t = self.threshold
        return t is not None and batch >= t

    def target(self, batch: int) -> torch.device:
        """Where a batch of ``batch`` items runs."""
        return self.accelerator if self.uses_accelerator(batch) and self.accelerator is not None else torch.device("cpu")

    def run(self, fn: Callable[..., Any], *tensors: torch.Tensor, batch: int | None = None) -> Any:
        """``fn(*tensors)`` on the chosen device; tensor results come back on the CPU.

        A device failure (OOM, CUDA error, or an injected fault) reruns ``fn`` on the CPU and warns
        once per dispatcher; other errors propagate.
        """
        n = batch if batch is not None else (tensors[0].shape[0] if tensors and tensors[0].dim() > 1 else 1)
        if not self.uses_accelerator(n):
            return fn(*(t.cpu() for t in tensors))
        dev = self.target(n)
        try:
            if self.fault is not None:
                self.fault(dev)
            out = fn(*(to_device(t, dev) for t in tensors))
            return _map_tensors(out, to_host)
        except Exception as exc:  # noqa: BLE001 - filtered by is_device_failure
            if not is_device_failure(exc):
                raise
            self.fallbacks += 1
            if not self._warned:
                warnings.warn(f"hrr: {dev} failed ({type(exc).__name__}: {exc}); running on the CPU instead",
                              RuntimeWarning, stacklevel=2)
                self._warned = True
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            return fn(*(t.cpu() for t in tensors))


def _map_tensors(out: Any, f: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        return f(out)
    if isinstance(out, tuple):
        return tuple(_map_tensors(o, f) for o in out)
    if isinstance(out, list):
        return [_map_tensors(o, f) for o in out]
    return out
