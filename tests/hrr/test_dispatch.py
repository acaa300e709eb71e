"""Dispatch: threshold routing, calibration cache keyed by hardware fingerprint, transfers."""

from __future__ import annotations

import json

import pytest
import torch

from torchnitro.errors import BackendUnavailableError, InputError
from torchnitro.hrr import backend, dispatch
from torchnitro.hrr.dispatch import Dispatcher, calibrate, is_device_failure


def test_no_accelerator_means_cpu_and_no_measurement(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cal = calibrate(256)
    assert cal.accelerator is None and cal.threshold is None
    disp = Dispatcher("auto")
    assert disp.target(10**6) == torch.device("cpu")


def test_explicit_cuda_without_gpu_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailableError, match="no CUDA GPU"):
        Dispatcher("cuda")
    with pytest.raises(InputError, match="'gpu'"):
        Dispatcher("gpu")


def test_threshold_routing():
    disp = Dispatcher("auto", accelerator="cpu", threshold=100)
    assert not disp.uses_accelerator(99) and disp.uses_accelerator(100)
    assert not Dispatcher("cpu", accelerator="cpu", threshold=1).uses_accelerator(10**6)


def test_calibration_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    measured = []
    real = dispatch._measure_crossover

    def spy(d, batches, accel):
        measured.append(batches)
        return real(d, batches, accel)

    monkeypatch.setattr(dispatch, "_measure_crossover", spy)
    cal = calibrate(32, accelerator="cpu", batches=(1, 8))
    assert set(cal.timings) == {"1", "8"} and all(t["cpu_s"] > 0 and t["accel_s"] > 0 for t in cal.timings.values())
    again = calibrate(32, accelerator="cpu", batches=(1, 8))
    assert again == cal and len(measured) == 1
    files = list(tmp_path.glob("hrr-calibration-*.json"))
    assert len(files) == 1 and cal.fingerprint in files[0].name
    assert json.loads(files[0].read_text())["threshold"] == cal.threshold
    calibrate(32, accelerator="cpu", batches=(1, 8), force=True)
    assert len(measured) == 2


def test_threshold_is_start_of_winning_run(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    fake = {"1": {"cpu_s": 1, "accel_s": 2}, "4": {"cpu_s": 2, "accel_s": 1}, "16": {"cpu_s": 2, "accel_s": 3},
            "64": {"cpu_s": 5, "accel_s": 1}, "256": {"cpu_s": 9, "accel_s": 1}}
    monkeypatch.setattr(dispatch, "_measure_crossover", lambda d, b, a: fake)
    assert calibrate(16, accelerator="cpu", force=True).threshold == 64


def test_corrupt_cache_is_remeasured(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dispatch, "_measure_crossover", lambda d, b, a: {"1": {"cpu_s": 2, "accel_s": 1}})
    first = calibrate(8, accelerator="cpu")
    files = list(tmp_path.glob("*.json"))
    files[0].write_text("{broken")
    assert calibrate(8, accelerator="cpu") == first


def test_cleanup_has_its_own_cached_calibration_per_size_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    seen = []
    real = dispatch._measure_cleanup_crossover

    def spy(d, n, batches, accel):
        seen.append(n)
        return real(d, n, batches, accel)

    monkeypatch.setattr(dispatch, "_measure_cleanup_crossover", spy)
    monkeypatch.setattr(dispatch, "_measure_crossover", lambda *a: pytest.fail("cleanup must not time bind"))
    cal = calibrate(32, op="cleanup", n_items=1500, accelerator="cpu", batches=(1, 8))
    assert cal.op == "cleanup" and cal.n_items == 2048 and seen == [2048]
    assert set(cal.timings) <= {"1", "8"} and all(t["cpu_s"] > 0 for t in cal.timings.values())
    assert calibrate(32, op="cleanup", n_items=2000, accelerator="cpu", batches=(1, 8)) == cal  # same bucket: cached
    calibrate(32, op="cleanup", n_items=5000, accelerator="cpu", batches=(1, 8))  # another bucket: measured
    assert seen == [2048, 8192]
    names = sorted(f.name for f in tmp_path.glob("*.json"))
    assert len(names) == 2 and all("-cleanup-d32-n" in n for n in names)


def test_cleanup_measurement_stops_once_the_accelerator_keeps_winning(monkeypatch):
    calls = iter([(2.0, 1.0), (3.0, 1.0), (9.0, 9.0)])  # (cpu, accel) medians per batch
    from torchnitro.bench import timing

    def fake_compare(fns, cfg):
        cpu, acc = next(calls)
        return {"cpu": timing.Timing([cpu]), "accel": timing.Timing([acc])}

    monkeypatch.setattr("torchnitro.bench.compare", fake_compare)
    out = dispatch._measure_cleanup_crossover(16, 64, (1, 4, 16), torch.device("cpu"))
    assert list(out) == ["1", "4"]  # two wins in a row: the batch of 16 is not measured


def test_dispatcher_thresholds_follow_op_and_codebook_size(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    fake = {"bind": {"1": {"cpu_s": 2, "accel_s": 1}},
            1024: {"1": {"cpu_s": 1, "accel_s": 2}, "64": {"cpu_s": 2, "accel_s": 1}},
            4096: {"1": {"cpu_s": 1, "accel_s": 2}, "16": {"cpu_s": 2, "accel_s": 1}}}
    monkeypatch.setattr(dispatch, "_measure_crossover", lambda d, b, a: fake["bind"])
    monkeypatch.setattr(dispatch, "_measure_cleanup_crossover", lambda d, n, b, a: fake[n])
    assert Dispatcher("auto", accelerator="cpu", d=8).threshold == 1
    disp = Dispatcher("auto", accelerator="cpu", d=8, op="cleanup", n_items=1000)
    assert disp.threshold == 64 and not disp.uses_accelerator(16)
    disp.n_items = 3000  # the codebook grew into the next bucket
    assert disp.threshold == 16 and disp.uses_accelerator(16)
    with pytest.raises(InputError, match="op='gemm'"):
        Dispatcher("auto", op="gemm")
    with pytest.raises(InputError, match="n_items=None"):
        calibrate(8, op="cleanup", accelerator="cpu")


def test_is_device_failure():
    assert is_device_failure(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_device_failure(RuntimeError("CUDA error: an illegal memory access"))
    assert not is_device_failure(RuntimeError("shape mismatch"))
    assert not is_device_failure(ValueError("CUDA"))


@pytest.mark.gpu
def test_pinned_non_blocking_roundtrip_and_real_oom_fallback():
    x = torch.randn(1000, 64)
    y = backend.to_device(x, torch.device("cuda"))
    assert y.is_cuda
    back = backend.to_host(y * 2)
    assert back.is_pinned() and torch.equal(back, x * 2)

    def boom(t):
        if t.is_cuda:
            torch.empty(1 << 50, device=t.device)  # a real CUDA OOM
        return t * 2

    disp = Dispatcher("cuda")
    with pytest.warns(RuntimeWarning, match="OutOfMemoryError"):
        out = disp.run(boom, x)
    assert torch.equal(out, x * 2) and disp.fallbacks == 1


@pytest.mark.gpu
def test_cleanup_calibration_on_gpu_and_auto_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHNITRO_CACHE_DIR", str(tmp_path))
    cal = calibrate(256, op="cleanup", n_items=20_000, accelerator="cuda", batches=(1, 64, 1024))
    assert cal.op == "cleanup" and cal.n_items == 32768 and cal.timings
    assert cal.threshold is not None and cal.threshold <= 1024  # 1024 x 32768 x 256 top-1: the GPU wins
    from torchnitro.hrr import ops
    from torchnitro.hrr.memory import ItemMemory

    book = ops.random(20_000, 256, generator=torch.Generator().manual_seed(0))
    q = ops.random(1024, 256, generator=torch.Generator().manual_seed(1))
    mem = ItemMemory(book, device="auto")
    assert mem.dispatcher.threshold == cal.threshold and mem.dispatcher.uses_accelerator(1024)
    got, want = mem.topk(q, 3), ItemMemory(book, device="cpu").topk(q, 3)
    assert torch.equal(got[1], want[1])
