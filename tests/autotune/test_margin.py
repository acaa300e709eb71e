"""The default margin: a verified finalist faster than eager by more than its measured noise wins."""

from __future__ import annotations

import random

from fake_recipes import eager_and_cand_report

from torchnitro.autotune.config import OptimizeConfig
from torchnitro.autotune.final import pick_winner
from torchnitro.bench.timing import Timing




def test_five_percent_with_tiny_noise_wins_under_default_config():
    rng = random.Random(0)
    drift = [1e-3 * rng.uniform(0.75, 1.25) for _ in range(30)]  # load changes between rounds, alike for both
    res = {"eager": Timing([x * 1.05 for x in drift]), "cand": Timing(drift)}
    assert res["eager"].cv > 0.10  # the old bar (1 + eager's cv, capped at 0.10) wanted 1.10x here
    rep = eager_and_cand_report()
    assert pick_winner(res, rep, OptimizeConfig()) == "cand"
    c = rep.get("cand")
    assert abs(c.speedup - 1.05) < 1e-9 and c.noise < 0.01 and c.interleaved
    assert "1.05x ±0.00" in rep.rows()[1][6]  # the noise sits next to the ratio in the table


def test_five_percent_with_large_noise_does_not():
    rng = random.Random(0)
    jumps = [1e-3 * (0.6 + 0.8 * i / 30) for i in range(31)]  # median exactly 1 ms, +-40% around it
    rng.shuffle(jumps)
    res = {"eager": Timing([1.05e-3 * rng.uniform(0.995, 1.005) for _ in range(31)]), "cand": Timing(jumps)}
    assert res["eager"].cv < 0.01  # eager alone looks quiet: the old bar was 1.03x
    rep = eager_and_cand_report()
    assert pick_winner(res, rep, OptimizeConfig()) is None  # eager
    c = rep.get("cand")
    assert 1.04 < c.speedup < 1.06 and c.noise > c.speedup - 1.0


def test_min_speedup_is_kept_and_below_one_still_forces():
    rng = random.Random(0)
    drift = [1e-3 * rng.uniform(0.9, 1.1) for _ in range(30)]
    res = {"eager": Timing([x * 1.05 for x in drift]), "cand": Timing(drift)}
    assert pick_winner(res, eager_and_cand_report(), OptimizeConfig(min_speedup=1.2)) is None
    slower = {"eager": Timing(drift), "cand": Timing([x * 1.3 for x in drift])}
    assert pick_winner(slower, eager_and_cand_report(), OptimizeConfig(min_speedup=0.0)) == "cand"
