"""Completion latency of one model's requests, as a cumulative histogram (the Prometheus form).

The dispatcher publishes it in its state answer (`ndif.dispatcher.state`); readers (the dashboard's
plots and `/metrics`) take differences between two answers, so any number of them can read it
without resetting anything, and a quantile over any window comes from the buckets' differences.
"""

from __future__ import annotations

import bisect
from typing import Any

# Upper bounds in seconds (Prometheus `le`): from a no-op call to a request held the queue lifetime.
LATENCY_BOUNDS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class LatencyHistogram:
    """Seconds from the dispatcher taking a request to its terminal answer (COMPLETED or ERROR)."""

    __slots__ = ("_counts", "count", "sum")

    def __init__(self) -> None:
        self._counts = [0] * (len(LATENCY_BOUNDS_S) + 1)  # per bucket, the last one past every bound
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def snapshot(self) -> dict[str, Any]:
        """`{"le": bounds, "counts": cumulative counts (one per bound, then +Inf), "sum", "count"}`."""
        cum, total = [], 0
        for c in self._counts:
            total += c
            cum.append(total)
        return {"le": list(LATENCY_BOUNDS_S), "counts": cum, "sum": round(self.sum, 6), "count": self.count}
