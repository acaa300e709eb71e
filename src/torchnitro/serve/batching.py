"""What a ``DynamicBatcher`` is configured and observed with: ``BatchingConfig`` and the
``BatchObserver`` metrics hooks (the batching itself is in ``batcher.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from torchnitro.errors import ConfigError

__all__ = ["BatchingConfig", "BatchObserver"]


@dataclass
class BatchingConfig:
    max_batch_size: int = 32  # rows per batch; bigger amortises per-call overhead, costs latency
    max_wait_ms: float = 5.0  # how long a batch's first request may wait for company
    preferred_batch_sizes: tuple[int, ...] = ()  # sizes the model runs best at; close early on these
    max_queue_size: int = 1024  # bound on waiting requests; beyond it -> 429, never a hang
    priority_levels: int = 1  # number of priorities, 0 = most urgent
    default_priority: int = 0  # level of requests that name none (over HTTP/gRPC: Triton's priority 0)
    aging_ms: float = 100.0  # a waiting request is promoted one level per aging_ms (no starvation)
    default_timeout_ms: float | None = None  # deadline for requests that do not give one
    bucket_boundaries: tuple[int, ...] = ()  # length buckets, e.g. (32, 64, 128): batch like lengths
    adaptive: bool = False  # learn the batch-latency curve and pick batch size + wait online
    latency_target_ms: float | None = None  # end-to-end target the adaptive policy keeps within
    concurrency: int = 1  # batches in flight at once (one per worker)

    def __post_init__(self) -> None:
        def bad(name: str, got: Any, want: str) -> ConfigError:
            return ConfigError(f"BatchingConfig.{name}: received {got!r}, expected {want}")

        if self.max_batch_size < 1:
            raise bad("max_batch_size", self.max_batch_size, "an integer >= 1")
        if self.max_wait_ms < 0:
            raise bad("max_wait_ms", self.max_wait_ms, "a number >= 0 (milliseconds)")
        if self.max_queue_size < 1:
            raise bad("max_queue_size", self.max_queue_size, "an integer >= 1")
        if self.priority_levels < 1:
            raise bad("priority_levels", self.priority_levels, "an integer >= 1")
        if not 0 <= self.default_priority < self.priority_levels:
            raise bad("default_priority", self.default_priority, f"a level in [0, {self.priority_levels - 1}]")
        if self.aging_ms <= 0:
            raise bad("aging_ms", self.aging_ms, "a number > 0 (milliseconds)")
        if self.concurrency < 1:
            raise bad("concurrency", self.concurrency, "an integer >= 1")
        self.preferred_batch_sizes = tuple(sorted(set(int(s) for s in self.preferred_batch_sizes)))
        if any(s < 1 or s > self.max_batch_size for s in self.preferred_batch_sizes):
            raise bad("preferred_batch_sizes", self.preferred_batch_sizes,
                      f"sizes between 1 and max_batch_size={self.max_batch_size}")
        self.bucket_boundaries = tuple(sorted(set(int(b) for b in self.bucket_boundaries)))
        if self.adaptive and not self.latency_target_ms:
            raise bad("latency_target_ms", self.latency_target_ms,
                      "a positive target in ms when adaptive=true (set latency_target_ms)")


class BatchObserver(Protocol):
    """Hooks for metrics; every method is optional in practice (see ``DynamicBatcher``)."""

    def on_request_done(self, status: str, queue_s: float | None, total_s: float) -> None: ...

    def on_batch(self, rows: int, compute_s: float) -> None: ...

    def on_queue_depth(self, depth: int) -> None: ...

    def on_pending(self, pending: int) -> None: ...  # accepted and not yet answered
