"""What the benchmarks share: percentiles, and the typed field sets their synthetic events are built from.

Imported by the scripts beside it (`python tools/bench/<name>.py` puts this directory on sys.path).
"""

from __future__ import annotations

from datetime import datetime
from typing import TypedDict


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


class Envelope(TypedDict):
    """The envelope fields of every event (`E.Event`), passed as `**env`."""

    event_id: str
    ts: datetime
    actor: str


class ReplicaRef(TypedDict):
    """The fields naming a replica (`E.ReplicaEvent`), passed as `**rep`."""

    model_key: str
    replica_id: int
    node_id: str
