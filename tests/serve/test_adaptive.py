from __future__ import annotations

import asyncio

import pytest

from torchnitro.serve.adaptive import AdaptivePolicy, LatencyCurve
from torchnitro.serve.batcher import BatchingConfig, DynamicBatcher
from torchnitro.serve.testing import run_virtual


@pytest.mark.parametrize("a,b", [(0.004, 0.001), (0.010, 0.0002)])
def test_curve_recovers_linear_cost(a, b):
    c = LatencyCurve()
    for _ in range(5):
        for rows in (1, 4, 8, 16, 32):
            c.add(rows, a + b * rows)
    assert c.a == pytest.approx(a, rel=1e-6)
    assert c.b == pytest.approx(b, rel=1e-6)
    assert c.predict(64) == pytest.approx(a + b * 64, rel=1e-6)


def test_policy_picks_largest_size_within_target():
    cfg = BatchingConfig(max_batch_size=64, max_wait_ms=5, adaptive=True, latency_target_ms=51)
    p = AdaptivePolicy(cfg, headroom=1.0)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        for _ in range(3):
            p.on_batch(rows, 0.002 + 0.001 * rows)
    # 2 * (2 ms + B ms) <= 51 ms  ->  B <= 23.5
    assert p.best_size() == 23
    for i in range(50):
        p.on_arrival(i * 0.001)  # 1000 rows/s
    size, wait = p.choose(0.05)
    assert size == 23
    assert 0 <= wait <= 0.051 - 2 * (0.002 + 0.023) + 1e-9


def test_policy_uses_config_until_it_has_data_and_never_below_one():
    cfg = BatchingConfig(max_batch_size=16, max_wait_ms=7, adaptive=True, latency_target_ms=1)
    p = AdaptivePolicy(cfg)
    assert p.choose(0.0) == (16, 0.007)
    p.on_batch(16, 0.5)  # far slower than the target: smallest size
    assert p.choose(0.0)[0] == 1


def test_adaptive_batcher_converges_under_load():
    """Batch cost 2 ms + 1 ms/row, target 40 ms: sizes settle at or below the feasible 14.

    On virtual time (``run_virtual``) the model's cost is exact, so the bounds are the policy's
    own, not a margin for a loaded machine."""

    async def model(items):
        await asyncio.sleep(0.002 + 0.001 * len(items))
        return items

    async def main():
        cfg = BatchingConfig(max_batch_size=64, max_wait_ms=10, adaptive=True, latency_target_ms=40)
        b = DynamicBatcher(model, cfg)
        sizes = []
        orig = b.adaptive.on_batch

        def spy(rows, s):
            sizes.append(rows)
            orig(rows, s)

        b.adaptive.on_batch = spy
        async with b:
            async def client(i):
                for j in range(40):
                    assert await b.submit(i * 1000 + j) == i * 1000 + j

            await asyncio.gather(*(client(i) for i in range(48)))
        late = sizes[len(sizes) // 2:]
        assert max(late) <= 14  # worst case 2*(2+1*B) ms <= 0.8*40 -> B <= 14
        assert sum(late) / len(late) >= 4  # still batching, not collapsed to 1
        assert b.adaptive.to_dict()["curve"]["b_s_per_row"] > 0

    run_virtual(main)
