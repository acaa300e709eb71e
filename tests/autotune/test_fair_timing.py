"""The final comparison times each variant as it will run: own-runtime candidates alone in their own process,
eager checked against eager alone, ORT pools quiet wherever other work is timed."""

from __future__ import annotations

import os

import pytest
import torch

import torchnitro
from torchnitro.autotune import fair
from torchnitro.autotune.recipe import register_recipe, unregister_recipe
from torchnitro.bench.environment import describe_environment, timing_environment
from torchnitro.bench.isolated import ChildTimer, process_is_shared, save_inputs, shared_process
from torchnitro.bench.timing import Timing, TimingConfig, compare
from torchnitro.errors import InputError, RecipeError

_FAST = TimingConfig(warmup=1, warmup_s=0.0, min_iters=4, min_time_s=0.0, max_time_s=5.0, min_sample_s=1e-4)


@pytest.fixture
def busy_recipe():
    import fake_standalone as fs

    register_recipe(fs.BusyRuntime)
    fs.LOADS.clear()
    yield fs
    unregister_recipe(fs.BusyRuntime.name)


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
    with ChildTimer("fake_standalone:identity_loader", {"scale": 2.0}, tmp_path / "in.pt", threads=1,
                    settle_s=0.0) as timer:
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


def test_disturbed_eager_in_the_comparison_is_redone_and_reported(fake_recipes, fast_cfg, monkeypatch):
    import torchnitro.autotune.search as search_mod

    fr = fake_recipes
    real, calls = search_mod._compare_finalists, []

    def disturbed_once(s, report, fns, tc):
        res = real(s, report, fns, tc)
        calls.append(1)
        if len(calls) == 1:  # eager 20x slower, as after a spinning runtime's call
            e = res["eager"]
            res["eager"] = Timing([x * 20 for x in e.samples], e.calls_per_sample, e.items_per_call)
        return res

    monkeypatch.setattr(search_mod, "_compare_finalists", disturbed_once)
    monkeypatch.setattr(fair, "SETTLE_S", 0.0)
    opt = torchnitro.optimize(fr.SlowModel(), fr.tiny_inputs(), fast_cfg(recipes=["test-faster"]))
    rep = opt.report
    assert len(calls) == 2
    assert any(n.startswith("final comparison redone") for n in rep.notes)
    assert rep.get("eager").redone and rep.get("test-faster").redone
    assert any("eager p50 alone" in n and "inside the comparison" in n for n in rep.notes)


def test_undisturbed_comparison_is_not_redone(fake_recipes, fast_cfg, monkeypatch):
    import torchnitro.autotune.search as search_mod

    fr = fake_recipes
    calls: list[int] = []

    def matches_alone(s, report, fns, tc):  # eager inside == eager alone exactly
        calls.append(1)
        alone = s.p50.get("eager") or 30.0
        return {n: Timing([alone / 1e3] * 4) if n == "eager" else Timing([alone / 3e3] * 4) for n in fns}

    monkeypatch.setattr(search_mod, "_compare_finalists", matches_alone)
    opt = torchnitro.optimize(fr.SlowModel(), fr.tiny_inputs(), fast_cfg(recipes=["test-faster"]))
    assert len(calls) == 1
    assert not opt.report.get("eager").redone
    assert not any(n.startswith("final comparison redone") for n in opt.report.notes)


# ---- own-runtime candidates never load in the search process --------------------------------------

def test_own_runtime_candidate_is_timed_alone_and_never_loaded_here(busy_recipe, fast_cfg):
    """With the old comparison, load() ran here: its busy pool stole the core from eager timed after it.

    A second candidate's timing process dies mid-comparison: only that candidate fails."""
    from fake_recipes import tiny_inputs, tiny_model

    fs = busy_recipe
    register_recipe(fs.DiesWhileTimed)
    try:  # min_speedup 100: eager is handed back, so nothing of the candidates is needed in this process
        opt = torchnitro.optimize(tiny_model(), tiny_inputs(), fast_cfg(
            recipes=[fs.BusyRuntime.name, fs.DiesWhileTimed.name], min_speedup=100.0))
    finally:
        unregister_recipe(fs.DiesWhileTimed.name)
    c = opt.report.get(fs.BusyRuntime.name)
    assert opt.recipe == "eager" and c.status == "verified" and c.interleaved and c.alone
    assert not opt.report.get("eager").alone and opt.report.get("eager").interleaved
    assert os.getpid() not in fs.LOADS and fs.busy_threads() == []
    assert any("each alone in its own process" in n for n in opt.report.notes)
    dead = opt.report.get(fs.DiesWhileTimed.name)
    assert dead.status == "failed" and dead.reason.startswith("timing it alone failed: the timing process")


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
