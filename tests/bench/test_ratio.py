"""bench.ratio: the noise of an interleaved ratio is measured on rounds, not on each timing's spread."""

from __future__ import annotations

import random

import pytest

from torchnitro.bench.ratio import paired_ratio
from torchnitro.bench.timing import Timing
from torchnitro.errors import InputError


def _drifting(n: int = 40, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [1e-3 * rng.uniform(0.7, 1.3) for _ in range(n)]  # the machine's speed, round by round


def test_drift_that_hits_both_leaves_the_ratio_steady():
    d = _drifting()
    base, cand = Timing([x * 1.05 for x in d]), Timing(d)
    assert base.cv > 0.1  # each timing alone looks noisy
    est = paired_ratio(base, cand)
    assert est.ratio == pytest.approx(1.05)
    assert est.noise < 1e-9 and est.beats_noise and est.rounds == 40


def test_a_jumpy_candidate_gets_a_wide_interval():
    jumps = [1e-3 * (0.6 + 0.8 * i / 40) for i in range(41)]  # median exactly 1 ms, +-40% around it
    random.Random(1).shuffle(jumps)
    est = paired_ratio(Timing([1.05e-3] * 41), Timing(jumps))
    assert abs(est.ratio - 1.05) < 1e-9 and est.noise > 0.05 and est.low < 1.0 < est.high and not est.beats_noise
    assert est.text().startswith(f"{est.ratio:.2f}x ±")


def test_p99_and_unpaired_inputs():
    d = _drifting()
    assert paired_ratio(Timing([x * 2 for x in d]), Timing(d), q=99).ratio == pytest.approx(2.0)
    with pytest.raises(InputError, match="received 3 baseline and 2 candidate"):
        paired_ratio(Timing([1.0, 1.0, 1.0]), Timing([1.0, 1.0]))
    one = paired_ratio(Timing([2.0]), Timing([1.0]))
    assert one.ratio == 2.0 and not one.beats_noise  # one round says nothing about the noise
