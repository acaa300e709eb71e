"""pick_config: the default off the device, measurement and caching on it (faked timer)."""

from __future__ import annotations

import pytest

from torchnitro.errors import InputError
from torchnitro.kernels import _triton


@pytest.fixture
def fresh(monkeypatch):
    _triton.clear_tuned_configs()
    yield
    _triton.clear_tuned_configs()


CANDS = [{"ROWS": 1}, {"ROWS": 2}, {"ROWS": 4}]


def test_cpu_uses_default_without_running(fresh):
    calls = []
    assert _triton.pick_config(("k", 1), CANDS, calls.append, "cpu") == CANDS[0]
    assert calls == [] and _triton.tuned_configs() == {}


def test_measured_pick_is_cached_and_exposed(fresh, monkeypatch):
    monkeypatch.setattr(_triton, "tuning_enabled", lambda device: True)
    timed = []

    def fake_time(cands, run):
        timed.append(len(cands))
        return {0: 3.0, 1: 1.0, 2: 2.0}

    monkeypatch.setattr(_triton, "_time_candidates", fake_time)
    assert _triton.pick_config(("k", 2), CANDS, lambda c: None, "cuda") == {"ROWS": 2}
    assert _triton.pick_config(("k", 2), CANDS, lambda c: None, "cuda") == {"ROWS": 2}
    assert timed == [3]  # timed once per key
    picked = _triton.tuned_configs()
    assert picked["('k', 2)"]["config"] == {"ROWS": 2} and picked["('k', 2)"]["ms"]["ROWS=1"] == 3.0


def test_all_failing_falls_back_to_default(fresh, monkeypatch):
    monkeypatch.setattr(_triton, "tuning_enabled", lambda device: True)
    monkeypatch.setattr(_triton, "_time_candidates", lambda cands, run: {})
    assert _triton.pick_config(("k", 3), CANDS, lambda c: None, "cuda") == CANDS[0]


def test_env_switch_and_interpreter_disable_tuning(monkeypatch):
    monkeypatch.setenv("TORCHNITRO_KERNEL_TUNE", "0")
    assert not _triton.tuning_enabled("cuda")
    monkeypatch.setenv("TORCHNITRO_KERNEL_TUNE", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _triton.tuning_enabled("cuda")


def test_empty_candidates_raise():
    with pytest.raises(InputError, match="empty candidate list"):
        _triton.pick_config(("k", 4), [], lambda c: None, "cpu")


def test_small_launches_are_not_timed(fresh, monkeypatch):
    monkeypatch.setattr(_triton, "tuning_enabled", lambda device: True)
    monkeypatch.setattr(_triton, "_time_candidates", lambda cands, run: pytest.fail("timed a small launch"))
    assert _triton.pick_config(("k", 5), CANDS, lambda c: None, "cuda", size=_triton.TUNE_MIN_SIZE - 1) == CANDS[0]
    assert _triton.tuned_configs() == {}
