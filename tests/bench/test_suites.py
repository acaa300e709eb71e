"""``bench.suites``: every suite builds and times its micro tier on CPU, fails per case, skips what does not fit."""

from __future__ import annotations

import pytest
import torch

from torchnitro.bench import suites
from torchnitro.bench.suites import SUITES, TIERS, register_suite, run_suite
from torchnitro.bench.timing import TimingConfig

_FAST = TimingConfig(warmup=1, warmup_s=0.0, min_iters=3, max_iters=3, min_time_s=0.0, max_time_s=600.0,
                     min_sample_s=0.0)


@pytest.fixture(autouse=True)
def _no_tier_limit(monkeypatch):
    """Tier time limits are for real runs; here max_iters ends every run, whatever the machine's load."""
    monkeypatch.setattr(suites, "TIER_LIMIT_S", {t: 1e6 for t in TIERS})


@pytest.mark.parametrize("suite,cases", [
    ("fused", {f"{op}/{impl}" for op in ("rms_norm", "layer_norm", "rope", "swiglu")
               for impl in ("torchnitro", "eager")}),
    ("train", {"eager", "fused"}),
    ("models", {"encoder", "lm", "mlp", "cnn"}),
])
def test_suite_times_every_case_of_the_micro_tier(suite, cases):
    run = run_suite(suite, ["micro"], timing=_FAST)
    assert set(run.timings) == {f"{suite}/micro/{c}" for c in cases} and not run.skipped
    assert all(len(t.samples) == 3 and min(t.samples) > 0 for t in run.timings.values())


def test_fused_cases_compute_the_same_as_eager():
    fns = SUITES["fused"].build(TIERS["small"], "cpu")
    for op in ("rms_norm", "layer_norm", "rope", "swiglu"):
        torch.testing.assert_close(fns[f"{op}/torchnitro"](), fns[f"{op}/eager"](), rtol=1e-4, atol=1e-5)


def test_train_case_updates_the_weights():
    fns = SUITES["train"].build(TIERS["micro"], "cpu")
    first = fns["eager"]()
    for _ in range(3):
        last = fns["eager"]()
    assert first.requires_grad is False and torch.isfinite(last) and last.item() != first.item()


def test_a_case_that_raises_is_skipped_with_its_error_and_the_rest_is_timed():
    def build(shape, device):
        def bad():
            raise RuntimeError("no kernel for this shape")
        return {"good": lambda: torch.ones(4).sum(), "bad": bad}

    register_suite("_test_partial", need=lambda s, d: 0)(build)
    try:
        run = run_suite("_test_partial", ["micro", "small"], timing=_FAST)
    finally:
        del SUITES["_test_partial"]
    assert set(run.timings) == {"_test_partial/micro/good", "_test_partial/small/good"}
    assert "RuntimeError: no kernel for this shape" in run.skipped["_test_partial/micro/bad"]


def test_train_tier_that_does_not_fit_is_skipped_before_building():
    run = run_suite("train", ["xlarge"], timing=_FAST, free_bytes=2**30)
    assert not run.timings and "more than half of the 1024 MiB free" in run.skipped["train/xlarge"]


def test_a_case_cut_short_by_the_tier_limit_is_skipped_not_written(monkeypatch):
    import time

    register_suite("_test_slow", need=lambda s, d: 0)(lambda shape, dev: {"slow": lambda: time.sleep(0.02),
                                                                          "fast": lambda: None})
    monkeypatch.setattr(suites, "TIER_LIMIT_S", {t: 0.0 for t in TIERS})  # every run stops after one round
    try:
        run = run_suite("_test_slow", ["micro"], timing=_FAST)
    finally:
        del SUITES["_test_slow"]
    assert not run.timings
    assert "only 1 samples within the tier's 0 s limit; expected at least 3" in run.skipped["_test_slow/micro/slow"]
