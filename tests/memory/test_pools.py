from __future__ import annotations

import warnings

import pytest
import torch

from torchnitro.errors import BackendUnavailableError, BudgetError, InputError
from torchnitro.memory.pools import PinnedBufferPool, Prefetcher


def test_pool_reuses_buffers_by_size_class():
    pool = PinnedBufferPool(max_bytes=1 << 20, pin=False)
    a = pool.acquire((10, 10), torch.float32)  # 400 B -> 512 B bucket
    assert a.shape == (10, 10) and a.dtype == torch.float32
    pool.release(a)
    b = pool.acquire((100,), torch.float32)  # same 512 B bucket: reused
    assert pool.hits == 1 and pool.misses == 1 and pool.allocated_bytes == 512
    c = pool.stage(torch.arange(6, dtype=torch.int64).view(2, 3))
    assert torch.equal(c, torch.arange(6).view(2, 3))
    pool.release(b)
    pool.release(c)


def test_pool_budget_and_bad_release():
    pool = PinnedBufferPool(max_bytes=1024, pin=False)
    pool.acquire((256,), torch.float32)  # 1024 B
    with pytest.raises(BudgetError, match="max_bytes"):
        pool.acquire((1,), torch.float32)
    with pytest.raises(InputError, match="acquire"):
        pool.release(torch.zeros(3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")
def test_cpu_fallbacks():
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        PinnedBufferPool(pin=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert PinnedBufferPool().pin is False
    assert any("pageable" in str(x.message) for x in w)
    with pytest.raises(BackendUnavailableError):
        Prefetcher([torch.zeros(1)], device="cuda")
    batches = [{"x": torch.full((2,), i)} for i in range(3)]
    assert [b["x"][0].item() for b in Prefetcher(batches, device="cpu")] == [0, 1, 2]


@pytest.mark.gpu
def test_prefetcher_on_cuda_overlaps_and_preserves_data():
    pool = PinnedBufferPool(pin=True)
    batches = [(torch.randn(256, 256), {"y": torch.randint(0, 9, (256,))}) for _ in range(5)]
    out = list(Prefetcher(batches, device="cuda", pool=pool, depth=2))
    for (x, d), (gx, gd) in zip(batches, out):
        assert gx.is_cuda and torch.equal(gx.cpu(), x) and torch.equal(gd["y"].cpu(), d["y"])
    assert pool.hits >= 1 and pool.acquire((4,), torch.float32).is_pinned()
