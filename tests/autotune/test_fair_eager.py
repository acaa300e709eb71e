"""Eager's baseline from several fresh processes in the final comparison (``OptimizeConfig.eager_processes``):
K eager timing processes, every one in every round; eager's p50 for every speedup is the median of theirs."""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import pytest
import torch

import torchnitro
from torchnitro.autotune import fair_eager, fair_place
from fake_recipes import eager_and_cand_report

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.fair_eager import EagerBaseline
from torchnitro.autotune.report import Status
from torchnitro.bench.isolated import ChildTimer
from torchnitro.bench.ratio import paired_ratio
from torchnitro.bench.timing import Timing, TimingConfig
from torchnitro.errors import ConfigError, InputError, RecipeError


def _drift(n: int = 30, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [1e-3 * rng.uniform(0.75, 1.25) for _ in range(n)]  # load that changes between rounds, alike for all


# ---- the baseline's statistics and its bootstrap ----------------------------------------------------

def test_baseline_is_the_median_of_the_per_process_p50s_and_the_bootstrap_keeps_rounds_paired():
    drift = _drift()
    procs = [Timing([x * f for x in drift]) for f in (1.1, 1.3, 1.2)]  # three per-process modes
    cand = Timing(drift)
    base = EagerBaseline(tuple(procs))
    assert base.median == pytest.approx(statistics.median(p.median for p in procs))
    assert base.p50s_ms() == pytest.approx([p.median * 1e3 for p in procs])
    est = base.ratio(cand)
    assert est.ratio == pytest.approx(1.2)
    skewed = EagerBaseline(tuple(procs[:2] + [Timing([x * 2.0 for x in drift])]))  # 1.1 / 1.3 / 2.0: mean 1.47
    assert skewed.ratio(cand).ratio == pytest.approx(1.3)  # the median process's ratio
    # rounds drawn whole: the 25% drift hits every process and the candidate alike, so the interval is tight
    assert est.noise < 0.01 and est.beats_noise and est.rounds == 30
    shuffled = Timing(random.Random(1).sample(drift, len(drift)))  # the same samples, pairing broken
    assert base.ratio(shuffled).noise > 10 * est.noise
    assert base.stat(99.0) == pytest.approx(statistics.median(p.p99 for p in procs))


def test_one_process_is_the_old_paired_ratio_exactly():
    drift = _drift()
    eager, cand = Timing([x * 1.07 for x in drift]), Timing(drift)
    assert EagerBaseline((eager,)).ratio(cand) == paired_ratio(eager, cand)
    assert EagerBaseline((eager,)).ratio(cand, 99.0) == paired_ratio(eager, cand, 99.0)


def test_baseline_refuses_unpaired_samples_and_a_result_without_eager():
    with pytest.raises(InputError, match=r"\[3, 4\] eager and 3 candidate"):
        EagerBaseline((Timing([1.0] * 3), Timing([1.0] * 4))).ratio(Timing([1.0] * 3))
    with pytest.raises(InputError, match="no eager entry"):
        EagerBaseline.of({"cand": Timing([1.0])})


def test_process_names_and_which_entries_are_eager():
    assert fair_eager.process_names(3) == ["eager", "eager-2", "eager-3"]
    assert fair_eager.process_names(1) == ["eager"]
    assert fair_eager.is_eager("eager") and fair_eager.is_eager("eager-2") and fair_eager.is_copy("eager-12")
    assert not fair_eager.is_copy("eager") and not fair_eager.is_eager("eager-bf16") and not fair_eager.is_eager("x-2")
    with pytest.raises(InputError, match="received 0"):
        fair_eager.process_names(0)


def test_config_field_is_checked():
    assert OptimizeConfig().eager_processes == 1
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError, match="eager_processes"):
            OptimizeConfig(eager_processes=bad)
    assert OptimizeConfig(eager_processes=1).cache_key_fields()["eager_processes"] == 1


# ---- pick_winner with several eager processes -------------------------------------------------------



def test_pick_winner_divides_the_median_eager_process_and_fills_eagers_row():
    from torchnitro.autotune.final import pick_winner

    drift = _drift()
    res = {"eager": Timing([x * 1.0 for x in drift]), "eager-2": Timing([x * 1.5 for x in drift]),
           "eager-3": Timing([x * 1.2 for x in drift]), "cand": Timing(drift)}
    rep = eager_and_cand_report()
    assert pick_winner(res, rep, OptimizeConfig()) == "cand"  # 1.2x by the median; 1.0x by eager's first process
    e, c = rep.get("eager"), rep.get("cand")
    assert c.speedup == pytest.approx(1.2) and c.noise < 0.01
    assert e.p50_ms == pytest.approx(res["eager-3"].median * 1e3) and e.speedup == 1.0 and e.interleaved
    assert e.process_p50_ms == pytest.approx([res[n].median * 1e3 for n in ("eager", "eager-2", "eager-3")])
    one = {"eager": res["eager"], "cand": res["cand"]}
    rep1 = eager_and_cand_report()
    assert pick_winner(one, rep1, OptimizeConfig()) is None  # one process: the old result (1.0x: eager)
    assert rep1.get("eager").p50_ms == pytest.approx(res["eager"].median * 1e3)
    assert rep1.get("cand").speedup == pytest.approx(paired_ratio(res["eager"], res["cand"]).ratio)


# ---- a dead eager process, a failed copy ------------------------------------------------------------

class _Fake:
    """A timing process that takes ``seconds`` per call and dies after ``lives`` samples."""

    times_itself = True

    def __init__(self, seconds: float, lives: int | None = None):
        self.seconds, self.lives, self.failed, self.calls = seconds, lives, None, 0

    def __call__(self, k: int) -> float:
        self.calls += 1
        if self.lives is not None and self.calls > self.lives:
            self.failed = "the timing process exited"
            raise RecipeError(self.failed)
        return self.seconds


def test_a_dead_eager_process_is_dropped_and_another_takes_eagers_name():
    from torchnitro.autotune import final

    rep = eager_and_cand_report()
    fns = {"eager": _Fake(1e-3, lives=2), "eager-2": _Fake(3e-3), "eager-3": _Fake(2e-3), "cand": _Fake(1e-3)}
    s = SimpleNamespace(wl=SimpleNamespace(items_per_call=1))
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=4, min_time_s=0.0, max_time_s=5.0, min_sample_s=1e-4)
    res = final._compare_finalists(s, rep, fns, tc)
    assert sorted(res) == ["cand", "eager", "eager-2"] and res["eager"].median == pytest.approx(2e-3)  # eager-3's
    assert EagerBaseline.of(res).median == pytest.approx(2.5e-3)  # two processes: the mean of the two
    assert "eager's timing process eager died mid-comparison" in rep.get("eager").notes
    assert "eager goes on in 2 process(es)" in rep.get("eager").notes
    assert rep.get("cand").status == Status.VERIFIED


def test_a_copy_whose_outputs_differ_is_dropped_alone_and_all_go_when_eagers_own_fails(tmp_path):
    import fake_standalone as fs

    ref = torch.ones(2, 3)

    def places(bad: str | None) -> dict[str, fair_place.Placement]:
        out = {}
        for n in ("eager", "eager-2", "eager-3", "cand"):
            p = fair_place.Placement({"recipe": None if n != "cand" else "m:C"}, "alone", needs_eager=True)
            if n != "cand":
                p.outputs = tmp_path / f"{n}.pt"
                torch.save([ref * (2.0 if n == bad else 1.0)], p.outputs)
            out[n] = p
        return out

    timers = {n: fs.FakeChild(1e-3, 1e-3) for n in ("eager", "eager-2", "eager-3", "cand")}
    calls: list[int] = []
    fallen = fair_place.ready_children(timers, places("eager-2"), "eager", lambda: calls.append(1) or ref, 1e-4)
    assert list(timers) == ["eager", "eager-3", "cand"] and calls == [1]  # this process's eager ran once
    assert fallen["eager-2"].startswith("eager's timing process eager-2 was dropped: its output 0 differs")
    timers = {n: fs.FakeChild(1e-3, 1e-3) for n in ("eager", "eager-2", "eager-3", "cand")}
    fallen = fair_place.ready_children(timers, places("eager"), "eager", lambda: ref, 1e-4)
    assert timers == {} and set(fallen) == {"eager", "eager-2", "eager-3", "cand"}
    assert "eager itself is timed in this process" in fallen["eager-3"]


# ---- the optimizer's comparison: processes started, the median reported ----------------------------

def _recorded(monkeypatch, seconds: dict[str, list[float]]) -> list[ChildTimer]:
    """Every ChildTimer the comparison starts; its samples are injected: eager's processes take
    ``seconds['eager']`` per call in the order they start, other variants ``seconds['other'][0]``."""
    started: list[ChildTimer] = []
    eager_s = iter(seconds["eager"])

    class Recorded(ChildTimer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.eager = self.spec["kwargs"].get("recipe", "") is None
            self.fixed = next(eager_s) if self.eager else seconds["other"][0]
            started.append(self)

        def sample(self, k: int, warm: int = 0) -> float:
            self.wait_ready()
            return self.fixed

    monkeypatch.setattr(fair_place, "ChildTimer", Recorded)
    return started


def test_three_eager_processes_are_started_and_every_speedup_uses_the_median_of_their_p50s(
        fake_recipes, fast_cfg, monkeypatch):
    import fake_standalone as fs

    started = _recorded(monkeypatch, {"eager": [10e-3, 30e-3, 20e-3], "other": [5e-3]})
    opt = torchnitro.optimize(fs.CountingSlowModel(), fake_recipes.tiny_inputs(),
                              fast_cfg(recipes=["test-faster"], final_alone=True, eager_processes=3))
    rep = opt.report
    assert sum(t.eager for t in started) == 3 and len(started) == 4  # eager x3 and the candidate
    e, c = rep.get("eager"), rep.get("test-faster")
    assert e.alone and c.alone and e.interleaved
    assert e.process_p50_ms == pytest.approx([10.0, 30.0, 20.0]) and e.p50_ms == pytest.approx(20.0)
    assert c.speedup == pytest.approx(4.0) and opt.recipe == "test-faster"  # 20 / 5, not 10 / 5
    line = [n for n in rep.notes if n.startswith("eager in the final comparison:")]
    assert len(line) == 1 and "3 fresh processes, p50 10.000 / 30.000 / 20.000 ms" in line[0]  # one line, each listed
    assert "their median, 20.000 ms" in line[0]
    check = [n for n in rep.notes if n.startswith("eager p50 alone")]
    assert len(check) == 1 and "median of its 3 own processes' p50s" in check[0], rep.notes
    assert "inside the comparison (median of the same 3 processes' p50s: 10.000 / 30.000 / 20.000 ms) 20.000" \
        in check[0] and "+0.0%" in check[0]
    assert "in 3 fresh processes (eager_processes=3)" in e.notes
    assert not any(n.startswith("final comparison redone") for n in rep.notes)


def test_one_eager_process_reproduces_the_single_process_comparison(fake_recipes, fast_cfg, monkeypatch):
    import fake_standalone as fs

    started = _recorded(monkeypatch, {"eager": [10e-3], "other": [5e-3]})
    opt = torchnitro.optimize(fs.CountingSlowModel(), fake_recipes.tiny_inputs(),
                              fast_cfg(recipes=["test-faster"], final_alone=True, eager_processes=1))
    rep = opt.report
    assert sum(t.eager for t in started) == 1 and len(started) == 2
    e, c = rep.get("eager"), rep.get("test-faster")
    assert e.p50_ms == pytest.approx(10.0) and e.process_p50_ms == pytest.approx([10.0])
    assert c.speedup == pytest.approx(2.0)
    assert not any(n.startswith("eager in the final comparison:") for n in rep.notes)
    assert any(n.startswith("eager p50 alone (its own process, nothing else running) 10.000 ms, inside the "
                            "comparison 10.000 ms") for n in rep.notes), rep.notes
    assert "eager_processes" not in e.notes
