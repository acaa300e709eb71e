"""The "no growth over repeated saves" statistic has power: a leak of one buffer per save is detected (the slope's
confidence interval excludes zero and holds the leak), and without it the interval rules such a leak out. On
synthetic series, on real allocations, and on real async DCP saves with a leak injected. No timing."""

from __future__ import annotations

import random

import pytest
import torch

from torchnitro.bench.growth import fit_growth, memory_sample, t_quantile
from torchnitro.errors import InputError

MiB = 2**20


def test_t_quantile_matches_tables():
    assert t_quantile(0.975, 10) == pytest.approx(2.2281, abs=1e-3)
    assert t_quantile(0.975, 38) == pytest.approx(2.0244, abs=1e-3)
    assert t_quantile(0.975, 5) == pytest.approx(2.5706, abs=5e-3)


def test_too_few_samples_is_an_input_error():
    with pytest.raises(InputError, match="received 8 samples with warmup=5"):
        fit_growth([1.0] * 8, warmup=5)


@pytest.mark.parametrize("leak", [0, 16 * MiB])
def test_synthetic_rss_noise(leak):
    """RSS-like noise (sd 40 MiB, as the 30 M-param benchmark's idle samples): a 16 MiB/save leak shows, and
    without it a 16 MiB/save leak is ruled out."""
    rng = random.Random(0)
    ys = [1000 * MiB + i * leak + rng.gauss(0, 40 * MiB) for i in range(45)]
    g = fit_growth(ys, warmup=5)
    if leak:
        assert g.grows and g.low <= leak <= g.high
    else:
        assert not g.grows and g.rules_out(16 * MiB)


def _assert_leak_seen_or_ruled_out(samples: list[float], *, warmup: int, leak: int) -> None:
    """With a leak of ``leak`` bytes per sample, the fitted slope shows it; without, a 1 MiB leak is ruled out."""
    g = fit_growth(samples, warmup=warmup)
    if leak:  # the leaked buffer plus its tensor's and the list's few hundred bytes (and DCP's ~17 KiB/save)
        assert g.grows and g.slope == pytest.approx(leak, rel=0.05)
    else:
        assert g.rules_out(MiB)


def _cycle(keep: list, leak_bytes: int) -> None:
    tmp = torch.ones(2 * MiB // 4)  # freed every cycle: churn the allocator the way a staged copy does
    if leak_bytes:
        keep.append(torch.ones(leak_bytes // 4))
    del tmp


@pytest.mark.parametrize("leak", [0, MiB])
def test_real_allocations_malloc_in_use(leak):
    if memory_sample()["malloc_in_use"] is None:
        pytest.skip("malloc in-use bytes need glibc's mallinfo2 (glibc >= 2.33)")
    keep: list = []
    samples = []
    for _ in range(20):
        _cycle(keep, leak)
        samples.append(memory_sample()["malloc_in_use"])
    _assert_leak_seen_or_ruled_out(samples, warmup=3, leak=leak)


@pytest.fixture
def world_one(monkeypatch):
    from torchnitro.distributed import ParallelConfig, init, shutdown

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    init(ParallelConfig())
    yield
    shutdown()


@pytest.mark.parametrize("leak", [0, MiB])
def test_async_saves_with_an_injected_leak(world_one, tmp_path, leak):
    """The benchmark's loop in small: async saves, one sample per save once the previous one has finished. A
    leaked 1 MiB buffer per save (a staged copy kept by mistake would be one) is seen; without it, it is ruled out."""
    if memory_sample()["malloc_in_use"] is None:
        pytest.skip("malloc in-use bytes need glibc's mallinfo2 (glibc >= 2.33)")
    from torchnitro.distributed import ModelState, save

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    state = {"train": ModelState(model, opt)}
    keep, samples, pending = [], [], None
    for i in range(16):
        if pending is not None:
            pending.wait()
        samples.append(memory_sample()["malloc_in_use"])
        pending = save(state, tmp_path, step=i + 1, async_=True, keep=2)
        if leak:
            keep.append(torch.ones(leak // 4))
    pending.wait()
    samples.append(memory_sample()["malloc_in_use"])
    _assert_leak_seen_or_ruled_out(samples, warmup=4, leak=leak)
