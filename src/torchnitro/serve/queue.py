"""The batcher's queue: one FIFO per (length bucket, priority), most urgent head first after aging."""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Request", "RequestQueue"]

_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """One submitted item; ``rows`` counts toward the batch size (a request may carry several)."""

    item: Any
    rows: int
    priority: int
    bucket: int
    arrival: float
    deadline: float | None
    future: asyncio.Future = field(repr=False)
    started: float | None = None  # when its batch was first handed to the function
    finished: bool = False  # answered (result, error or cancel) and accounted for
    queued: bool = False  # counted in the queue's totals; only RequestQueue sets or clears it
    # its deadline timer, cancelled once it is answered: the timer holds the request (and its inputs)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    seq: int = field(default_factory=lambda: next(_ids))

    @property
    def live(self) -> bool:
        return not self.future.done()


class RequestQueue:
    """Per-(bucket, priority) FIFO deques; picks the most urgent head after aging."""

    def __init__(self, levels: int, aging_s: float):
        self.levels, self.aging_s = levels, aging_s
        self.lanes: dict[tuple[int, int], deque[Request]] = {}
        self.live = 0  # live requests (dead ones are dropped lazily)
        self.live_rows = 0  # rows of those requests (what a filling batch waits for)

    def push(self, r: Request) -> None:
        self.lanes.setdefault((r.bucket, r.priority), deque()).append(r)
        r.queued = True
        self.live += 1
        self.live_rows += r.rows

    def discard(self, r: Request) -> bool:
        """Uncount ``r`` if it is still queued (it finished early: timeout/cancel); it leaves its
        lane lazily. Returns whether it was queued: a request a batch already took is not counted
        here, so a deadline or a disconnect after collection changes nothing."""
        if not r.queued:
            return False
        r.queued = False
        self.live -= 1
        self.live_rows -= r.rows
        return True

    def _head(self, lane: deque[Request]) -> Request | None:
        while lane and not lane[0].live:
            lane.popleft()
        return lane[0] if lane else None

    def best(self, now: float, bucket: int | None = None) -> Request | None:
        """Most urgent live head: lowest aged priority, then oldest."""
        best, key = None, None
        for (b, _), lane in self.lanes.items():
            if bucket is not None and b != bucket:
                continue
            r = self._head(lane)
            if r is None:
                continue
            k = (r.priority - int((now - r.arrival) / self.aging_s), r.arrival, r.seq)
            if key is None or k < key:
                best, key = r, k
        return best

    def pop(self, r: Request) -> None:
        lane = self.lanes[(r.bucket, r.priority)]
        if lane[0] is not r:  # pragma: no cover - only heads are ever popped
            raise RuntimeError("internal: popped a request that is not at the head of its lane")
        lane.popleft()
        self.discard(r)

    def clear(self) -> list[Request]:
        """Empty every lane; returns the requests that were still queued."""
        out = [r for lane in self.lanes.values() for r in lane if r.queued]
        for r in out:
            self.discard(r)
        self.lanes.clear()
        return out
