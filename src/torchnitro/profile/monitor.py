"""Energy and device counters sampled while a profile runs: RAPL for the CPU, NVML for NVIDIA GPUs.

- ``RaplEnergy`` reads the package/DRAM energy counters under ``/sys/class/powercap`` at start and
  stop (wrap-around handled with ``max_energy_range_uj``). Where they are missing or unreadable
  (most containers; non-root since 2020 kernels) the result says so: CPU energy is never guessed
  from a TDP.
- ``NvmlSampler`` polls NVML in a background thread (SM utilisation, memory used, SM clock, power,
  throttle reasons) and takes the energy from the device's total-energy counter (Volta and newer),
  so joules per step do not depend on the polling rate; power integrated over the samples
  (``joules_from_power``, over ``power_window_s``) is kept beside it as a cross-check. The NVML
  module is injectable: tests pass
  a fake, production code uses ``pynvml`` from nvidia-ml-py (the ``gpu`` extra).

Each sampler's ``stop(steps)`` returns a dict with a one-line ``summary``, or ``unavailable`` and why.
"""

from __future__ import annotations

import importlib
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["RaplEnergy", "NvmlSampler", "Monitors", "monitors", "POWERCAP"]

POWERCAP = Path("/sys/class/powercap")


class RaplEnergy:
    """CPU energy from the RAPL counters: joules between ``start()`` and ``stop()``."""

    name = "cpu_energy"

    def __init__(self, root: Path = POWERCAP, clock: Callable[[], float] = time.monotonic):
        self.root, self.clock = Path(root), clock
        self._start: dict[str, int] = {}
        self._t0 = 0.0
        self.unavailable: str | None = None
        self.domains: dict[str, tuple[Path, int]] = {}  # label -> (energy_uj file, wrap range)
        self._find()

    def _find(self) -> None:
        if not self.root.is_dir():
            self.unavailable = f"{self.root} does not exist (no RAPL powercap driver here)"
            return
        # top-level zones (intel-rapl:0) are packages; their children (intel-rapl:0:0) are core/dram parts
        for zone in sorted(self.root.glob("intel-rapl:*")):
            f = zone / "energy_uj"
            if not f.exists():
                continue
            label = (zone / "name").read_text().strip() if (zone / "name").exists() else zone.name
            label = f"{zone.name} {label}"
            try:
                int(f.read_text())
                rng = int((zone / "max_energy_range_uj").read_text())
            except (OSError, ValueError) as exc:
                self.unavailable = f"{f} is not readable ({type(exc).__name__}: {exc}); RAPL needs root on most kernels"
                self.domains.clear()
                return
            self.domains[label] = (f, rng)
        if not self.domains:
            self.unavailable = f"no intel-rapl zones under {self.root}"

    def _read(self) -> dict[str, int]:
        return {k: int(f.read_text()) for k, (f, _) in self.domains.items()}

    def start(self) -> None:
        if self.unavailable is None:
            self._start, self._t0 = self._read(), self.clock()

    def stop(self, steps: int) -> dict[str, Any]:
        if self.unavailable is not None or not self._start:
            return {"unavailable": self.unavailable or "stopped before it was started"}
        end, secs = self._read(), self.clock() - self._t0
        joules = {}
        for k, (_, rng) in self.domains.items():
            d = end[k] - self._start[k]
            joules[k] = (d + rng if d < 0 else d) / 1e6  # the counter wrapped once
        # packages are the zones without a sub-index; their parts (core, dram...) would double count
        total = sum(v for k, v in joules.items() if k.split()[0].count(":") == 1)
        return {"joules": total, "joules_per_step": total / max(steps, 1), "seconds": secs,
                "watts": total / secs if secs > 0 else None, "domains": joules,
                "summary": f"{total / max(steps, 1):.3f} J per step, {total / secs if secs > 0 else 0:.1f} W mean "
                           f"over {secs:.2f} s (RAPL packages)"}


class NvmlSampler:
    """GPU counters polled every ``interval_s`` in a thread; energy from the device's counter."""

    name = "gpu"

    def __init__(self, index: int = 0, interval_s: float = 0.05, nvml: Any = None,
                 clock: Callable[[], float] = time.monotonic):
        self.index, self.interval_s, self.clock = index, interval_s, clock
        self.unavailable: str | None = None
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nvml = nvml
        if self.nvml is None:
            try:
                self.nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                self.unavailable = f"nvidia-ml-py is not installed ({exc}); install torchnitro[gpu]"
                return
        try:
            self.nvml.nvmlInit()
            self.handle = self.nvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # noqa: BLE001 - NVMLError subclasses are generated per error code
            self.unavailable = f"NVML could not open GPU {index}: {exc}"

    def _energy_mj(self) -> float | None:
        try:
            return float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except Exception:  # noqa: BLE001 - pre-Volta GPUs have no energy counter
            return None

    def _sample(self) -> dict[str, float]:
        n, h = self.nvml, self.handle
        util = n.nvmlDeviceGetUtilizationRates(h)
        mem = n.nvmlDeviceGetMemoryInfo(h)
        s = {"t": self.clock(), "sm_util": float(util.gpu), "mem_used": float(mem.used),
             "power_w": n.nvmlDeviceGetPowerUsage(h) / 1e3,
             "sm_clock_mhz": float(n.nvmlDeviceGetClockInfo(h, getattr(n, "NVML_CLOCK_SM", 1))),
             "throttle": float(n.nvmlDeviceGetCurrentClocksThrottleReasons(h))}
        return s

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self._sample())
            except Exception as exc:  # noqa: BLE001 - keep the profile; report the sampler's failure
                self.unavailable = f"NVML sampling failed: {exc}"
                return
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if self.unavailable is not None:
            return
        self.samples.clear()
        self._t0, self._e0 = self.clock(), self._energy_mj()
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="torchnitro-nvml", daemon=True)
        self._thread.start()

    def stop(self, steps: int) -> dict[str, Any]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        if self.unavailable is not None or self._thread is None:
            return {"unavailable": self.unavailable or "stopped before it was started"}
        self._thread = None
        secs, e1 = self.clock() - self._t0, self._energy_mj()
        out: dict[str, Any] = {"seconds": secs, "samples": len(self.samples)}
        if e1 is not None and self._e0 is not None:
            j = (e1 - self._e0) / 1e3
            out.update(joules=j, joules_per_step=j / max(steps, 1), energy_source="device energy counter")
        if len(self.samples) >= 2:  # cross-check of the counter: power integrated over the samples (trapezoids)
            pts = [(x["t"], x["power_w"]) for x in self.samples]
            out["joules_from_power"] = sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(pts, pts[1:]))
            out["power_window_s"] = pts[-1][0] - pts[0][0]
        for key in ("sm_util", "power_w", "sm_clock_mhz", "mem_used"):
            vals = [s[key] for s in self.samples]
            if vals:
                out[f"{key}_mean"], out[f"{key}_max"] = statistics.fmean(vals), max(vals)
        reasons = 0
        for s in self.samples:
            reasons |= int(s["throttle"])
        out["throttle_reasons_mask"] = reasons
        energy = f"{out['joules_per_step']:.3f} J per step, " if "joules" in out else "no energy counter, "
        out["summary"] = (f"{energy}SM util {out.get('sm_util_mean', 0):.0f}% mean, power "
                          f"{out.get('power_w_mean', 0):.0f} W mean / {out.get('power_w_max', 0):.0f} W max, "
                          f"{len(self.samples)} samples over {secs:.2f} s, throttle mask {reasons:#x}")
        return out


class Monitors:
    """Several samplers started and stopped together; ``stop`` -> name -> result."""

    def __init__(self, samplers: list[Any]):
        self.samplers = samplers

    def start(self) -> None:
        for s in self.samplers:
            s.start()

    def stop(self, steps: int) -> dict[str, Any]:
        return {s.name: s.stop(steps) for s in self.samplers}


def monitors(device: str = "cpu") -> Monitors:
    """RAPL always (reported unavailable where unreadable); NVML too when the profile runs on CUDA."""
    samplers: list[Any] = [RaplEnergy()]
    if device.startswith("cuda"):
        samplers.append(NvmlSampler())
    return Monitors(samplers)
