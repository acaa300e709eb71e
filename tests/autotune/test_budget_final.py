"""The budget covers the whole search, the final phase included (``autotune.final_budget``): the final phase's share is
reserved before the candidates, its steps shrink or are skipped with notes naming the budget, and a real search ends
within its budget plus one candidate's limit."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

import torchnitro
from torchnitro.autotune import fair, final_trials
from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.final_budget import MAX_SHARE, FinalBudget, final_deadline, fit_pool, plan_final
from torchnitro.autotune.report import CandidateResult, Status
from torchnitro.bench.environment import ALLOCATOR_SETTING

from test_final_env import _FakeTimer, _report, _trial_search


def _at(left_s: float, **kw) -> FinalBudget:
    """A budget whose frozen clock has ``left_s`` seconds to its deadline."""
    return FinalBudget(100.0 + left_s, lambda: 100.0, **kw)


def test_plan_counts_processes_comparison_and_trials_and_the_deadline_never_passes_budget_plus_one_limit():
    cfg = OptimizeConfig(finalists=3, eager_processes=1, final_min_time_s=1.0)
    plan = plan_final(cfg, "cpu", threads=4, startup_s=4.0, overhead=3.0)
    assert plan.processes == 4 and plan.starts_s == 16.0  # 3 finalists + eager, each in its own process
    assert plan.comparison_s == pytest.approx(3.0 * (0.5 + 0.5 + 3 + 1))  # eager alone (half) before and after
    assert plan.trials_s == pytest.approx(2 * 4.0 + 3.0 * 4 + 2 * 4.0 + 3.0 * 3)  # allocator, then 2 thread counts
    here = plan_final(OptimizeConfig(final_alone=False, tune_allocator=False), "cpu", threads=1)
    assert here.processes == 0 and here.trials_s == 0.0
    # the final phase ends by the budget, or its reserve after a late candidate, never past budget + one limit
    assert final_deadline(0.0, 30.0, budget_s=60.0, reserve_s=20.0, limit_s=120.0) == 60.0
    assert final_deadline(0.0, 55.0, budget_s=60.0, reserve_s=20.0, limit_s=120.0) == 75.0
    assert final_deadline(0.0, 170.0, budget_s=60.0, reserve_s=20.0, limit_s=120.0) == 180.0
    assert MAX_SHARE <= 0.5


def test_fit_shrinks_the_comparisons_measured_time_and_rounds_before_anything_is_dropped():
    from torchnitro.bench.timing import TimingConfig

    tc = TimingConfig(min_iters=10, min_time_s=1.0, max_time_s=5.0)
    same, note = _at(100.0, overhead=2.0).fit(tc, 4, 1.0)
    assert same is tc and note is None
    short, note = _at(4.0, overhead=2.0).fit(tc, 4, 1.0)
    assert short.min_time_s == pytest.approx(0.5) and short.min_iters == 5 and short.max_time_s == pytest.approx(1.5)
    assert note.startswith("shortened for the budget: 0.50 s measured per entry instead of 1.00 s (4 s left")
    assert _at(4.0).skip_reason("allocator trial", 20.0) == "allocator trial skipped: budget (4 s left, needs ~20 s)"
    assert _at(4.0).skip_reason("allocator trial", 3.0) is None


def _pool_search(left_s: float, own: tuple[str, ...] = (), startup_s: float = 4.0, **cfg) -> SimpleNamespace:
    """``own``: candidates with their own runtime and a standalone artifact (timed alone wherever the rest is)."""
    from torchnitro.autotune.recipe import CandidateFiles

    return SimpleNamespace(cfg=OptimizeConfig(**cfg), device=SimpleNamespace(type="cpu"),
                           where={n: CandidateFiles(None, [], {}, True) for n in own},
                           final_budget=_at(left_s, startup_s=startup_s, overhead=3.0))


def test_short_budget_skips_the_screen_eagers_further_processes_and_the_processes_then_drops_the_last_finalists():
    """10 s left, 5 s a process start-up: in-process finalists and eager move here; of the two own-runtime
    finalists, the second does not fit with its process and is dropped."""
    s = _pool_search(10.0, ("onnxruntime", "openvino"), startup_s=5.0, finalists=2, eager_processes=3,
                     final_min_time_s=1.0)
    report = _report()
    pool = [CandidateResult(n, "exact", Status.VERIFIED) for n in ("onnxruntime", "openvino", "torchscript", "bf16")]
    kept = fit_pool(s, report, pool)
    assert [c.recipe for c in kept] == ["onnxruntime"]
    assert any(n.startswith("screen of 4 candidates skipped: budget (10 s left, needs ~") for n in report.notes)
    assert any(n.startswith("eager's 2 further timing process(es) skipped: budget (10 s left, needs ~26 s)") and
               n.endswith("eager is timed in one process") for n in report.notes), report.notes
    assert any(n.startswith("timing processes for eager and the finalists skipped: budget (10 s left, needs ~16 s); "
                            "eager and in-process finalists are timed in this process") for n in report.notes)
    assert s.cfg.eager_processes == 1 and s.cfg.final_alone is False  # what fair_place.plan then reads
    assert s.final_budget.moved_here  # and the rows say why (below)
    assert "not compared with eager: final comparison of 2 finalist(s) skipped: budget (10 s left, needs ~11 s)" \
        in pool[1].notes and "search-time estimate" in pool[1].notes
    assert not pool[2].notes  # cut by the skipped screen, not compared either way


def test_a_row_timed_here_for_the_budget_says_so_not_that_the_user_turned_final_alone_off():
    from torchnitro.autotune import fair_place
    from torchnitro.autotune.fair import ChildModel
    from torchnitro.autotune.recipe import get_recipe

    rules = fair_place.PlaceRules(ChildModel(None, ""), "cpu", all_alone=False)
    moved = fair_place.place(get_recipe("eager"), None, dataclasses.replace(rules, budget_here=True))
    assert moved.kwargs is None and moved.why == ("timed in this process (the budget left no time for a timing "
                                                  "process of its own: see the notes)")
    assert "final_alone=False" in fair_place.place(get_recipe("eager"), None, rules).why


def test_no_room_for_any_finalist_keeps_eager_and_says_so_and_enough_room_keeps_everything():
    report = _report()
    pool = [CandidateResult("onnxruntime", "exact", Status.VERIFIED)]
    assert fit_pool(_pool_search(3.0, ("onnxruntime",), finalists=1), report, pool) == []
    assert any("eager kept" in n and "budget (3 s left" in n for n in report.notes), report.notes
    here = _report()  # no room for a process: the in-process finalist is compared here, the own-runtime one dropped
    pool = [CandidateResult(n, "exact", Status.VERIFIED) for n in ("onnxruntime", "torchscript")]
    assert fit_pool(_pool_search(3.0, ("onnxruntime",), finalists=2), here, pool) == [pool[1]]
    assert "not compared with eager: final comparison of 2 finalist(s) skipped: budget (3 s left" in pool[0].notes
    roomy = _report()
    pool = [CandidateResult(n, "exact", Status.VERIFIED) for n in ("onnxruntime", "openvino", "torchscript")]
    s = _pool_search(1000.0, ("onnxruntime",), finalists=2, eager_processes=3)
    assert fit_pool(s, roomy, pool) == pool
    assert roomy.notes == [] and s.cfg.eager_processes == 3 and s.cfg.final_alone


def test_trials_that_do_not_fit_are_skipped_with_budget_notes_and_start_no_process(tmp_path, monkeypatch):
    """12 s left, a process start-up of 8 s: neither trial fits. Nothing starts; the artifact keeps the allocator
    setting its comparison process ran under and the comparison's thread count."""
    monkeypatch.setattr("torchnitro.bench.environment.allocator_untunable", lambda *a, **k: None)
    log: list[str] = []
    v, e = _FakeTimer("v", log), _FakeTimer("eager", log)
    s = _trial_search(tmp_path)
    s.cfg.final_min_time_s = 1.0
    s.final_budget = _at(12.0, startup_s=8.0, overhead=3.0)
    report, phases = _report(), final_trials.Phases()
    final_trials.run_trials(s, report, "v", {"v": fair.Steady(v), "eager": fair.Steady(e)}, phases)
    assert not [x for x in log if x.startswith(("start ", "sample "))], log
    assert "allocator trial skipped: budget (12 s left, needs ~" in report.notes[0]
    assert report.notes[0].endswith("the artifact keeps the allocator setting the comparison ran it under "
                                    "(glibc's defaults untried)")
    assert report.notes[1].startswith("thread trial skipped: budget (12 s left, needs ~")
    assert report.notes[1].endswith("the artifact keeps the comparison's 2 thread(s)")
    assert s.where["v"].meta["environment"] == dict(ALLOCATOR_SETTING)
    assert "threads_trial" not in s.where["v"].meta and s.where["v"].meta["threads"] == 2
    assert phases.seconds == {}


def test_the_allocator_trial_runs_when_it_fits_and_the_thread_trial_is_skipped_when_only_one_fits(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setattr("torchnitro.bench.environment.allocator_untunable", lambda *a, **k: None)
    log: list[str] = []
    v, e = _FakeTimer("v", log), _FakeTimer("eager", log)
    s = _trial_search(tmp_path)
    s.cfg.final_min_time_s = 0.01
    s.final_budget = _at(10.0, startup_s=4.0, overhead=3.0)  # allocator: 2 starts ~8 s fits; + thread trial does not
    report = _report()
    final_trials.run_trials(s, report, "v", {"v": fair.Steady(v), "eager": fair.Steady(e)}, final_trials.Phases())
    assert sorted(x for x in log if x.startswith("start ")) == ["start eager/defaults", "start v/defaults"], log
    assert any(n.startswith("thread trial skipped: budget (10 s left") for n in report.notes), report.notes
    assert any(n.startswith("allocator setting MALLOC_") for n in report.notes), report.notes


def test_a_late_final_phase_shortens_the_comparison_and_skips_the_redo_with_notes(fake_recipes, fast_cfg,
                                                                                 monkeypatch):
    """Budget 20 s, 10 s kept for the final phase; the candidate runs into the reserve (fake clock: it ends at
    21 s), so the final phase has until budget + its 3 s limit = 23 s: 2 s for 2 x 1 s measured at ~3x overhead.
    The comparison is shortened, not skipped, and after it (clock past the deadline) the redo is skipped."""
    import torchnitro.autotune.final as final_mod
    import torchnitro.autotune.search as search_mod
    from torchnitro.bench.timing import Timing

    now = [0.0]
    monkeypatch.setattr(search_mod, "_clock", lambda: now[0])
    real_one = search_mod._Search.run_one

    def run_one(self, r, limit_s, remaining_s=math.inf):
        res = real_one(self, r, limit_s, remaining_s)
        now[0] += {"eager": 2.0, "test-faster": 19.0}[r.name]
        return res

    monkeypatch.setattr(search_mod._Search, "run_one", run_one)
    real_cmp, tcs = final_mod._compare_finalists, []

    def disturbed(s, report, fns, tc):  # eager 20x slower inside the comparison: a redo would be wanted
        res = real_cmp(s, report, fns, tc)
        tcs.append(tc)
        now[0] += 5.0  # the comparison took the time that was left
        e = res["eager"]
        res["eager"] = Timing([x * 20 for x in e.samples], e.calls_per_sample, e.items_per_call)
        return res

    monkeypatch.setattr(final_mod, "_compare_finalists", disturbed)
    cfg = fast_cfg(recipes=["test-faster"], budget_s=20.0, candidate_timeout_s=3.0, final_min_time_s=1.0,
                   final_min_iters=10)
    rep = torchnitro.optimize(fake_recipes.SlowModel(), fake_recipes.tiny_inputs(), cfg).report
    assert rep.get("test-faster").interleaved  # compared, not dropped
    assert len(tcs) == 1 and tcs[0].min_time_s == pytest.approx(2.0 / (3.0 * 2)) and tcs[0].min_iters == 5
    assert any(n.startswith("final comparison shortened for the budget: 0.33 s measured per entry instead of 1.00 s "
                            "(2 s left") for n in rep.notes), rep.notes
    assert any("final comparison redo skipped: budget (0 s left" in n and "carry that error" in n
               for n in rep.notes), rep.notes
    assert not any(n.startswith("final comparison redone") for n in rep.notes)
    assert any(n.startswith("budget: 20 s for the whole search; the final phase was planned at ~") for n in rep.notes)


def test_a_real_small_search_ends_within_its_budget_plus_one_candidate_limit(tmp_path):
    """Real processes: the finalists and eager (3 processes) timed alone, both trials on. Before the final phase had a
    budget this configuration spent ~1 min after the candidates; the design bounds the search by budget + one limit
    (the margin covers the mandatory start-ups running slower than estimated on a loaded machine). The limit is
    short (8 s, was 15 s): a candidate that runs into the final phase's reserve ends it at most that much later,
    and an onnxruntime build that outlasts it times out, which bounds this test's own time too."""
    budget, limit = 10.0, 8.0
    cfg = OptimizeConfig(budget_s=budget, candidate_timeout_s=limit, recipes=["torchscript", "onnxruntime"],
                         eager_processes=3, threads=2, min_speedup=0.5, progress=False, cache=False,
                         cache_dir=str(tmp_path / "cache"), timing_min_time_s=0.05)
    rep = torchnitro.optimize("mlp", config=cfg).report
    # generous margin (the old code took ~104 s here): the bound, not a speed, is what is tested
    assert rep.search_s < budget + limit + 20.0, [n for n in rep.notes if n.startswith(("final phase", "budget"))]
    assert any(n.startswith("budget: 10 s for the whole search") for n in rep.notes)
