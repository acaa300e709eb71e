"""Where an HRR operation runs: ``device="auto"`` keeps small batches on the CPU, sends large ones to
the accelerator, and falls back to the CPU (with one warning) when the accelerator fails.

The CPU/GPU crossover is measured, not guessed: ``calibrate()`` times bind on the CPU against
"pinned copy in, bind on the GPU, copy out" for growing batches, takes the smallest batch where the
GPU round trip wins, and caches the answer on disk keyed by the hardware fingerprint
(``torchnitro.hardware``), so each machine measures once.

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

__all__ = [
    "Calibration", "calibrate", "calibration_path", "Dispatcher", "to_device", "to_host",
    "is_device_failure", "CALIBRATION_VERSION",
]

CALIBRATION_VERSION = 1
_DEFAULT_BATCHES = (1, 4, 16, 64, 256, 1024, 4096)


@dataclass(frozen=True)
class Calibration:
    """Measured CPU/accelerator crossover for bind at dimension ``d``."""

    fingerprint: str  # hardware fingerprint the numbers belong to
    accelerator: str | None  # "cuda", or None when there is none (everything stays on the CPU)
    d: int  # vector dimension the crossover was measured at
    threshold: int | None  # smallest batch where the accelerator round trip wins; None: never
    timings: dict[str, dict[str, float]] = field(default_factory=dict)  # batch -> {"cpu_s", "accel_s"}
    version: int = CALIBRATION_VERSION  # cache format version


def _cache_dir() -> Path:
    root = os.environ.get("TORCHNITRO_CACHE_DIR") or os.path.join(Path.home(), ".cache", "torchnitro")
    return Path(root)


def calibration_path(fingerprint: str, d: int, accelerator: str) -> Path:
    """Cache file of one calibration."""
    return _cache_dir() / f"hrr-calibration-{fingerprint}-{accelerator}-d{d}.json"


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


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> accelerator through pinned memory with a non-blocking copy."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        if not t.is_pinned():
            t = t.pin_memory()
        return t.to(device, non_blocking=True)
    return t.to(device)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Accelerator -> host into pinned memory, non-blocking, then one stream sync before use."""
    if t.device.type != "cuda":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return out


def _measure_crossover(d: int, batches: tuple[int, ...], accel: torch.device) -> dict[str, dict[str, float]]:
    from torchnitro.bench import TimingConfig, compare
    from torchnitro.hrr import ops

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


def calibrate(
    d: int = 1024,
    *,
    accelerator: str | None = None,
    batches: tuple[int, ...] = _DEFAULT_BATCHES,
    force: bool = False,
) -> Calibration:
    """Measure (or read from the cache) the batch size above which the accelerator pays off.

    Without an accelerator (none given and no CUDA) it returns ``threshold=None`` at once: everything
    stays on the CPU. ``force`` re-measures and overwrites the cache.
    """
    from torchnitro.hardware import hardware_info

    fp = hardware_info().fingerprint
    accel = accelerator or ("cuda" if torch.cuda.is_available() else None)
    if accel is None:
        return Calibration(fingerprint=fp, accelerator=None, d=d, threshold=None)
    if accel.startswith("cuda") and not torch.cuda.is_available():
        raise BackendUnavailableError(f"calibrate: accelerator {accel!r} requested but CUDA is not available")
    path = calibration_path(fp, d, accel.replace(":", ""))
    if path.is_file() and not force:
        try:
            data = json.loads(path.read_text())
            if data.get("version") == CALIBRATION_VERSION and data.get("fingerprint") == fp:
                return Calibration(**data)
        except (OSError, ValueError, TypeError):
            pass  # unreadable cache: measure again and overwrite it
    timings = _measure_crossover(d, tuple(sorted(batches)), torch.device(accel))
    wins = [int(b) for b, t in timings.items() if t["accel_s"] < t["cpu_s"]]
    # the threshold is the start of the run of wins that reaches the largest batch
    threshold = None
    for b in sorted((int(b) for b in timings), reverse=True):
        if b not in wins:
            break
        threshold = b
    cal = Calibration(fingerprint=fp, accelerator=accel, d=d, threshold=threshold, timings=timings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cal), indent=2))
    tmp.replace(path)
    return cal


class Dispatcher:
    """Runs a function of tensors on the CPU or the accelerator, with fallback to the CPU.

    device: ``"auto"`` (by batch size against the calibrated threshold), ``"cpu"``, or an
    accelerator such as ``"cuda"`` (always there; raises at construction if it is unavailable).
    """

    def __init__(
        self,
        device: str = "auto",
        *,
        accelerator: str | None = None,
        threshold: int | None = None,
        d: int = 1024,
        fault: Callable[[torch.device], None] | None = None,
    ) -> None:
        if not isinstance(device, str) or not (device in ("auto", "cpu") or device.startswith("cuda")):
            raise InputError(f"device: received {device!r}, expected 'auto', 'cpu' or 'cuda[:N]'")
        if device.startswith("cuda") and not torch.cuda.is_available() and accelerator is None:
            raise BackendUnavailableError(
                f"device={device!r} was requested but no CUDA GPU is visible; use device='auto' or 'cpu'")
        self.device = device
        if accelerator is None:
            accelerator = device if device.startswith("cuda") else ("cuda" if torch.cuda.is_available() else None)
        self.accelerator = torch.device(accelerator) if accelerator is not None else None
        self._threshold, self._d, self.fault = threshold, d, fault
        self.fallbacks = 0  # how many calls fell back to the CPU
        self._warned = False

    @property
    def threshold(self) -> int | None:
        """Batch size from which "auto" uses the accelerator (measured on first use)."""
        if self._threshold is None and self.accelerator is not None and self.device == "auto":
            self._threshold = calibrate(self._d, accelerator=str(self.accelerator)).threshold
            if self._threshold is None:
                self._threshold = -1  # measured: the accelerator never wins here
        return None if self._threshold is None or self._threshold < 0 else self._threshold

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
