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


class FakeClock:
    """Stands in for the ``time`` module inside bench.timing: time moves only when a timed function says so,
    so the statistics are exact whatever else loads the machine."""

    def __init__(self):
        self.ns = 0

    def advance(self, seconds: float) -> None:
        self.ns += round(seconds * 1e9)

    def perf_counter_ns(self) -> int:
        return self.ns

    def perf_counter(self) -> float:
        return self.ns / 1e9

    monotonic = perf_counter

    def monotonic_ns(self) -> int:
        return self.ns

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)


@pytest.fixture
def clock(monkeypatch):
    from torchnitro.bench import timing

    c = FakeClock()
    monkeypatch.setattr(timing, "time", c)
    return c


def test_measure_reports_the_clock_time_of_each_call(clock):
    durations = iter([0.010, 0.001, 0.002, 0.003, 0.004, 0.005, 0.006] * 10)  # the first call is warm-up
    t = measure(lambda: clock.advance(next(durations)),
                TimingConfig(warmup=1, warmup_s=0, min_iters=6, min_time_s=0.01, min_sample_s=0, device="cpu"))
    assert t.warmup_calls == 1 and t.calls_per_sample == 1
    assert t.samples == pytest.approx([0.001, 0.002, 0.003, 0.004, 0.005, 0.006])  # warm-up not in the samples
    assert t.median == pytest.approx(0.0035) and t.min == pytest.approx(0.001)
    assert t.p99 >= t.p90 >= t.median >= t.min
    assert t.throughput == pytest.approx(1 / t.median)


def test_measure_keeps_sampling_until_min_time(clock):
    t = measure(lambda: clock.advance(0.002),
                TimingConfig(warmup=1, warmup_s=0, min_iters=5, min_time_s=0.05, min_sample_s=0, device="cpu"))
    assert t.n == 25 and t.median == pytest.approx(0.002)  # 25 x 2 ms reaches 50 ms, 5 samples would not


def test_real_sleeps_are_never_reported_shorter():
    t = measure(lambda: time.sleep(0.002), TimingConfig(warmup=1, warmup_s=0, min_iters=3, min_time_s=0,
                                                        device="cpu"))
    assert t.n >= 3 and t.min >= 0.002  # sleep can only overshoot, however loaded the machine


def test_fast_functions_are_batched_into_samples(clock):
    t = measure(lambda: clock.advance(1e-6), QUICK)
    assert t.calls_per_sample in (100, 101)  # ceil(min_sample_s 1e-4 / 1 us per call), in floating point
    assert t.median == pytest.approx(1e-6)


def test_min_iters_and_items_per_call():
    calls = []
    t = measure(lambda: calls.append(1), TimingConfig(warmup=2, warmup_s=0, min_iters=7, min_time_s=0,
                                                      min_sample_s=0), items_per_call=32)
    assert t.n == 7 and t.warmup_calls == 2 and len(calls) == 9
    assert t.throughput == pytest.approx(32 / t.median)


def test_compare_interleaves_and_ranks(clock):
    order = []

    def mk(name, s):
        def f():
            order.append(name)
            clock.advance(s)
        return f

    cfg = TimingConfig(warmup=1, warmup_s=0, min_iters=4, min_time_s=0, min_sample_s=0, device="cpu")
    res = compare({"slow": mk("slow", 0.004), "fast": mk("fast", 0.001)}, cfg, baseline="slow")
    timed = order[2:]  # after one warm-up call each
    assert timed == ["slow", "fast", "fast", "slow", "slow", "fast", "fast", "slow"]  # rotating, one sample each
    assert res["fast"].median == pytest.approx(0.001) and res["slow"].median == pytest.approx(0.004)
    assert speedups(res, "slow") == pytest.approx({"slow": 1.0, "fast": 4.0})


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
