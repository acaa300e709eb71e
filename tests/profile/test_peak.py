"""The in-run GEMM peak and the whole-step accounting (unattributed time, profiled vs unprofiled step)."""

from __future__ import annotations

import time

import pytest
import torch

from torchnitro.errors import InputError
from torchnitro.profile import ProfileConfig, profile
from torchnitro.profile.peak import GemmPeak, PeakProbe
from torchnitro.profile.result import Profile, findings


def test_gemm_peak_statistics_and_raising_to_the_step():
    g = GemmPeak("cpu", "float32", 64, 2, [40e9, 50e9, 45e9])
    assert g.best == 50e9 and g.median == 45e9 and g.spread == pytest.approx(0.2)
    assert "best of 3 64^3 float32" in g.describe() and "spread 20.0%" in g.describe()
    g.raised_to_step = 60e9  # the step itself ran faster than every timing: the peak is at least that
    assert g.best == 60e9 and "raised to the step's own best rate 60.0" in g.describe()
    assert g.to_dict()["best"] == 60e9


def test_probe_finish_keeps_mfu_at_most_one():
    probe = PeakProbe("cpu", "float32", n=8)
    probe.peak.flops_samples[:] = [1e9, 2e9]  # as if timed under load
    flops = 10**7  # a step of 10 MFLOP that took 2 ms at best: 5 GFLOP/s, faster than every timing
    peak = probe.finish(flops, [0.002, 0.003])
    assert peak.best == pytest.approx(5e9) and peak.raised_to_step == pytest.approx(5e9)
    assert PeakProbe("cpu", "float32", n=8).finish(10**3, [1.0]).raised_to_step == 1e3  # no timings: the step's rate
    with pytest.raises(InputError, match="int8"):
        PeakProbe("cpu", "int8")


def test_probe_default_size_is_the_rooflines(monkeypatch):
    from torchnitro import hardware
    from torchnitro.autotune import analyze
    from torchnitro.profile import peak

    assert hardware.roofline_gemm_n("cpu") == 1024 and hardware.roofline_gemm_n("cuda:0") == 4096
    assert analyze.roofline_gemm_n is peak.roofline_gemm_n is hardware.roofline_gemm_n  # one size for both peaks
    monkeypatch.setattr(peak, "roofline_gemm_n", lambda device: 16)  # one source: the probe follows it
    assert PeakProbe("cpu", "float32").n == 16 and PeakProbe("cpu", "float32", n=8).n == 8


def test_a_gemm_step_reads_at_most_full_mfu_against_its_own_run():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    p = profile(lambda: torch.mm(a, b), config=ProfileConfig(warmup=1, steps=3, monitor=False, track_memory=False,
                                                              peak_timings=2, unprofiled_steps=2, peak_gemm=64))
    assert len(p.peak["flops_samples"]) == 2 and p.peak_flops == p.peak["best"] and p.peak["n"] == 64
    assert 0 < p.mfu <= 1.0 and p.mfu_range[0] <= p.mfu_range[1]
    assert "GEMM timings around the recorded steps" in p.peak_source and "MFU:" in p.summary()
    back = Profile.from_dict(p.to_dict())
    assert back.peak == p.peak and back.unprofiled_step_times_s == p.unprofiled_step_times_s


def test_python_time_between_ops_is_its_own_category_and_everything_adds_up():
    x = torch.ones(4)

    def step() -> None:
        x.add(1)
        time.sleep(0.02)  # host time outside every op: no op category may claim it
        x.mul(2)

    p = profile(step, config=ProfileConfig(warmup=1, steps=2, monitor=False, count_flops=False, track_memory=False))
    assert p.shares["unattributed"] > 0.5 and p.accounted == pytest.approx(1.0)
    assert p.profiled_over_unprofiled is not None and p.unprofiled_step_time_s >= 0.02
    assert "they add up to 100.0% of the profiled step" in p.summary() and "unprofiled:" in p.summary()
    assert any("between ops" in f for f in p.findings)


def test_profiler_cost_finding():
    p = Profile(device="t", clock="cpu", warmup=1, steps=2, step_time_s=0.02, step_times_s=[0.02, 0.02],
                categories={"matmul": 0.02}, unprofiled_step_times_s=[0.01, 0.01])
    assert p.profiled_over_unprofiled == 2.0 and any("2.00x the unprofiled" in f for f in findings(p))


def test_bad_counts_are_refused():
    with pytest.raises(InputError, match="peak_timings"):
        ProfileConfig(peak_timings=0)
    with pytest.raises(InputError, match="unprofiled_steps"):
        ProfileConfig(unprofiled_steps=-1)
    with pytest.raises(InputError, match="peak_gemm"):
        ProfileConfig(peak_gemm=0)
