"""Sequential comparison on seeded synthetic samples (no timing): error rates over repeated looks, power, input."""

from __future__ import annotations

import numpy as np
import pytest

from torchnitro.bench.sequential import (SequentialConfig, beyond_threshold_p, compare_interleaved_sequential,
                                         compare_sequential, look, quantile_ratio_test)
from torchnitro.errors import InputError


def _run(rng: np.random.Generator, n: int, level: float = 1e-3, tail: float = 0.3) -> np.ndarray:
    """A clean mode with 1% noise, and a share ``tail`` of samples hit by preemption (2x to 5x): one-sided noise."""
    x = rng.normal(level, level * 0.01, n)
    hit = rng.random(n) < tail
    return np.where(hit, x * rng.uniform(2, 5, n), x)


def _batches(seed: int, slowdown: float, n: int = 20, tail: float = 0.3):
    rng = np.random.default_rng(seed)
    return lambda: (_run(rng, n, tail=tail), _run(rng, n, 1e-3 * (1 + slowdown), tail=tail))


FAST = dict(n_perm=199, n_boot=200)  # coarse p (>= 1/200) is enough at alpha 0.05 over 3 looks


def test_false_alarms_over_all_looks_stay_within_alpha():
    # threshold 0: only the test stands between noise and a verdict, so this is the test's error rate over looks
    cfg = SequentialConfig(looks=3, alpha=0.05, threshold=0.0, **FAST)
    trials = 300
    called = sum(compare_sequential(_batches(s, 0.0), cfg).verdict != "same" for s in range(trials))
    assert called / trials <= 0.05 + 2.5 * np.sqrt(0.05 * 0.95 / trials)


def test_spending_alpha_is_what_keeps_repeated_looks_honest():
    # the same looks, each at the full alpha (no spending): the error rate grows past what the spent version makes
    trials, looks = 300, 3
    full = SequentialConfig(looks=1, alpha=0.05, threshold=0.0, **FAST)
    spent = SequentialConfig(looks=looks, alpha=0.05, threshold=0.0, **FAST)
    naive = 0
    for s in range(trials):
        more, base, new = _batches(s, 0.0), [], []
        for _ in range(looks):
            a, b = more()
            base += list(a)
            new += list(b)
            if look(base, new, 1, full).verdict != "same":
                naive += 1
                break
    honest = sum(compare_sequential(_batches(s, 0.0), spent).verdict != "same" for s in range(trials))
    assert naive > 0.05 * trials > honest


def test_ten_percent_is_found_through_heavy_one_sided_noise():
    # a median comparison loses this often with half the samples preempted; the low quantile does not
    cfg = SequentialConfig()
    found = [compare_sequential(_batches(s, 0.10, tail=0.5), cfg) for s in range(40)]
    assert sum(v.verdict == "slower" for v in found) == 40
    assert all(1.07 < v.ratio < 1.13 and v.ci_low > 1 for v in found)


def test_three_percent_is_not_a_regression_under_a_five_percent_threshold():
    verdicts = [compare_sequential(_batches(s, 0.03), SequentialConfig()).verdict for s in range(40)]
    assert verdicts.count("slower") == 0


@pytest.mark.parametrize("change, old_calls", [(0.05, 100), (0.045, 20)])
def test_a_change_up_to_the_threshold_is_called_slower_at_most_alpha(change, old_calls):
    # 1% noise and up to 60 samples: a real 4.5-5% change is significant almost always, and its estimate
    # lands at or above 5% often. Comparing the estimate with the threshold called it slower that often (at
    # least 139/200 at 5%, 47/200 at 4.5% on these seeds); testing "at most the threshold" keeps it within
    # alpha over all looks
    cfg = SequentialConfig(looks=3, alpha=0.05, **FAST)
    trials = 200
    verdicts = [compare_sequential(_batches(s, change, tail=0.1), cfg) for s in range(trials)]
    called = sum(v.verdict == "slower" for v in verdicts)
    assert called / trials <= 0.05 + 2.5 * np.sqrt(0.05 * 0.95 / trials)
    old_rule = sum(any(lk.p_value < lk.alpha and lk.ci_low > 1 and lk.ratio >= 1.05 for lk in v.history)
                   for v in verdicts)  # a significant look whose estimate moved >= 5%: what was called slower
    assert old_rule >= old_calls
    slower = [v for v in verdicts if v.verdict == "slower"]
    assert all(v.p_threshold < 0.05 / 2 and "at most 5%" in v.reason for v in slower)


def test_a_speedup_beyond_the_threshold_is_faster_and_one_within_it_is_not():
    cfg = SequentialConfig()
    assert [compare_sequential(_batches(s, -0.10), cfg).verdict for s in range(10)] == ["faster"] * 10
    assert "faster" not in [compare_sequential(_batches(s, -0.045, tail=0.1), cfg).verdict for s in range(10)]


def test_beyond_threshold_p_tests_the_threshold_not_zero():
    rng = np.random.default_rng(0)
    base = rng.normal(1e-3, 1e-5, 40)
    new = rng.normal(1e-3, 1e-5, 40)
    assert beyond_threshold_p(base, new * 1.10, 0.05, n_perm=199) < 0.01  # 10% beyond 5%: shown
    assert beyond_threshold_p(base, new * 1.03, 0.05, n_perm=199) > 0.5  # 3%: real (p of no change is tiny) ...
    assert quantile_ratio_test(base, new * 1.03, n_perm=199, n_boot=200)[3] < 0.01  # ... but not beyond 5%
    assert beyond_threshold_p(base, new / 1.10, 0.05, n_perm=199) < 0.01  # faster: the mirror image
    assert beyond_threshold_p(base, new / 1.03, 0.05, paired=True, n_perm=199) > 0.5
    with pytest.raises(InputError, match="threshold -0.1"):
        beyond_threshold_p(base, new, -0.1)


def test_inconclusive_first_look_collects_more_and_decides():
    # 4 samples a batch at 5% noise: the first look cannot show 10%; more batches can
    rng = np.random.default_rng(1)
    cfg = SequentialConfig(looks=5, quantile=0.5)

    def more():
        return rng.normal(1e-3, 5e-5, 4), rng.normal(1.1e-3, 5.5e-5, 4)

    v = compare_sequential(more, cfg, case="attn/small")
    assert v.history[0].verdict == "inconclusive" and v.looks_used > 1
    assert v.verdict == "slower" and v.n_base == v.n_new == 4 * v.looks_used and len(v.base) == v.n_base
    assert v.to_dict()["case"] == "attn/small" and "base" not in v.to_dict()


def test_same_is_decided_early_when_the_interval_is_within_the_threshold():
    v = compare_sequential(_batches(3, 0.0, tail=0.1), SequentialConfig())
    assert v.verdict == "same" and v.looks_used == 1 and 1 / 1.05 < v.ci_low <= v.ci_high < 1.05


def test_the_last_look_is_final():
    # noise so large nothing is shown: at the cap the answer is "same", never "inconclusive"
    rng = np.random.default_rng(0)
    v = compare_sequential(lambda: (rng.lognormal(0, 1, 5), rng.lognormal(0.05, 1, 5)), SequentialConfig(looks=2))
    assert v.looks_used == 2 and v.verdict == "same" and "last look" in v.reason


def test_paired_test_holds_its_level_when_load_drifts_between_rounds():
    # a strong trend over the rounds hits both sides alike: swapping inside rounds keeps that, so the
    # A/A rejection rate stays at alpha
    rejected, trials = 0, 200
    for s in range(trials):
        rng = np.random.default_rng(s)
        load = np.linspace(1, 3, 20) * rng.uniform(0.9, 1.1, 20)  # (rounds,)
        base, new = 1e-3 * load * _run(rng, 20, 1.0), 1e-3 * load * _run(rng, 20, 1.0)
        rejected += quantile_ratio_test(base, new, paired=True, n_perm=199, n_boot=200, seed=s)[3] < 0.05
    assert rejected / trials <= 0.05 + 2.5 * np.sqrt(0.05 * 0.95 / trials)


def test_permutation_p_is_exact_for_identical_runs():
    x = np.full(10, 1e-3)
    ratio, lo, hi, p = quantile_ratio_test(x, x)
    assert ratio == 1.0 and lo == hi == 1.0 and p == 1.0


class _Fake:
    """A ``bench.compare`` entry that returns seeded seconds per call instead of timing anything."""

    times_itself = True

    def __init__(self, level: float, seed: int):
        self.level, self.rng = level, np.random.default_rng(seed)

    def __call__(self, k: int) -> float:
        return float(_run(self.rng, 1, self.level, tail=0.3)[0])


def test_interleaved_sequential_decides_each_case_on_its_own_rounds():
    from torchnitro.bench import TimingConfig

    cfg = TimingConfig(warmup=0, warmup_s=0.0, min_iters=10, max_iters=10, min_time_s=0.0)
    fns = {"base": _Fake(1e-3, 0), "same": _Fake(1e-3, 1), "slower": _Fake(1.2e-3, 2)}
    out = {v.case: v for v in compare_interleaved_sequential(fns, "base", cfg, SequentialConfig(looks=3))}
    assert out["slower"].verdict == "slower" and out["same"].verdict == "same"
    for v in out.values():
        assert v.n_base == v.n_new == 10 * v.looks_used == 10 * len(v.history)


@pytest.mark.parametrize("kw, match", [
    (dict(looks=0), "looks"), (dict(alpha=1.5), "alpha"), (dict(quantile=0.0), "quantile"),
    (dict(threshold=-0.1), "threshold"), (dict(looks=2, alpha_spending=(0.5, 0.6)), "alpha_spending"),
    (dict(looks=4, alpha=0.01, n_perm=99), "n_perm"),
])
def test_bad_configs_name_the_field(kw, match):
    with pytest.raises(InputError, match=match):
        SequentialConfig(**kw)


def test_bad_samples_are_refused_clearly():
    with pytest.raises(InputError, match="paired samples come in equal numbers"):
        look([1.0] * 5, [1.0] * 6, 1, paired=True)
    with pytest.raises(InputError, match="at least 3 positive"):
        look([1.0, -1.0, 1.0], [1.0] * 3, 1)
    with pytest.raises(InputError, match="look 5"):
        SequentialConfig(looks=4).alpha_at(5)
    with pytest.raises(InputError, match="baseline 'x'"):
        compare_interleaved_sequential({"a": lambda: None, "b": lambda: None}, "x")
