"""Replay: fold a history up to a sequence or a time, optionally failing on any anomaly."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from controlplane.core.projections.cluster import ClusterState
from schemas.errors import ReplayAnomalyError
from schemas.events import Event, Skipped


def replay(
    items: Iterable[tuple[int, Event | Skipped]],
    *,
    until_seq: int | None = None,
    until_time: datetime | None = None,
    strict: bool = False,
    state: ClusterState | None = None,
) -> ClusterState:
    """Fold `items` (in seq order) up to and including `until_seq` / events at or before `until_time`.

    With `strict`, raise `ReplayAnomalyError` if the history holds anomalies or unreadable events.
    """
    st = state if state is not None else ClusterState()
    for seq, item in items:
        if until_seq is not None and seq > until_seq:
            break
        if until_time is not None and isinstance(item, Event) and item.ts > until_time:
            break
        st.apply(seq, item)
    if strict:
        check_strict(st)
    return st


def check_strict(state: ClusterState) -> None:
    """`replay --strict`: any anomaly or skipped event fails, naming the first few."""
    if state.anomaly_count or state.skipped:
        first = "; ".join(f"seq {a.seq} {a.event_type}: {a.message}" for a in state.anomalies[:3])
        raise ReplayAnomalyError(
            f"history has {state.anomaly_count} anomalies and {state.skipped} unreadable events"
            + (f" (first: {first})" if first else ""),
            anomalies=tuple(state.anomalies),
        )
