"""Prometheus metrics for the server, on a private registry per server (tests run several).

Names (all prefixed ``torchnitro_``): ``requests_total{model,code}``, ``queue_seconds``,
``compute_seconds`` (per batch), ``request_seconds`` (end to end inside the server), ``batch_size``
(histograms, label ``model``), ``queue_depth`` and ``requests_pending`` (accepted, not yet answered:
queued, batching or computing) gauges, and ``worker_restarts_total``.

Per-request observations (``requests_total``, ``request_seconds``, ``queue_seconds``) are counted in
a ``Tally`` on the event loop thread, without prometheus_client's lock per value (~1 us each, three
to five per request), and added to the metrics when ``/metrics`` is rendered (``ServeMetrics.render``).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServeMetrics", "ModelStats", "Duration", "Tally", "CONTENT_TYPE_LATEST", "parse_batch_size"]

_LAT = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Duration:
    """A count and a total time in nanoseconds (Triton's ``StatisticDuration``)."""

    __slots__ = ("count", "ns")

    def __init__(self) -> None:
        self.count, self.ns = 0, 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def to_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


class Tally:
    """Pending observations of one labelled histogram (or, ``counter``, counter) child: counted here
    without a lock (one thread only: the event loop's) and added to the child by ``flush``.

    A histogram's counts go straight into its buckets (prometheus_client's ``_buckets`` and ``_sum``
    internals); a client without those gets the kept values observed one by one instead.
    """

    __slots__ = ("child", "counts", "total", "values", "_bounds")

    def __init__(self, child: Any, counter: bool = False) -> None:
        self.child = child
        bounds = None if counter else getattr(child, "_upper_bounds", None)
        fast = bounds is not None and hasattr(child, "_buckets") and hasattr(child, "_sum")
        self._bounds: list[float] | None = list(bounds) if fast else None
        self.counts = [0] * len(self._bounds) if self._bounds is not None else None
        self.total = 0.0  # sum of observations (counter: the increments)
        self.values: list[float] | None = None if fast or counter else []

    def inc(self, n: float = 1) -> None:
        self.total += n

    def observe(self, v: float) -> None:
        if self.counts is not None:
            i = bisect_left(self._bounds, v)  # first bucket with v <= bound, as Histogram.observe
            if i < len(self.counts):
                self.counts[i] += 1
            self.total += v
        elif self.values is not None:
            self.values.append(v)

    def flush(self) -> None:
        # what is pending is taken first and then added, so an observation made meanwhile (a
        # render from another thread, as tests do) waits for the next flush instead of being lost
        child, total, self.total = self.child, self.total, 0.0
        if self.counts is not None:
            counts, self.counts = self.counts, [0] * len(self.counts)
            for i, n in enumerate(counts):
                if n:
                    child._buckets[i].inc(n)
            if total:
                child._sum.inc(total)
        elif self.values is not None:
            values, self.values = self.values, []
            for v in values:
                child.observe(v)
        elif total:
            child.inc(total)


class ModelStats:
    """One model's counters in Triton's statistics layout (``GET /v2/models/{name}/stats``).

    Updated by the batcher's observer on the event loop thread and read there, so no lock: requests
    answered by the batcher (success, or failure of any kind) with their time inside it, queue time
    of those that reached a batch, and per executed batch its rows and compute time.
    """

    def __init__(self) -> None:
        self.success, self.fail, self.queue, self.compute = Duration(), Duration(), Duration(), Duration()
        self.inference_count = 0  # rows computed (Triton counts a batch of n as n inferences)
        self.execution_count = 0  # batches computed
        self.last_inference_ms = 0  # wall-clock ms since the epoch of the last batch
        self.batches: dict[int, Duration] = {}  # rows per batch -> its compute time

    def to_dict(self, name: str, version: str) -> dict[str, Any]:
        zero = Duration().to_dict()
        return {"name": name, "version": version, "last_inference": self.last_inference_ms,
                "inference_count": self.inference_count, "execution_count": self.execution_count,
                "inference_stats": {"success": self.success.to_dict(), "fail": self.fail.to_dict(),
                                    "queue": self.queue.to_dict(), "compute_input": zero,
                                    "compute_infer": self.compute.to_dict(), "compute_output": zero},
                "batch_stats": [{"batch_size": k, "compute_input": zero, "compute_infer": d.to_dict(),
                                 "compute_output": zero} for k, d in sorted(self.batches.items())]}


class _Observer:
    """The batcher's hooks, bound to one model's label."""

    def __init__(self, m: "ServeMetrics", model: str):
        self.m, self.model = m, model
        # labelled children resolved once: .labels() costs a lock and a dict lookup per call
        self.queue, self.batch = m.tally(m.queue.labels(model)), m.batch.labels(model)
        self.compute, self.depth = m.compute.labels(model), m.depth.labels(model)
        self.pending = m.pending.labels(model)
        self.stats = m.stats.setdefault(model, ModelStats())
        self._live = False  # gauges read from the batcher at scrape time (watch) instead of on each change

    def watch(self, batcher: Any) -> None:
        """Read queue depth and pending from ``batcher`` when /metrics is scraped: two gauge writes
        (each a lock) on every enqueue and answer cost more than reading them once per scrape."""
        self.depth.set_function(lambda: batcher.depth)
        self.pending.set_function(lambda: batcher.pending)
        self._live = True

    def on_request_done(self, status: str, queue_s: float | None, total_s: float) -> None:
        st = self.stats
        (st.success if status == "ok" else st.fail).add(total_s)
        if queue_s is not None:
            self.queue.observe(queue_s)
            st.queue.add(queue_s)

    def on_batch(self, rows: int, compute_s: float) -> None:
        self.batch.observe(rows)
        self.compute.observe(compute_s)
        st = self.stats
        st.inference_count += rows
        st.execution_count += 1
        st.last_inference_ms = int(time.time() * 1e3)
        st.compute.add(compute_s)
        d = st.batches.get(rows)
        if d is None:
            d = st.batches[rows] = Duration()
        d.add(compute_s)

    def on_queue_depth(self, depth: int) -> None:
        if not self._live:
            self.depth.set(depth)

    def on_pending(self, pending: int) -> None:
        if not self._live:
            self.pending.set(pending)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("torchnitro_requests_total", "Inference requests by HTTP status code",
                                ["model", "code"], registry=r)
        self.queue = Histogram("torchnitro_queue_seconds", "Time a request waited before its batch ran",
                               ["model"], buckets=_LAT, registry=r)
        self.compute = Histogram("torchnitro_compute_seconds", "Compute time per batch",
                                 ["model"], buckets=_LAT, registry=r)
        self.latency = Histogram("torchnitro_request_seconds", "End-to-end request time inside the server",
                                 ["model"], buckets=_LAT, registry=r)
        self.batch = Histogram("torchnitro_batch_size", "Rows per executed batch", ["model"],
                               buckets=_SIZES, registry=r)
        self.depth = Gauge("torchnitro_queue_depth", "Requests waiting for a batch", ["model"], registry=r)
        self.pending = Gauge("torchnitro_requests_pending", "Accepted requests not yet answered", ["model"],
                             registry=r)
        self.restarts = Counter("torchnitro_worker_restarts_total", "Worker processes restarted after a crash",
                                ["model"], registry=r)
        self.stats: dict[str, ModelStats] = {}  # model -> Triton-style statistics
        self._tallies: list[Tally] = []  # per-request observations not yet in the metrics (render adds them)

    def tally(self, child: Any, counter: bool = False) -> Tally:
        """A ``Tally`` for ``child`` (a labelled histogram, or with ``counter`` a counter), added to it
        whenever the metrics are rendered. Observe it on the event loop thread only."""
        t = Tally(child, counter)
        self._tallies.append(t)
        return t

    def flush(self) -> None:
        """Add every tally's pending observations to the metrics (on the event loop thread)."""
        for t in self._tallies:
            t.flush()

    def observer(self, model: str) -> _Observer:
        return _Observer(self, model)

    def render(self) -> bytes:
        """The /metrics page, with the pending tallies added first."""
        self.flush()
        return generate_latest(self.registry)


def parse_batch_size(text: str, model: str | None = None) -> tuple[float, float]:
    """(sum, count) of ``torchnitro_batch_size`` from a /metrics page, over one or all models."""
    total = count = 0.0
    for line in text.splitlines():
        if not line.startswith("torchnitro_batch_size_"):
            continue
        head, _, value = line.rpartition(" ")
        if model is not None and f'model="{model}"' not in head:
            continue
        if head.startswith("torchnitro_batch_size_sum"):
            total += float(value)
        elif head.startswith("torchnitro_batch_size_count"):
            count += float(value)
    return total, count
