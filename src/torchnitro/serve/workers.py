"""Model replicas behind the batcher: processes on CPU, in-process threads, CUDA streams on GPU.

Every pool exposes ``size`` (batches it can run at once; the batcher runs that many consumers on
one shared queue, so the next batch goes to whichever replica is free), ``async run(items)`` (one
batch: assemble into reused buffers, compute, split per request), ``restarts`` and ``ready``.

``ProcessPool``: N spawned processes (``serve.worker_process``), each loading the model from its spec string with
``cpu_count // N`` torch threads. Batch inputs are written by the parent straight into a per-worker
shared-memory arena (reused for every batch; only a small layout message crosses the pipe).
A worker that dies is noticed by EOF on its pipe: the batch it held fails with ``WorkerError``
(HTTP 500, never silence; the batcher then retries its requests in halves) and a replacement is
spawned; the other workers keep serving. A watchdog does the same to a worker that holds one batch
longer than ``batch_timeout_s`` (stopped with SIGSTOP, deadlocked, swapping): it is killed and
replaced. ``ready`` is False while no worker is up (all being replaced).

``InlinePool``: the model runs in the server process on a thread per replica (torch releases the
GIL in its kernels); used for callables that cannot be pickled and for one-process setups
(``--workers 0``). With ``loop_max_ms`` (one replica), a batch predicted to take at most that long
runs on the event loop itself when nothing else is pending (``others``: the batcher holds no other
accepted request, so there is no I/O to overlap with): no thread hand-off per batch and no
contention for the GIL between the loop and the model thread. Under a deeper load (more clients
than a batch holds) batches stay on the thread, so the loop reads the next batch's requests and
writes the last one's answers while the model computes. The prediction is the batch's rows times the per-row time of recent
batches (it rises at once after a slow batch and halves its distance to each faster one); with no
measurement yet, or over the limit, the batch runs on the thread as before. A batch on the loop holds every other request's
I/O for its duration, which is why the limit is small (``ServeConfig.inline_loop_ms``).

``DevicePool``: one replica per (GPU, stream), inputs staged through pinned host buffers and
copied with ``non_blocking=True`` on the replica's stream.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import multiprocessing as mp
import os
import time
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from torchnitro.errors import BackendUnavailableError, ConfigError, ServeError, WorkerError
from torchnitro.serve.models import ServedModel
from torchnitro.serve.protocol import InferItem, ModelSignature, assemble, split_outputs
from torchnitro.serve.worker_process import decode, encode, run_model, worker_main

__all__ = ["WorkerPool", "InlinePool", "ProcessPool", "DevicePool", "threads_per_worker"]

_ALIGN = 64


def threads_per_worker(workers: int, cores: int | None = None) -> int:
    """Split the usable cores evenly so replicas do not oversubscribe them."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, workers))


# --------------------------------------------------------------------------- in-process

async def _run_on_free_slot(free: asyncio.Queue[Any] | None, compute: Callable[[Any], Any]) -> Any:
    """Take a free slot (buffers or a stream index), run ``compute(slot)`` in a thread, give it back."""
    if free is None:
        raise ServeError("the worker pool is not started; `await pool.start()` first")
    slot = await free.get()
    try:
        return await asyncio.get_running_loop().run_in_executor(None, compute, slot)
    finally:
        free.put_nowait(slot)

class WorkerPool(Protocol):
    """What a ``server.ModelEndpoint`` drives: ``InlinePool``, ``ProcessPool``, ``DevicePool`` (or a test's own)."""

    size: int  # replicas computing at once: the batcher's concurrency
    signature: ModelSignature | None  # known once started
    on_restart: Callable[[int], None] | None  # called with a replica's index when it is replaced

    @property
    def ready(self) -> bool: ...  # at least one replica answers (False while every one is being replaced)

    async def start(self) -> None: ...

    async def run(self, items: list[InferItem]) -> list[list[Tensor]]: ...

    async def close(self) -> None: ...


class InlinePool:
    """Replicas in this process, each on its own thread with its own reused input buffers; cheap
    batches of a single replica on the event loop (``loop_max_ms``, module docstring)."""

    def __init__(self, model: ServedModel, replicas: int = 1, *, loop_max_ms: float | None = None):
        if replicas < 1:
            raise ConfigError(f"replicas: received {replicas}, expected >= 1")
        if loop_max_ms is not None and loop_max_ms < 0:
            raise ConfigError(f"loop_max_ms: received {loop_max_ms}, expected milliseconds >= 0, or None "
                              "(every batch on a thread)")
        self.model = model
        self.signature: ModelSignature = model.signature
        self.size = replicas
        self.restarts = 0
        self.ready = True  # threads in this process: nothing to replace
        self.on_restart: Callable[[int], None] | None = None  # never called: nothing here is replaced
        self._free: asyncio.Queue[list[Tensor]] | None = None
        # several replicas compute at once on threads; the loop can only hold one batch
        self.loop_max_s = None if loop_max_ms is None or replicas > 1 else loop_max_ms / 1e3
        self.row_s: float | None = None  # per-row seconds of recent batches (rises at once, falls by halves)
        self.on_loop = 0  # batches computed on the event loop (the rest went to a thread)
        # requests accepted besides a batch of n (ModelEndpoint sets it to the batcher's): any -> thread
        self.others: Callable[[int], int] | None = None

    async def start(self) -> None:
        self._free = asyncio.Queue()
        for _ in range(self.size):
            self._free.put_nowait([torch.empty(0, dtype=s.dtype) for s in self.signature.inputs])

    def _compute(self, items: list[InferItem], buffers: list[Tensor]) -> list[list[Tensor]]:
        batch, padded = assemble(items, self.signature, buffers)
        outs = run_model(self.model, batch)
        # outputs may alias input buffers (identity-like models): copy before the buffer is reused
        return split_outputs([o.clone() for o in outs], items, self.signature, padded)

    def _timed(self, items: list[InferItem], buffers: list[Tensor]) -> list[list[Tensor]]:
        t0 = time.perf_counter()
        out = self._compute(items, buffers)
        per_row = (time.perf_counter() - t0) / max(1, sum(it.rows for it in items))
        prev = self.row_s
        self.row_s = per_row if prev is None or per_row > prev else 0.5 * (prev + per_row)
        return out

    async def run(self, items: list[InferItem]) -> list[list[Tensor]]:
        if self.loop_max_s is None:
            return await _run_on_free_slot(self._free, lambda buffers: self._compute(items, buffers))
        est = self.row_s
        if est is not None and est * sum(it.rows for it in items) <= self.loop_max_s:
            await asyncio.sleep(0)  # answers of the previous batch, already set, are written first
        if (est is None or est * sum(it.rows for it in items) > self.loop_max_s
                or (self.others is not None and self.others(len(items)) > 0)):
            return await _run_on_free_slot(self._free, lambda buffers: self._timed(items, buffers))
        if self._free is None:
            raise ServeError("the worker pool is not started; `await pool.start()` first")
        buffers = self._free.get_nowait()  # one replica, one batch at a time: its buffers are free
        try:
            self.on_loop += 1
            return self._timed(items, buffers)
        finally:
            self._free.put_nowait(buffers)

    async def close(self) -> None:
        return None


# --------------------------------------------------------------------------- processes
# (the worker's own side, what runs in the spawned process: ``serve.worker_process``)

def _lost(msg: str) -> WorkerError:
    """A batch lost with its worker: the batcher retries its requests one at a time (``retry_alone``),
    so a request that kills workers costs one more restart, not one per halving step."""
    err = WorkerError(msg)
    err.retry_alone = True  # type: ignore[attr-defined]
    return err


class _Proc:
    def __init__(self, idx: int, process: Any, conn: Any, arena: Tensor):
        self.idx, self.process, self.conn, self.arena = idx, process, conn, arena


class ProcessPool:
    """N worker processes loading ``spec``; see the module docstring."""

    def __init__(self, spec: str, name: str | None = None, workers: int = 2, *, threads: int | None = None,
                 arena_mb: float = 16.0, start_timeout_s: float = 120.0,
                 on_restart: Callable[[int], None] | None = None, trust_code: bool = False,
                 batch_timeout_s: float | None = 120.0):
        if workers < 1:
            raise ConfigError(f"workers: received {workers}, expected >= 1 (0 means in-process; use InlinePool)")
        self.spec, self.name, self.size = spec, name or str(spec), workers
        self.threads = threads or threads_per_worker(workers)
        self.session_threads = threads  # given (serve --threads): also an ONNX Runtime / OpenVINO session's count
        self.arena_bytes = int(arena_mb * 2**20)
        self.start_timeout_s = start_timeout_s
        self.batch_timeout_s = batch_timeout_s  # watchdog: a worker holding a batch longer is replaced
        self.on_restart = on_restart
        self._replacing: set[int] = set()  # worker indices being restarted
        self.trust_code = trust_code  # artifact specs: let them run code (torchnitro.load(trust_code=True))
        self.restarts = 0
        self.signature: ModelSignature | None = None
        self._procs: dict[int, _Proc] = {}
        self._free: asyncio.Queue[int] | None = None
        self._ctx = mp.get_context("spawn")
        self._bids = itertools.count()
        self._closing = False
        self._tasks: set[asyncio.Task] = set()

    def _spawn(self, idx: int, arena: Tensor | None = None) -> _Proc:
        """Start worker ``idx``; a replacement gets the arena of the worker it replaces (dead, and
        workers only read it), so shared memory stays at one arena per slot however many restarts."""
        if arena is None:
            arena = torch.empty(self.arena_bytes, dtype=torch.uint8).share_memory_()
        parent, child = self._ctx.Pipe(duplex=True)
        p = self._ctx.Process(target=worker_main,
                              args=(self.spec, self.name, child, arena, self.threads, self.trust_code,
                                    self.session_threads),
                              name=f"torchnitro-worker-{idx}", daemon=True)
        p.start()
        child.close()
        return _Proc(idx, p, parent, arena)

    async def _recv(self, proc: _Proc, timeout: float | None = None) -> Any:
        """The next message from ``proc``; ``asyncio.TimeoutError`` after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = proc.conn.fileno()

        def readable() -> None:
            loop.remove_reader(fd)
            if fut.done():
                return
            try:
                os.set_blocking(fd, True)  # uvloop leaves watched fds non-blocking; recv needs whole messages
                fut.set_result(proc.conn.recv())
            except BaseException as exc:  # noqa: BLE001 - EOF means the process died
                fut.set_exception(exc)

        def late() -> None:
            if not fut.done():
                fut.set_exception(asyncio.TimeoutError())

        loop.add_reader(fd, readable)
        timer = None if timeout is None else loop.call_later(timeout, late)  # no task per batch
        try:
            return await fut
        finally:
            loop.remove_reader(fd)
            if timer is not None:
                timer.cancel()
            # an error stored in fut keeps its traceback, whose frames (readable/late) hold fut: a
            # cycle only the cyclic GC frees, and with it this batch's frames and its worker (arena)
            fut = None

    async def _wait_ready(self, proc: _Proc) -> None:
        try:
            msg = await self._recv(proc, self.start_timeout_s)
        except (EOFError, OSError, asyncio.TimeoutError):
            code = proc.process.exitcode
            raise WorkerError(f"worker {proc.idx} for {self.spec!r} did not start (exit code {code}); "
                              "run the model spec in-process (--workers 0) to see the error") from None
        if msg[0] != "ready":
            raise WorkerError(f"worker {proc.idx} could not load model {self.spec!r}: {msg[1]}")
        self.signature = msg[1]

    async def start(self) -> None:
        self._free = asyncio.Queue()
        procs = [self._spawn(i) for i in range(self.size)]
        for p in procs:
            self._procs[p.idx] = p
        try:
            await asyncio.gather(*(self._wait_ready(p) for p in procs))
        except BaseException:
            await self.close()
            raise
        for p in procs:
            self._free.put_nowait(p.idx)

    @property
    def ready(self) -> bool:
        """At least one worker is up (not being replaced)."""
        return len(self._replacing) < self.size

    def _schedule_restart(self, idx: int) -> None:
        if self._closing:
            return
        self._replacing.add(idx)
        t = asyncio.get_running_loop().create_task(self._restart(idx))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def _restart(self, idx: int) -> None:
        old = self._procs[idx]
        old.conn.close()
        await asyncio.get_running_loop().run_in_executor(None, old.process.join, 5)
        self.restarts += 1
        if self.on_restart is not None:
            self.on_restart(idx)
        while not self._closing:
            new = self._spawn(idx, old.arena)
            self._procs[idx] = new
            try:
                await self._wait_ready(new)
            except WorkerError:
                await asyncio.sleep(1.0)  # keep trying; the other workers serve meanwhile
                continue
            self._replacing.discard(idx)
            self._free_queue().put_nowait(idx)
            return

    def _free_queue(self) -> asyncio.Queue[int]:
        if self._free is None:
            raise ServeError("the worker pool is not started; `await pool.start()` first")
        return self._free

    def _signature(self) -> ModelSignature:
        if self.signature is None:
            raise ServeError("the worker pool has no model signature yet; `await pool.start()` first")
        return self.signature

    async def _acquire(self) -> _Proc:
        free = self._free_queue()
        while True:
            idx = await free.get()
            proc = self._procs[idx]
            if proc.process.is_alive():
                return proc
            self._schedule_restart(idx)  # died while idle: replace it, use another one

    def _layout(self, items: list[InferItem], proc: _Proc) -> tuple[list[Tensor] | None, list[Any]]:
        """Typed views into the worker's arena for each batch input, or None if it does not fit."""
        signature = self._signature()
        rows = sum(it.rows for it in items)
        lengths = [it.length for it in items if it.length is not None]
        views, layout, off = [], [], 0
        for k, spec in enumerate(signature.inputs):
            shape = [rows, *items[0].tensors[k].shape[1:]]
            if spec.ragged:
                shape[1] = max(lengths)
            n = 1
            for d in shape:
                n *= d
            nbytes = n * spec.dtype.itemsize
            if off + nbytes > self.arena_bytes:
                return None, []
            views.append(proc.arena[off:off + nbytes].view(spec.dtype))
            layout.append((off, nbytes, spec.dtype, tuple(shape)))
            off += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return views, layout

    async def run(self, items: list[InferItem]) -> list[list[Tensor]]:
        signature = self._signature()
        proc = await self._acquire()
        bid = next(self._bids)
        healthy = True
        try:
            views, layout = self._layout(items, proc)
            batch, padded = assemble(items, signature, views)
            inline = None if views is not None else [encode(t) for t in batch]
            try:
                proc.conn.send(("batch", bid, layout if views is not None else None, inline))
                while True:
                    reply = await self._recv(proc, self.batch_timeout_s)
                    if reply[1] == bid:
                        break
            except asyncio.TimeoutError:
                healthy = False
                proc.process.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
                raise _lost(
                    f"worker {proc.idx} (pid {proc.process.pid}) held this batch of {len(items)} request(s) "
                    f"for more than {self.batch_timeout_s:g} s (stopped or hung); it was killed and is being "
                    "replaced, retry the request (ServeConfig.worker_timeout_s sets the limit)") from None
            except (EOFError, OSError):
                healthy = False
                await asyncio.get_running_loop().run_in_executor(None, proc.process.join, 2)
                raise _lost(
                    f"worker {proc.idx} (pid {proc.process.pid}) died with exit code {proc.process.exitcode} "
                    f"while running this batch of {len(items)} request(s); it is being restarted, retry "
                    "the request") from None
        finally:
            if healthy:
                self._free_queue().put_nowait(proc.idx)
            else:
                self._schedule_restart(proc.idx)
        if reply[0] == "err":
            raise WorkerError(f"the model raised on this batch: {reply[2]}")
        return split_outputs([decode(o) for o in reply[2]], items, self.signature, padded)

    @property
    def pids(self) -> list[int]:
        return [p.process.pid for p in self._procs.values()]

    async def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        for p in self._procs.values():
            try:
                p.conn.send(("stop",))
            except (OSError, ValueError):
                pass
        loop = asyncio.get_running_loop()
        for p in self._procs.values():
            await loop.run_in_executor(None, p.process.join, 5)
            if p.process.is_alive():
                p.process.kill()
            p.conn.close()


# --------------------------------------------------------------------------- GPU
class DevicePool:
    """Replicas on CUDA devices, ``streams`` per device, staged through pinned host buffers."""

    def __init__(self, model: ServedModel, module: torch.nn.Module, devices: Sequence[int] | None = None,
                 streams: int = 2, make_fn: Callable[[torch.nn.Module], Callable[..., Any]] | None = None):
        if not torch.cuda.is_available():
            raise BackendUnavailableError("DevicePool needs CUDA and none is visible; use ProcessPool on CPU")
        devs = list(devices) if devices is not None else list(range(torch.cuda.device_count()))
        self.signature = model.signature
        self.restarts = 0
        self.ready = True
        self.on_restart: Callable[[int], None] | None = None  # never called: nothing here is replaced
        self._replicas: list[tuple[torch.device, torch.cuda.Stream, Callable[..., Any]]] = []
        for d in devs:
            dev = torch.device("cuda", d)
            mod = copy.deepcopy(module).to(dev).eval()
            fn = make_fn(mod) if make_fn else mod
            for _ in range(streams):
                self._replicas.append((dev, torch.cuda.Stream(dev), fn))
        self.size = len(self._replicas)
        self._free: asyncio.Queue[int] | None = None
        self._pinned: list[list[Tensor]] = []

    async def start(self) -> None:
        self._free = asyncio.Queue()
        for i in range(self.size):
            self._pinned.append([torch.empty(0, dtype=s.dtype).pin_memory() for s in self.signature.inputs])
            self._free.put_nowait(i)

    def _compute(self, i: int, items: list[InferItem]) -> list[list[Tensor]]:
        dev, stream, fn = self._replicas[i]
        batch, padded = assemble(items, self.signature, self._pinned[i])  # into pinned host memory
        with torch.cuda.device(dev), torch.cuda.stream(stream), torch.inference_mode():
            xs = [t.to(dev, non_blocking=True) for t in batch]
            out = fn(*xs)
            outs = [out] if isinstance(out, Tensor) else list(out)
            host = [o.to("cpu", non_blocking=True) for o in outs]
        stream.synchronize()  # the pinned buffers are free again only after the copies finished
        return split_outputs(host, items, self.signature, padded)

    async def run(self, items: list[InferItem]) -> list[list[Tensor]]:
        return await _run_on_free_slot(self._free, lambda i: self._compute(i, items))

    async def close(self) -> None:
        return None
