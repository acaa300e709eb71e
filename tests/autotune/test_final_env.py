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


# ---- the allocator and thread trials: what they start, when, and what they note ----------------------------------

class _FakeTimer(ChildTimer):
    """A ChildTimer without a process: ``again`` makes another (logged), samples take ``seconds`` (logged)."""

    def __init__(self, label: str, log: list[str], threads: int = 2, env: dict | None = None, seconds: float = 1e-3):
        self.label, self.log, self.seconds = label, log, seconds
        self.env = dict(ALLOCATOR_SETTING) if env is None else env
        self.spec = {"threads": threads, "kwargs": {"meta": {"threads": threads}}}
        self.name, self.failed, self.faults, self.gate, self.closed = label, None, [], None, False

    def again(self, env, *, threads=None, kwargs=None, name=None):
        t = threads or self.spec["threads"]
        label = f"{self.label}/{'defaults' if env and all(v is None for v in env.values()) else f'{t}t'}"
        self.log.append(f"start {label}")
        return _FakeTimer(label, self.log, t, {**self.env, **(env or {})}, self.seconds)

    def wait_ready(self) -> None:  # like ChildTimer's: waits once, then returns at once
        if f"ready {self.label}" not in self.log:
            self.log.append(f"ready {self.label}")

    def sample(self, k: int, warm: int = 0) -> float:
        self.log.append(f"sample {self.label}")
        self.ks = getattr(self, "ks", []) + [k]
        return self.seconds

    def close(self) -> None:
        self.closed = True


def _trial_search(tmp_path, **cfg):
    from types import SimpleNamespace

    from torchnitro.autotune.recipe import CandidateFiles

    from torchnitro.autotune.final_budget import FinalBudget

    files = CandidateFiles(tmp_path, [], {"threads": 2}, True)
    return SimpleNamespace(where={"v": files, "eager": files}, device=SimpleNamespace(type="cpu"),
                           cfg=SimpleNamespace(final_min_time_s=0.0, tune_allocator=True, tune_threads=True, **cfg),
                           final_budget=FinalBudget.unlimited())


def _report():
    from torchnitro.autotune.report import Report

    return Report(model="m", inputs="x", objective="o", hardware="h")


def test_trial_processes_start_together_and_are_ready_before_any_trial_sample(tmp_path, monkeypatch):
    """The allocator trial's two processes (the chosen variant and eager with glibc's defaults) and the thread
    trial's one (1 thread) start before either trial times anything; the comparison's warm processes are reused
    (no second process under the setting); every trial process is closed, the comparison's are not."""
    from torchnitro.autotune import final_trials

    monkeypatch.setattr("torchnitro.bench.environment.allocator_untunable", lambda *a, **k: None)
    log: list[str] = []
    v, e = _FakeTimer("v", log), _FakeTimer("eager", log)
    report, phases = _report(), final_trials.Phases()
    final_trials.run_trials(_trial_search(tmp_path), report, "v", {"v": fair.Steady(v), "eager": fair.Steady(e)}, phases)
    starts = [i for i, x in enumerate(log) if x.startswith("start ")]
    readies = [i for i, x in enumerate(log) if x.startswith("ready ")]
    trial_samples = [i for i, x in enumerate(log) if x.startswith("sample ")]
    assert sorted(x for x in log if x.startswith("start ")) == ["start eager/defaults", "start v/1t",
                                                                  "start v/defaults"], log
    assert trial_samples and max(starts + readies) < min(trial_samples), log
    assert {x for x in log if x.startswith("sample ")} == {"sample v", "sample eager", "sample v/defaults",
                                                            "sample eager/defaults", "sample v/1t"}
    assert not v.closed and not e.closed
    assert any(n.startswith("allocator setting MALLOC_") for n in report.notes), report.notes
    assert any(n.startswith("thread count: the chosen variant alone") for n in report.notes), report.notes
    assert set(phases.seconds) == {"starting the trials' processes together", "allocator trial", "thread trial"}
    assert phases.text().startswith("final phase time: ") and "allocator trial" in phases.text()


def test_a_trial_process_that_fails_to_load_is_started_again_by_its_trial(tmp_path, monkeypatch):
    """Started ahead and failed: its trial starts it once more itself (and times it), nothing left open."""
    from torchnitro.autotune import final_trials
    from torchnitro.errors import RecipeError

    monkeypatch.setattr("torchnitro.bench.environment.allocator_untunable", lambda *a, **k: None)
    log: list[str] = []
    failures = [1]

    class FailsOnce(_FakeTimer):
        def wait_ready(self) -> None:
            if self.label.endswith("/1t") and failures[0]:
                failures[0] -= 1
                raise RecipeError("the timing process failed while waiting for 'ready'")
            super().wait_ready()

        def again(self, env, *, threads=None, kwargs=None, name=None):
            t = super().again(env, threads=threads, kwargs=kwargs, name=name)
            return FailsOnce(t.label, log, t.spec["threads"], t.env)

    v = FailsOnce("v", log)
    report = _report()
    final_trials.run_trials(_trial_search(tmp_path), report, "v", {"v": fair.Steady(v)}, final_trials.Phases())
    assert log.count("start v/1t") == 2 and "sample v/1t" in log, log
    assert any(n.startswith("thread count: the chosen variant alone") for n in report.notes), report.notes


@pytest.mark.parametrize("threads, best, note", [
    (1, "v", "thread count not tried: the comparison ran the chosen variant with 1 thread: nothing fewer to try"),
    (2, None, "thread count not tried: no variant beat eager, so there is no chosen variant to try"),
])
def test_a_thread_trial_that_cannot_gain_is_skipped_with_a_note_and_starts_nothing(tmp_path, monkeypatch, threads,
                                                                                   best, note):
    from torchnitro.autotune import final_trials

    monkeypatch.setattr("torchnitro.bench.environment.allocator_untunable", lambda *a, **k: None)
    log: list[str] = []
    v, e = _FakeTimer("v", log, threads), _FakeTimer("eager", log, threads)
    report = _report()
    final_trials.run_trials(_trial_search(tmp_path), report, best, {"v": fair.Steady(v), "eager": fair.Steady(e)},
                      final_trials.Phases())
    assert note in report.notes, report.notes
    assert [x for x in log if x.startswith("start ") and not x.endswith("/defaults")] == [], log  # no thread trial


def test_trial_samples_of_a_fast_variant_repeat_its_call_to_the_trial_sample_length(tmp_path, monkeypatch):
    """A 1 ms variant is sampled 20 calls at a time (TRIAL_SAMPLE_S 20 ms), not one call per gated request: the
    per-sample overhead (gate, request, untimed call) was most of a fast model's trial time."""
    from torchnitro.autotune import final_trials

    monkeypatch.setattr("torchnitro.bench.environment.allocator_untunable", lambda *a, **k: None)
    log: list[str] = []
    spawned: list[_FakeTimer] = []

    class Kept(_FakeTimer):
        def again(self, env, *, threads=None, kwargs=None, name=None):
            t = super().again(env, threads=threads, kwargs=kwargs, name=name)
            spawned.append(Kept(t.label, log, t.spec["threads"], t.env, self.seconds))
            return spawned[-1]

    v = Kept("v", log, seconds=1e-3)
    final_trials.run_trials(_trial_search(tmp_path), _report(), "v", {"v": fair.Steady(v)}, final_trials.Phases())
    assert final_trials.TRIAL_SAMPLE_S == 0.02 and len(spawned) == 2  # glibc's defaults, 1 thread
    for timer in [v, *spawned]:  # v is in both trials: one one-call warm-up in each (bench.compare's)
        assert timer.ks.count(1) == (2 if timer is v else 1), (timer.label, timer.ks)
        assert len(timer.ks) >= 6 and set(timer.ks) == {1, 20}, (timer.label, timer.ks)
