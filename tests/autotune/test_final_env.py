"""The optimizer's final comparison starts every timing process with the OpenMP wait setting a deployed process
has (nothing added) and under glibc's allocator setting (fresh processes agree), and its report says so."""

from __future__ import annotations

import os
import platform

import pytest

import torchnitro
from torchnitro.autotune import fair, fair_place
from torchnitro.bench.environment import ALLOCATOR_SETTING
from torchnitro.bench.isolated import ChildTimer


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator setting is glibc's")
def test_final_comparison_children_run_libgomps_default_wait_and_the_report_says_so(fake_recipes, fast_cfg,
                                                                                     monkeypatch):
    import fake_standalone as fs

    for k in ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LD_PRELOAD"] + [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k, raising=False)
    started: list[ChildTimer] = []

    class Recorded(ChildTimer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started.append(self)

    monkeypatch.setattr(fair, "ChildTimer", Recorded)
    monkeypatch.setattr(fair_place, "ChildTimer", Recorded)
    opt = torchnitro.optimize(fs.CountingSlowModel(), fake_recipes.tiny_inputs(),
                              fast_cfg(recipes=["test-faster"], final_alone=True))
    assert opt.report.get("eager").alone and opt.report.get("test-faster").alone
    assert len(started) >= 2  # eager's process and the candidate's
    # OpenMP: the deployed setting (nothing added); glibc: the fixed thresholds
    assert all(t.env == ALLOCATOR_SETTING for t in started), [t.env for t in started]
    env_notes = [n for n in opt.report.notes if n.startswith("timing environment:")]
    assert env_notes and env_notes[0].endswith("timing processes run libgomp's default OpenMP wait (nothing added)")
    assert "timing processes started with MALLOC_MMAP_THRESHOLD_=268435456" in env_notes[0]
    gate = [n for n in opt.report.notes if n.startswith("timing gate:")]
    assert gate and "retaken" in gate[0], opt.report.notes  # the report says how many samples were retaken


def test_program_parity_notes_a_probe_that_cannot_start_instead_of_stopping_the_search():
    """The program's probe with glibc's defaults is a second process: when it cannot start, eager is timed in the
    search process and its row says why (the search goes on)."""
    from types import SimpleNamespace

    from torchnitro.autotune import final
    from torchnitro.autotune.report import CandidateResult, Report, Status
    from torchnitro.errors import RecipeError

    class NoSecond:
        env = dict(ALLOCATOR_SETTING)

        def again(self, env):
            raise RecipeError("a fresh timing process could not start (Resource temporarily unavailable)")

    report = Report(model="m", inputs="x", objective="o", hardware="h")
    report.candidates = [CandidateResult("eager", "exact", Status.VERIFIED, p50_ms=1.0)]
    s = SimpleNamespace(cfg=SimpleNamespace(final_min_time_s=0.01), device=SimpleNamespace(type="cpu"))
    why = final._program_parity(s, report, NoSecond())
    assert why is not None and why.startswith("timed in this process") and "could not start" in why


def test_an_environment_that_chooses_the_allocator_is_inherited_and_no_trial_runs(fake_recipes, fast_cfg,
                                                                                monkeypatch):
    """docs/optimize.md: timing processes inherit the user's own allocator choice, the trial is not run, the note
    says why and the artifact records no setting."""
    import fake_standalone as fs

    for k in ["OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "LD_PRELOAD"] + [k for k in os.environ if k.startswith("MALLOC_")]:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    started: list[ChildTimer] = []

    class Recorded(ChildTimer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            started.append(self)

    monkeypatch.setattr(fair_place, "ChildTimer", Recorded)
    opt = torchnitro.optimize(fs.CountingSlowModel(), fake_recipes.tiny_inputs(),
                              fast_cfg(recipes=["test-faster"], final_alone=True, tune_allocator=True))
    assert started and all(t.env == {} for t in started), [t.env for t in started]
    assert any(n.startswith("allocator setting not tried: MALLOC_MMAP_THRESHOLD_ already set") for n in opt.report.notes)
    assert "environment" not in opt.candidate.meta
