"""benchmarks/timing_fairness.py's parts without timing processes: the goal arithmetic over rounds, the chain of
blocks (each comparison between two alone sets) and a drifting machine, the tables built from rounds, the
allocator and OpenMP tables on fake timers, the probe's failure.
(tests/bench/test_timing_fairness_script.py runs the script end to end.)"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.report import CandidateResult, Report
from torchnitro.bench import ResultTable, TimingConfig
from torchnitro.errors import RecipeError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture()
def tf(monkeypatch):
    spec = importlib.util.spec_from_file_location("timing_fairness", ROOT / "benchmarks" / "timing_fairness.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "timing_fairness", mod)
    spec.loader.exec_module(mod)
    return mod


def test_goal_is_checked_on_the_median_of_the_rounds_differences(tf):
    d = tf.diffs([10.0, 12.0, 10.2], [10.0, 10.0, 10.0])  # one round in another phase: +20%
    assert d == pytest.approx([0.0, 0.2, 0.02])
    assert tf.median(d) == pytest.approx(0.02) and tf.within(tf.median(d), tf.P50_GOAL)
    assert not tf.within(tf.median(tf.diffs([11.0, 11.0, 10.0], [10.0, 10.0, 10.0])), tf.P50_GOAL)  # 2 of 3 at +10%
    assert tf.within(-0.05, 0.05) and not tf.within(-0.0501, 0.05)
    # a round without the variant counts as missing, not as zero; no rounds at all never meets the goal
    assert math.isnan(tf.diffs([math.nan, 11.0], [10.0, 10.0])[0])
    assert tf.median([math.nan, 0.1]) == pytest.approx(0.1)
    assert math.isnan(tf.median([math.nan])) and not tf.within(math.nan, 0.05)
    assert tf._per_round([1.23456, math.nan, 47.6189]) == "1.235/-/47.62"


def _round(tf, inside, alone, speedup, chosen, probe=(1.0, 1.0), redone=False, number=1):
    return tf.Round(number=number, order="alone set 0, comparison, alone set 1", started="08:00:00", probe_ms=probe,
                    inside=inside, speedup=speedup, alone=alone, how={n: "own process" for n in inside}, chosen=chosen,
                    eager_processes_ms=[inside["eager"]], redone=redone, comparison_s=10.0, alone_s=(5.0, 6.0),
                    alone_sets=(alone, {n: math.nan for n in alone}))


def test_rows_give_every_round_and_check_the_median(tf):
    tables = tf._tables({}, allocator=False, threads=False)
    done = [_round(tf, {"eager": 10.0, "ort": 5.0}, {"eager": 10.0, "ort": 5.0}, {"ort": 2.0}, "ort"),
            _round(tf, {"eager": 12.0, "ort": 5.0}, {"eager": 10.0, "ort": 4.0}, {"ort": 2.4}, "eager",
                   probe=(1.0, 1.15), redone=True, number=2),  # a phase change inside the round: the probe shows it
            _round(tf, {"eager": 10.1, "ort": 5.0}, {"eager": 10.0, "ort": 5.0}, {"ort": 2.02}, "ort", number=3)]
    tf._add_rows("w", ["eager", "ort"], {"onnxruntime": "ort"}, done,
                 {"eager": "built-in rebuilt from its factory", "ort": "artifact (torchnitro.load)"}, tables)
    eager, ort = tables["variants"].rows
    assert eager["in comparison per round ms"] == "10/12/10.1" and eager["alone per round ms"] == "10/10/10"
    assert eager["diff per round"] == "+0.0%/+20.0%/+1.0%" and eager["diff"] == "+1.0%" and eager["within 5%"] is True
    assert eager["p50 in comparison ms"] == pytest.approx(10.1) and eager["p50 alone ms"] == pytest.approx(10.0)
    assert ort["diff per round"] == "+0.0%/+25.0%/+0.0%" and ort["within 5%"] is True
    assert eager["timed in comparison"] == "own process, redone in round 2" and ort["family"] == "onnxruntime"
    (sp,) = tables["speedups"].rows
    assert sp["isolated per round"] == "2/2.5/2" and sp["reported per round"] == "2/2.4/2.02"
    assert sp["diff per round"] == "+0.0%/-4.0%/+1.0%" and sp["diff"] == "+0.0%" and sp["within 10%"] is True
    assert sp["chosen in rounds"] == "1/3"
    rows = tables["rounds"].rows
    assert [r["probe change"] for r in rows] == ["+0.0%", "+15.0%", "+0.0%"] and rows[1]["redone"] is True
    assert [r["round"] for r in rows] == [1, 2, 3] and rows[0]["alone s"] == "5/6"
    assert eager["alone sets per round ms"] == "10|- / 10|- / 10|-"  # before|after, a failed set as "-"
    # the goal fails when most rounds miss it, whatever one round says
    tables = tf._tables({}, allocator=False, threads=False)
    miss = [_round(tf, {"eager": 11.0}, {"eager": 10.0}, {}, "eager") for _ in range(2)]
    tf._add_rows("w", ["eager"], {}, miss + done[:1], {"eager": "x"}, tables)
    assert tables["variants"].rows[0]["diff"] == "+10.0%" and tables["variants"].rows[0]["within 5%"] is False


class _FakeProbe:
    def __init__(self):
        self.reads = 0

    def read(self):
        self.reads += 1
        return float(self.reads)


class _Drift:
    """A machine whose speed drifts linearly: every block (an alone set or a comparison) runs 10% slower than the one
    before. Variants take ``base`` ms alone and inside alike, so any difference a round shows is the drift's."""

    base = {"eager": 10.0, "ort": 5.0}

    def __init__(self, fail_comparison=(), fail_alone=()):
        self.blocks, self.calls = 0, []
        self.fail_comparison, self.fail_alone = fail_comparison, fail_alone

    def _speed(self):
        self.blocks += 1
        return 1.0 + 0.1 * (self.blocks - 1)

    def comparison(self, w, notes, label):
        self.calls.append(("comparison", label))
        f = self._speed()
        if len([c for c in self.calls if c[0] == "comparison"]) in self.fail_comparison:
            raise RecipeError("its timing process died")
        rep = Report("m", "x", "latency", "cpu")
        e, o = self.base["eager"] * f, self.base["ort"] * f
        rep.candidates = [CandidateResult("eager", "exact", "verified", p50_ms=e, speedup=1.0, interleaved=True,
                                          alone=True, process_p50_ms=[e]),
                          CandidateResult("ort", "exact", "chosen", p50_ms=o, speedup=e / o, interleaved=True,
                                          alone=True, redone=True)]
        return rep, "ort"

    def alone(self, spec, batch, seq, names, *args, label="", **kwargs):
        self.calls.append(("alone", label))
        f = self._speed()
        if len([c for c in self.calls if c[0] == "alone"]) - 1 in self.fail_alone:
            raise RecipeError("no process")
        return {n: self.base[n] * f for n in names}


def _fake_build(tf, monkeypatch, machine):
    """``run``'s building search, artifacts and blocks replaced by fakes (``machine``: the blocks' numbers)."""
    def fake_optimize(model, inputs, cfg, info=None):
        class Opt:
            recipe = "ort"
            report = Report("m", "x", "latency", "cpu", [
                CandidateResult("eager", "exact", "verified", interleaved=True),
                CandidateResult("ort", "exact", "chosen", interleaved=True)])
        return Opt()

    monkeypatch.setattr(tf, "optimize", fake_optimize)
    monkeypatch.setattr(tf, "model_and_inputs", lambda spec, batch=None, seq=None: (None, (), None))
    monkeypatch.setattr(tf, "save_artifacts", lambda *a, **k: {})
    monkeypatch.setattr(tf, "_comparison", machine.comparison)
    monkeypatch.setattr(tf, "_alone", machine.alone)


def test_each_comparison_sits_between_two_alone_sets_and_linear_drift_cancels(tf, monkeypatch):
    """The machine slows 10% a block: a round's comparison against the mean of the alone sets before and after it
    differs by nothing. (The pairs of the old rounds, comparison and alone set back to back in alternating order,
    read -9.1/+8.3/-6.7% here: the goal failed on the drift alone.)"""
    machine = _Drift()
    _fake_build(tf, monkeypatch, machine)
    tables, notes, probe = tf._tables({}, allocator=False, threads=False), [], _FakeProbe()
    tf.run("w", "mlp", 2, 0, {"onnxruntime": "ort"}, False, tables, notes, probe, rounds=3)
    assert machine.calls == [("alone", "w alone set 0"), ("comparison", "w round 1 of 3 comparison"),
                             ("alone", "w alone set 1"), ("comparison", "w round 2 of 3 comparison"),
                             ("alone", "w alone set 2"), ("comparison", "w round 3 of 3 comparison"),
                             ("alone", "w alone set 3")]
    eager, ort = tables["variants"].rows
    assert eager["diff per round"] == ort["diff per round"] == "+0.0%/+0.0%/+0.0%"
    assert eager["within 5%"] is True and ort["within 5%"] is True
    assert eager["alone sets per round ms"] == "10|12 / 12|14 / 14|16"
    assert eager["alone per round ms"] == "11/13/15" and eager["in comparison per round ms"] == "11/13/15"
    (sp,) = tables["speedups"].rows
    assert sp["diff per round"] == "+0.0%/+0.0%/+0.0%" and sp["chosen in rounds"] == "1/2/3"
    rounds = tables["rounds"].rows
    assert [r["blocks"] for r in rounds] == [f"alone set {i - 1}, comparison, alone set {i}" for i in (1, 2, 3)]
    # the probe: read before every block and after the last (1..8); a round shows the readings around its bracket
    assert probe.reads == 8
    assert [(r["probe at start ms"], r["probe at end ms"]) for r in rounds] == [(1.0, 4.0), (3.0, 6.0), (5.0, 8.0)]
    assert all(r["redone"] is True for r in rounds)


def test_the_default_rounds_and_time_per_variant_are_the_workloads(tf, monkeypatch):
    machine, seen = _Drift(), {}
    _fake_build(tf, monkeypatch, machine)
    real = tf.Workload

    def spy(*args):
        w = real(*args)
        seen[w.name] = w
        return w

    monkeypatch.setattr(tf, "Workload", spy)
    tf.run("mlp", "mlp", 2, 0, {"onnxruntime": "ort"}, False, tf._tables({}, allocator=False, threads=False), [],
           _FakeProbe())
    final_s, rounds = tf.BLOCKS["mlp"]
    assert len([c for c in machine.calls if c[0] == "comparison"]) == rounds
    assert seen["mlp"].cfg.final_min_time_s == final_s == seen["mlp"].tc.min_time_s
    assert seen["mlp"].tc.warmup == 1  # the comparison's own warm-up (final_check.DriftCheck.comparison)


class _FakeTimer:
    """A ChildTimer stand-in: eager under glibc's defaults takes 2 ms a call, 1 ms under any other setting."""

    times_itself = True
    made: list["_FakeTimer"] = []

    def __init__(self, loader, kwargs, inputs, *, threads, timeout_s=0.0, env=None, gate=None, name=None):
        self.loader, self.kwargs, self.env, self.name = loader, kwargs, dict(env or {}), name
        defaults = "MALLOC_MMAP_THRESHOLD_" in self.env and self.env["MALLOC_MMAP_THRESHOLD_"] is None
        self.slow = (defaults and not kwargs.get("mallopt")) or self.env.get("GOMP_SPINCOUNT") == "1000"
        self.faults = [7.0, 9.0] if self.slow else [0.0]  # per sample, as the child reports them
        _FakeTimer.made.append(self)

    def _ms(self):
        return 2e-3 if self.slow else 1e-3

    def __call__(self, k):
        return self._ms()

    def wait_ready(self):
        pass

    def close(self):
        pass


def test_allocator_and_thread_tables_on_fake_timers(tf, monkeypatch, tmp_path):
    _FakeTimer.made = []
    monkeypatch.setattr(tf, "ChildTimer", _FakeTimer)
    tc = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, min_time_s=0.0, max_time_s=1.0)
    w = tf.Workload("w", "mlp", 2, 0, None, (torch.zeros(2, 4),), None, OptimizeConfig(threads=1), tc, ["eager"], {},
                    tmp_path)
    table, notes = ResultTable("a", tf.ALLOCATOR_COLUMNS), []
    tf._allocator_table(w, table, notes)
    rows = {r["setting"]: r for r in table.rows}
    assert list(rows) == list(tf.MALLOC_SETTINGS)
    assert rows["glibc defaults"]["eager p50 alone ms"] == pytest.approx(2.0) and rows["glibc defaults"]["env"] == "-"
    assert rows["glibc defaults"]["page faults per call"] == pytest.approx(8.0)
    mallopt = rows["same via mallopt after start (torchnitro.load)"]
    assert mallopt["env"].startswith("mallopt MALLOC_MMAP_THRESHOLD_=268435456") and mallopt["vs glibc defaults"] == \
        pytest.approx(2.0)
    assert rows["mmap threshold 256 MiB"]["env"] == "MALLOC_MMAP_THRESHOLD_=268435456"
    # each row is eager built in its own child under that row's environment and mallopt setting
    assert all(t.kwargs["recipe"] == "eager" and t.loader.endswith(":build_variant") for t in _FakeTimer.made)
    assert [t.kwargs["mallopt"] for t in _FakeTimer.made] == [m for _, m in tf.MALLOC_SETTINGS.values()]
    assert notes == ["w allocator table: timing gate: no gated samples; second half of each process's samples "
                     "against its first half (p50): -"]  # 3 samples each: too few to split
    _FakeTimer.made = []
    table = ResultTable("t", tf.THREAD_COLUMNS)
    tf._thread_table(w, table)
    assert [(r["beside"], r["setting"]) for r in table.rows] == [
        (b, s) for b in ("nothing", "one busy process") for s in tf.THREAD_SETTINGS]
    spin = [r for r in table.rows if r["env"] == "GOMP_SPINCOUNT=1000"]
    assert len(spin) == 2 and all(r["vs libgomp default, same load"] == pytest.approx(0.5) for r in spin)
    assert table.rows[0]["vs libgomp default, same load"] == pytest.approx(1.0)
    assert [t.env for t in _FakeTimer.made[:len(tf.THREAD_SETTINGS)]] == [e for e, _ in tf.THREAD_SETTINGS.values()]


def test_halves_show_a_process_that_speeds_up_inside_its_set(tf):
    from torchnitro.bench.timing import Timing

    young = Timing([2e-3] * 4 + [1.5e-3] * 4)  # faster once it has run a while
    steady = Timing([1e-3, 1.1e-3, 0.9e-3, 1e-3, 0.9e-3, 1.1e-3])
    text = tf._halves({"eager": young, "ort": steady, "short": Timing([1.0] * 5)})
    assert text == "second half of each process's samples against its first half (p50): eager -25.0%, ort +0.0%"


def test_a_failed_probe_leaves_nan_and_says_why(tf, monkeypatch, tmp_path):
    class Dying(_FakeTimer):
        closed = False

        def __call__(self, k):
            raise RecipeError("the child died")

        def close(self):
            Dying.closed = True

    monkeypatch.setattr(tf, "ChildTimer", Dying)
    probe = tf.Probe(tmp_path, threads=1, seconds=0.01)
    assert math.isnan(probe.read()) and "the child died" in probe.failed and Dying.closed
    assert math.isnan(probe.read())  # closed: later rounds read NaN without a process


def test_probe_is_a_fixed_matmul(tf):
    fn = tf.speed_probe(8)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 8, generator=g), torch.randn(8, 8, generator=g)
    assert torch.equal(fn(torch.zeros(1)), a @ b) and torch.equal(fn(), a @ b)


def test_a_failed_block_is_left_out_and_noted(tf, monkeypatch):
    """Comparison 2 of 3 fails: rounds 1 and 3 make the rows (numbered as run); alone set 3 fails: round 3 is
    measured against alone set 2 alone. The notes say why."""
    machine = _Drift(fail_comparison=(2,), fail_alone=(3,))
    _fake_build(tf, monkeypatch, machine)
    tables, notes = tf._tables({}, allocator=False, threads=False), []
    tf.run("w", "mlp", 2, 0, {"onnxruntime": "ort"}, False, tables, notes, _FakeProbe(), rounds=3)
    assert [r["round"] for r in tables["rounds"].rows] == [1, 3]
    eager = tables["variants"].rows[0]
    assert eager["alone sets per round ms"] == "10|12 / 14|-" and eager["alone per round ms"] == "11/14"
    assert any(n.startswith("w round 2 of 3 failed, left out: RecipeError: its timing process died") for n in notes)
    assert any(n.startswith("w alone set 3 failed: RecipeError: no process") for n in notes)
    machine = _Drift(fail_comparison=(1, 2))
    _fake_build(tf, monkeypatch, machine)
    with pytest.raises(RuntimeError, match="every round failed"):
        tf.run("w", "mlp", 2, 0, {}, False, tf._tables({}, allocator=False, threads=False), [], _FakeProbe(), rounds=2)
