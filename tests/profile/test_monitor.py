"""Energy and GPU samplers, driven by a fake powercap tree and a fake NVML (no hardware needed)."""

from __future__ import annotations

import time
import types
from pathlib import Path

import pytest

from torchnitro.profile.monitor import POWERCAP, NvmlSampler, RaplEnergy


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _zone(root: Path, name: str, label: str, uj: int, rng: int = 2**32) -> Path:
    z = root / name
    z.mkdir(parents=True)
    (z / "name").write_text(label + "\n")
    (z / "energy_uj").write_text(str(uj))
    (z / "max_energy_range_uj").write_text(str(rng))
    return z


def test_rapl_energy_sums_packages_and_handles_wrap(tmp_path):
    p0 = _zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    p1 = _zone(tmp_path, "intel-rapl:1", "package-1", 999_000, rng=1_000_000)  # about to wrap
    d0 = _zone(tmp_path, "intel-rapl:0:0", "dram", 0)  # a part of package 0: not added twice
    clock = _Clock()
    r = RaplEnergy(tmp_path, clock=clock)
    r.start()
    (p0 / "energy_uj").write_text(str(4_000_000))  # +3 J
    (p1 / "energy_uj").write_text(str(1_000))  # wrapped: +2000 uJ
    (d0 / "energy_uj").write_text(str(500_000))
    clock.t = 2.0
    out = r.stop(steps=4)
    assert out["joules"] == pytest.approx(3.002)
    assert out["joules_per_step"] == pytest.approx(3.002 / 4) and out["watts"] == pytest.approx(1.501)
    assert out["domains"]["intel-rapl:0:0 dram"] == pytest.approx(0.5)
    assert "J per step" in out["summary"]


def test_rapl_unavailable_is_reported_not_guessed(tmp_path):
    out = RaplEnergy(tmp_path / "missing").stop(1)
    assert "does not exist" in out["unavailable"] and "joules" not in out
    z = _zone(tmp_path / "pc", "intel-rapl:0", "package-0", 0)
    (z / "energy_uj").write_text("not a number")
    assert "not readable" in RaplEnergy(tmp_path / "pc").stop(1)["unavailable"]


def test_rapl_on_this_machine():
    r = RaplEnergy()
    if r.unavailable is not None:
        pytest.skip(f"no readable RAPL here: {r.unavailable}")
    r.start()
    sum(i * i for i in range(200_000))
    out = r.stop(1)
    assert out["joules"] >= 0 and POWERCAP.is_dir()


class _FakeNvml:
    """Enough of pynvml: a device whose energy counter goes up 500 mJ per read."""

    NVML_CLOCK_SM = 1

    def __init__(self, energy_counter: bool = True) -> None:
        self.energy_mj, self.energy_counter, self.reads = 10_000, energy_counter, 0

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        if i != 0:
            raise RuntimeError(f"NVML_ERROR_INVALID_ARGUMENT: no GPU {i}")
        return "gpu0"

    def nvmlDeviceGetTotalEnergyConsumption(self, h: str) -> int:
        if not self.energy_counter:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        self.energy_mj += 500
        return self.energy_mj

    def nvmlDeviceGetUtilizationRates(self, h: str) -> types.SimpleNamespace:
        self.reads += 1
        return types.SimpleNamespace(gpu=80 if self.reads % 2 else 100, memory=30)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(used=2**30, total=80 * 2**30)

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        return 250_000  # mW

    def nvmlDeviceGetClockInfo(self, h: str, kind: int) -> int:
        return 1980

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: str) -> int:
        return 0x4 if self.reads > 1 else 0x0


def test_nvml_sampler_with_a_fake_device():
    clock = _Clock()
    s = NvmlSampler(nvml=_FakeNvml(), interval_s=0.001, clock=clock)
    s.start()
    for _ in range(10_000):  # bounded: a dead sampler thread fails the asserts below, not the run
        if len(s.samples) >= 3:
            break
        time.sleep(0.001)
    clock.t = 10.0
    out = s.stop(steps=5)
    assert out["joules"] == pytest.approx(0.5) and out["joules_per_step"] == pytest.approx(0.1)
    assert out["energy_source"] == "device energy counter"
    assert 80 <= out["sm_util_mean"] <= 100 and out["sm_util_max"] == 100
    assert out["power_w_mean"] == pytest.approx(250.0) and out["sm_clock_mhz_max"] == 1980
    assert out["throttle_reasons_mask"] == 0x4 and out["samples"] >= 3
    assert "J per step" in out["summary"]


def test_nvml_power_integral_beside_the_counter():
    ticks = iter(range(1000))
    s = NvmlSampler(nvml=_FakeNvml(), interval_s=0.001, clock=lambda: 0.5 * next(ticks))  # 0.5 s per clock read
    s.start()
    for _ in range(10_000):
        if len(s.samples) >= 4:
            break
        time.sleep(0.001)
    out = s.stop(steps=1)
    assert out["power_window_s"] == pytest.approx(0.5 * (out["samples"] - 1))
    assert out["joules_from_power"] == pytest.approx(250.0 * out["power_window_s"])  # constant 250 W


def test_nvml_without_energy_counter_or_device():
    s = NvmlSampler(nvml=_FakeNvml(energy_counter=False), interval_s=0.001)
    s.start()
    out = s.stop(1)
    assert "joules" not in out and "no energy counter" in out["summary"]
    assert "could not open GPU 3" in NvmlSampler(index=3, nvml=_FakeNvml()).stop(1)["unavailable"]


def test_nvml_on_this_machine():
    s = NvmlSampler()
    if s.unavailable is not None:
        pytest.skip(f"no NVML GPU here: {s.unavailable}")
    s.start()
    out = s.stop(1)
    assert "summary" in out


def test_stop_before_start_reports_instead_of_raising(tmp_path):
    _zone(tmp_path, "intel-rapl:0", "package-0", 5)
    assert RaplEnergy(tmp_path).stop(1) == {"unavailable": "stopped before it was started"}
    assert NvmlSampler(nvml=_FakeNvml()).stop(1) == {"unavailable": "stopped before it was started"}
