"""The final comparison times each variant as it will run: own-runtime candidates alone in their own process,
eager checked against eager alone, ORT pools quiet wherever other work is timed."""

from __future__ import annotations

import json
import os

import pytest
import torch

import torchnitro
from torchnitro.autotune import fair, fair_place
from torchnitro.autotune.recipe import register_recipe, unregister_recipe
from torchnitro.bench.environment import describe_environment, timing_environment
from torchnitro.bench.isolated import ChildTimer, process_is_shared, save_inputs, shared_process
from torchnitro.bench.timing import Timing, TimingConfig, compare
from torchnitro.errors import InputError, RecipeError

_FAST = TimingConfig(warmup=1, warmup_s=0.0, min_iters=4, min_time_s=0.0, max_time_s=5.0, min_sample_s=1e-4)


@pytest.fixture
def own_runtime():
    import fake_recorded_runtime as fr
    import fake_standalone as fs

    register_recipe(fr.RecordedRuntime)
    fs.LOADS.clear()
    yield fr.RecordedRuntime
    unregister_recipe(fr.RecordedRuntime.name)


@pytest.fixture(autouse=True)
def _no_settle_pause(monkeypatch):
    """A redo's pause lets a burst of load pass in a real search; here a redo (a loaded test machine) needs none."""
    monkeypatch.setattr(fair, "SETTLE_S", 0.0)


def _has_ort() -> bool:
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))


needs_ort = pytest.mark.skipif(not _has_ort(), reason="onnx/onnxruntime not installed (torchnitro[onnx])")


# ---- the child timer ------------------------------------------------------------------------------

def test_child_timer_alternates_with_this_process_reports_load_errors_and_takes_env(tmp_path):
    x = torch.randn(4, 8)
    save_inputs([(x,)], tmp_path / "in.pt")
    order: list[str] = []

    def here(k: int) -> float:  # one sample taken in this process
        order.append("here")
        return 1e-3

    here.times_itself = True  # type: ignore[attr-defined]
    broken = ChildTimer("fake_standalone:failing_loader", {}, tmp_path / "in.pt", threads=1)  # all start at once
    malloc = {"MALLOC_MMAP_THRESHOLD_": "268435456"}
    with_env = ChildTimer("fake_standalone:env_loader", {"name": "MALLOC_MMAP_THRESHOLD_", "value": "268435456"},
                          tmp_path / "in.pt", threads=1, env=malloc)
    with ChildTimer("fake_standalone:identity_loader", {"scale": 2.0}, tmp_path / "in.pt", threads=1) as timer:
        timer.wait_ready()
        res = compare({"eager": here, "alone": _Counting(timer, order)}, _FAST)
    assert res["alone"].n == res["eager"].n >= 4
    assert all(s > 0 for s in res["alone"].samples)
    rounds = order[2:]  # after one warm-up each: every round takes one sample on each side
    assert len(rounds) == 2 * res["eager"].n
    assert all(sorted(rounds[i:i + 2]) == ["alone", "here"] for i in range(0, len(rounds), 2))
    assert timer.proc.poll() is not None  # closed: the child exited
    with pytest.raises(RecipeError, match="artifact is missing its weights"):
        broken.wait_ready()
    assert broken.proc.poll() is not None and broken.failed
    with with_env:
        with_env.wait_ready()  # its loader raises unless the child started with the extra environment


class _Counting:
    times_itself = True

    def __init__(self, timer: ChildTimer, order: list[str]):
        self.timer, self.order = timer, order

    def __call__(self, k: int) -> float:
        self.order.append("alone")
        return self.timer(k)


def test_save_inputs_refuses_objects_a_child_would_have_to_unpickle(tmp_path):
    class Box:
        pass

    save_inputs([(torch.ones(2), 3, {"mask": None})], tmp_path / "ok.pt")
    with pytest.raises(InputError, match="tensors"):
        save_inputs([(torch.ones(2), Box())], tmp_path / "bad.pt")


# ---- the eager check ------------------------------------------------------------------------------

def test_eager_check_band_is_5_percent_or_twice_the_cv_at_most_25():
    t = lambda ms: Timing([ms / 1e3] * 5)  # noqa: E731
    assert fair.check_eager(10.0, 0.01, t(10.4)).ok  # +4% within 5%
    assert not fair.check_eager(10.0, 0.01, t(10.6)).ok  # +6% outside 5%
    assert fair.check_eager(10.0, 0.05, t(10.9)).ok  # cv 5% -> band 10%
    wide = fair.check_eager(10.0, 0.05, t(5.0))
    assert not wide.ok and wide.band == pytest.approx(0.10) and wide.drift == pytest.approx(-0.5)
    assert "10.000 ms" in wide.text() and "5.000 ms" in wide.text()
    assert fair.check_eager(10.0, 1.4, t(12.4)).ok and not fair.check_eager(10.0, 1.4, t(12.6)).ok  # capped at 25%
    with pytest.raises(InputError, match="positive"):
        fair.check_eager(0.0, 0.01, t(1.0))


class _ColdAfterSwitch:
    """A timing process whose first call after another process ran is slow (caches and threads cold)."""

    times_itself = True
    last: list[object] = [None]

    def __init__(self, warm_s: float):
        self.warm_s, self.calls = warm_s, []

    def __call__(self, k: int) -> float:
        cold = _ColdAfterSwitch.last[0] is not self
        _ColdAfterSwitch.last[0] = self
        self.calls.append(k)
        return (self.warm_s * 20 + self.warm_s * (k - 1)) / k if cold else self.warm_s


def test_steady_samples_follow_an_untimed_call_so_rotation_does_not_time_the_switch():
    cfg = TimingConfig(warmup=1, warmup_s=0.0, min_iters=5, min_time_s=0.0, max_time_s=60.0, device="cpu")
    a, b = _ColdAfterSwitch(1e-2), _ColdAfterSwitch(2e-2)
    plain = compare({"a": a, "b": b}, cfg)
    assert plain["a"].median > 0.1  # every sample was the first call after the other process's
    a, b = _ColdAfterSwitch(1e-2), _ColdAfterSwitch(2e-2)
    steady = compare({"a": fair.Steady(a), "b": fair.Steady(b)}, cfg)
    assert steady["a"].median == pytest.approx(1e-2) and steady["b"].median == pytest.approx(2e-2)
    assert a.calls[:2] == [1, 1] and a.calls[2::2] == [1] * len(a.calls[2::2])  # an untimed call before each
    calls: list[int] = []
    # in this process: one untimed call, then k timed (ungated: a gated sample disturbed by other CPU on a loaded
    # machine is retaken, which adds calls; the gate's retakes are tested in tests/bench/test_isolated_gate.py)
    here = fair.Steady(lambda: calls.append(1), gate=None)
    assert here(3) >= 0 and len(calls) == 4
    a.failed = "the timing process exited"
    assert fair.Steady(a).failed == "the timing process exited"  # the comparison reads a dead child through it


def test_steady_on_cuda_enqueues_the_untimed_call_before_the_start_event(monkeypatch):
    """On CUDA a variant timed in this process is timed with events around its k calls; the untimed call comes
    first, outside them (the rotation's switch is not timed, as on the CPU)."""
    log: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.at = None

        def record(self):
            log.append("record")
            self.at = len([x for x in log if x == "call"])

        def synchronize(self):
            log.append("sync")

        def elapsed_time(self, end) -> float:  # ms: 2 ms per call enqueued between the events
            return 2.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    steady = fair.Steady(lambda: log.append("call"), gate=None, cuda=True)
    assert steady(3) == pytest.approx(2e-3)
    assert log == ["call", "record", "call", "call", "call", "record", "sync"]
    assert fair.Steady(lambda: None).cuda is False  # the CPU path is the default


def test_disturbed_eager_in_the_comparison_is_redone_and_reported(fake_recipes, fast_cfg, monkeypatch):
    import torchnitro.autotune.final as final_mod

    fr = fake_recipes
    real, calls = final_mod._compare_finalists, []

    def disturbed_once(s, report, fns, tc):
        res = real(s, report, fns, tc)
        calls.append(1)
        if len(calls) == 1:  # eager 20x slower, as after a spinning runtime's call
            e = res["eager"]
            res["eager"] = Timing([x * 20 for x in e.samples], e.calls_per_sample, e.items_per_call)
        return res

    monkeypatch.setattr(final_mod, "_compare_finalists", disturbed_once)
    monkeypatch.setattr(fair, "SETTLE_S", 0.0)
    opt = torchnitro.optimize(fr.SlowModel(), fr.tiny_inputs(), fast_cfg(recipes=["test-faster"]))
    rep = opt.report
    assert len(calls) == 2  # eager here: its reference is its search-time p50, no solo run (tests/autotune/test_final_check.py)
    assert any(n.startswith("final comparison redone") for n in rep.notes)
    assert rep.get("eager").redone and rep.get("test-faster").redone
    assert any(n.startswith("eager p50 alone (search time: this process, before any candidate ran)") and
               "inside the comparison" in n for n in rep.notes)


def test_undisturbed_comparison_is_not_redone(fake_recipes, fast_cfg, monkeypatch):
    import torchnitro.autotune.final as final_mod

    fr = fake_recipes
    calls: list[int] = []

    def matches_alone(s, report, fns, tc):  # eager inside == eager alone exactly
        calls.append(1)
        alone = s.p50.get("eager") or 30.0
        return {n: Timing([alone / 1e3] * 4) if n == "eager" else Timing([alone / 3e3] * 4) for n in fns}

    monkeypatch.setattr(final_mod, "_compare_finalists", matches_alone)
    opt = torchnitro.optimize(fr.SlowModel(), fr.tiny_inputs(), fast_cfg(recipes=["test-faster"]))
    assert len(calls) == 1
    assert not opt.report.get("eager").redone
    assert not any(n.startswith("final comparison redone") for n in opt.report.notes)


# ---- own-runtime candidates never load in the search process --------------------------------------

def test_own_runtime_candidate_is_timed_alone_and_never_loaded_here(own_runtime, fast_cfg):
    """With the old comparison, load() ran here (a foreign runtime's busy pool then stole the core from eager timed
    after it); the recipe records every process it loads in (``LOADS``)."""
    import fake_standalone as fs
    from fake_recipes import tiny_inputs, tiny_model

    # min_speedup 100: eager is handed back, so nothing of the candidate is needed in this process
    opt = torchnitro.optimize(tiny_model(), tiny_inputs(), fast_cfg(recipes=[own_runtime.name], min_speedup=100.0))
    c = opt.report.get(own_runtime.name)
    assert opt.recipe == "eager" and c.status == "verified" and c.interleaved and c.alone
    assert not opt.report.get("eager").alone and opt.report.get("eager").interleaved
    assert os.getpid() not in fs.LOADS  # LOADS sees only this process: a load here would be in it
    assert any(f"each alone in its own fresh process: {own_runtime.name}" in n for n in opt.report.notes)


def test_a_timing_process_that_dies_mid_comparison_fails_only_its_candidate(tmp_path):
    """A real child that exits on its third call (the ready call, then the warm-up's untimed and timed calls): its
    row fails with the reason, the rest of the comparison runs to the end."""
    from types import SimpleNamespace

    from fake_recipes import eager_and_cand_report

    from torchnitro.autotune import final
    from torchnitro.autotune.report import CandidateResult, Status

    save_inputs([(torch.randn(4, 8),)], tmp_path / "in.pt")
    rep = eager_and_cand_report()
    rep.candidates.append(CandidateResult("dies", "exact", Status.VERIFIED))
    with ChildTimer("fake_recorded_runtime:exits_on_third_call", {}, tmp_path / "in.pt", threads=1) as dies:
        fns = {"eager": fair.Steady(lambda: None, gate=None), "cand": fair.Steady(lambda: None, gate=None),
               "dies": fair.Steady(dies)}
        res = final._compare_finalists(SimpleNamespace(wl=SimpleNamespace(items_per_call=1)), rep, fns, _FAST)
    assert sorted(res) == ["cand", "eager"] and res["cand"].n >= 4 and "dies" not in fns
    dead = rep.get("dies")
    assert dead.status == Status.FAILED and dead.reason.startswith("timing it alone failed: the timing process"), \
        dead.reason
    assert rep.get("cand").status == Status.VERIFIED


@needs_ort
def test_onnx_finalist_is_timed_alone_and_no_session_spins_in_the_search(fake_recipes, fast_cfg, monkeypatch):
    import torchnitro.autotune.recipes.onnx as onnx_mod

    made: list[tuple[int, bool]] = []
    real_init = onnx_mod.OrtRunner.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append((os.getpid(), self.spinning))

    monkeypatch.setattr(onnx_mod.OrtRunner, "__init__", spy)
    fr = fake_recipes
    opt = torchnitro.optimize(fr.tiny_model(), fr.tiny_inputs(), fast_cfg(recipes=["onnxruntime"], min_speedup=100.0))
    c = opt.report.get("onnxruntime")
    assert c.status == "verified" and c.alone and c.interleaved and c.p50_ms > 0
    assert made == []  # built in the search child, timed in its own process: no session here
    assert "allocator" in " ".join(opt.report.notes)


# ---- ORT spinning --------------------------------------------------------------------------------

@needs_ort
def test_ort_spinning_follows_the_measured_choice_and_is_off_in_a_shared_process(tmp_path):
    from fake_recipes import tiny_inputs, tiny_model

    from torchnitro.autotune.recipes.onnx import OrtRunner, choose_spinning, export_onnx

    meta = export_onnx(tiny_model(), tiny_inputs(), tmp_path / "model.onnx", {})
    meta["threads"] = 1
    runner = choose_spinning(tmp_path / "model.onnx", meta, tiny_inputs())
    assert isinstance(meta["ort_spinning"], bool) and set(meta["ort_spin_p50_ms"]) == {"on", "off"}
    assert runner.spinning == meta["ort_spinning"]

    def entry(r: OrtRunner) -> str:
        return r.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")

    assert entry(OrtRunner(tmp_path / "model.onnx", dict(meta, ort_spinning=True), 1)) == "1"
    assert entry(OrtRunner(tmp_path / "model.onnx", dict(meta, ort_spinning=False), 1)) == "0"
    with shared_process():
        assert process_is_shared()
        assert entry(OrtRunner(tmp_path / "model.onnx", dict(meta, ort_spinning=True), 1)) == "0"
    assert not process_is_shared()


# ---- the environment the numbers were measured under ----------------------------------------------

def test_timing_environment_records_allocator_and_thread_settings(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "268435456")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = timing_environment()
    assert env["MALLOC_MMAP_THRESHOLD_"] == "268435456" and env["OMP_NUM_THREADS"] == "2"
    assert env["torch_threads"] == str(torch.get_num_threads()) and env["allocator"]
    text = describe_environment(env)
    assert "MALLOC_MMAP_THRESHOLD_=268435456" in text and "default thresholds" not in text
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert "default thresholds" in describe_environment() or "malloc" not in timing_environment()["allocator"]


# ---- every finalist alone, eager included (final_alone) -------------------------------------------

@pytest.fixture
def faster(fake_recipes):
    return fake_recipes


def _finalist_calls(monkeypatch) -> list[int]:
    """Counts CountingSlowModel.forward calls made in this process while the final comparison runs."""
    import fake_standalone as fs

    import torchnitro.autotune.final as final_mod

    real, seen = final_mod.run_finalists, []

    def counted(s, report):
        fs.FORWARD_PIDS.clear()
        try:
            return real(s, report)
        finally:
            seen.append(len(fs.FORWARD_PIDS))

    monkeypatch.setattr(final_mod, "run_finalists", counted)
    return seen


def test_eager_and_in_process_candidates_are_each_timed_alone_in_their_own_process(faster, fast_cfg, monkeypatch):
    """The old comparison timed eager (and every in-process candidate) in the search's own process: the
    model's forward ran there for every sample. Now it runs there once, for the check of eager's child."""
    import fake_standalone as fs

    seen = _finalist_calls(monkeypatch)
    opt = torchnitro.optimize(fs.CountingSlowModel(), faster.tiny_inputs(),
                              fast_cfg(recipes=["test-faster", "torchscript"], final_alone=True))
    rep = opt.report
    assert seen == [1]  # eager_outputs(): this process's eager on the first timing set, nothing timed here
    for name in ("eager", "test-faster", "torchscript"):
        c = rep.get(name)
        assert c.interleaved and c.alone, (name, c.notes)
    assert "a pickle of the model object" in rep.get("eager").notes
    assert "rebuilt from the re-created eager model" in rep.get("test-faster").notes
    assert "loaded from its standalone artifact" in rep.get("torchscript").notes
    assert any(n.startswith("eager p50 alone (its own process") for n in rep.notes)  # eager_processes=1
    assert any("each alone in its own fresh process: eager" in n for n in rep.notes)
    assert opt.recipe in ("test-faster", "torchscript")  # both drop SlowModel's 30 ms sleep


def test_final_alone_off_times_eager_in_this_process(faster, fast_cfg, monkeypatch):
    import fake_standalone as fs

    seen = _finalist_calls(monkeypatch)
    opt = torchnitro.optimize(fs.CountingSlowModel(), faster.tiny_inputs(), fast_cfg(recipes=["test-faster"]))
    assert seen[0] > 3 and not opt.report.get("eager").alone  # every sample of eager ran here
    assert "final_alone=False" in opt.report.get("eager").notes


@pytest.mark.parametrize("model_name, why", [
    ("ShiftsWhenUnpickled", "differs from this process's eager"),
    ("FailsWhenUnpickled", "cannot be re-created from a pickle"),
])
def test_eager_that_cannot_be_recreated_in_a_child_is_timed_here_and_the_row_says_why(faster, fast_cfg, model_name,
                                                                                       why):
    """A child whose eager differs from (or fails to become) the search's eager is not trusted: eager and the
    candidates rebuilt from it fall back to this process; a standalone artifact is still timed alone."""
    import fake_standalone as fs

    opt = torchnitro.optimize(getattr(fs, model_name)(), faster.tiny_inputs(),
                              fast_cfg(recipes=["test-faster", "torchscript"], final_alone=True, min_speedup=0.5))
    rep = opt.report
    eager, rebuilt, ts = rep.get("eager"), rep.get("test-faster"), rep.get("torchscript")
    assert not eager.alone and "timed in this process: eager re-created in a child failed" in eager.notes
    assert why in eager.notes
    assert not rebuilt.alone and "could not be re-created in a child" in rebuilt.notes and rebuilt.interleaved
    assert ts.alone and ts.interleaved
    assert any("in this process: eager, test-faster (each row says why)" in n for n in rep.notes)


def test_model_defined_in_the_running_script_without_a_program_stays_in_this_process(faster):
    import fake_standalone as fs

    from torchnitro.autotune.recipe import get_recipe

    class ScriptModel(fs.SlowModel):
        pass

    ScriptModel.__module__ = "__main__"
    cm = fair.child_model(ScriptModel(), None, {}, __import__("pathlib").Path(os.devnull).parent / "unused")
    assert cm.kwargs is None and "ScriptModel" in cm.text and "running script" in cm.text
    p = fair_place.place(get_recipe("eager"), None, fair_place.PlaceRules(cm, "cpu", all_alone=True))
    assert p.kwargs is None and p.why.startswith("timed in this process") and "running script" in p.why
    failed = fair.child_model(ScriptModel(), None, {}, __import__("pathlib").Path(os.devnull).parent / "unused",
                              program=lambda: (_ for _ in ()).throw(RuntimeError("export broke")))
    assert failed.kwargs is None and "export broke" in failed.text


def test_model_defined_in_the_running_script_is_timed_alone_from_its_exported_program(tmp_path, faster):
    """Issue 15's MiniLM wrapper: its class lives in the user's script, so eager used to be timed in the search's
    process, beside the in-process candidates, while the OpenVINO variant ran alone; the search's 2.57x and the
    side-by-side table's 2.01x disagreed. Eager now runs alone too, from the program the search exported."""
    import fake_standalone as fs

    from torchnitro.autotune.program import prepare_program
    from torchnitro.autotune.recipe import get_recipe

    class ScriptModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))

    ScriptModel.__module__ = "__main__"
    model, x = ScriptModel().eval(), torch.randn(3, 8)
    prog = prepare_program("exported", model, (x,), {0: [0]}, tmp_path / "prog")
    cm = fair.child_model(model, None, {}, tmp_path, program=lambda: prog)
    assert cm.kwargs is not None and cm.kwargs["how"] == "program" and not cm.rebuilds
    assert "torch.export program" in cm.text and "running script" in cm.text
    rules = fair_place.PlaceRules(cm, "cpu", all_alone=True)
    p = fair_place.place(get_recipe("eager"), None, rules)
    assert p.kwargs is not None and p.needs_eager and p.why.startswith("alone in its own process")
    rebuilt = fair_place.place(get_recipe("test-faster"), fs_files(tmp_path), rules)
    assert rebuilt.kwargs is None and "eager model object, which a child cannot re-create" in rebuilt.why
    fn = fair.load_variant(None, None, {}, cm.kwargs)  # what the child runs: no ScriptModel class needed
    assert not any(type(m).__module__ == "__main__" for m in fn.modules())
    torch.testing.assert_close(fn(x), model(x))


def fs_files(tmp_path):
    from torchnitro.autotune.recipe import CandidateFiles

    return CandidateFiles(tmp_path, [], {}, False)


def test_script_model_search_times_eager_alone_and_rebuilt_candidates_here(faster, fast_cfg, monkeypatch):
    import fake_standalone as fs

    import torchnitro.autotune.final as final_mod

    class ScriptModel(fs.CountingSlowModel):
        pass

    ScriptModel.__module__ = "__main__"
    monkeypatch.setattr(final_mod, "_program_parity", lambda s, report, timer: None)  # placement only here
    opt = torchnitro.optimize(ScriptModel(), faster.tiny_inputs(),
                              fast_cfg(recipes=["test-faster", "torchscript"], final_alone=True, min_speedup=0.5,
                                       eager_processes=2))  # more than one: each re-created from the program
    rep = opt.report
    eager, rebuilt, ts = rep.get("eager"), rep.get("test-faster"), rep.get("torchscript")
    assert eager.alone and eager.interleaved and "torch.export program" in eager.notes, eager.notes
    assert not rebuilt.alone and rebuilt.interleaved and "cannot re-create" in rebuilt.notes
    assert ts.alone and ts.interleaved
    assert any(n.startswith("eager p50 alone (median of its 2 own processes") for n in rep.notes)
    assert len(eager.process_p50_ms) == 2  # every eager process re-created from the same program


def test_a_child_that_cannot_start_is_timed_here_and_nothing_rebuilt_from_an_unchecked_eager_runs_alone(
        tmp_path, monkeypatch):
    import fake_standalone as fs

    def no_process(*a, **kw):
        raise OSError("Resource temporarily unavailable")

    places = {"eager": fair_place.Placement({"recipe": None}, "alone (eager)", needs_eager=True),
              "rebuilt": fair_place.Placement({"recipe": "m:R"}, "alone (rebuilt)", needs_eager=True),
              "standalone": fair_place.Placement({"recipe": "m:S"}, "alone (standalone)")}
    monkeypatch.setattr(fair_place, "ChildTimer", no_process)
    assert fair_place.start_children({"eager": places["eager"]}, tmp_path / "in.pt", tmp_path, threads=1,
                               device="cpu") == {}
    assert places["eager"].kwargs is None and "could not start (Resource temporarily" in places["eager"].why
    timers = {"rebuilt": fs.FakeChild(1e-3, 1e-3), "standalone": fs.FakeChild(1e-3, 1e-3)}
    rebuilt = timers["rebuilt"]
    fallen = fair_place.ready_children(timers, places, "eager", lambda: None, 1e-4)
    assert list(timers) == ["standalone"] and rebuilt.closed
    assert "could not be re-created in a child" in fallen["rebuilt"] and "standalone" not in fallen


def test_outputs_differ_names_shape_value_and_nan_differences(tmp_path):
    ref = (torch.ones(2, 3), {"b": torch.arange(4.0)})
    path = tmp_path / "out.pt"
    torch.save([torch.ones(2, 3), torch.arange(4.0)], path)
    assert fair_place.outputs_differ(path, ref, 1e-4) is None
    torch.save([torch.ones(2, 3), torch.arange(4.0) * 1.01], path)
    assert "output 1 differs" in fair_place.outputs_differ(path, ref, 1e-4)
    torch.save([torch.ones(2, 3)], path)
    assert "shapes" in fair_place.outputs_differ(path, ref, 1e-4)
    torch.save([torch.full((2, 3), float("nan")), torch.arange(4.0)], path)
    assert "output 0 differs" in fair_place.outputs_differ(path, ref, 1e-4)
    assert "could not be read" in fair_place.outputs_differ(tmp_path / "missing.pt", ref, 1e-4)


def test_memory_guard_refuses_more_copies_than_fit():
    from fake_recipes import tiny_model

    assert fair_place.memory_fits(tiny_model(), 1) is None
    why = fair_place.memory_fits(tiny_model(), 10**7)
    assert why is None or ("processes holding a copy of the model" in why and "MiB are available" in why)
    if os.path.exists("/proc/meminfo"):
        assert why is not None


def test_child_timer_again_starts_a_fresh_process_with_the_extra_environment(tmp_path):
    save_inputs([(torch.ones(3),)], tmp_path / "in.pt")
    first = ChildTimer("fake_standalone:env_scale_loader", {"name": "TORCHNITRO_TEST_SCALE"}, tmp_path / "in.pt",
                       threads=1, outputs=tmp_path / "out.pt", env={"OMP_NUM_THREADS": "1"})
    with first:
        first.wait_ready()
        assert torch.load(tmp_path / "out.pt", weights_only=True)[0].tolist() == [0.0, 0.0, 0.0]
        with first.again({"TORCHNITRO_TEST_SCALE": "3"}) as second:
            second.wait_ready()
            assert second.proc.pid != first.proc.pid
            assert second.extra_env == {"OMP_NUM_THREADS": "1", "TORCHNITRO_TEST_SCALE": "3"}
            assert torch.load(tmp_path / "out.pt", weights_only=True)[0].tolist() == [3.0, 3.0, 3.0]


# ---- the allocator knob ----------------------------------------------------------------------------

def test_tune_allocator_keeps_the_setting_only_when_the_fresh_process_with_it_is_faster():
    import fake_standalone as fs

    from torchnitro.bench.environment import ALLOCATOR_SETTING

    helped = fs.FakeChild(2e-3, 1e-3)
    trial = fair.tune_allocator(helped, _FAST)
    assert trial.keep and trial.ratio == pytest.approx(2.0) and trial.default_ms == pytest.approx(2.0)
    assert helped.spawned[0].env == ALLOCATOR_SETTING and helped.spawned[0].closed and not helped.closed
    assert "kept in the artifact" in trial.text() and "MALLOC_TRIM_THRESHOLD_=536870912" in trial.text()
    same = fair.tune_allocator(fs.FakeChild(2e-3, 2e-3), _FAST)
    assert not same.keep and same.ratio == pytest.approx(1.0) and "not kept" in same.text()
    slightly = fair.tune_allocator(fs.FakeChild(2e-3, 1.98e-3), _FAST)  # 1%: below MIN_ALLOCATOR_GAIN
    assert not slightly.keep


def test_under_the_setting_the_trial_starts_glibcs_defaults_and_keeps_the_setting_unless_they_win():
    """Every timing process runs under the setting (bench.environment.timing_process_env): the trial is the same
    variant with glibc's defaults, and the artifact keeps the setting the comparison's numbers were taken under
    unless the defaults were faster beyond the noise."""
    import fake_standalone as fs

    from torchnitro.bench.environment import ALLOCATOR_SETTING, GLIBC_DEFAULTS

    faulting = fs.FakeChild(1e-3, 2e-3, env=dict(ALLOCATOR_SETTING))  # with glibc's defaults: 2 ms
    trial = fair.tune_allocator(faulting, _FAST)
    assert faulting.spawned[0].env == GLIBC_DEFAULTS and faulting.spawned[0].closed
    assert trial.compared_under and trial.keep
    assert trial.default_ms == pytest.approx(2.0) and trial.tuned_ms == pytest.approx(1.0)
    assert "timed every process under it; kept in the artifact" in trial.text()
    assert fair.tune_allocator(fs.FakeChild(2e-3, 2e-3, env=dict(ALLOCATOR_SETTING)), _FAST).keep  # a tie keeps it
    lost = fair.tune_allocator(fs.FakeChild(2e-3, 1e-3, env=dict(ALLOCATOR_SETTING)), _FAST)
    assert not lost.keep and "glibc's defaults were faster beyond the noise: not kept" in lost.text()
    both = fair.tune_allocator({"the chosen variant": fs.FakeChild(1e-3, 1e-3, env=dict(ALLOCATOR_SETTING)),
                                "eager": fs.FakeChild(4e-3, 6e-3, env=dict(ALLOCATOR_SETTING))}, _FAST)
    assert set(both) == {"the chosen variant", "eager"}
    assert both["eager"].default_ms == pytest.approx(6.0) and both["eager"].label == "eager"


def _no_malloc_env(monkeypatch) -> None:
    """MALLOC_* absent now and after the test, whatever the code under test puts into os.environ."""
    for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.setenv(k, "0")  # recorded as absent before: restored as absent
        monkeypatch.delenv(k)


def _kept_trial(timers, tc, started=None):
    return {name: fair.AllocatorTrial(2.0, 1.0, 2.0, 0.01, True, label=name) for name in timers}


@pytest.mark.parametrize("min_speedup, chosen", [(1.03, "test-faster"), (1e6, "eager")])
def test_kept_allocator_setting_goes_into_the_artifact_and_load_and_serve_apply_it(faster, fast_cfg, monkeypatch,
                                                                                   tmp_path, min_speedup, chosen):
    import torchnitro.bench.environment as env_mod
    from torchnitro.autotune.artifact import read_manifest

    _no_malloc_env(monkeypatch)
    monkeypatch.setattr(fair, "tune_allocator", _kept_trial)
    opt = torchnitro.optimize(faster.SlowModel(), faster.tiny_inputs(), fast_cfg(
        recipes=["test-faster"], final_alone=True, tune_allocator=True, min_speedup=min_speedup))
    assert opt.recipe == chosen
    assert any(n.startswith("allocator setting MALLOC_MMAP_THRESHOLD_") for n in opt.report.notes)
    against = [n for n in opt.report.notes if "against eager with glibc's defaults" in n]
    assert len(against) == (chosen != "eager"), opt.report.notes  # eager's own trial, beside the chosen one's
    assert opt.candidate.meta["environment"] == env_mod.ALLOCATOR_SETTING
    opt.save(tmp_path / "art")
    meta = read_manifest(tmp_path / "art")["meta"]
    assert meta["environment"] == env_mod.ALLOCATOR_SETTING and meta["environment_gain"]["ratio"] == 2.0

    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(env_mod, "_mallopt", lambda param, value: calls.append((param, value)) or True)
    torchnitro.load(tmp_path / "art", model=faster.SlowModel(), trust_code=True, allocator=False)
    assert calls == [] and "MALLOC_MMAP_THRESHOLD_" not in os.environ
    torchnitro.load(tmp_path / "art", model=faster.SlowModel(), trust_code=True)
    assert sorted(calls) == [(-3, 268435456), (-1, 536870912)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert not any(k in os.environ for k in env_mod.ALLOCATOR_SETTING)  # load changes this process only


def test_serve_sets_the_artifacts_allocator_setting_before_any_worker_starts(tmp_path, monkeypatch):
    import typer
    from typer.testing import CliRunner

    import torchnitro.bench.environment as env_mod
    import torchnitro.serve.cli as serve_cli
    from torchnitro.autotune.artifact import EagerSource, write_artifact
    from torchnitro.autotune.recipe import CandidateFiles
    from torchnitro.autotune.report import Report

    _no_malloc_env(monkeypatch)
    monkeypatch.setattr(env_mod, "_mallopt", lambda param, value: True)
    cand = tmp_path / "cand"
    cand.mkdir()
    (cand / "model.onnx").write_bytes(b"not really onnx")
    write_artifact(tmp_path / "art", CandidateFiles(cand, ["model.onnx"], {"environment": env_mod.ALLOCATOR_SETTING},
                                                    True), EagerSource(), recipe="onnxruntime", numeric_class="exact",
                   signature={}, report=Report(model="m", inputs="x", objective="o", hardware="h"), hardware="h")
    seen: list[dict[str, str]] = []
    monkeypatch.setattr(serve_cli, "_start_server", lambda *a, **k: seen.append(
        {k: os.environ.get(k, "") for k in env_mod.ALLOCATOR_SETTING}))
    app = typer.Typer()
    serve_cli.register(app)
    app.command("noop")(lambda: None)  # a second command: typer keeps 'serve' as a subcommand
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "art")])
    assert result.exit_code == 0, result.output
    assert seen == [env_mod.ALLOCATOR_SETTING]


def test_apply_allocator_sets_glibc_thresholds_in_a_running_process(tmp_path):
    """In a fresh interpreter: a 64 MiB block is mmapped under glibc's defaults (threshold 128 KiB), still after
    applying nothing (the control), and comes from the heap once apply_allocator set the 256 MiB threshold with
    mallopt (mallinfo2's hblks counts the mmapped blocks in use: one more while the block is held, or none)."""
    import platform
    import subprocess
    import sys

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("the MALLOC_* thresholds are glibc's; this C library is not glibc")
    code = """
import ctypes, json, sys
from torchnitro.bench.environment import ALLOCATOR_SETTING, apply_allocator
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.mallinfo2.restype = Info
def mmapped():
    n0 = libc.mallinfo2().hblks
    p = libc.malloc(64 << 20)
    n = libc.mallinfo2().hblks - n0
    libc.free(ctypes.c_void_p(p))
    return n
out = {"before": mmapped()}
out["applied off"] = apply_allocator({})
out["off"] = mmapped()
out["applied on"] = apply_allocator(ALLOCATOR_SETTING)
out["on"] = mmapped()
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["before"] == out["off"] == 1 and out["applied off"] == {}  # the control: still mmapped without it
    assert out["on"] == 0
    assert out["applied on"] == {"MALLOC_MMAP_THRESHOLD_": "268435456", "MALLOC_TRIM_THRESHOLD_": "536870912"}


def test_apply_allocator_refuses_unknown_variables_and_keeps_the_users_own(monkeypatch):
    import torchnitro.bench.environment as env_mod

    monkeypatch.setattr(env_mod, "_mallopt", lambda param, value: True)
    with pytest.raises(InputError, match="MALLOC_BOGUS"):
        env_mod.apply_allocator({"MALLOC_BOGUS": "1"})
    with pytest.raises(InputError, match="non-negative integer"):
        env_mod.apply_allocator({"MALLOC_TRIM_THRESHOLD_": "-5"})
    _no_malloc_env(monkeypatch)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1000")
    assert env_mod.apply_allocator(env_mod.ALLOCATOR_SETTING) == {"MALLOC_MMAP_THRESHOLD_": "268435456"}
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "1000"
    assert "already set" in env_mod.allocator_untunable()


def test_a_program_that_is_not_eagers_speed_leaves_eager_in_this_process(faster, fast_cfg):
    """SlowModel sleeps 30 ms in Python: its torch.export program does not, so timing it as 'eager alone'
    would make every candidate look 1000x slower than it is. The solo check against eager's search-time p50
    catches it and eager is timed here, its row saying why."""
    import fake_standalone as fs

    class ScriptModel(fs.CountingSlowModel):
        pass

    ScriptModel.__module__ = "__main__"
    # an in-process candidate: rebuilt from the model object, it stays here too, so no process of its own starts
    opt = torchnitro.optimize(ScriptModel(), faster.tiny_inputs(),
                              fast_cfg(recipes=["test-faster"], final_alone=True, min_speedup=0.5))
    eager = opt.report.get("eager")
    assert not eager.alone and eager.interleaved
    assert "torch.export program alone" in eager.notes and "not eager's speed" in eager.notes, eager.notes
