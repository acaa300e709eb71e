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


@pytest.mark.gpu
def test_tuned_launches_on_device_are_correct_and_exposed(fresh, monkeypatch):
    """Shapes big enough to be timed: the measured picks compute the reference and are listed."""
    import torch

    from torchnitro.kernels import apply_rope, layer_norm, reference, rms_norm
    from torchnitro.nn.models import rope_cache

    monkeypatch.delenv("TORCHNITRO_KERNEL_TUNE", raising=False)
    monkeypatch.setenv("TORCHNITRO_KERNELS", "triton")
    x = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for got, want in ((layer_norm(x, w, b), reference.layer_norm(x.float(), w.float(), b.float())),
                      (rms_norm(x, w), reference.rms_norm(x.float(), w.float(), 1e-6))):
        torch.testing.assert_close(got.float(), want, atol=6e-2, rtol=6e-2)
        got.sum().backward()
    cos, sin = rope_cache(1024, 128, device="cuda")
    q = torch.randn(1, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 4, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qo, ko = apply_rope(q, k, cos, sin)
    torch.testing.assert_close(qo.float(), reference.rope(q.float(), cos, sin), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(ko.float(), reference.rope(k.float(), cos, sin), atol=3e-2, rtol=3e-2)
    (qo.sum() + ko.sum()).backward()
    picked = " ".join(_triton.tuned_configs())
    for name in ("layer_norm_fwd", "layer_norm_bwd", "rms_norm_fwd", "rms_norm_bwd", "rope"):
        assert name in picked, f"{name} was not tuned; picked: {picked}"


def test_default_kept_within_the_noise_margin(fresh, monkeypatch):
    monkeypatch.setattr(_triton, "tuning_enabled", lambda device: True)
    monkeypatch.setattr(_triton, "_time_candidates", lambda cands, run: {0: 1.01, 1: 1.0, 2: 1.5})
    assert _triton.pick_config(("k", 6), CANDS, lambda c: None, "cuda") == CANDS[0]


def _fake_events(monkeypatch, clock):
    """torch.cuda.Event and synchronize on a fake clock (ms in ``clock["t"]``)."""
    import torch

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.t = 0.0

        def record(self):
            self.t = clock["t"]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)


def test_cuda_ms_is_the_mean_over_the_burst(monkeypatch):
    clock = {"t": 0.0}
    _fake_events(monkeypatch, clock)
    steps = iter([0.5, 1.0, 1.5, 1.0])

    def fn():
        clock["t"] += next(steps)

    assert _triton.cuda_ms(fn, 4) == pytest.approx(1.0)  # four calls between the events, 4 ms in all


def test_timer_skips_candidates_that_raise(monkeypatch):
    """The CUDA-event timer with fake events: a candidate that fails to build is left out, the rest timed."""
    clock = {"t": 0.0}
    _fake_events(monkeypatch, clock)

    def run(cfg):
        if cfg["ROWS"] == 2:
            raise RuntimeError("out of resources")
        clock["t"] += 0.01 * cfg["ROWS"]  # ms per launch

    ms = _triton._time_candidates(CANDS, run)
    assert set(ms) == {0, 2}
    assert ms[0] == pytest.approx(0.01) and ms[2] == pytest.approx(0.04)
