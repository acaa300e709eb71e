"""Pinned host buffers and an asynchronous host-to-device prefetcher.

``PinnedBufferPool`` hands out page-locked host buffers bucketed by power-of-two size and takes them
back for reuse: pinning is slow (a ``cudaHostAlloc`` per buffer), copying from pinned memory is fast
and can be asynchronous. ``Prefetcher`` wraps an iterable of CPU batches: while the model works on
batch i, batch i+1 is staged into a pinned buffer and copied to the GPU on a side CUDA stream; the
consumer's stream waits on that copy's event before use, and ``record_stream`` keeps the allocator
from recycling the device memory early.

Without CUDA there is nothing to pin or overlap: the pool hands out pageable buffers (with one
warning, unless ``pin=False`` was asked for) and the prefetcher yields batches as they come.
"""

from __future__ import annotations

import threading
import warnings
from collections import defaultdict
from typing import Any, Iterable, Iterator

import torch
from torch.utils._pytree import tree_map

from torchnitro.errors import BackendUnavailableError, BudgetError, InputError

__all__ = ["PinnedBufferPool", "Prefetcher"]


def _bucket(nbytes: int) -> int:
    return 1 << max(9, (nbytes - 1).bit_length())  # >= 512 B, next power of two


class PinnedBufferPool:
    """Reusable host staging buffers; ``pin=None`` pins when CUDA is present."""

    def __init__(self, max_bytes: int = 1 << 30, pin: bool | None = None):
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise InputError(f"max_bytes: received {max_bytes!r}, expected a positive integer")
        if pin and not torch.cuda.is_available():
            raise BackendUnavailableError("PinnedBufferPool(pin=True) needs CUDA to page-lock memory; none is "
                                          "visible. Use pin=None (pins when possible) or pin=False.")
        if pin is None and not torch.cuda.is_available():
            warnings.warn("PinnedBufferPool: no CUDA, handing out pageable buffers", stacklevel=2)
        self.pin = bool(pin if pin is not None else torch.cuda.is_available())
        self.max_bytes = max_bytes
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._lock = threading.Lock()
        self._out: dict[int, torch.Tensor] = {}  # data_ptr -> raw buffer, for buffers handed out
        self.allocated_bytes = 0  # bytes of buffers created (in use or free)
        self.hits = 0
        self.misses = 0

    def acquire(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor of ``shape``/``dtype`` viewing a pooled buffer; give it back with ``release``."""
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        size = _bucket(max(1, nbytes))
        with self._lock:
            if self._free[size]:
                raw = self._free[size].pop()
                self.hits += 1
            else:
                if self.allocated_bytes + size > self.max_bytes:
                    raise BudgetError(f"PinnedBufferPool: a {size}-byte buffer would exceed max_bytes="
                                      f"{self.max_bytes} ({self.allocated_bytes} allocated); release buffers or "
                                      "raise max_bytes")
                raw = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
                self.allocated_bytes += size
                self.misses += 1
            self._out[raw.data_ptr()] = raw
        return raw[:nbytes].view(dtype).view(tuple(shape))

    def release(self, t: torch.Tensor) -> None:
        """Return a tensor from ``acquire`` to the pool (its base buffer is reused)."""
        with self._lock:
            base = self._out.pop(t.data_ptr(), None)
            if base is None:
                raise InputError("PinnedBufferPool.release: received a tensor that did not come from acquire() "
                                 "(or was already released)")
            self._free[base.numel()].append(base)

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        """Copy ``t`` into a pooled (pinned) buffer and return the buffer view."""
        buf = self.acquire(t.shape, t.dtype)
        buf.copy_(t)
        return buf


class Prefetcher:
    """Iterate device batches whose host-to-device copies overlap the previous batch's compute."""

    def __init__(self, batches: Iterable[Any], device: str | torch.device = "cuda",
                 pool: PinnedBufferPool | None = None, depth: int = 1):
        self.batches, self.device = batches, torch.device(device)
        if depth < 1:
            raise InputError(f"depth: received {depth!r}, expected >= 1 batches in flight")
        self.depth = depth
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise BackendUnavailableError(f"Prefetcher to {self.device}: CUDA is not available; use device='cpu'")
        self.pool = pool if pool is not None else (PinnedBufferPool(pin=True) if self.cuda else None)

    def _send(self, batch: Any, stream: Any) -> tuple[Any, Any, list[torch.Tensor]]:
        staged: list[torch.Tensor] = []

        def move(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            host = self.pool.stage(t) if (self.pool is not None and t.device.type == "cpu") else t
            if host is not t:
                staged.append(host)
            return host.to(self.device, non_blocking=True)

        with torch.cuda.stream(stream):
            out = tree_map(move, batch)
            event = torch.cuda.Event()
            event.record(stream)
        return out, event, staged

    def __iter__(self) -> Iterator[Any]:
        if not self.cuda:
            yield from (tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, b)
                        for b in self.batches)
            return
        stream = torch.cuda.Stream(device=self.device)
        inflight: list[tuple[Any, Any, list[torch.Tensor]]] = []
        it = iter(self.batches)
        for b in it:
            inflight.append(self._send(b, stream))
            if len(inflight) > self.depth:
                yield self._ready(*inflight.pop(0))
        while inflight:
            yield self._ready(*inflight.pop(0))

    def _ready(self, out: Any, event: Any, staged: list[torch.Tensor]) -> Any:
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        event.synchronize()  # the host staging buffers may be reused only after the copy finished

        def keep(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                t.record_stream(cur)
            return t

        tree_map(keep, out)
        for h in staged:
            self.pool.release(h)  # type: ignore[union-attr]
        return out
