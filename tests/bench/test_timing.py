from __future__ import annotations

import time

import pytest

from torchnitro.bench import ResultTable, TimingConfig, compare, measure, percentile, speedups

QUICK = TimingConfig().quick()


def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_measure_sleeps_are_timed_not_guessed():
    t = measure(lambda: time.sleep(0.002), TimingConfig(warmup=1, warmup_s=0, min_iters=5, min_time_s=0.01))
    assert t.n >= 5
    assert 0.002 <= t.median < 0.02  # sleep(2 ms) can only overshoot
    assert t.p99 >= t.p90 >= t.median >= t.min
    assert t.throughput == pytest.approx(1 / t.median)


def test_fast_functions_are_batched_into_samples():
    t = measure(lambda: None, QUICK)
    assert t.calls_per_sample > 1  # a no-op is far below the minimum sample time
    assert t.median < 1e-4


def test_min_iters_and_items_per_call():
    calls = []
    t = measure(lambda: calls.append(1), TimingConfig(warmup=2, warmup_s=0, min_iters=7, min_time_s=0,
                                                      min_sample_s=0), items_per_call=32)
    assert t.n == 7 and t.warmup_calls == 2 and len(calls) == 9
    assert t.throughput == pytest.approx(32 / t.median)


def test_compare_interleaves_and_ranks():
    order = []

    def mk(name, s):
        def f():
            order.append(name)
            time.sleep(s)
        return f

    cfg = TimingConfig(warmup=1, warmup_s=0, min_iters=4, min_time_s=0, min_sample_s=0)
    res = compare({"slow": mk("slow", 0.004), "fast": mk("fast", 0.001)}, cfg, baseline="slow")
    timed = order[2:]  # after one warm-up call each
    assert timed[:4] == ["slow", "fast", "fast", "slow"]  # rotating order, one sample each per round
    assert res["fast"].median < res["slow"].median
    assert speedups(res, "slow")["fast"] > 1.5


def test_compare_rejects_unknown_baseline():
    with pytest.raises(KeyError, match="baseline 'x'"):
        compare({"a": lambda: None}, QUICK, baseline="x")


def test_result_table_roundtrip(tmp_path):
    t = ResultTable("demo", ["name", "ms"], meta={"machine": "test"})
    t.add(name="a", ms=1.23456)
    with pytest.raises(KeyError, match="not in the table"):
        t.add(name="b", seconds=1.0)
    jp, mp = t.save("demo", tmp_path)
    assert "| a | 1.23 |" in mp.read_text()
    assert '"ms": 1.23456' in jp.read_text()
