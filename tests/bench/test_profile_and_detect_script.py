"""benchmarks/profile_and_detect.py: the detector rows decided from recorded samples (no timing here)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from torchnitro.bench import ResultTable, TimingConfig
from torchnitro.bench.sequential import SequentialConfig, compare_sequential
from torchnitro.errors import InputError

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def pd(monkeypatch):
    """The benchmark script, imported by name as its run imports its statistics module beside it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("profile_and_detect")


@pytest.fixture
def stats(monkeypatch):
    """How the script decides rows from samples (no timing)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("_profile_detect_stats")


def test_implied_rate_counts_the_noise_that_would_cross_the_threshold(stats):
    # a 3% change reaches 5% when the noise alone moved the ratio to >= 1.05 / 1.03 = 1.0194
    assert stats.implied_rate([1.0, 1.02, 1.03, 0.99]) == 0.5
    assert stats.implied_rate([1.0, 1.0]) == 0.0


def test_pytest_benchmark_rule_on_known_samples(stats):
    pytest.importorskip("pytest_benchmark", reason="pytest-benchmark is in the bench extra, not installed here")
    base = [1.0] * 10
    assert stats._pytest_benchmark_fails(base, [1.06] * 10) is True  # mean grew 6% > 5%
    assert stats._pytest_benchmark_fails(base, [1.04] * 10) is False


def test_pyperf_calls_a_small_significant_change_slower_and_we_do_not(stats):
    pytest.importorskip("pyperf", reason="pyperf is in the bench extra, not installed here")
    rng = np.random.default_rng(0)
    a, b = rng.normal(1, 0.01, 20), rng.normal(1.02, 0.01, 20)
    assert stats._pyperf_slower(a, b) is True  # significant and larger: pyperf has no minimum effect
    t = stats.Tally()
    t.add(a, b, paired=False)
    assert t.counts["ours"] == 0 and t.counts["pyperf compare_to"] == 1  # 2% is under our 5% threshold


def _recorded(trials: int, seed: int = 0) -> dict:
    """Interleaved rounds share a load factor (it cancels in pairs); back-to-back runs each get their own."""
    rng = np.random.default_rng(seed)
    rec = {"gemm": 8, "samples_per_run": 20}
    for label, extra in (("A/A", 0.0), ("10% slower", 0.10), ("3% slower", 0.03)):
        runs = {"interleaved": [], "back to back": []}
        for _ in range(trials):
            load = rng.uniform(1.0, 1.3, 20)  # (rounds,)
            noise = rng.normal(1, 0.01, (2, 20))
            runs["interleaved"].append([list(load * noise[0]), list(load * noise[1] * (1 + extra))])
            runs["back to back"].append([list(rng.normal(1, 0.01, 20)), list(rng.normal(1 + extra, 0.01, 20))])
        rec[label] = runs
    return rec


def test_recorded_samples_give_the_rows_and_the_paired_test_sees_through_round_load(stats):
    # a file from before the sequential detector (one batch a trial): the sequential rows get one look
    table = ResultTable("t", ["check", "value", "goal", "met", "detail"])
    stats.decide_real(table, _recorded(20))
    inter_aa, inter_10, inter_3, b2b_aa, b2b_10, b2b_3 = table.rows
    assert "interleaved" in inter_aa["check"] and inter_aa["check"].endswith("A/A")
    assert inter_aa["value"] == "0/20 called slower (ours sequential); 0/20 (ours paired)" and inter_aa["met"] is True
    # unpaired, the 30% round-to-round load swings hide part of the 10%; the low-quantile test keeps each round's
    # load on both sides of every permutation but does not divide it out as the per-round ratios do. With one
    # look, a change beyond the 5% threshold (what "slower" now needs) is shown 8/20 times; the estimate lay
    # beyond 5% with a significant change 18/20 times (what "slower" needed before the threshold was tested)
    assert inter_10["value"] == "8/20 called slower (ours sequential); 20/20 (ours paired)"
    assert "ours 18/20, ours paired 20/20" in inter_10["detail"]
    assert "alpha 1% + 2 SE: the threshold is tested" in inter_3["goal"] and "noise-implied rate" in inter_3["detail"]
    assert "back to back" in b2b_aa["check"] and b2b_aa["value"].startswith("0/20 called slower (ours sequential)")
    assert [r["met"] for r in (b2b_aa, b2b_10, b2b_3)] == [True, True, True]
    assert b2b_3["goal"].startswith("<= 10.9% (alpha 1%") and "rule 0.0%" in b2b_3["detail"]


def test_sequential_trials_are_replayed_from_their_batches(stats):
    # a trial is the batches the detector asked for; deciding again from the file gives the same looks
    rng = np.random.default_rng(1)
    rec = {"gemm": 8, "samples_per_run": 4, "sequential": {"looks": 3, "quantile": 0.5}}
    for label, extra in (("A/A", 0.0), ("10% slower", 0.10), ("3% slower", 0.03)):
        trial = [[list(rng.normal(1, 0.05, 4)), list(rng.normal(1 + extra, 0.05, 4))] for _ in range(3)]
        rec[label] = {"interleaved": [trial], "back to back": [trial]}
    t = stats.Tally()
    t.add(*rec["10% slower"]["interleaved"][0][0], paired=True, batches=rec["10% slower"]["interleaved"][0],
          seq=SequentialConfig(looks=3, quantile=0.5))
    assert t.samples_used > 4  # 4 noisy samples were not enough: it used the recorded later batches
    table = ResultTable("t", ["check", "value", "goal", "met", "detail"])
    stats.decide_real(table, rec)
    assert "up to 3 batches" in table.rows[0]["check"] and "samples a side on average" in table.rows[1]["detail"]
    borrowed = ResultTable("t", ["check", "value", "goal", "met", "detail"])
    stats.decide_real(borrowed, _recorded(8), borrow=True)  # one batch a trial: the next trials lend theirs
    assert "up to 4 batches" in borrowed.rows[0]["check"]


@pytest.mark.parametrize("bad", [{}, {"gemm": 8, "samples_per_run": 20, "A/A": {"interleaved": []}}])
def test_recorded_file_without_the_runs_fails_clearly(stats, bad):
    with pytest.raises(InputError, match="expected the samples file"):
        stats.decide_real(ResultTable("t", ["check"]), bad)


class _Level:
    """A stand-in for a timed function: its samples come from a seeded generator at ``level`` (no timing)."""

    def __init__(self, level: float):
        self.level = level


def test_shared_base_records_each_rows_trials_and_replays_them(pd, stats, monkeypatch):
    rng = np.random.default_rng(0)
    calls: list[list[str]] = []

    class _T:
        def __init__(self, level: float, n: int = 20):
            self.samples = list(level * 1e-3 * (1 + np.abs(rng.normal(0, 0.02, n))))

    def fake_compare(fns, cfg):
        calls.append(list(fns))
        return {name: _T(f.level) for name, f in fns.items()}

    monkeypatch.setattr(pd, "compare", fake_compare)
    monkeypatch.setattr(pd, "measure", lambda f, cfg: (calls.append(["measure", f.level]), _T(f.level))[1])
    news = {"A/A": _Level(1.0), "10% slower": _Level(1.1), "3% slower": _Level(1.03)}
    seq = SequentialConfig(looks=3)
    saved: list[int] = []
    rec = pd._record_shared(4, _Level(1.0), news, TimingConfig(), seq,
                            lambda part: saved.append(len(part["A/A"]["interleaved"])))
    assert saved == [4]  # the last trial checkpoints what was recorded
    for label in news:
        for mode in ("interleaved", "back to back"):
            assert len(rec[label][mode]) == 4  # every row has its trials
            for trial in rec[label][mode]:
                assert 1 <= len(trial) <= 3 and all(len(a) == len(b) == 20 for a, b in trial)
    # the rows of one trial share the base samples, batch by batch, while both are open
    assert rec["A/A"]["interleaved"][0][0][0] == rec["10% slower"]["interleaved"][0][0][0]
    assert calls[0][0] == "base" and sorted(calls[0][1:]) == sorted(news)  # one compare: base + all open rows
    assert rec["10% slower"]["back to back"][0] == rec["10% slower"]["back to back"][0][:1]  # decided at look 1
    # replaying the file takes the same looks: each trial's batches are exactly what its decision used
    for label in news:
        for mode in ("interleaved", "back to back"):
            for trial in rec[label][mode]:
                it = iter(trial)
                v = compare_sequential(lambda: next(it), seq, paired=mode == "interleaved")
                assert v.looks_used == len(trial)
    table = ResultTable("t", ["check", "value", "goal", "met", "detail"])
    stats.decide_real(table, {"gemm": 8, "samples_per_run": 20, "sequential": {"looks": 3}, "shared base": True, **rec})
    assert "one base run shared by the three rows" in table.rows[0]["check"]
    assert table.rows[1]["value"].startswith("4/4 called slower")


def test_from_samples_run_writes_the_recorded_table(pd, stats, tmp_results, tmp_path, monkeypatch):
    # the script end to end on a recorded file, through both of its modules (200 synthetic trials take
    # ~20 s here, so that part runs 5)
    samples = tmp_path / "old_samples.json"
    samples.write_text(json.dumps({**_recorded(6), "written": "then", "load average at start": "1.00"}))
    monkeypatch.setattr(pd, "synthetic_rows", lambda table, trials: stats.synthetic_rows(table, 5))
    monkeypatch.setattr(sys, "argv", ["profile_and_detect.py", "--from-samples", str(samples)])
    pd.main()
    saved = json.loads((tmp_results / "profile_and_detect_recorded.json").read_text())
    checks = [r["check"] for r in saved["rows"]]
    assert len(checks) == 6 + 2 + 6  # two synthetic modes, two step checks, then two real modes
    assert checks[-6].startswith("real runs, interleaved") and checks[-1].startswith("real runs, back to back")
    assert saved["rows"][-2]["value"].startswith("6/6 called slower")  # back to back 10%: found every time
    assert "old_samples.json (recorded then" in saved["meta"]["samples"]
