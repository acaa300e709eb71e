"""Regression statistics on seeded synthetic samples (no timing): verdicts, intervals, step detection."""

from __future__ import annotations

import numpy as np
import pytest

from torchnitro.bench.regress import CompareConfig, compare_samples, detect_steps, mann_whitney_u, ratio_ci
from torchnitro.errors import InputError


def _runs(seed: int, slowdown: float, noise: float, n: int = 20) -> tuple[np.ndarray, np.ndarray]:
    r = np.random.default_rng(seed)
    return r.normal(1e-3, 1e-3 * noise, n), r.normal(1e-3 * (1 + slowdown), 1e-3 * (1 + slowdown) * noise, n)


def test_mann_whitney_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats", reason="scipy is the reference here; not a torchnitro dependency")
    r = np.random.default_rng(3)
    for a, b in [(r.normal(1, 0.1, 20), r.normal(1.05, 0.1, 25)),
                 (np.round(r.normal(1, 0.1, 20), 1), np.round(r.normal(1.05, 0.1, 17), 1))]:  # many ties
        u, p = mann_whitney_u(a, b)
        ref = stats.mannwhitneyu(a, b, alternative="two-sided", method="asymptotic")
        assert u == pytest.approx(ref.statistic) and p == pytest.approx(ref.pvalue, rel=1e-9)


def test_ten_percent_slowdown_with_low_noise_is_slower():
    base, new = _runs(0, 0.10, 0.02)
    v = compare_samples(base, new, case="attention/small")
    assert v.verdict == "slower" and v.ratio == pytest.approx(1.10, abs=0.02)
    assert 1.0 < v.ci_low <= v.ratio <= v.ci_high and v.p_value < 0.01
    assert compare_samples(new, base).verdict == "faster"


@pytest.mark.parametrize("noise", [0.02, 0.05])
def test_same_distribution_twice_is_same_in_all_seeds(noise):
    verdicts = [compare_samples(*_runs(seed, 0.0, noise)).verdict for seed in range(60)]
    assert verdicts.count("same") == 60


def test_ten_percent_is_found_in_nearly_all_seeds_and_three_percent_mostly_not():
    found = sum(compare_samples(*_runs(100 + s, 0.10, 0.03)).verdict == "slower" for s in range(60))
    assert found >= 57  # >= 95%
    small = sum(compare_samples(*_runs(200 + s, 0.03, 0.03)).verdict == "slower" for s in range(60))
    assert small <= 6  # the 5% threshold keeps a real 3% change mostly 'same'


def test_small_but_significant_change_is_same_with_a_reason():
    base, new = _runs(7, 0.02, 0.002, n=40)  # certain, but only 2%
    v = compare_samples(base, new)
    assert v.verdict == "same" and "small change" in v.reason and v.ci_low > 1
    assert compare_samples(base, new, CompareConfig(threshold=0.01)).verdict == "slower"


def test_ratio_interval_is_seeded_and_covers_the_truth():
    base, new = _runs(5, 0.10, 0.05)
    assert ratio_ci(base, new, seed=1) == ratio_ci(base, new, seed=1)
    lo, hi = ratio_ci(base, new)
    assert lo < 1.10 < hi


def test_bad_samples_are_refused():
    with pytest.raises(InputError, match="base has 2 samples"):
        compare_samples([1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(InputError, match="positive"):
        compare_samples([1.0, -1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(InputError, match="threshold"):
        CompareConfig(threshold=-0.1)


def test_a_step_is_found_at_the_right_index():
    r = np.random.default_rng(11)
    series = np.r_[r.normal(1.0, 0.02, 12), r.normal(1.10, 0.022, 13)]
    steps = detect_steps(series)
    assert [s.index for s in steps] == [12]
    assert steps[0].ratio == pytest.approx(1.10, abs=0.03) and steps[0].p_value < 0.01


def test_two_steps_and_a_recovery():
    r = np.random.default_rng(12)
    series = np.r_[r.normal(1.0, 0.02, 10), r.normal(1.2, 0.02, 10), r.normal(1.0, 0.02, 10)]
    assert [s.index for s in detect_steps(series)] == [10, 20]


def test_flat_noisy_series_has_no_steps_in_nearly_all_seeds():
    false = sum(bool(detect_steps(np.random.default_rng(s).normal(1.0, 0.03, 24), seed=s)) for s in range(25))
    assert false <= 1  # alpha = 1%: about 0.25 expected


def test_ten_percent_steps_at_two_percent_noise_are_found():
    hits = 0
    for s in range(40):
        r = np.random.default_rng(1000 + s)
        series = np.r_[r.normal(1.0, 0.02, 10), r.normal(1.1, 0.022, 10)]
        hits += [st.index for st in detect_steps(series, seed=s)] == [10]
    assert hits >= 36  # >= 90%


def test_detect_steps_bad_input():
    with pytest.raises(InputError, match="positive"):
        detect_steps([1.0, 0.0, 1.0])
    assert detect_steps([1.0, 1.1, 1.2]) == []  # too short to split


def test_compare_interleaved_uses_the_timings_samples():
    from torchnitro.bench.regress import compare_interleaved
    from torchnitro.bench.timing import Timing

    r = np.random.default_rng(21)
    timings = {"eager": Timing(list(r.normal(1e-3, 2e-5, 20))), "fused": Timing(list(r.normal(0.8e-3, 2e-5, 20))),
               "same": Timing(list(r.normal(1e-3, 2e-5, 20)))}
    verdicts = {v.case: v.verdict for v in compare_interleaved(timings, "eager")}
    assert verdicts == {"fused": "faster", "same": "same"}
    with pytest.raises(InputError, match="baseline 'nope'"):
        compare_interleaved(timings, "nope")


def test_wilcoxon_matches_scipy():
    stats = pytest.importorskip("scipy.stats", reason="scipy is the reference here; not a torchnitro dependency")
    from torchnitro.bench.regress import wilcoxon_signed_rank

    r = np.random.default_rng(4)
    for d in (r.normal(0.01, 0.05, 20), np.round(r.normal(0.02, 0.05, 25), 2)):  # the second has ties and zeros
        ref = stats.wilcoxon(d, zero_method="wilcox", correction=True, method="approx").pvalue
        assert wilcoxon_signed_rank(d) == pytest.approx(ref, rel=1e-9)


def test_paired_rounds_cancel_shared_drift():
    from torchnitro.bench.regress import compare_paired

    r = np.random.default_rng(8)
    load = r.lognormal(0.0, 0.25, 20)  # each round's machine load hits both variants alike
    base = 1e-3 * load * r.normal(1, 0.01, 20)
    slow = 1.10e-3 * load * r.normal(1, 0.01, 20)
    twin = 1e-3 * load * r.normal(1, 0.01, 20)
    assert compare_samples(base, slow).verdict == "same"  # unpaired: drowned by the drift
    v = compare_paired(base, slow)
    assert v.verdict == "slower" and v.ratio == pytest.approx(1.10, abs=0.02)
    assert compare_paired(base, twin).verdict == "same"
    with pytest.raises(InputError, match="equal numbers"):
        compare_paired(base, slow[:-1])
