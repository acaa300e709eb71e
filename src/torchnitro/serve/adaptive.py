"""Adaptive batching: learn the batch-latency curve online, pick batch size and wait from it.

Model: compute time of a batch of ``B`` rows is ``lat(B) = a + b * B`` (fixed per-call overhead
plus per-row cost), fitted by least squares over an exponentially weighted mean per batch size;
that is accurate enough to rank sizes and cheap to refit after every batch. Throughput ``B / lat(B)``
grows with ``B``, so the best size is the largest one whose worst case fits the latency target:

    wait + lat(B) (own batch) + lat(B) (the batch already running on a busy worker) <= target

and the wait is the smaller of what the target leaves over and the time the arrival rate needs to
fill ``B`` rows (waiting longer than that adds latency without adding rows). That rate is measured
on the wait windows themselves (rows that arrived while a batch waited, per second waited), because
in a closed loop clients only send after their answer and the plain arrival rate overstates what
waiting brings. When not even one more row is expected it does not wait, except for an occasional
short probe window. A waiting batch also closes early once the queue has been quiet for 1.5 mean
inter-arrival gaps (at least a quarter of the batch's compute time): with a fixed client
population, everyone who could join has joined. Before the first batch
the policy uses the configured ``max_batch_size`` / ``max_wait_ms``; with one size seen it assumes
cost proportional to rows, and refines as load varies the sizes it sees.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["AdaptivePolicy", "LatencyCurve"]


@dataclass
class _Point:
    mean_s: float
    n: int


class LatencyCurve:
    """Per-size EWMA of batch compute time and a linear fit ``a + b * B`` across sizes."""

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha  # weight of the newest sample: adapts to load changes in ~5 batches
        self.points: dict[int, _Point] = {}
        self.a, self.b = 0.0, 0.0
        self.fitted = False

    def add(self, rows: int, seconds: float) -> None:
        p = self.points.get(rows)
        if p is None:
            self.points[rows] = _Point(seconds, 1)
        else:
            p.mean_s += self.alpha * (seconds - p.mean_s)
            p.n += 1
        self._fit()

    def _fit(self) -> None:
        xs = list(self.points)
        if len(xs) < 2:
            (rows, only), = self.points.items()
            # one size seen: assume cost proportional to rows (pessimistic for bigger batches)
            self.a, self.b, self.fitted = 0.0, only.mean_s / rows, True
            return
        w = [min(p.n, 20) for p in self.points.values()]  # trust sizes seen more often, capped
        ys = [p.mean_s for p in self.points.values()]
        sw = sum(w)
        mx = sum(wi * x for wi, x in zip(w, xs)) / sw
        my = sum(wi * y for wi, y in zip(w, ys)) / sw
        sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, xs))
        sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, xs, ys))
        b = max(sxy / sxx, 0.0) if sxx > 0 else 0.0  # latency never falls with batch size
        a = max(my - b * mx, 0.0)
        self.a, self.b, self.fitted = a, b, True

    def predict(self, rows: int) -> float:
        """Estimated compute seconds for a batch of ``rows``."""
        p = self.points.get(rows)
        if p is not None and p.n >= 3:
            return max(p.mean_s, self.a + self.b * rows) if self.fitted else p.mean_s
        return self.a + self.b * rows

    def to_dict(self) -> dict[str, Any]:
        return {"a_s": self.a, "b_s_per_row": self.b,
                "points": {int(k): {"mean_s": v.mean_s, "n": v.n} for k, v in sorted(self.points.items())}}


class AdaptivePolicy:
    """Chooses ``(max_rows, wait_s)`` for the next batch from the learned curve and arrival rate."""

    def __init__(self, config: Any, headroom: float = 0.8):
        self.config = config
        self.target_s = float(config.latency_target_ms) / 1e3
        self.headroom = headroom  # use this share of the target; the rest absorbs noise
        self.curve = LatencyCurve()
        self.rate = 0.0  # arrivals (rows) per second, EWMA
        self._last_arrival: float | None = None
        self.choice = (config.max_batch_size, config.max_wait_ms / 1e3)
        # what waiting actually bought: decayed sums of seconds waited and rows that arrived meanwhile.
        # (In a closed loop the arrival rate says nothing about whether waiting brings company.)
        self.waited_s = 0.0
        self.gained_rows = 0.0
        self._decisions = 0
        self._last_gain = -1  # rows the last wait window gained (-1: none yet)
        self.probe_every = 16  # with no evidence that waiting helps, still probe now and then

    def on_arrival(self, now: float, rows: int = 1) -> None:
        if self._last_arrival is not None:
            gap = max(now - self._last_arrival, 1e-6)
            inst = rows / gap
            self.rate = inst if self.rate == 0 else self.rate + 0.05 * (inst - self.rate)
        self._last_arrival = now

    def on_batch(self, rows: int, seconds: float) -> None:
        self.curve.add(rows, seconds)

    def on_window(self, waited_s: float, gained_rows: int) -> None:
        """A batch waited ``waited_s`` for company and ``gained_rows`` arrived meanwhile."""
        self.waited_s = 0.7 * self.waited_s + waited_s
        self.gained_rows = 0.7 * self.gained_rows + gained_rows
        self._last_gain = gained_rows

    @property
    def wait_rate(self) -> float:
        """Rows gained per second of waiting (falls back to the arrival rate before any window)."""
        return self.gained_rows / self.waited_s if self.waited_s > 1e-6 else self.rate

    def best_size(self) -> int:
        """Largest batch whose worst-case latency fits the target (at least 1)."""
        budget = self.target_s * self.headroom
        best = 1
        for b in range(1, self.config.max_batch_size + 1):
            if 2 * self.curve.predict(b) <= budget:
                best = b
        return best

    def idle_gap(self) -> float:
        """Close a waiting batch after this long without a new arrival.

        1.5 mean arrival gaps, but at least a quarter of the chosen batch's compute time (a closed
        loop's clients come back in a burst that a busy client process spreads out; waiting a
        fraction of one batch for them costs little) and at least 0.5 ms.
        """
        if self.rate <= 0:
            return self.config.max_wait_ms / 1e3
        return max(1.5 / self.rate, 0.25 * self.curve.predict(self.choice[0]), 5e-4)

    def choose(self, now: float) -> tuple[int, float]:
        if not self.curve.fitted:
            return self.config.max_batch_size, self.config.max_wait_ms / 1e3
        size = self.best_size()
        slack = max(self.target_s * self.headroom - 2 * self.curve.predict(size), 0.0)
        rate = self.wait_rate
        fill = (size - 1) / rate if rate > 0 else 0.0
        wait = min(slack, fill, max(self.config.max_wait_ms, self.target_s * 1e3) / 1e3)
        self._decisions += 1
        if not math.isfinite(wait) or rate * wait < 1.0 or self._last_gain == 0:
            # not even one more row expected in the window: waiting only adds latency; but probe
            # with a short window now and then, so a rise in load is noticed
            probe = self._decisions % self.probe_every == 0
            wait = min(slack, self.config.max_wait_ms / 1e3) if probe else 0.0
        self.choice = (size, wait)
        return self.choice

    def to_dict(self) -> dict[str, Any]:
        size, wait = self.choice
        return {"target_ms": self.target_s * 1e3, "batch_size": size, "wait_ms": wait * 1e3,
                "arrival_rate_per_s": self.rate, "rows_per_s_waited": self.wait_rate, "curve": self.curve.to_dict()}
