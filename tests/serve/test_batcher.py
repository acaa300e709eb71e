from __future__ import annotations

import asyncio
import gc

import pytest

from torchnitro.config import from_dict
from torchnitro.errors import ConfigError, DeadlineExceededError, DrainingError, InputError, QueueFullError
from torchnitro.serve.batcher import BatchingConfig, DynamicBatcher, Request
from torchnitro.serve.testing import run_virtual


def now() -> float:
    """The running loop's clock: virtual under ``run_virtual``, so durations are exact and a loaded
    machine cannot change them (the batcher's default clock is the same one)."""
    return asyncio.get_running_loop().time()


class Recorder:
    """A batch function that records batches and can be held closed by a gate."""

    def __init__(self, gate: bool = False):
        self.batches: list[list] = []
        self.gate = asyncio.Event() if gate else None

    async def __call__(self, items):
        self.batches.append(list(items))
        if self.gate is not None:
            await self.gate.wait()
        return [x * 2 for x in items]


def test_batch_closes_at_max_size_and_results_follow_inputs():
    async def main():
        rec = Recorder()
        async with DynamicBatcher(rec, BatchingConfig(max_batch_size=4, max_wait_ms=200)) as b:
            t0 = now()
            out = await asyncio.gather(*(b.submit(i) for i in range(8)))
            dt = now() - t0
        assert out == [i * 2 for i in range(8)]
        assert [len(x) for x in rec.batches] == [4, 4]
        assert dt == 0  # full batches do not wait for the 200 ms window

    run_virtual(main)


def test_batch_closes_when_wait_window_of_first_request_ends():
    async def main():
        rec = Recorder()
        async with DynamicBatcher(rec, BatchingConfig(max_batch_size=64, max_wait_ms=40)) as b:
            t0 = now()
            first = asyncio.create_task(b.submit(1))
            await asyncio.sleep(0.02)
            second = asyncio.create_task(b.submit(2))
            assert await first == 2 and await second == 4
            dt = now() - t0
        assert rec.batches == [[1, 2]]
        assert dt == pytest.approx(0.04)  # window counted from the first request, not the second

    run_virtual(main)


def test_sync_function_runs_in_thread():
    async def main():
        seen = []

        def fn(items):
            seen.append(len(items))
            return [x + 1 for x in items]

        async with DynamicBatcher(fn, BatchingConfig(max_batch_size=3, max_wait_ms=50)) as b:
            out = await asyncio.gather(*(b.submit(i) for i in range(6)))
        assert out == [i + 1 for i in range(6)] and seen == [3, 3]

    run_virtual(main)


def test_full_queue_rejects_immediately():
    async def main():
        rec = Recorder(gate=True)
        cfg = BatchingConfig(max_batch_size=1, max_wait_ms=0, max_queue_size=2)
        async with DynamicBatcher(rec, cfg) as b:
            running = asyncio.create_task(b.submit(0))
            await asyncio.sleep(0.01)  # now in the (blocked) function
            queued = [asyncio.create_task(b.submit(i)) for i in (1, 2)]
            await asyncio.sleep(0.01)
            t0 = now()
            with pytest.raises(QueueFullError, match="queue is full"):
                await b.submit(3)
            assert now() == t0  # refused at once, not after waiting for room
            rec.gate.set()
            assert await running == 0 and [await q for q in queued] == [2, 4]

    run_virtual(main)


def test_deadline_expired_requests_are_never_computed():
    async def main():
        rec = Recorder(gate=True)
        async with DynamicBatcher(rec, BatchingConfig(max_batch_size=1, max_wait_ms=0)) as b:
            running = asyncio.create_task(b.submit(0))
            await asyncio.sleep(0.01)
            late = asyncio.create_task(b.submit(99, timeout_ms=30))
            with pytest.raises(DeadlineExceededError, match="deadline"):
                await late
            assert b.depth == 0
            rec.gate.set()
            await running
            await asyncio.sleep(0.02)
        assert [99] not in rec.batches

    run_virtual(main)


def test_high_priority_overtakes_full_low_priority_queue():
    async def main():
        rec = Recorder(gate=True)
        cfg = BatchingConfig(max_batch_size=2, max_wait_ms=0, priority_levels=3, aging_ms=10_000)
        async with DynamicBatcher(rec, cfg) as b:
            blocker = asyncio.create_task(b.submit(-1))
            await asyncio.sleep(0.01)
            low = [asyncio.create_task(b.submit(i, priority=2)) for i in range(6)]
            await asyncio.sleep(0.01)
            high = asyncio.create_task(b.submit(100, priority=0))
            await asyncio.sleep(0.01)
            rec.gate.set()
            await asyncio.gather(blocker, high, *low)
        assert rec.batches[1][0] == 100  # the very next batch after the blocker leads with it

    run_virtual(main)


def test_aging_prevents_starvation():
    async def main():
        rec = Recorder(gate=True)
        cfg = BatchingConfig(max_batch_size=1, max_wait_ms=0, priority_levels=2, aging_ms=20)
        async with DynamicBatcher(rec, cfg) as b:
            blocker = asyncio.create_task(b.submit(-1))
            await asyncio.sleep(0.01)
            old_low = asyncio.create_task(b.submit(7, priority=1))
            await asyncio.sleep(0.06)  # aged by three levels
            new_high = asyncio.create_task(b.submit(8, priority=0))
            await asyncio.sleep(0.01)
            rec.gate.set()
            await asyncio.gather(blocker, old_low, new_high)
        assert rec.batches[1] == [7]

    run_virtual(main)


def test_cancelled_request_leaves_queue_and_is_not_computed():
    async def main():
        rec = Recorder(gate=True)
        async with DynamicBatcher(rec, BatchingConfig(max_batch_size=1, max_wait_ms=0)) as b:
            blocker = asyncio.create_task(b.submit(0))
            await asyncio.sleep(0.01)
            gone = asyncio.create_task(b.submit(5))
            await asyncio.sleep(0.01)
            assert b.depth == 1
            gone.cancel()
            await asyncio.sleep(0.01)
            assert b.depth == 0
            rec.gate.set()
            await blocker
            assert await b.submit(6) == 12
        assert [5] not in rec.batches

    run_virtual(main)


def run_batch(values: tuple, exc: Exception, calls: list) -> list:
    """Submit ``values`` as one batch to a function that records each call and raises ``exc`` on
    any batch holding 13; returns each request's result or exception."""

    async def main():
        async def fn(items):
            calls.append(list(items))
            if 13 in items:
                raise exc
            return items

        cfg = BatchingConfig(max_batch_size=len(values), max_wait_ms=20)
        async with DynamicBatcher(fn, cfg) as b:
            return await asyncio.gather(*(b.submit(x) for x in values), return_exceptions=True)

    return run_virtual(main)


def test_failing_batch_is_split_until_only_the_culprit_fails():
    calls = []
    res = run_batch((1, 2, 3, 13, 5, 6, 7, 8), RuntimeError("bad luck"), calls)
    assert isinstance(res[3], RuntimeError) and "bad luck" in str(res[3])
    assert res[:3] + res[4:] == [1, 2, 3, 5, 6, 7, 8]  # batched with the bad one, answered anyway
    # whole batch, its halves, then quarters of the failing half, then the pair holding 13
    assert calls == [[1, 2, 3, 13, 5, 6, 7, 8], [1, 2, 3, 13], [1, 2], [3, 13], [3], [13], [5, 6, 7, 8]]


def test_function_failing_for_every_item_fails_each_without_retrying_deadlines():
    calls = []

    async def main():
        async def fn(items):
            calls.append(len(items))
            raise DeadlineExceededError("not retried: it is about time, not input") if items[0] < 0 \
                else ValueError("broken model")

        async with DynamicBatcher(fn, BatchingConfig(max_batch_size=4, max_wait_ms=20)) as b:
            res = await asyncio.gather(*(b.submit(x) for x in range(4)), return_exceptions=True)
            assert all(isinstance(r, ValueError) for r in res)
            assert calls == [4, 2, 1, 1, 2, 1, 1]  # bounded: 2 * 4 - 1 calls
            calls.clear()
            res = await asyncio.gather(*(b.submit(x) for x in (-1, -2)), return_exceptions=True)
            assert all(isinstance(r, DeadlineExceededError) for r in res) and calls == [2]

    run_virtual(main)


def test_buckets_never_mix_lengths():
    async def main():
        rec = Recorder()
        cfg = BatchingConfig(max_batch_size=8, max_wait_ms=30, bucket_boundaries=(16, 64))
        async with DynamicBatcher(rec, cfg) as b:
            lengths = [3, 100, 10, 40, 12, 50, 200, 5]
            out = await asyncio.gather(*(b.submit(n, length=n) for n in lengths))
        assert out == [n * 2 for n in lengths]
        for batch in rec.batches:
            buckets = {0 if n <= 16 else 1 if n <= 64 else 2 for n in batch}
            assert len(buckets) == 1, batch
        assert len(rec.batches) == 3

    run_virtual(main)


def test_rows_count_toward_batch_size_and_oversized_request_rejected():
    async def main():
        rec = Recorder()
        async with DynamicBatcher(rec, BatchingConfig(max_batch_size=4, max_wait_ms=30)) as b:
            await asyncio.gather(b.submit(1, rows=3), b.submit(2, rows=2), b.submit(3, rows=1))
            with pytest.raises(InputError, match="max_batch_size=4"):
                await b.submit(4, rows=5)
        assert sorted(len(x) for x in rec.batches) == [1, 2]

    run_virtual(main)


def test_preferred_size_closes_early_when_nothing_waits():
    async def main():
        rec = Recorder()
        cfg = BatchingConfig(max_batch_size=16, max_wait_ms=300, preferred_batch_sizes=(2,))
        async with DynamicBatcher(rec, cfg) as b:
            t0 = now()
            await asyncio.gather(b.submit(1), b.submit(2))
            assert now() == t0  # not the 300 ms window

    run_virtual(main)


def test_concurrency_runs_batches_in_parallel():
    async def main():
        async def slow(items):
            await asyncio.sleep(0.05)
            return items

        cfg = BatchingConfig(max_batch_size=1, max_wait_ms=0, concurrency=4)
        async with DynamicBatcher(slow, cfg) as b:
            t0 = now()
            await asyncio.gather(*(b.submit(i) for i in range(4)))
            assert now() - t0 == pytest.approx(0.05)  # four 50 ms batches at once, not one after another

    run_virtual(main)


def test_stop_drains_accepted_then_rejects():
    async def main():
        rec = Recorder()
        b = await DynamicBatcher(rec, BatchingConfig(max_batch_size=2, max_wait_ms=5)).start()
        tasks = [asyncio.create_task(b.submit(i)) for i in range(5)]
        await asyncio.sleep(0)
        await b.stop(drain=True)
        assert [await t for t in tasks] == [i * 2 for i in range(5)]
        with pytest.raises(DrainingError):
            await b.submit(1)

    run_virtual(main)


def test_bad_priority_and_timeout_raise_input_error():
    async def main():
        async with DynamicBatcher(Recorder(), BatchingConfig(priority_levels=2)) as b:
            with pytest.raises(InputError, match=r"priority: received 5"):
                await b.submit(1, priority=5)
            with pytest.raises(InputError, match="timeout"):
                await b.submit(1, timeout_ms=-1)

    run_virtual(main)


def test_config_validation_and_from_dict():
    cfg = from_dict(BatchingConfig, {"max_batch_size": 8, "preferred_batch_sizes": [4, 8]})
    assert cfg.preferred_batch_sizes == (4, 8)
    with pytest.raises(ConfigError, match="max_batch_size"):
        BatchingConfig(max_batch_size=0)
    with pytest.raises(ConfigError, match="latency_target_ms"):
        BatchingConfig(adaptive=True)
    with pytest.raises(ConfigError, match="unknown key"):
        from_dict(BatchingConfig, {"max_batch": 3})


def test_exact_lengths_only_batches_equal_lengths():
    async def main():
        rec = Recorder()
        cfg = BatchingConfig(max_batch_size=8, max_wait_ms=30, bucket_boundaries=(64,))
        async with DynamicBatcher(rec, cfg, exact_lengths=True) as b:
            lengths = [3, 4, 3, 5, 4, 3]
            await asyncio.gather(*(b.submit(n, length=n) for n in lengths))
        assert sorted(sorted(x) for x in rec.batches) == [[3, 3, 3], [4, 4], [5]]

    run_virtual(main)


def test_filling_batch_wakes_once_per_batch_not_per_request():
    async def main():
        rec = Recorder()
        b = DynamicBatcher(rec, BatchingConfig(max_batch_size=16, max_wait_ms=500))
        waits = []
        orig = b._wait_for_work

        async def counted(timeout, need=1):
            waits.append(need)
            await orig(timeout, need)

        b._wait_for_work = counted
        async with b:
            t0 = now()
            tasks = []
            for i in range(16):  # arrive one by one, each after the consumer went back to sleep
                tasks.append(asyncio.create_task(b.submit(i)))
                await asyncio.sleep(0.002)
            out = await asyncio.gather(*tasks)
            dt = now() - t0
        assert out == [2 * i for i in range(16)] and [len(x) for x in rec.batches] == [16]
        assert dt == pytest.approx(16 * 0.002)  # closed when full (the 16th arrived at 30 ms), not at 500 ms
        # one wait for the first request, then one for "15 more rows": not 15 separate wake-ups
        assert waits[:2] == [1, 15] and len(waits) <= 3, waits

    run_virtual(main)


def test_two_consumers_cancelled_and_timed_out_requests_keep_counts_right():
    async def main():
        rec = Recorder(gate=True)
        cfg = BatchingConfig(max_batch_size=4, max_wait_ms=5, concurrency=2, max_queue_size=64)
        async with DynamicBatcher(rec, cfg) as b:
            busy = [asyncio.create_task(b.submit(i)) for i in range(8)]  # both consumers hold a batch
            await asyncio.sleep(0.05)
            gone = [asyncio.create_task(b.submit(100 + i)) for i in range(3)]
            late = asyncio.create_task(b.submit(200, timeout_ms=20))
            await asyncio.sleep(0.01)
            for t in gone:
                t.cancel()  # the waiting task is cancelled: its request leaves the queue
            with pytest.raises(DeadlineExceededError):
                await late
            assert b.depth == 0 and b._queue.live_rows == 0
            rec.gate.set()
            assert await asyncio.gather(*busy) == [2 * i for i in range(8)]
            assert await b.submit(7) == 14  # still serving after the withdrawals
        computed = [x for batch in rec.batches for x in batch]
        assert not {100, 101, 102, 200} & set(computed)

    run_virtual(main)


async def _double(items):
    return [x * 2 for x in items]


@pytest.mark.parametrize("how", ["deadline", "disconnect"])
def test_request_gone_inside_batch_window_does_not_wedge(how):
    async def main():
        loop = asyncio.get_running_loop()
        b = await DynamicBatcher(_double, BatchingConfig(max_batch_size=8, max_wait_ms=300),
                                 clock=loop.time).start()
        if how == "deadline":
            with pytest.raises(DeadlineExceededError):
                await b.submit(1, timeout_ms=30)  # expires while its batch waits for company
        else:
            req = b.enqueue(1)
            await asyncio.sleep(0.05)  # collected, the batch window still open
            b.cancel(req)
        assert b.depth == 0 and b._queue.live_rows == 0
        await asyncio.sleep(1)  # the emptied batch's window is over: the consumer waits for work
        t0 = loop.time()
        assert await asyncio.wait_for(b.submit(2), 5) == 4  # a single request is answered alone
        assert loop.time() - t0 <= 0.3 + 1e-6  # within its own window (virtual time)
        t0 = loop.time()
        await b.stop(drain=True, timeout_s=30)
        assert loop.time() - t0 < 0.1  # idle: nothing to drain

    run_virtual(main)


def test_lost_worker_failure_is_retried_one_request_at_a_time():
    calls = []

    class Lost(RuntimeError):
        retry_alone = True  # what ProcessPool marks a batch lost with its worker

    res = run_batch((1, 13, 2, 3), Lost("worker died"), calls)
    assert res[0] == 1 and isinstance(res[1], Lost) and res[2:] == [2, 3]
    assert calls == [[1, 13, 2, 3], [1], [13], [2], [3]]  # the culprit runs twice in all, not log2(n) + 1 times


@pytest.mark.parametrize("lost", [False, True], ids=["model-error", "worker-lost"])
def test_answered_requests_are_freed_without_the_cycle_collector(lost):
    """A failed request's error sits on its future; a traceback frame that still holds the request
    (the batch, the waiter) makes a cycle that only the cyclic GC frees, so under a steady share of
    failing requests (the soak: 8%) requests and their inputs pile up between full collections."""

    class Failure(RuntimeError):
        retry_alone = lost

    def fn(items):  # a plain function: run in a thread, as a model is
        if 13 in items:
            raise Failure("the model rejects 13")
        return [x * 2 for x in items]

    async def main():
        async with DynamicBatcher(fn, BatchingConfig(max_batch_size=4, max_wait_ms=1)) as b:
            res = await asyncio.gather(*(b.submit(x) for x in (1, 13, 2, 3, 13, 4, 5, 6)), return_exceptions=True)
            assert [r if isinstance(r, int) else type(r) for r in res] == [2, Failure, 4, 6, Failure, 8, 10, 12]
            del res
            return sum(type(o) is Request for o in gc.get_objects())

    gc.collect()
    gc.disable()  # what a cycle holds now stays held, so the count is deterministic
    try:
        live = run_virtual(main)
    finally:
        gc.enable()
    assert live == 0


def test_an_answered_request_is_not_held_until_its_deadline():
    """A deadline is a timer on the loop holding its request: answered long before it, the request
    (and its inputs) must not stay alive until the timer would have fired (a gRPC client's 30 s
    deadline on every request kept 30 s of traffic alive)."""

    async def main():
        async with DynamicBatcher(Recorder(), BatchingConfig(max_batch_size=4, max_wait_ms=1)) as b:
            assert await asyncio.gather(*(b.submit(x, timeout_ms=60_000) for x in range(6))) == [0, 2, 4, 6, 8, 10]
            return sum(type(o) is Request for o in gc.get_objects())

    assert run_virtual(main) == 0
