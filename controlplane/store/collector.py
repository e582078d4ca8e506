"""Pausing Python's cyclic garbage collector around one synchronous burst of allocations.

Decoding a snapshot (a cluster's fold: tens of thousands of objects) or building a page's whole
state (a dict per node, card and replica) in one step makes the collector run young collections
over the half-built structure again and again and promote it to the oldest generation, which
brings on a full collection: with the dashboard's cached states in memory a full collection takes
60-110 ms, and on a 200,000-event log most past positions the dashboard built paid one. What these
steps build holds no reference cycles, so reference counting frees it without the collector.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside the block. For synchronous code only (never across an await,
    where other tasks would run without it); a block entered with the collector off leaves it off."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
