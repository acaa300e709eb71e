"""Dynamic batching in pure asyncio (no HTTP): requests in, batches to a function, results out.

A batch closes when it holds ``max_batch_size`` rows, or when the wait window counted from its
*first* request ends (whichever comes first). ``concurrency`` consumers pull from one shared queue,
so a batch is formed only when a consumer (a worker) is free and load goes to whoever is free.

Per request: a priority (0 is the most urgent) that ages, so a waiting low-priority request gains
one level every ``aging_ms`` and is never starved; a deadline (expired requests are answered with
``DeadlineExceededError`` and never computed); cancellation (a cancelled ``submit`` leaves the
queue and is skipped; one that a filling batch already holds is dropped from it); an optional
length, which puts it in a bucket so one batch only mixes similar lengths (the function pads to
the batch's longest and unpads, see ``protocol``); with ``exact_lengths`` (models that padding
would change) only equal lengths share a batch.

The queue is bounded: a full queue raises ``QueueFullError`` at once instead of waiting.

A batch whose function raises is split in halves and each half retried (recursively), so one bad
request fails alone and the good ones batched with it still get their answers. An exception with a
true ``retry_alone`` attribute (a lost worker process: repeating it costs a restart) is retried one
request at a time instead.

Accounting: the ``RequestQueue`` alone decides whether a request is counted as queued (a batch
that collects it takes it out; a deadline or cancel after that leaves the queue's counts alone);
the batcher keeps every accepted, unanswered request in ``_pending`` so a drain waits for exactly
those, wherever they are (queued, held by a filling batch, or computing).
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import time
from typing import Any, Awaitable, Callable, Sequence

from torchnitro.errors import DeadlineExceededError, DrainingError, InputError, QueueFullError, ServeError
from torchnitro.serve.batching import BatchingConfig, BatchObserver
from torchnitro.serve.queue import Request, RequestQueue

# the batcher's interface in one import: its config and observer (batching.py) and Request (queue.py)
__all__ = ["BatchingConfig", "DynamicBatcher", "BatchObserver", "Request"]


# errors about the request itself, not its input: splitting the batch would not change them
_NOT_RETRIED = (DeadlineExceededError, DrainingError, QueueFullError)


def _release(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class DynamicBatcher:
    """Collects ``submit``-ted items into batches for ``fn(items) -> results`` (one result per item).

    ``fn`` may be a plain function (run in a thread so the event loop stays free) or a coroutine
    function. It receives a list of items and must return a sequence of the same length. An
    exception from ``fn`` is narrowed down by retrying halves of the batch: it fails only the
    request(s) it still raises for alone.
    """

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any] | Awaitable[Sequence[Any]]],
                 config: BatchingConfig | None = None, *, observer: BatchObserver | None = None,
                 clock: Callable[[], float] | None = None, exact_lengths: bool = False):
        self.fn = fn
        self.exact_lengths = exact_lengths  # only equal lengths share a batch (padding would change results)
        self.config = config or BatchingConfig()
        self.observer = observer
        # default: the event loop's own clock, the one its timers (deadlines, windows) run on
        self._clock_arg = clock
        self.clock: Callable[[], float] = clock or time.monotonic
        self._is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None))
        self._queue = RequestQueue(self.config.priority_levels, self.config.aging_ms / 1e3)
        # consumers waiting for work: (future, rows wanted); woken by enqueue once that many rows wait
        self._waiters: list[tuple[asyncio.Future, int]] = []
        self._started = False
        self._consumers: list[asyncio.Task] = []
        self._inflight: set[Request] = set()
        self._pending: set[Request] = set()  # accepted and not yet answered, wherever they are
        self._idle: asyncio.Event | None = None  # set while _pending is empty (what a drain waits for)
        self._accepting = True
        self.adaptive = None
        if self.config.adaptive:
            from torchnitro.serve.adaptive import AdaptivePolicy

            self.adaptive = AdaptivePolicy(self.config)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "DynamicBatcher":
        if not self._consumers:
            if self._clock_arg is None:
                self.clock = asyncio.get_running_loop().time
            self._idle = asyncio.Event()
            self._idle.set()
            self._started = True
            self._accepting = True
            self._consumers = [asyncio.create_task(self._consume(), name=f"batcher-{i}")
                               for i in range(self.config.concurrency)]
        return self

    async def __aenter__(self) -> "DynamicBatcher":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop(drain=True)

    @property
    def depth(self) -> int:
        """Requests waiting in the queue (not yet in a batch)."""
        return self._queue.live

    @property
    def pending(self) -> int:
        """Requests accepted and not yet answered (queued, in a filling batch, or computing)."""
        return len(self._pending)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    async def stop(self, drain: bool = True, timeout_s: float = 30.0) -> None:
        """Stop accepting; with ``drain`` finish everything accepted first, else fail it (503)."""
        self._accepting = False
        if drain and self._idle is not None and self._pending:
            self._notify(force=True)  # filling batches close now instead of at their window's end
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        for t in self._consumers:
            t.cancel()
        await asyncio.gather(*self._consumers, return_exceptions=True)
        self._consumers = []
        err = DrainingError("the batcher stopped before this request ran; retry on another replica")
        for r in list(self._pending):
            self._finish(r, "error", exc=err)
        self._queue.clear()
        self._started = False

    # ------------------------------------------------------------------ submit
    def _bucket(self, length: int | None) -> int:
        if length is None:
            return 0
        if self.exact_lengths:
            return length
        if not self.config.bucket_boundaries:
            return 0
        return bisect.bisect_left(self.config.bucket_boundaries, length)

    def enqueue(self, item: Any, *, priority: int = 0, timeout_ms: float | None = None,
                rows: int = 1, length: int | None = None) -> Request:
        """Queue ``item`` now (synchronously: admission is decided before any await)."""
        cfg = self.config
        if not self._consumers:
            raise DrainingError("the batcher is not started; call `await batcher.start()` first")
        if not self._accepting:
            raise DrainingError("the server is draining and accepts no new requests; retry elsewhere")
        if not (isinstance(priority, int) and 0 <= priority < cfg.priority_levels):
            raise InputError(f"priority: received {priority!r}, expected an integer in "
                             f"[0, {cfg.priority_levels - 1}] (0 is most urgent)")
        if rows < 1 or rows > cfg.max_batch_size:
            raise InputError(f"request has {rows} rows, expected 1..max_batch_size={cfg.max_batch_size}; "
                             "split it into smaller requests")
        if self._queue.live >= cfg.max_queue_size:
            raise QueueFullError(f"queue is full ({cfg.max_queue_size} waiting); retry after a short pause")
        timeout_ms = cfg.default_timeout_ms if timeout_ms is None else timeout_ms
        if timeout_ms is not None and timeout_ms <= 0:
            raise InputError(f"timeout: received {timeout_ms!r} ms, expected a positive number of ms")
        now = self.clock()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_ms is None else now + timeout_ms / 1e3
        req = Request(item, rows, priority, self._bucket(length), now, deadline, loop.create_future())
        self._queue.push(req)
        self._pending.add(req)
        if self._idle is not None:
            self._idle.clear()
        if self.observer is not None:
            self.observer.on_pending(len(self._pending))
        if deadline is not None:
            req.timer = loop.call_later(timeout_ms / 1e3, self._expire, req)
        if self.adaptive is not None:
            self.adaptive.on_arrival(now, rows)
        self._observe_depth()
        self._notify()
        return req

    async def submit(self, item: Any, *, priority: int = 0, timeout_ms: float | None = None,
                     rows: int = 1, length: int | None = None) -> Any:
        """Queue ``item`` and wait for its result. Cancelling the await removes it from the queue."""
        req = self.enqueue(item, priority=priority, timeout_ms=timeout_ms, rows=rows, length=length)
        try:
            return await self.wait(req)
        finally:
            req = None  # see wait()

    async def wait(self, req: Request) -> Any:
        """The request's result, or its error raised. Callers that keep ``req`` in a local while
        this raises should drop it (``finally: req = None``): the error's traceback holds their
        frame, and the frame would hold the future that holds the error, a cycle that only the
        cyclic GC frees, with the request's tensors in it."""
        try:
            # no shield: cancelling the waiting task cancels the future too, and _finish below
            # still does the bookkeeping (it keys on req.finished, not on the future's state)
            return await req.future
        except asyncio.CancelledError:
            self._finish(req, "cancelled", exc=asyncio.CancelledError())
            raise
        finally:
            req = None

    def cancel(self, req: Request) -> None:
        """Withdraw a request (its client went away): it leaves the queue and is never computed."""
        self._finish(req, "cancelled", exc=asyncio.CancelledError())

    def _finish(self, req: Request, status: str, result: Any = None, exc: BaseException | None = None) -> None:
        if req.finished:
            return
        req.finished = True
        if req.timer is not None:  # answered before its deadline: the loop must not keep it until then
            req.timer.cancel()
            req.timer = None
        fut = req.future
        if fut.done():  # cancelled together with the task that awaited it
            pass
        elif exc is None:
            fut.set_result(result)
        elif isinstance(exc, asyncio.CancelledError):
            fut.cancel()
        else:
            fut.set_exception(exc)
        if self._queue.discard(req):
            self._observe_depth()
        elif req.started is None:  # held by a filling batch: let its consumer see it is gone
            self._notify(force=True)
        self._pending.discard(req)
        self._inflight.discard(req)
        if not self._pending and self._idle is not None:
            self._idle.set()
        if self.observer is not None:
            self.observer.on_pending(len(self._pending))
            qs = None if req.started is None else req.started - req.arrival
            self.observer.on_request_done(status, qs, self.clock() - req.arrival)

    def _expire(self, req: Request) -> None:
        if req.live:
            waited = (self.clock() - req.arrival) * 1e3
            self._finish(req, "timeout", exc=DeadlineExceededError(
                f"request deadline passed after {waited:.0f} ms "
                f"({'still queued' if req.started is None else 'computing'}); raise `timeout` or reduce load"))

    def _notify(self, force: bool = False) -> None:
        """Wake the consumers whose wanted rows are now queued (all with ``force``).

        Consumers filling a batch have first claim: one waiting for a *new* batch is woken only
        by rows beyond what the filling ones still want (they come back to it when they close).
        """
        if not self._waiters:
            return
        rows = self._queue.live_rows
        claimed = sum(need for f, need in self._waiters if need > 1 and not f.done())
        keep = []
        for fut, need in self._waiters:
            if fut.done():
                continue
            if force or (rows >= need if need > 1 else rows > claimed):
                fut.set_result(None)
            else:
                keep.append((fut, need))
        self._waiters = keep

    def _observe_depth(self) -> None:
        if self.observer is not None:
            self.observer.on_queue_depth(self._queue.live)

    # ------------------------------------------------------------------ batching
    def _limits(self) -> tuple[int, float, float | None]:
        """(max rows, wait window, idle gap that closes the batch early or None)."""
        if self.adaptive is not None:
            size, wait = self.adaptive.choose(self.clock())
            return size, wait, self.adaptive.idle_gap()
        return self.config.max_batch_size, self.config.max_wait_ms / 1e3, None

    async def _wait_for_work(self, timeout: float | None, need: int = 1) -> None:
        """Sleep until ``need`` rows are queued, ``timeout`` passes, or a forced wake-up.

        A plain future and a timer handle: ``asyncio.wait_for`` would create a task per wait, and
        a filling batch waits once per ``need`` rows instead of once per arriving request.
        """
        if not self._started:
            raise ServeError("the batcher is not started; use `async with DynamicBatcher(...)` or `await start()`")
        if timeout is not None and timeout <= 0:
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append((fut, max(1, need)))
        timer = None if timeout is None else loop.call_later(timeout, _release, fut)
        try:
            await fut
        finally:
            if timer is not None:
                timer.cancel()

    async def _collect(self) -> list[Request]:
        """Wait for a first request, then fill until full or its wait window ends."""
        q = self._queue
        while True:
            first = q.best(self.clock())
            if first is not None:
                break
            await self._wait_for_work(None)
        max_rows, wait_s, idle_s = self._limits()
        q.pop(first)
        batch, rows, bucket = [first], first.rows, first.bucket
        close_at = first.arrival + wait_s
        waited, rows_before_wait = 0.0, None
        last_add = self.clock()
        while rows < max_rows:
            r = q.best(self.clock(), bucket)
            if r is not None:
                if rows + r.rows > max_rows:
                    break
                q.pop(r)
                batch.append(r)
                rows += r.rows
                last_add = self.clock()
                continue
            remaining = close_at - self.clock()
            if idle_s is not None:  # adaptive: a quiet queue means the clients are all in already
                remaining = min(remaining, last_add + idle_s - self.clock())
            if remaining <= 0 or not self._accepting:
                break
            if not any(r.live for r in batch):
                break  # every request it held expired or was withdrawn: start afresh
            if rows in self.config.preferred_batch_sizes and self._queue.live == 0:
                break  # on a size the model likes and nothing else is waiting: go now
            if rows_before_wait is None:
                rows_before_wait = rows
            t0 = self.clock()
            # adaptive watches each arrival (its idle gap); otherwise wake when the batch can be
            # full, or reach the next preferred size
            need = 1 if idle_s is not None else next(
                (p for p in self.config.preferred_batch_sizes if p > rows), max_rows) - rows
            await self._wait_for_work(remaining, need)
            waited += self.clock() - t0
        if self.adaptive is not None and rows_before_wait is not None:
            self.adaptive.on_window(waited, rows - rows_before_wait)
        self._observe_depth()
        self._notify()  # rows this batch left behind may start another consumer's batch
        return batch

    async def _consume(self) -> None:
        while True:
            batch = [r for r in await self._collect() if r.live]
            if batch:
                await self._run(batch)
            del batch  # a consumer waiting for work holds no answered request

    async def _run(self, batch: list[Request]) -> None:
        """Compute ``batch``; if the function raises, retry each half so only the culprit fails.

        Isolation costs at most ``2 * len(batch) - 1`` calls (a function that fails on everything);
        errors about the request itself (deadline, draining) are not retried.
        """
        t0 = self.clock()
        for r in batch:
            if r.started is None:  # a retried half keeps its first start (queue time is real wait)
                r.started = t0
            self._inflight.add(r)
        rows = sum(r.rows for r in batch)
        try:
            out, exc = await self._call([r.item for r in batch])
        except asyncio.CancelledError:
            for r in batch:
                self._finish(r, "error", exc=DrainingError("the batcher stopped while this request ran"))
            raise
        finally:
            dt = self.clock() - t0
            if self.observer is not None:
                self.observer.on_batch(rows, dt)
            if self.adaptive is not None:
                self.adaptive.on_batch(rows, dt)
        if exc is not None:  # one bad request fails only itself
            if len(batch) > 1 and isinstance(exc, Exception) and not isinstance(exc, _NOT_RETRIED):
                mid = len(batch) // 2
                # a failure that costs a lot to repeat (a worker process lost) is retried one request
                # at a time: only the culprit can cause it again, not every batch on its way down
                parts = [[r] for r in batch] if getattr(exc, "retry_alone", False) else [batch[:mid], batch[mid:]]
                for half in parts:
                    live = [r for r in half if r.live]
                    if live:
                        await self._run(live)
                return
            for r in batch:
                self._finish(r, getattr(exc, "status", "error"), exc=exc)
            return
        for r, res in zip(batch, out):
            self._finish(r, "ok", result=res)

    async def _call(self, items: list[Any]) -> tuple[Sequence[Any], None] | tuple[None, BaseException]:
        """``fn(items)``: (results, None), or (None, the exception it raised).

        The exception is caught here, in a frame that holds items but no ``Request``: it is then
        stored on the requests' futures, and a traceback through ``_run`` (which holds the batch,
        hence those futures) would make a cycle that only the cyclic GC frees.
        """
        try:
            if self._is_async:
                out = await self.fn(items)
            else:
                out = await asyncio.get_running_loop().run_in_executor(None, self.fn, items)
            if len(out) != len(items):
                raise RuntimeError(f"batch function returned {len(out)} results for {len(items)} items; "
                                   "it must return exactly one result per item")
            return out, None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - _run decides: retry halves or fail the requests
            return None, exc
